"""The limits that span data-parallel replicas: tenant quotas and rate limits and the global
queue bounds, judged in the frontend by the scheduler's own admission rules, so that a
tenant's limits are not multiplied by the number of replicas. Each replica still orders its
own queue (priorities, fair share) and applies the same limits to its share, which never
refuses what these let through."""

from __future__ import annotations

from collections.abc import Iterator

from msgspec import Struct

from scheduler.admission import Admission
from scheduler.tenants import Tenant
from surge.config import OverloadConfig, SchedulerConfig, TenantConfig
from surge.protocol import EngineRequest, RequestOutput


class _Entry(Struct, kw_only=True):
    tenant: Tenant
    priority: int
    arrival_time: float
    prompt_tokens: int


class _Queue:
    """The requests admitted here that no replica has started yet (admission's Waiting)."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[_Entry]:
        return iter(self.entries.values())


class GlobalLimits:
    def __init__(self, tenants: dict[str, TenantConfig], scheduler: SchedulerConfig,
                 now: float) -> None:
        # The overload ladder stays per replica (it judges each one's own queue and cache):
        # this one is never judged, so it never caps or refuses.
        self.admission = Admission(scheduler, tenants, OverloadConfig(), now)
        self.waiting = _Queue()
        self.running: dict[str, _Entry] = {}

    def configure(self, tenants: dict[str, TenantConfig], scheduler: SchedulerConfig,
                  now: float) -> None:
        self.admission.configure(scheduler, tenants, self.admission.ladder.cfg, now)

    def admit(self, requests: list[EngineRequest], now: float) -> RequestOutput | None:
        """One API request's engine requests, admitted as a unit: a refusal (for the first;
        the caller gives it to each), or None once they are counted and charged."""
        first = requests[0]
        tenant = self.admission.tenant(first.tenant, now)
        priority = tenant.cfg.priority if first.priority is None else first.priority
        timeout = first.timeout_s or tenant.cfg.timeout_s
        refusal = self.admission.check(requests, tenant, self.waiting, now, priority, timeout)
        if refusal is not None:
            return refusal
        for r in requests:
            tokens = len(r.prompt_token_ids)
            self.waiting.entries[r.request_id] = _Entry(
                tenant=tenant, priority=priority, arrival_time=r.arrival_time,
                prompt_tokens=tokens)
            self.waiting.num_tokens += tokens
            tenant.num_waiting += 1
        return None

    def _dequeue(self, request_id: str) -> _Entry | None:
        entry = self.waiting.entries.pop(request_id, None)
        if entry is not None:
            self.waiting.num_tokens -= entry.prompt_tokens
            entry.tenant.num_waiting -= 1
        return entry

    def started(self, request_id: str, now: float) -> None:
        """Its replica has scheduled it: its first output with tokens (the empty
        acknowledgement comes when it is queued)."""
        entry = self._dequeue(request_id)
        if entry is not None:
            entry.tenant.num_running += 1
            self.running[request_id] = entry
            self.admission.drained.add(now)

    def generated(self, request_id: str, num_tokens: int, now: float) -> None:
        """Generated tokens count against tokens_per_min as they come, as in the scheduler."""
        entry = self.running.get(request_id) or self.waiting.entries.get(request_id)
        if entry is not None:
            entry.tenant.tokens.take(num_tokens, now)

    def ended(self, request_id: str, now: float) -> None:
        """Finished, refused by its replica, failed or aborted: it holds no quota any more."""
        if self._dequeue(request_id) is not None:
            return
        entry = self.running.pop(request_id, None)
        if entry is not None:
            entry.tenant.num_running -= 1
            entry.tenant.finished.add(now)
