"""Admission at arrival: tenant quotas and rate limits, the global queue bounds, and deadlines
that cannot be met. A refused request is answered at once (429 or 503 with Retry-After),
never queued into a timeout."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

import msgspec

from scheduler.block_manager import BlockManager
from scheduler.overload import Ladder, Step
from scheduler.tenants import RateMeter, Tenant
from surge.config import OverloadConfig, SchedulerConfig, TenantConfig
from surge.config_live import INHERITED
from surge.protocol import EngineRequest, RequestOutput

# Retry-After when there is no measured rate to estimate it from yet.
_DEFAULT_RETRY_S = 1.0


class Queued(Protocol):
    priority: int
    arrival_time: float


class Waiting(Protocol):
    """What admission reads of a queue: a WaitingQueue, or the frontend's count of requests
    not yet started on any replica (server/limits.py)."""

    num_tokens: int  # prompt tokens waiting

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Queued]: ...


def table_of(tenants: dict[str, TenantConfig], name: str) -> str:
    """The [tenants.NAME] table a tenant's limits come from."""
    return name if name in tenants else INHERITED["tenants"]


def limits_of(tenants: dict[str, TenantConfig], name: str) -> TenantConfig:
    """Tenants without a [tenants.NAME] table share the [tenants.default] limits."""
    return tenants.get(name) or tenants.get(INHERITED["tenants"]) or TenantConfig()


def too_urgent(tenants: dict[str, TenantConfig], name: str, priority: int) -> str | None:
    """Why tenant `name` may not ask for priority (None: it may). Without API keys everyone is
    `default`, whose clients choose freely (as vLLM's); a named tenant may not be more urgent
    than its operator's priority unless its min_priority allows."""
    limits = limits_of(tenants, name)
    floor = limits.min_priority if limits.min_priority is not None else \
        None if name == INHERITED["tenants"] else limits.priority
    if floor is None or priority >= floor:
        return None
    return (f"tenant {name!r} may ask for priority {floor} or above (lower is more urgent), "
            f"not {priority}; an operator can allow it with "
            f"tenants.{table_of(tenants, name)}.min_priority")


