"""Continuous batching: which sequences run in the next step, and what their results mean.

A step may be planned while earlier ones are still running on the worker (overlapped steps):
a sequence whose last token is still being sampled feeds PREVIOUS_TOKEN, which the worker fills
in. Workers run plans strictly in order, so a block freed or reused here is only written by a
later step after every earlier step has finished with it.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Iterable
from itertools import islice

from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, Status
from surge.config import SchedulerConfig
from surge.protocol import (
    PREVIOUS_TOKEN,
    EngineRequest,
    RequestOutput,
    ScheduledSeq,
    StepPlan,
    StepResult,
)

log = logging.getLogger("surge.scheduler")
_BUCKET_WINDOW = 64  # how far down the queue length bucketing looks for similar prompts


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, num_blocks: int) -> None:
        self.cfg = cfg
        self.blocks = BlockManager(num_blocks, cfg.block_size, prefix_cache=cfg.prefix_cache)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        self.num_preemptions = 0
        self.queue_waits: list[float] = []  # arrival to first step, drained by the loop

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: EngineRequest) -> RequestOutput | None:
        """Queue a request; an error output instead if it could never fit the KV cache."""
        if req.sampling.max_tokens < 1 or not req.prompt_token_ids:
            return RequestOutput(req.request_id, [], "error",
                                 "a request needs a prompt and max_tokens >= 1", status=400)
        need = self.blocks.blocks_for(len(req.prompt_token_ids) + req.sampling.max_tokens)
        if need > self.blocks.num_blocks:
            return RequestOutput(
                req.request_id, [], "error",
                f"prompt + max_tokens needs {need} KV blocks but the cache holds "
                f"{self.blocks.num_blocks}; shorten the prompt, lower max_tokens, or start surge "
                f"with a larger --kv-cache-memory", status=400)
        if req.request_id in self.requests:
            return RequestOutput(req.request_id, [], "error",
                                 f"request id {req.request_id} is already in use", status=400)
        seed = req.sampling.seed if req.sampling.seed is not None else random.getrandbits(62)
        seq = Sequence(self._next_seq_id, req.request_id, req.prompt_token_ids, req.sampling,
                       seed, req.arrival_time, req.priority)
        self._next_seq_id += 1
        self.requests[req.request_id] = seq
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return None

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None:
                self._finish(seq)
                outputs.append(RequestOutput(rid, [], "abort"))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.free(seq)
        del self.requests[seq.request_id]
        del self.seqs[seq.seq_id]

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first in line; it recomputes from its tokens so far
        (mostly from the prefix cache, if its blocks survive)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("preempted", extra={"request_id": seq.request_id})

    def restart(self) -> None:
        """The worker and its KV cache are gone: every sequence starts over from the tokens it
        has (the ones in flight are sampled again, identically, from their seed and position)."""
        for seq in reversed(self.running):
            self.blocks.free(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        self.running.clear()
        for seq in self.waiting:
            seq.num_computed_tokens = 0
            seq.num_pending = 0
        self.blocks.forget_contents()

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """The least urgent sequence, the latest arrival among equals."""
        return max(reversed(candidates), key=lambda s: (s.priority, s.arrival_time))

    def schedule(self) -> StepPlan | None:
        """Pack the next step within the token budget: decodes first, then the chunks of
        prompts being prefilled, then waiting requests (long prompts split across steps)."""
        budget = self.cfg.max_num_batched_tokens
        # Planned on the spot, so that blocks a prompt fills are named before the next waiting
        # request looks them up: n choices of one prompt share it within the same step.
        chosen: list[ScheduledSeq] = []
        # Sorting is stable: admission order holds within the decodes and within the prefills.
        for seq in sorted(self.running, key=lambda s: s.num_computed_tokens < s.num_tokens - 1):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or not seq.wants_more:
                continue
            n = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            if n == 0:
                continue
            need = seq.num_computed_tokens + n
            while self.blocks.blocks_needed(seq, need) > self.blocks.num_free:
                # Never a sequence already in this step: its slots are about to be written.
                taken = {s.seq_id for s in chosen}
                victim = self._victim([s for s in self.running if s.seq_id not in taken])
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.allocate(seq, need)
                chosen.append(self._scheduled(seq, n))
                budget -= n
        for seq in self._admission_order():
            if budget == 0 or len(self.running) == self.cfg.max_num_seqs:
                break
            if seq.num_pending:
                break  # preempted with a token still in flight: resume once it is known
            hits = self.blocks.lookup(seq.token_ids)
            cached = len(hits) * self.cfg.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.can_admit(hits, cached + n):
                break
            self.waiting.remove(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = time.time()
                self.queue_waits.append(seq.first_scheduled - seq.arrival_time)
            self.blocks.admit(seq, hits)
            self.blocks.allocate(seq, cached + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen.append(self._scheduled(seq, n))
            budget -= n
        if not chosen:
            return None
        plan = StepPlan(self._next_step_id, chosen)
        self._next_step_id += 1
        return plan

    def _admission_order(self) -> Iterable[Sequence]:
        """Waiting sequences in the order to try them: first come, first served; with length
        bucketing, the oldest first and then those of a length within 2x of it."""
        room = self.cfg.max_num_seqs - len(self.running)
        if not self.cfg.length_bucketing or not self.waiting:
            return list(islice(self.waiting, room))
        head = self.waiting[0]
        similar = [s for s in islice(self.waiting, 1, _BUCKET_WINDOW)
                   if 0.5 <= s.num_tokens / head.num_tokens <= 2.0]
        return [head, *similar[: room - 1]]

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start : start + n]
        tokens += [PREVIOUS_TOKEN] * (n - len(tokens))
        seq.num_computed_tokens += n
        sample = seq.num_computed_tokens == seq.num_tokens + seq.num_pending
        # The index, among the outputs, of the token this step samples.
        output_index = seq.num_output_tokens + seq.num_pending
        seq.num_pending += sample
        self.blocks.name_full_blocks(seq)
        params = seq.sampling
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=tokens, start_pos=start,
            block_table=list(seq.block_table), sample=sample, sampling=params, seed=seq.seed,
            ban_stop_tokens=sample and output_index < params.min_tokens,
            history=list(seq.token_ids) if sample and params.uses_penalties else None,
            num_prompt_tokens=seq.num_prompt_tokens)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append each sampled token, apply the stop checks, free what finished."""
        assert result.step_id == plan.step_id, (result.step_id, plan.step_id)
        sampled = iter(result.sampled_token_ids)
        logprobs = iter(result.logprobs or [None] * len(result.sampled_token_ids))
        outputs = []
        for item in plan.seqs:
            if not item.sample:
                continue
            token, token_logprobs = next(sampled), next(logprobs)
            seq = self.seqs.get(item.seq_id)
            if seq is None:
                continue  # finished or aborted while the step ran
            seq.token_ids.append(token)
            seq.num_pending -= 1
            reason = None
            if token in seq.sampling.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= seq.sampling.max_tokens:
                reason = "length"
            if reason:
                self._finish(seq)
            else:
                self.blocks.name_full_blocks(seq)
            outputs.append(RequestOutput(seq.request_id, [token], reason, None,
                                         None if token_logprobs is None else [token_logprobs]))
        return outputs
