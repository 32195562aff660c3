"""Continuous batching: which sequences run in the next step, and what their results mean."""

from __future__ import annotations

import logging
import random
from collections import deque

from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, Status
from surge.config import SchedulerConfig
from surge.protocol import (
    EngineRequest,
    RequestOutput,
    ScheduledSeq,
    StepPlan,
    StepResult,
)

log = logging.getLogger("surge.scheduler")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, num_blocks: int) -> None:
        self.cfg = cfg
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Sequence] = {}
        self.seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: EngineRequest) -> RequestOutput | None:
        """Queue a request; an error output instead if it could never fit the KV cache."""
        need = self.blocks.blocks_for(len(req.prompt_token_ids) + req.sampling.max_tokens)
        if need > self.blocks.num_blocks:
            return RequestOutput(
                req.request_id, [], "error",
                f"prompt + max_tokens needs {need} KV blocks but the cache holds "
                f"{self.blocks.num_blocks}; shorten the prompt, lower max_tokens, or start surge "
                f"with a larger --kv-cache-memory")
        if req.request_id in self.requests:
            return RequestOutput(req.request_id, [], "error",
                                 f"request id {req.request_id} is already in use")
        seed = req.sampling.seed if req.sampling.seed is not None else random.getrandbits(62)
        seq = Sequence(self._next_seq_id, req.request_id, req.prompt_token_ids, req.sampling,
                       seed, req.arrival_time)
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
        """Free seq's blocks and queue it first in line; it recomputes from its tokens so far."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("preempted", extra={"request_id": seq.request_id})

    def schedule(self) -> StepPlan | None:
        """Pack the next step: running sequences first (oldest first), then waiting ones, within
        the token budget; long prompts are split into chunks across steps."""
        budget = self.cfg.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = seq.num_computed_tokens + n
            while self.blocks.blocks_needed(seq, need) > self.blocks.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.allocate(seq, seq.num_computed_tokens + n)
                chosen.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.blocks.blocks_needed(seq, n) > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
        if not chosen:
            return None
        plan = StepPlan(self._next_step_id, [self._scheduled(seq, n) for seq, n in chosen])
        self._next_step_id += 1
        return plan

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        seq.num_computed_tokens += n
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start : start + n],
            start_pos=start,
            block_table=list(seq.block_table),
            sample=seq.num_computed_tokens == seq.num_tokens,
            temperature=seq.sampling.temperature,
            seed=seq.seed,
        )

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append each sampled token, apply the stop checks, free what finished."""
        assert result.step_id == plan.step_id, (result.step_id, plan.step_id)
        sampled = iter(result.sampled_token_ids)
        outputs = []
        for item in plan.seqs:
            if not item.sample:
                continue
            token = next(sampled)
            seq = self.seqs.get(item.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            seq.token_ids.append(token)
            reason = None
            if token in seq.sampling.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= seq.sampling.max_tokens:
                reason = "length"
            if reason:
                self._finish(seq)
            outputs.append(RequestOutput(seq.request_id, [token], reason))
        return outputs
