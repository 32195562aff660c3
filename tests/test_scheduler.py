"""Scheduler and prefix cache invariants under any interleaving of requests, overlapped steps,
preemptions and aborts, checked against a fake worker that records which token each KV slot
holds (the block manager's own invariants: check_blocks, after every action)."""

from __future__ import annotations

import itertools
from collections import deque

from hypothesis import event, given, settings
from hypothesis import strategies as st

from scheduler.quarantine import POISON_ERROR
from scheduler.scheduler import Scheduler
from shm import STAGING_WORDS
from surge.config import SchedulerConfig, SpeculativeConfig, TenantConfig
from surge.protocol import (
    PREVIOUS_TOKEN,
    EngineRequest,
    RequestOutput,
    SamplingParams,
    SeqResult,
    StepPlan,
    StepResult,
)
from surge.step_size import step_words
from tests.test_block_manager import check_blocks

EOS = 2


def _request(rid: str, prompt: list[int], max_tokens: int, priority: int = 0,
             arrival: float = 0.0, tenant: str = "default", bias: int = 0) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, arrival_time=arrival,
                         priority=priority, tenant=tenant,
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 stop_token_ids=[EOS],
                                                 logit_bias={t: 0.0 for t in range(bias)}))


def next_token(seq_id: int, position: int, eos_every: int) -> int:
    """The fake model's output: fixed by sequence and position; EOS now and then."""
    if eos_every and (seq_id + position) % eos_every == 0:
        return EOS
    return 3 + (seq_id * 31 + position * 7) % 9  # repeats: n-gram proposals can be right


class FakeWorker:
    """Runs plans in order like the real worker: writes each fed token into its KV slot, then
    checks that every position the sequence attends to holds that sequence's true token. A
    proposed token is accepted when it is the true one (greedy verification)."""

    def __init__(self, block_size: int, eos_every: int) -> None:
        self.bs = block_size
        self.eos_every = eos_every
        self.slots: dict[int, int] = {}
        self.truth: dict[int, list[int]] = {}  # seq_id -> every token it has been fed or sampled
        self.last_sampled: dict[int, int] = {}

    def _true(self, seq_id: int, pos: int) -> int:
        truth = self.truth[seq_id]
        if len(truth) == pos:
            truth.append(next_token(seq_id, pos, self.eos_every))
        return truth[pos]

    def run(self, plan: StepPlan) -> StepResult:
        results: dict[int, SeqResult] = {}
        for item in plan.seqs:
            truth = self.truth[item.seq_id]
            known = len(item.token_ids) - item.num_draft
            for i, token in enumerate(item.token_ids):
                pos = item.start_pos + i
                if token == PREVIOUS_TOKEN:
                    token = self.last_sampled[item.seq_id]
                if i < known:
                    assert token == truth[pos], f"seq {item.seq_id} fed a wrong token at {pos}"
                self.slots[item.block_table[pos // self.bs] * self.bs + pos % self.bs] = token
        for item in plan.seqs:  # attention reads after every write of the step, as on the device
            end = item.start_pos + len(item.token_ids) - item.num_draft
            drafts = item.token_ids[len(item.token_ids) - item.num_draft :]
            accepted = 0
            while accepted < len(drafts) and \
                    drafts[accepted] == self._true(item.seq_id, end + accepted):
                accepted += 1
            for pos in range(end + accepted):
                slot = item.block_table[pos // self.bs] * self.bs + pos % self.bs
                assert self.slots.get(slot) == self.truth[item.seq_id][pos], \
                    f"seq {item.seq_id} reads a wrong K/V at position {pos}"
            if item.sample:
                sampled = [self._true(item.seq_id, end + i) for i in range(accepted + 1)]
                self.last_sampled[item.seq_id] = sampled[-1]
                # A draft model's proposals: its steps write K/V from the newest token on, so
                # those slots must be there; right at even positions, wrong at odd ones.
                newest = end + accepted
                assert len(item.block_table) * self.bs >= newest + item.propose
                proposals = [self._true(item.seq_id, newest + 1 + i) + (newest % 2)
                             for i in range(item.propose)]
                results[item.seq_id] = SeqResult(sampled, None, proposals)
        return StepResult(plan.step_id, results)


prefixes = [[5 + (i * 13 + k) % 30 for i in range(40)] for k in range(3)]
prompts = st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 12)).map(
    lambda t: prefixes[t[0]][: t[1]] + [40 + t[2]] * (t[2] % 5 + 1))
def _actions(max_tokens: int) -> st.SearchStrategy:
    return st.lists(st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, max_tokens), st.integers(0, 2),
                  st.sampled_from([0, 0, 5, 40])),
        st.tuples(st.just("step"), st.none(), st.none(), st.none(), st.none()),
        st.tuples(st.just("abort"), st.none(), st.integers(0, 30), st.none(), st.none()),
        st.tuples(st.just("worker lost"), st.none(), st.none(), st.none(), st.none()),
    ), max_size=60)