class Admission:
    def __init__(self, cfg: SchedulerConfig, tenants: dict[str, TenantConfig],
                 overload: OverloadConfig, now: float) -> None:
        self.cfg = cfg
        self.tenant_cfgs = tenants
        self.tenants: dict[str, Tenant] = {}
        self.drained = RateMeter()  # requests leaving the queue for the batch
        self.arrived = 0  # engine requests that arrived (refused ones too): the demand
        self.rejected: Counter[tuple[str, str]] = Counter()  # (tenant, limit) -> count
        self.ladder = Ladder(overload, tenants, now)

    def limits(self, name: str) -> TenantConfig:
        return limits_of(self.tenant_cfgs, name)

    def tenant(self, name: str, now: float) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name, self.limits(name), now)
        return tenant

    def table(self, name: str) -> str:
        return table_of(self.tenant_cfgs, name)

    def configure(self, cfg: SchedulerConfig, tenants: dict[str, TenantConfig],
                  overload: OverloadConfig, now: float) -> None:
        """New live values, from the next arrival and step on."""
        self.cfg, self.tenant_cfgs = cfg, tenants
        for name, tenant in self.tenants.items():
            tenant.configure(self.limits(name), now)
        self.ladder.configure(overload, tenants)

    def judge(self, queue: Waiting, blocks: BlockManager, now: float) -> None:
        """Let the ladder weigh the queue and the KV cache (see Ladder.judge)."""
        self.ladder.judge(now, self.drain_seconds(queue, now),
                          1 - blocks.num_free / blocks.num_blocks)

    def drain_seconds(self, queue: Waiting, now: float) -> float:
        """How long the queue would take to drain at the measured rate. Without one, the
        oldest request's wait is what the queue is known to take."""
        drain = self.drained.rate(now)
        return len(queue) / drain if drain else \
            max((now - s.arrival_time for s in queue), default=0.0)

    def degrade(self, reqs: list[EngineRequest], tenant: Tenant) -> tuple[list[EngineRequest],
                                                                          str | None]:
        """reqs with the ladder's cap on max_tokens when it is in force for the tenant, and
        what the client is told about it (None: not capped)."""
        if "cap" not in self.ladder.actions(self.table(tenant.name)):
            return reqs, None
        cap = tenant.cfg.degrade_max_tokens
        if all(r.sampling.max_tokens <= cap for r in reqs):
            return reqs, None
        self.ladder.degraded[Step(self.table(tenant.name), "cap")] += 1
        capped = [msgspec.structs.replace(r, sampling=msgspec.structs.replace(
            r.sampling, max_tokens=min(cap, r.sampling.max_tokens))) for r in reqs]
        return capped, f"max_tokens={cap}"

    def check(self, reqs: list[EngineRequest], tenant: Tenant, queue: Waiting,
              now: float, priority: int, timeout: float) -> RequestOutput | None:
        """A refusal naming the limit, or None (then the requests' cost is taken): reqs are
        one API request's, admitted as a unit. priority and timeout are the request's own or
        its tenant's defaults (0: no deadline)."""
        limits = tenant.cfg
        count = len(reqs)
        prompt = sum(len(r.prompt_token_ids) for r in reqs)
        prompts = f"the prompt ({prompt} tokens)" if count == 1 else \
            f"the prompts of its {count} choices ({prompt} tokens in all)"
        asks = "" if count == 1 else f" and this request asks for {count} more"
        drain = self.drained.rate(now)

        def refuse(limit: str, message: str, retry_s: float | None, status: int = 429
                   ) -> RequestOutput:
            self.rejected[(tenant.name, limit)] += 1
            retry = None if retry_s is None else float(max(1, math.ceil(retry_s)))
            hint = f"; retry after {retry:g}s" if retry else ""
            return RequestOutput(reqs[0].request_id, [], "error", message + hint,
                                 status=status, retry_after=retry)

        def queue_wait(ahead: int) -> float:
            return ahead / drain if drain else _DEFAULT_RETRY_S

        if (why := too_urgent(self.tenant_cfgs, tenant.name, priority)) is not None:
            return refuse("priority", why, None, 400)
        for limit, bound in (("max_concurrent", limits.max_concurrent),
                             ("max_queued", limits.max_queued),
                             ("max_queued_requests", self.cfg.max_queued_requests),
                             ("requests_per_min", limits.requests_per_min)):
            if bound and count > bound:
                return refuse(limit, f"the request's {count} choices are more than {limit} "
                              f"({bound:g}) allows at once", None, 400)
        if "refuse" in self.ladder.actions(self.table(tenant.name)):
            self.ladder.degraded[Step(self.table(tenant.name), "refuse")] += 1
            return refuse("overload", f"the server is overloaded and sheds tenant "
                          f"{tenant.name!r}'s new work first ({self.ladder.reason})",
                          self.ladder.cfg.ladder_interval_s)
        if limits.max_concurrent and tenant.num_waiting + tenant.num_running + count > \
                limits.max_concurrent:
            rate = tenant.finished.rate(now)
            return refuse("max_concurrent", f"tenant {tenant.name!r} has "
                          f"{tenant.num_waiting + tenant.num_running} requests in flight{asks}; "
                          f"its max_concurrent is {limits.max_concurrent}",
                          1 / rate if rate else _DEFAULT_RETRY_S)
        if limits.max_queued and tenant.num_waiting + count > limits.max_queued:
            return refuse("max_queued", f"tenant {tenant.name!r} has {tenant.num_waiting} "
                          f"requests queued{asks}; its max_queued is {limits.max_queued}",
                          queue_wait(tenant.num_waiting + count - limits.max_queued))
        bound = self.cfg.max_queued_requests
        if bound and len(queue) + count > bound:
            return refuse("max_queued_requests", f"the server's queue is full ({bound} "
                          "requests, max_queued_requests)", queue_wait(len(queue) + count - bound))
        bound = self.cfg.max_queued_tokens
        if bound and prompt > bound:
            return refuse("max_queued_tokens", f"{prompts} cannot fit: the whole queue "
                          f"holds max_queued_tokens={bound}", None, 400)
        if bound and queue.num_tokens + prompt > bound:
            share = queue.num_tokens / max(len(queue), 1)
            return refuse("max_queued_tokens", f"the server's queue is full ({queue.num_tokens} "
                          f"prompt tokens waiting, max_queued_tokens={bound})",
                          queue_wait(math.ceil((queue.num_tokens + prompt - bound) / share)
                                     if share else 1))
        if wait := tenant.requests.wait_for(count, now):
            return refuse("requests_per_min", f"tenant {tenant.name!r} is over its "
                          f"requests_per_min ({limits.requests_per_min:g})", wait)
        if limits.tokens_per_min and prompt > limits.tokens_per_min:
            return refuse("tokens_per_min", f"{prompts} cannot fit tenant {tenant.name!r}'s "
                          f"tokens_per_min ({limits.tokens_per_min:g}) at once", None, 400)
        if wait := tenant.tokens.wait_for(prompt, now):
            return refuse("tokens_per_min", f"tenant {tenant.name!r} is over its "
                          f"tokens_per_min ({limits.tokens_per_min:g})", wait)
        if timeout and drain:
            ahead = len(queue) if self.cfg.policy != "priority" else \
                sum(1 for s in queue if s.priority <= priority)
            if ahead / drain > timeout:
                return refuse("timeout", f"the request cannot start within its timeout of "
                              f"{timeout:g}s: {ahead} requests are ahead of it and the queue "
                              f"drains {drain:.1f} a second", ahead / drain - timeout, 503)
        tenant.requests.take(count, now)
        tenant.tokens.take(prompt, now)
        return None
