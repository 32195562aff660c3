"""Requests into the scheduler: validated, admitted as a unit (quotas, queue bounds, the
degradation ladder), queued as sequences; aborted; expired when their deadline to start
passes. A part of Scheduler (its base class), kept apart because it is one idea."""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable

import msgspec

from scheduler.admission import Admission
from scheduler.block_manager import BlockManager
from scheduler.queue import WaitingQueue
from scheduler.sequence import Sequence
from scheduler.tenants import Tenant
from surge.protocol import EngineRequest, RequestOutput

log = logging.getLogger("surge.scheduler")
MIXED_WINDOW_S = 10.0  # how recently a second priority class must have arrived to count


class Intake:
    # Scheduler's state and its _finish, which these methods use.
    admission: Admission
    blocks: BlockManager
    waiting: WaitingQueue
    requests: dict[str, Sequence]
    seqs: dict[int, Sequence]
    clock: Callable[[], float]
    _deadlines: list[tuple[float, int]]
    _next_seq_id: int
    _classes_seen: dict[int, float]
    _finish: Callable[[Sequence], None]

    def add(self, req: EngineRequest) -> RequestOutput | None:
        """Queue a request; an error output instead if it is refused (it could never fit the
        KV cache, or a limit says no)."""
        reply = self.add_all([req])[0]
        return reply if reply.finish_reason else None

    def add_all(self, reqs: list[EngineRequest]) -> list[RequestOutput]:
        """Queue the engine requests of one API request (its prompts and choices) as a unit:
        all of them, or none, each then refused as the first refused one is. One reply per
        request: its refusal, or its acknowledgement (which tells of a degradation)."""
        self.admission.arrived += len(reqs)
        refusal = next(filter(None, map(self._invalid, reqs)), None)
        if refusal is None:
            self.admission.ladder.requested += sum(r.sampling.max_tokens for r in reqs)
        now = self.clock()
        first = reqs[0]
        tenant = self.admission.tenant(first.tenant, now)
        # The tenant's defaults for what the request leaves out.
        priority = tenant.cfg.priority if first.priority is None else first.priority
        timeout = first.timeout_s or tenant.cfg.timeout_s
        refusal = refusal or self.admission.check(reqs, tenant, self.waiting, now, priority,
                                                  timeout)
        if refusal is not None:
            return [msgspec.structs.replace(refusal, request_id=r.request_id) for r in reqs]
        reqs, degraded = self.admission.degrade(reqs, tenant)
        if degraded:
            log.info("degraded under overload: %s", degraded,
                     extra={"request_id": first.request_id, "tenant": tenant.name})
        self._classes_seen[priority] = now
        if len(self._classes_seen) > 64:  # clients choose priorities: keep only recent ones
            self._classes_seen = {p: t for p, t in self._classes_seen.items()
                                  if now - t < MIXED_WINDOW_S}
        for req in reqs:
            self._queue(req, tenant, priority, timeout)
        return [RequestOutput(r.request_id, [], degraded=degraded) for r in reqs]

    def _invalid(self, req: EngineRequest) -> RequestOutput | None:
        """A 400 for a request that can never run here."""
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
        return None

    def _queue(self, req: EngineRequest, tenant: Tenant, priority: int, timeout: float) -> None:
        seed = req.sampling.seed if req.sampling.seed is not None else random.getrandbits(62)
        deadline = req.arrival_time + timeout if timeout else None
        seq = Sequence(self._next_seq_id, req.request_id, req.prompt_token_ids, req.sampling,
                       seed, req.arrival_time, tenant, priority, deadline, req.grammar)
        self._next_seq_id += 1
        self.requests[req.request_id] = seq
        self.seqs[seq.seq_id] = seq
        tenant.catch_up(self.admission.tenants.values())
        self.waiting.add(seq)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, seq.seq_id))

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None:
                self._finish(seq)
                outputs.append(RequestOutput(rid, [], "abort"))
        return outputs

    def expire(self) -> list[RequestOutput]:
        """End the queued requests whose deadline to start has passed."""
        now = self.clock()
        outputs = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq_id = heapq.heappop(self._deadlines)
            seq = self.seqs.get(seq_id)
            if seq is None or seq.first_scheduled is not None:
                continue
            self._finish(seq)
            self.admission.rejected[(seq.tenant.name, "timeout")] += 1
            outputs.append(RequestOutput(
                seq.request_id, [], "error",
                f"the request waited {now - seq.arrival_time:.1f}s in the queue without "
                f"starting, past its timeout; the server is overloaded: retry later or give a "
                f"longer timeout", status=503, retry_after=1.0))
        return outputs
