"""Scheduler and block manager invariants under any sequence of requests, steps and aborts."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from surge.config import SchedulerConfig
from surge.protocol import EngineRequest, SamplingParams, StepResult

EOS = 2


def _request(rid: str, prompt_len: int, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[5] * prompt_len, arrival_time=0.0,
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                 stop_token_ids=[EOS]))


def _check_blocks(sched: Scheduler) -> None:
    used = [b for seq in sched.requests.values() for b in seq.block_table]
    free = list(sched.blocks.free_blocks)
    assert len(set(used)) == len(used), "a block is held by two sequences"
    assert len(set(free)) == len(free), "a block is free twice"
    assert sorted(used + free) == list(range(sched.blocks.num_blocks)), "a block leaked"
    for seq in sched.running:
        assert len(seq.block_table) * sched.blocks.block_size >= seq.num_computed_tokens


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_blocks=4, block_size=16)
    seq = Sequence(0, "a", [1] * 17, SamplingParams(max_tokens=1), 0, 0.0)
    assert bm.blocks_needed(seq, 17) == 2
    bm.allocate(seq, 17)
    assert len(seq.block_table) == 2 and bm.num_free == 2
    assert bm.blocks_needed(seq, 32) == 0 and bm.blocks_needed(seq, 33) == 1
    bm.free(seq)
    assert bm.num_free == 4 and seq.block_table == []


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 20)),
        st.tuples(st.just("step"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(actions, st.integers(6, 24), st.integers(1, 8), st.integers(4, 64))
def test_no_block_leaks_and_every_request_ends_once(actions, num_blocks, max_seqs, budget):
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=max_seqs,
                                      max_num_batched_tokens=budget), num_blocks)
    ended: dict[str, str] = {}
    accepted: list[str] = []
    counter = itertools.count()

    def step(token: int) -> None:
        plan = sched.schedule()
        if plan is None:
            return
        assert sum(len(s.token_ids) for s in plan.seqs) <= budget
        assert len(plan.seqs) <= max_seqs
        sampled = [token] * sum(s.sample for s in plan.seqs)
        for out in sched.update(plan, StepResult(plan.step_id, sampled)):
            if out.finish_reason:
                assert out.request_id not in ended
                ended[out.request_id] = out.finish_reason
        _check_blocks(sched)

    for kind, a, b in actions:
        if kind == "add":
            rid = f"r{next(counter)}"
            error = sched.add(_request(rid, a, b))
            if error is None:
                accepted.append(rid)
            else:
                assert sched.blocks.blocks_for(a + b) > num_blocks
        elif kind == "step":
            step(EOS if a == 0 else 7)
        elif kind == "abort" and accepted:
            rid = accepted[a % len(accepted)]
            for out in sched.abort([rid]):
                assert out.request_id not in ended
                ended[out.request_id] = out.finish_reason
        _check_blocks(sched)
    for _ in range(10_000):
        if not sched.has_work():
            break
        step(7)
    assert not sched.has_work(), "requests were left behind"
    assert sorted(ended) == sorted(accepted)
    assert sched.blocks.num_free == num_blocks


def test_preemption_when_blocks_run_out():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), num_blocks=6)
    for i in range(3):
        assert sched.add(_request(f"r{i}", 7, 9)) is None  # 4 blocks each at the end
    done = set()
    while sched.has_work():
        plan = sched.schedule()
        sampled = [7] * sum(s.sample for s in plan.seqs)
        done |= {o.request_id for o in sched.update(plan, StepResult(plan.step_id, sampled))
                 if o.finish_reason == "length"}
    assert done == {"r0", "r1", "r2"}
    assert sched.num_preemptions > 0


def test_chunked_prefill_respects_budget():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=10), num_blocks=64)
    sched.add(_request("long", 35, 2))
    sizes = []
    while sched.has_work():
        plan = sched.schedule()
        sizes.append([len(s.token_ids) for s in plan.seqs])
        sampled = [7] * sum(s.sample for s in plan.seqs)
        sched.update(plan, StepResult(plan.step_id, sampled))
    assert sizes == [[10], [10], [10], [5], [1]]


def test_request_that_can_never_fit_is_refused():
    sched = Scheduler(SchedulerConfig(block_size=4), num_blocks=3)
    error = sched.add(_request("big", 10, 5))
    assert error is not None and error.finish_reason == "error"
    assert "KV blocks" in error.error and "--kv-cache-memory" in error.error
    assert not sched.has_work()