@settings(max_examples=1500, deadline=None)
@given(_actions(20), st.integers(6, 40), st.integers(1, 8), st.integers(4, 64), st.booleans(),
       st.sampled_from([1, 2]), st.sampled_from([0, 7]), st.booleans(),
       st.sampled_from(["fcfs", "priority", "sjf"]), st.sampled_from([STAGING_WORDS, 400, 150]))
def test_scheduler_invariants(actions, num_blocks, max_seqs, budget, prefix_cache, depth,
                              eos_every, bucketing, policy, staging_words):
    drive(actions, num_blocks, max_seqs, budget, prefix_cache, depth, eos_every, bucketing,
          policy, "off", staging_words)


@settings(max_examples=600, deadline=None)
@given(_actions(60), st.integers(12, 60), st.integers(1, 8), st.integers(4, 64), st.booleans(),
       st.sampled_from([1, 2]), st.sampled_from([0, 23]), st.sampled_from(["ngram", "draft"]))
def test_scheduler_invariants_with_speculation(actions, num_blocks, max_seqs, budget,
                                               prefix_cache, depth, eos_every, method):
    """The fake model's tokens repeat every 9 positions, so n-gram proposals are sometimes
    right, sometimes wrong and rolled back (the fake draft's too); outputs stay the true
    tokens."""
    drive(actions, num_blocks, max_seqs, budget, prefix_cache, depth, eos_every, False,
          "priority", method, 400)


@settings(max_examples=400, deadline=None)
@given(_actions(20), st.integers(6, 40), st.integers(1, 8), st.integers(4, 64), st.booleans(),
       st.sampled_from([2, 3]), st.sampled_from([0, 7]), st.sampled_from(["off", "ngram"]))
def test_scheduler_invariants_with_pipeline_stages(actions, num_blocks, max_seqs, budget,
                                                   prefix_cache, stages, eos_every, method):
    """P steps in flight, each stage running them in order (the fake worker is any stage):
    no placeholder is planned and no sequence is planned while its token is in flight."""
    drive(actions, num_blocks, max_seqs, budget, prefix_cache, stages, eos_every, False,
          "priority", method, STAGING_WORDS, stages=stages)


