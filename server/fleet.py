"""The frontend's view of several data-parallel replicas: the limits that span them
(GlobalLimits), the router, and what their outputs and reports say about each one."""

from __future__ import annotations

import msgspec

from scheduler.admission import too_urgent
from server.limits import GlobalLimits
from server.router import NoReplica, Router
from surge import metrics
from surge.config import SurgeConfig
from surge.protocol import EngineRequest, LiveSettings, RequestOutput


class Fleet:
    def __init__(self, cfg: SurgeConfig, now: float) -> None:
        self.router = Router(cfg.model.data_parallel_size, cfg.scheduler.block_size,
                             cfg.routing, cfg.pools)
        self.limits = GlobalLimits(cfg.tenants, cfg.scheduler, now)
        self._rejected: dict[tuple[str, str], int] = {}  # refusals already counted in metrics

    def configure(self, settings: LiveSettings, now: float) -> None:
        self.router.configure(settings.routing, settings.pools)
        self.limits.configure(settings.tenants, settings.scheduler, now)

    def priority(self, request: EngineRequest) -> int:
        """Its own priority, else its tenant's default (batch lines carry theirs)."""
        if request.priority is not None:
            return request.priority
        return self.limits.admission.limits(request.tenant).priority

    def place(self, requests: list[EngineRequest], now: float,
              allowed: list[int] | None = None) -> int | RequestOutput:
        """The replica, one of `allowed` (default: any), for one API
        request's engine requests (all on one, admitted as a unit there), or the refusal each
        of them gets: a global limit, or no replica."""
        first = requests[0]
        # Before routing, which picks a pool by the priority: one it may not ask for is the
        # client's fault (400), not a missing pool (503).
        admission = self.limits.admission
        priority = self.priority(first)
        if (why := too_urgent(admission.tenant_cfgs, first.tenant, priority)) is not None:
            admission.rejected[(first.tenant, "priority")] += 1
            self._count_rejections()
            return RequestOutput(first.request_id, [], "error", why, status=400)
        hashes = self.router.hashes(first.prompt_token_ids)
        try:
            replica = self.router.choose(hashes, priority, now, allowed)
        except NoReplica as e:
            return RequestOutput(first.request_id, [], "error", str(e), status=503)
        if (refusal := self.limits.admit(requests, now)) is not None:
            self._count_rejections()
            return refusal
        for r in requests:
            self.router.routed(r.request_id, replica, hashes, now)
        return replica

    def output(self, out: RequestOutput, now: float) -> None:
        """What an output says: the request started, generated tokens, or ended."""
        if out.new_token_ids:
            self.router.started(out.request_id)
            self.limits.started(out.request_id, now)
            self.limits.generated(out.request_id, len(out.new_token_ids), now)
        if out.finish_reason is not None:
            self.ended(out.request_id, now)

    def ended(self, request_id: str, now: float) -> None:
        self.router.ended(request_id)
        self.limits.ended(request_id, now)

    def _count_rejections(self) -> None:
        """The scheduler counts its refusals in surge_rejected_requests; these are ours."""
        for (tenant, limit), count in self.limits.admission.rejected.items():
            gained = count - self._rejected.get((tenant, limit), 0)
            if gained:
                metrics.rejected.labels(tenant, limit).inc(gained)
                self._rejected[(tenant, limit)] = count


def each(refusal: RequestOutput, requests: list[EngineRequest]) -> list[RequestOutput]:
    """One refusal as every engine request's own terminal output."""
    return [msgspec.structs.replace(refusal, request_id=r.request_id) for r in requests]
