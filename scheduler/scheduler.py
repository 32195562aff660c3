"""Continuous batching: which sequences run in the next step, and what their results mean.

A step may be planned while earlier ones are still running on the worker (overlapped steps):
a sequence whose last token is still being sampled feeds PREVIOUS_TOKEN, which the worker fills
in. Workers run plans strictly in order, so a block freed or reused here is only written by a
later step after every earlier step has finished with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from itertools import islice

from scheduler.admission import Admission
from scheduler.block_manager import BlockManager
from scheduler.cost import StepCost
from scheduler.intake import MIXED_WINDOW_S, Intake
from scheduler.pipeline import micro_batch_seats
from scheduler.preemption import Preemption
from scheduler.quarantine import POISON_ERROR, Quarantine
from scheduler.queue import WaitingQueue
from scheduler.sequence import Sequence, Status
from scheduler.speculation import Speculation
from shm import STAGING_WORDS
from surge.config import OverloadConfig, SchedulerConfig, SpeculativeConfig, TenantConfig
from surge.protocol import (
    PREVIOUS_TOKEN,
    RequestOutput,
    ScheduledSeq,
    SeqResult,
    StepPlan,
    StepResult,
)
from surge.step_size import StepSize

log = logging.getLogger("surge.scheduler")
_BUCKET_WINDOW = 64  # how far down the queue length bucketing looks for similar prompts


class Scheduler(Intake, Preemption):
    """Plans steps and applies their results; requests come in through Intake (add_all,
    abort, expire)."""

    def __init__(self, cfg: SchedulerConfig, num_blocks: int,
                 tenants: dict[str, TenantConfig] | None = None,
                 clock: Callable[[], float] = time.time,
                 speculative: SpeculativeConfig | None = None,
                 staging_words: int = STAGING_WORDS,
                 overload: OverloadConfig | None = None, window: int = 0,
                 stages: int = 1) -> None:
        """window: how far back every layer of the model attends (0: some layer sees all);
        stages: pipeline stages (see scheduler/pipeline.py)."""
        self.cfg = cfg
        # Pipeline stages, and the steps the loop keeps in flight (it sets this: one at a
        # time, a step takes every sequence it can).
        self.stages = self.in_flight = stages
        self.staging_words = staging_words  # the most a step's inputs may take on the worker
        self.clock = clock  # a fake one in the simulation tests
        self.blocks = BlockManager(num_blocks, cfg.block_size, prefix_cache=cfg.prefix_cache,
                                   window=window)
        self.admission = Admission(cfg, tenants or {}, overload or OverloadConfig(), clock())
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.seqs: dict[int, Sequence] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, seq_id)
        self._next_seq_id = 0
        self._next_step_id = 0
        self.num_preemptions = 0
        self.cost = StepCost()
        self._classes_seen: dict[int, float] = {}  # priority -> its latest arrival
        self.queue_waits: list[float] = []  # arrival to first step, drained by StatsCollector
        self.spec = Speculation(speculative or SpeculativeConfig())
        self.quarantine = Quarantine()
        # Requests ended while planning (a step of their own could never be staged), for the
        # loop to send.
        self.failed: list[RequestOutput] = []
        self._released: list[int] = []  # for the next plan's StepPlan.released

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def configure(self, cfg: SchedulerConfig, tenants: dict[str, TenantConfig],
                  speculative: SpeculativeConfig | None = None,
                  overload: OverloadConfig | None = None) -> None:
        """Live parameters, applied between two steps."""
        self.cfg = cfg
        self.spec.cfg = speculative or self.spec.cfg
        self.blocks.prefix_cache = cfg.prefix_cache
        self.admission.configure(cfg, tenants, overload or self.admission.ladder.cfg,
                                 self.clock())

    def _start(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        seq.tenant.num_running += 1
        self.admission.drained.add(self.clock())

    def _stop(self, seq: Sequence, status: Status) -> None:
        """Out of the batch (finished, or back to the queue); its blocks are freed."""
        self.running.remove(seq)
        seq.tenant.num_running -= 1
        self.blocks.free(seq)
        seq.status = status

    def _finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self._stop(seq, Status.FINISHED)
        else:
            self.waiting.remove(seq)
            self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.tenant.finished.add(self.clock())
        self.quarantine.forget(seq.seq_id)
        if seq.grammar is not None:
            self._released.append(seq.seq_id)
        del self.requests[seq.request_id]
        del self.seqs[seq.seq_id]

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it again; it recomputes from its tokens so far (mostly
        from the prefix cache, if its blocks survive). Its arrival keeps its place in line."""
        self._stop(seq, Status.WAITING)
        seq.num_computed_tokens = 0
        seq.draft = []
        seq.grammar_sent = False
        self.waiting.add(seq)
        self.num_preemptions += 1
        log.debug("preempted", extra={"request_id": seq.request_id})

    def crashed(self, plans: list[StepPlan]) -> list[RequestOutput]:
        """The steps in plans died with the worker (call before restart): a request that
        crashed it twice ends with an error (see Quarantine); the others will be recomputed."""
        outputs = []
        for seq in self.quarantine.crashed(plans, self.seqs):
            log.error("request crashed the worker twice; ending it",
                      extra={"request_id": seq.request_id})
            self._finish(seq)
            outputs.append(RequestOutput(seq.request_id, [], "error", POISON_ERROR, status=400))
        return outputs

    def restart(self) -> None:
        """The worker and its KV cache are gone: every sequence starts over from the tokens it
        has (the ones in flight are sampled again, identically, from their seed and position)."""
        for seq in list(self.running):
            self._stop(seq, Status.WAITING)
            self.waiting.add(seq)
        for seq in self.waiting:
            seq.num_computed_tokens = 0
            seq.num_pending = 0
            seq.draft, seq.spec_inflight = [], False
            seq.grammar_sent = False
        self._released = []  # the new workers hold no matchers
        self.blocks.forget_contents()

    def speculating(self) -> bool:
        """Whether the next step may carry proposals; then it must not be planned before the
        previous one's tokens are known (see Speculation)."""
        return not self.admission.ladder.conservative and \
            self.spec.active(self.running, self._next_step_id)

    def interactive(self) -> bool:
        """Whether steps are kept short for urgent arrivals (see interactive_step_ms)."""
        if not self.cfg.interactive_step_ms or self.cfg.policy != "priority":
            return False
        now = self.clock()
        return sum(now - seen < MIXED_WINDOW_S for seen in self._classes_seen.values()) > 1

    def schedule(self) -> StepPlan | None:
        """Pack the next step within the token budget and the staging buffer: decodes first,
        then the chunks of prompts being prefilled, then waiting requests (long prompts split
        across steps). While there are suspects of a crash, one of them runs alone."""
        self.admission.judge(self.waiting, self.blocks, self.clock())
        budget, seats = self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs
        if self.interactive():
            tokens = self.cost.tokens_within(self.cfg.interactive_step_ms / 1000)
            if tokens is not None:  # half the step for decodes, half for prompts
                budget, seats = min(budget, tokens), min(seats, max(1, tokens // 2))
            while len(self.running) > seats:
                self._preempt(self._victim(self.running))
        solo = self.quarantine.next(self.seqs)
        # Planned on the spot, so that blocks a prompt fills are named before the next waiting
        # request looks them up: n choices of one prompt share it within the same step.
        chosen: list[ScheduledSeq] = []
        size = StepSize()
        if self.cfg.policy == "priority" and self.cfg.priority_preemption and self.waiting \
                and solo is None:
            self._preempt_for_urgent(seats)
        speculate = self.speculating()
        full = False  # the staging buffer has no room for the next sequence
        step_seats = micro_batch_seats(min(self.stages, self.in_flight), len(self.running),
                                       len(self.waiting), seats)
        # Sorting is stable: admission order holds within the decodes and within the prefills.
        for seq in sorted(self.running, key=lambda s: s.num_computed_tokens < s.num_tokens - 1):
            if budget == 0 or len(chosen) >= step_seats:
                break
            if seq.status is not Status.RUNNING or not seq.wants_more or seq.spec_inflight \
                    or solo not in (None, seq) or (self.stages > 1 and seq.num_pending):
                continue
            n = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            if n == 0:
                continue
            while not self.blocks.allocate(seq, seq.num_computed_tokens + n):
                # Never a sequence already in this step: its slots are about to be written.
                taken = {s.seq_id for s in chosen}
                victim = self._victim([s for s in self.running if s.seq_id not in taken])
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            drafts, propose = self._speculation(seq, n, budget) if speculate else ([], 0)
            item = self._item(seq, n, drafts, propose)
            if (drafts or propose) and size.plus(item).words() > self.staging_words:
                self.blocks.trim(seq, seq.num_computed_tokens + n)  # proposals are optional
                item = self._item(seq, n)
            grown = self._staged(size, item, seq, bool(chosen))
            if grown is None:
                full = bool(chosen)
                if full:
                    break
                continue
            size = grown
            self._commit(seq, item)
            chosen.append(item)
            budget -= len(item.token_ids)
        order = self._admission_order(seats) if solo is None else self._make_room(solo, seats)
        for seq in order:
            if full or budget == 0 or len(self.running) >= seats or len(chosen) >= step_seats:
                break
            if seq.num_pending:
                continue  # preempted with a token still in flight: resume once it is known
            hits = self._hits(seq)
            cached = len(hits) * self.cfg.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.allocate(seq, cached + n, hits):
                break
            item = self._item(seq, n)
            grown = self._staged(size, item, seq, bool(chosen))
            if grown is None:
                if chosen:  # it waits for a step with room
                    self.blocks.free(seq)
                    seq.num_computed_tokens = 0
                break
            size = grown
            if seq.first_scheduled is None:
                seq.first_scheduled, seq.cached_tokens = self.clock(), cached
                self.queue_waits.append(seq.first_scheduled - seq.arrival_time)
            self._start(seq)
            self._commit(seq, item)
            chosen.append(item)
            budget -= n
        if not chosen:
            return None
        plan = StepPlan(self._next_step_id, chosen, self._released)
        self._released = []
        self._next_step_id += 1
        return plan

    def _staged(self, size: StepSize, item: ScheduledSeq, seq: Sequence,
                shared: bool) -> StepSize | None:
        """The step's size with item in it, or None if the staging buffer has no room for it.
        One that does not fit even alone (not shared) can never run: it ends with an error."""
        grown = size.plus(item)
        words = grown.words()
        if words <= self.staging_words:
            return grown
        if not shared:
            self._finish(seq)
            self.failed.append(RequestOutput(
                seq.request_id, [], "error",
                f"a step of this request alone needs {words} staging words, more than the "
                f"{self.staging_words} a step holds (its logit_bias, stop_token_ids, prompt "
                f"chunk or context are too large); it can never run", status=400))
        return None

    def _admission_order(self, seats: int) -> Iterator[Sequence]:
        """Waiting sequences in the order to try them (see WaitingQueue.order); with length
        bucketing, the first and then those of a length within 2x of it."""
        if len(self.running) >= seats or not self.waiting:
            return iter(())
        order = self.waiting.order(self.cfg, self.clock())
        if not self.cfg.length_bucketing:
            return order
        head = next(order)
        similar = [s for s in islice(order, _BUCKET_WINDOW)
                   if 0.5 <= s.num_tokens / head.num_tokens <= 2.0]
        return iter([head, *similar])

    def _speculation(self, seq: Sequence, n: int, budget: int) -> tuple[list[int], int]:
        """Tokens for seq to verify after its n, and how many the draft model should propose
        after this step, with their slots allocated; none where the KV cache has no spare room
        (they never preempt)."""
        ends = seq.num_computed_tokens + n == seq.num_tokens  # samples, last token known
        if not ends or not self.spec.eligible(seq, self._next_step_id):
            return [], 0
        drafts = self.spec.proposal(seq, min(budget - n, seq.remaining_output - 1))
        # The draft's steps write K/V up to `propose` positions past this step's tokens: no
        # further than max_tokens reaches, which the context window holds.
        propose = 0 if self.spec.cfg.speculative_method != "draft" else \
            max(0, min(self.spec.cfg.num_speculative_tokens, seq.remaining_output - len(drafts)))
        if not self.blocks.allocate(seq, seq.num_computed_tokens + n + len(drafts) + propose):
            return [], 0
        return drafts, propose

    def _item(self, seq: Sequence, n: int, drafts: list[int] | None = None,
              propose: int = 0) -> ScheduledSeq:
        """seq's next n tokens (then its proposals) as a step item; nothing changes until
        _commit."""
        drafts = drafts or []
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start : start + n]
        tokens += [PREVIOUS_TOKEN] * (n - len(tokens))
        sample = start + n == seq.num_tokens + seq.num_pending
        # The index, among the outputs, of the token this step samples.
        output_index = seq.num_output_tokens + seq.num_pending
        params = seq.sampling
        # A computation starts with every output token known (see the num_pending checks).
        grammar = seq.grammar if not seq.grammar_sent else None
        scores: list[int] = []  # the prompt tokens this chunk's rows predict
        if params.prompt_logprobs is not None and \
                len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
            scores = seq.token_ids[start + 1 : min(start + n + 1, seq.num_prompt_tokens)]
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=tokens + drafts, start_pos=start,
            block_table=list(seq.block_table), sample=sample, sampling=params, seed=seq.seed,
            ban_stop_tokens=sample and output_index < params.min_tokens,
            history=list(seq.token_ids) if sample and params.uses_penalties else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_draft=len(drafts), propose=propose,
            grammar=grammar,
            grammar_tokens=seq.token_ids[seq.num_prompt_tokens:] if grammar else [],
            scores=scores)

    def _commit(self, seq: Sequence, item: ScheduledSeq) -> None:
        """item is in the step: seq's tokens count as computed (its proposals' slots are
        written too; update() takes back those rejected)."""
        seq.num_computed_tokens += len(item.token_ids) - item.num_draft
        seq.tenant.serve(len(item.token_ids))
        seq.num_pending += item.sample
        self.blocks.name_full_blocks(seq)
        seq.num_computed_tokens += item.num_draft
        seq.spec_inflight = bool(item.num_draft or item.propose)
        seq.draft = []  # proposals are for the step right after the one that made them
        seq.grammar_sent = seq.grammar_sent or item.grammar is not None

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append each sequence's new tokens (with proposals, those accepted and one more),
        apply the stop checks, take back rejected proposals' slots, free what finished."""
        assert result.step_id == plan.step_id, (result.step_id, plan.step_id)
        outputs = []
        now = self.clock()
        for item in plan.seqs:
            seq = self.seqs.get(item.seq_id)
            if item.scores and seq is not None and len(seq.prompt_logprobs) >= item.start_pos:
                # A recomputed prompt is scored again: the positions already known are kept.
                got = result.prompt_logprobs.get(item.seq_id, [])
                seq.prompt_logprobs += got[len(seq.prompt_logprobs) - item.start_pos :]
            if not item.sample:
                continue
            new = result.seqs[item.seq_id]
            if seq is None:
                continue  # finished or aborted while the step ran
            seq.num_pending -= 1
            self._settle_speculation(seq, item, new, plan.step_id, len(plan.seqs))
            if new.grammar_error is not None:
                # Its tokens were sampled under a constraint that no longer holds: none shown.
                self._finish(seq)
                outputs.append(RequestOutput(
                    seq.request_id, [], "error", "the output constraint (response_format, "
                    f"guided_* or tool_choice) failed while decoding: {new.grammar_error}; "
                    "simplify it (smaller repetition counts, fewer alternatives)", status=400))
                continue
            tokens, reason = new.token_ids, None
            for n, token in enumerate(tokens, 1):
                seq.token_ids.append(token)
                if token in seq.sampling.stop_token_ids:
                    reason = "stop"
                elif seq.num_output_tokens >= seq.sampling.max_tokens:
                    reason = "length"
                if reason:
                    tokens = tokens[:n]
                    break
            seq.tenant.tokens.take(len(tokens), now)
            self.admission.ladder.generated += len(tokens)
            first = seq.num_output_tokens == len(tokens)
            if first:  # the ladder watches TTFT
                self.admission.ladder.ttfts.append(now - seq.arrival_time)
            if reason:
                self._finish(seq)
            else:
                self.blocks.name_full_blocks(seq)
                # Proposals of this step and of one planned after it may yet be rejected.
                self.blocks.release_outside_window(seq, 2 * self.spec.cfg.num_speculative_tokens)
            logprobs = None if new.logprobs is None else new.logprobs[: len(tokens)]
            outputs.append(RequestOutput(
                seq.request_id, tokens, reason, None, logprobs,
                queued_s=(seq.first_scheduled or now) - seq.arrival_time if first else None,
                cached_tokens=seq.cached_tokens if first else None,
                prompt_logprobs=seq.prompt_logprobs
                if first and seq.sampling.prompt_logprobs is not None else None))
        self.quarantine.served(plan, self.seqs)
        return outputs

    def _settle_speculation(self, seq: Sequence, item: ScheduledSeq, new: SeqResult, step: int,
                            batch: int) -> None:
        """Roll seq back to its accepted tokens, keep the draft model's next proposals."""
        num_accepted = len(new.token_ids) - 1
        if item.num_draft:
            self.spec.record(seq, item.num_draft, num_accepted, step, batch)
        if not (item.num_draft or item.propose):
            return
        seq.spec_inflight = False
        if seq.status is not Status.RUNNING:
            return  # preempted meanwhile: it starts over from its tokens
        seq.draft = new.draft
        seq.num_computed_tokens -= item.num_draft - num_accepted
        if not seq.num_pending:  # no later step holds its table
            self.blocks.trim(seq, seq.num_computed_tokens)