def drive(actions, num_blocks: int, max_seqs: int, budget: int, prefix_cache: bool, depth: int,
          eos_every: int, bucketing: bool, policy: str, speculation: str,
          staging_words: int = STAGING_WORDS, stages: int = 1) -> None:
    """Also: every step fits the staging buffer (a request whose step never could ends with
    an error), and a lost worker's steps make suspects of their requests (see Quarantine)."""
    bs = 4
    clock = [0.0]
    # Requests of priority p belong to tenant p (weights 1, 2, 3): fair sharing, priority
    # preemption and aging (one class a step) all in play.
    sched = Scheduler(SchedulerConfig(block_size=bs, max_num_seqs=max_seqs,
                                      max_num_batched_tokens=budget, prefix_cache=prefix_cache,
                                      length_bucketing=bucketing, policy=policy,
                                      priority_aging_s=1.0),
                      num_blocks, {str(p): TenantConfig(weight=p + 1) for p in range(3)},
                      clock=lambda: clock[0],
                      speculative=SpeculativeConfig(speculative_method=speculation, ngram_min=1,
                                                    speculative_max_batch=8,
                                                    speculative_min_acceptance=0.0),
                      staging_words=staging_words, stages=stages)
    worker = FakeWorker(bs, eos_every)
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    outputs: dict[str, list[int]] = {}
    ended: dict[str, str] = {}
    accepted: list[str] = []
    seq_of: dict[str, int] = {}
    requested: dict[str, tuple[list[int], int]] = {}
    counter = itertools.count()

    def finish_one() -> None:
        plan, result = inflight.popleft()
        for out in sched.update(plan, result):
            assert out.request_id not in ended
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finish_reason:
                ended[out.request_id] = out.finish_reason
        check_blocks(sched.blocks, sched.requests.values())

    def end(outs: list[RequestOutput]) -> None:
        for out in outs:
            assert out.request_id not in ended and out.finish_reason == "error"
            assert "staging words" in out.error or out.error == POISON_ERROR
            ended[out.request_id] = "error"
        check_blocks(sched.blocks, sched.requests.values())

    def step() -> None:
        clock[0] += 1.0
        # As the loop does (which also plans one at a time while sequences speculate).
        ahead = 1 if sched.quarantine or (stages > 1 and sched.speculating()) else depth
        sched.in_flight = ahead
        if len(inflight) >= ahead:
            finish_one()
        plan = sched.schedule()
        end(sched.failed)
        sched.failed = []
        if plan is None:
            if inflight:
                finish_one()
            return
        assert sum(len(s.token_ids) for s in plan.seqs) <= budget
        assert len(plan.seqs) <= max_seqs
        assert len({s.seq_id for s in plan.seqs}) == len(plan.seqs)
        assert step_words(plan, sampling=True) <= staging_words
        assert not sched.quarantine or len(plan.seqs) == 1
        if stages > 1:
            sampling = {s.seq_id for p, _ in inflight for s in p.seqs if s.sample}
            assert not sampling & {s.seq_id for s in plan.seqs}
            assert all(PREVIOUS_TOKEN not in s.token_ids for s in plan.seqs)
        inflight.append((plan, worker.run(plan)))
        check_blocks(sched.blocks, sched.requests.values())

    for kind, prompt, a, priority, bias in actions:
        if kind == "add":
            rid = f"r{next(counter)}"
            error = sched.add(_request(rid, prompt, a, priority, clock[0], tenant=str(priority),
                                       bias=bias))
            if error is None:
                accepted.append(rid)
                outputs[rid] = []
                requested[rid] = (prompt, a)
                seq_of[rid] = sched.requests[rid].seq_id
                worker.truth[seq_of[rid]] = list(prompt)
            else:
                assert sched.blocks.blocks_for(len(prompt) + a) > num_blocks
        elif kind == "step":
            step()
        elif kind == "worker lost":
            # Steps in flight vanish with the worker and its cache; everything is recomputed.
            end(sched.crashed([plan for plan, _ in inflight]))
            inflight.clear()
            worker.last_sampled = {}
            sched.restart()
            assert not any(s.spec_inflight or s.draft for s in sched.requests.values())
            assert not sched.running and sched.blocks.num_free == num_blocks
            assert not sched.blocks.by_hash
        elif kind == "abort" and accepted:
            rid = accepted[a % len(accepted)]
            for out in sched.abort([rid]):
                assert out.request_id not in ended
                ended[out.request_id] = out.finish_reason
        check_blocks(sched.blocks, sched.requests.values())
    for _ in range(10_000):
        if not sched.has_work() and not inflight:
            break
        step()
    assert not sched.has_work(), "requests were left behind"
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"worker lost: {any(a[0] == 'worker lost' for a in actions)}")
    event(f"ended with an error: {'error' in ended.values()}")
    event(f"prefix hits: {sched.blocks.hit_tokens > 0}")
    spec = sched.spec
    event(f"proposals accepted: {spec.accepted_tokens > 0}")
    event(f"proposals rejected: {spec.accepted_tokens < spec.proposed_tokens}")
    assert sorted(ended) == sorted(accepted)
    assert sched.blocks.num_free == num_blocks
    for rid in accepted:
        # What the client saw is what was generated (a step planned ahead past the end may have
        # sampled more, which nobody sees), ending at the first EOS or at max_tokens.
        out, (prompt, max_tokens) = outputs[rid], requested[rid]
        truth = worker.truth[seq_of[rid]]
        assert out == truth[len(prompt) : len(prompt) + len(out)]
        assert len(out) <= max_tokens and EOS not in out[:-1]
        if ended[rid] == "error":
            continue
        if ended[rid] == "stop":
            assert out[-1] == EOS
        elif ended[rid] == "length":
            assert len(out) == max_tokens and out[-1] != EOS


def _sampled(plan: StepPlan, token: int) -> StepResult:
    """Every sampling sequence of the plan got `token`."""
    return StepResult(plan.step_id, {s.seq_id: SeqResult([token]) for s in plan.seqs if s.sample})


def _drain(sched: Scheduler) -> dict[str, str]:
    done = {}
    while sched.has_work():
        plan = sched.schedule()
        for o in sched.update(plan, _sampled(plan, 7)):
            if o.finish_reason:
                done[o.request_id] = o.finish_reason
    return done


def test_preemption_when_blocks_run_out_picks_least_urgent_latest():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), num_blocks=7)
    assert sched.add(_request("urgent-late", [1] * 7, 9, priority=0, arrival=3.0)) is None
    assert sched.add(_request("lax-early", [3] * 7, 9, priority=5, arrival=1.0)) is None
    assert sched.add(_request("normal", [5] * 7, 9, priority=0, arrival=2.0)) is None
    plan = sched.schedule()
    assert len(plan.seqs) == 3
    order = []
    real = sched._preempt
    sched._preempt = lambda seq: (order.append(seq.request_id), real(seq))[1]
    sched.update(plan, _sampled(plan, 7))
    done = _drain(sched)
    assert done == {"urgent-late": "length", "lax-early": "length", "normal": "length"}
    assert order and order[0] == "lax-early"


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=10), num_blocks=64)
    sched.add(_request("short", [9, 9], 6))
    plan = sched.schedule()
    sched.update(plan, _sampled(plan, 7))
    sched.add(_request("long", [5] * 35, 2))
    sizes = []
    while sched.has_work():
        plan = sched.schedule()
        sizes.append([(sched.seqs[s.seq_id].request_id, len(s.token_ids)) for s in plan.seqs
                      if s.seq_id in sched.seqs])
        sched.update(plan, _sampled(plan, 7))
    # The short request decodes every step while the long prompt goes through in 9-token chunks.
    assert sizes[0] == [("short", 1), ("long", 9)]
    assert [n for step in sizes for rid, n in step if rid == "long"] == [9, 9, 9, 8, 1]
    assert all(("short", 1) in step for step in sizes[:5])


def test_shared_prefix_is_not_recomputed():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=512), num_blocks=64)
    system = list(range(100, 132))  # 8 full blocks
    sched.add(_request("first", [*system, 1, 2], 3))
    _drain(sched)
    sched.add(_request("second", [*system, 3, 4, 5], 3))
    plan = sched.schedule()
    (item,) = plan.seqs
    assert item.start_pos == 32 and item.token_ids == [3, 4, 5]
    assert sched.blocks.hit_tokens == 32


def test_prefix_cache_off_recomputes():
    sched = Scheduler(SchedulerConfig(block_size=4, prefix_cache=False), num_blocks=64)
    sched.add(_request("first", list(range(100, 120)), 2))
    _drain(sched)
    sched.add(_request("second", list(range(100, 120)), 2))
    assert sched.schedule().seqs[0].start_pos == 0


def test_request_that_can_never_fit_is_refused():
    sched = Scheduler(SchedulerConfig(block_size=4), num_blocks=3)
    error = sched.add(_request("big", [1] * 10, 5))
    assert error is not None and error.finish_reason == "error"
    assert "KV blocks" in error.error and "--kv-cache-memory" in error.error
    assert not sched.has_work()


def test_request_without_tokens_to_generate_is_refused():
    sched = Scheduler(SchedulerConfig(block_size=4), num_blocks=30)
    for rid, prompt, max_tokens in [("zero", [1] * 10, 0), ("empty", [], 5)]:
        error = sched.add(_request(rid, prompt, max_tokens))
        assert error is not None and error.finish_reason == "error"
    assert not sched.has_work()


def test_identical_prompts_share_blocks_within_one_step():
    """n choices of one prompt arrive together: the first computes it, the others reuse it."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=512), num_blocks=64)
    for i in range(3):
        sched.add(_request(f"choice{i}", list(range(100, 118)), 4))
    plan = sched.schedule()
    assert [(s.start_pos, len(s.token_ids)) for s in plan.seqs] == [(0, 18), (16, 2), (16, 2)]
    first, second, _ = (sched.seqs[s.seq_id] for s in plan.seqs)
    assert first.block_table[:4] == second.block_table[:4]


def test_a_request_in_two_crashed_steps_ends_alone_and_the_others_finish():
    """Both were in the step that crashed; after the restart each runs alone (the newest
    first) up to where it crashed, and the one whose step of its own crashes the worker again
    ends with an error."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), num_blocks=32)
    assert sched.add(_request("normal", [5] * 6, 8)) is None
    assert sched.add(_request("poison", [9] * 6, 8)) is None
    first = sched.schedule()
    sched.update(first, _sampled(first, 7))
    crashed = sched.schedule()  # a decode step of both
    assert len(crashed.seqs) == 2 and sched.crashed([crashed]) == []
    sched.restart()
    alone = sched.schedule()
    assert [s.seq_id for s in alone.seqs] == [sched.requests["poison"].seq_id]
    (out,) = sched.crashed([alone])
    assert (out.request_id, out.finish_reason, out.status) == ("poison", "error", 400)
    assert "crashed the engine twice" in out.error
    sched.restart()
    normal = sched.requests["normal"]
    while sched.quarantine:  # recomputed alone up to its crash point, then it rejoins
        plan = sched.schedule()
        assert [s.seq_id for s in plan.seqs] == [normal.seq_id]
        sched.update(plan, _sampled(plan, 7))
    assert _drain(sched) == {"normal": "length"}
    assert sched.blocks.num_free == 32


def test_a_request_alone_in_two_overlapped_steps_that_crash_has_crashed_once():
    """With async scheduling two steps of a lone request are in flight when the worker dies:
    one crash, so it becomes a suspect and is recomputed, not ended; a second crash of a
    step of its own ends it."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), num_blocks=32)
    assert sched.add(_request("lone", [9] * 6, 8)) is None
    prefill = sched.schedule()
    decode = sched.schedule()  # planned while the prefill is still in flight
    assert [s.seq_id for s in prefill.seqs] == [s.seq_id for s in decode.seqs]
    assert sched.crashed([prefill, decode]) == []
    sched.restart()
    (out,) = sched.crashed([sched.schedule()])
    assert (out.request_id, out.status) == ("lone", 400)


def test_a_step_is_never_planned_past_the_staging_buffer():
    """Requests with big logit_bias tables share steps only as far as the buffer holds them;
    one that would not fit even alone ends with a 400 naming the staging words."""
    words = 400  # a 40-entry bias is about 100 words a sampling row
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), num_blocks=64,
                      staging_words=words)
    for i in range(6):
        assert sched.add(_request(f"r{i}", [3 + i] * 5, 4, bias=40)) is None
    assert sched.add(_request("huge", [1] * 5, 4, bias=200)) is None
    done: dict[str, str] = {}
    sizes = []
    while sched.has_work():
        plan = sched.schedule()
        for out in sched.failed:
            done[out.request_id] = out.error
        sched.failed = []
        if plan is None:
            continue
        sizes.append(len(plan.seqs))
        assert step_words(plan) <= words
        for o in sched.update(plan, _sampled(plan, 7)):
            if o.finish_reason:
                done[o.request_id] = o.finish_reason
    assert "staging words" in done.pop("huge")
    assert done == {f"r{i}": "length" for i in range(6)}
    assert 1 < max(sizes) < 6  # batched, but not all six at once
