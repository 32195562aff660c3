"""The scheduler's figures: running totals of the steps, EngineStats snapshots (one a second for
the frontend's /stats, one per `surge admin stats`), and the Prometheus metrics set from them."""

from __future__ import annotations

import time

import msgspec
from prometheus_client import Counter

from scheduler.scheduler import Scheduler
from surge import metrics
from surge.config import LIVE_SECTION, SurgeConfig
from surge.protocol import EngineStats, RequestOutput, StepPlan, StepResult

# The snapshot's running totals that Prometheus counters follow.
_COUNTERS = (("prefix_queried_tokens", metrics.prefix_queries),
             ("prefix_hit_tokens", metrics.prefix_hits),
             ("preemptions", metrics.preemptions),
             ("spec_proposed_tokens", metrics.spec_proposed),
             ("spec_accepted_tokens", metrics.spec_accepted),
             ("spec_verifications", metrics.spec_verifications))


class StatsCollector:
    def __init__(self) -> None:
        self.steps = 0
        self.scheduled_tokens = 0
        self.generated_tokens = 0
        self.worker_compute_s = 0.0
        self.worker_wait_s = 0.0
        self.worker_forward_s = 0.0
        self._exported: dict[str, int] = {}  # counter totals already exported, by series
        self._queues_seen: set[tuple[str, str]] = set()  # (priority, tenant) labels exported

    def record_step(self, plan: StepPlan, result: StepResult, outputs: list[RequestOutput],
                    continuous: bool) -> None:
        """A finished step; continuous: the engine had work when the previous one ended."""
        tokens = sum(len(s.token_ids) for s in plan.seqs)
        self.steps += 1
        self.scheduled_tokens += tokens
        # Tokens, not outputs: an output carries several when proposals were accepted.
        self.generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        self.worker_compute_s += result.compute_s
        self.worker_forward_s += result.forward_s
        if continuous:  # the worker's wait before an idle engine's first step is not
            self.worker_wait_s += result.wait_s  # overhead, just an empty queue
        metrics.batch_size.observe(len(plan.seqs))
        metrics.step_tokens.observe(tokens)

    def snapshot(self, sched: Scheduler) -> EngineStats:
        blocks, spec = sched.blocks, sched.spec
        return EngineStats(
            time=time.time(), running=len(sched.running), waiting=len(sched.waiting),
            queued_tokens=sched.waiting.num_tokens,
            kv_blocks_used=blocks.num_blocks - blocks.num_free,
            kv_blocks_total=blocks.num_blocks,
            prefix_queried_tokens=blocks.queried_tokens, prefix_hit_tokens=blocks.hit_tokens,
            preemptions=sched.num_preemptions, steps=self.steps,
            scheduled_tokens=self.scheduled_tokens, generated_tokens=self.generated_tokens,
            worker_compute_s=self.worker_compute_s, worker_wait_s=self.worker_wait_s,
            worker_forward_s=self.worker_forward_s,
            spec_proposed_tokens=spec.proposed_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_verifications=spec.verifications)

    def export(self, stats: EngineStats, sched: Scheduler, cfg: SurgeConfig) -> None:
        """Set the Prometheus metrics: the engine-wide ones from the snapshot, the labelled
        ones from the scheduler and cfg in the same pass."""
        metrics.running.set(stats.running)
        metrics.queued_tokens.set(stats.queued_tokens)
        metrics.kv_blocks_used.set(stats.kv_blocks_used)
        metrics.kv_blocks_total.set(stats.kv_blocks_total)
        for name, counter in _COUNTERS:
            self._advance(counter, name, getattr(stats, name))
        if stats.spec_proposed_tokens:
            metrics.spec_acceptance.set(stats.spec_accepted_tokens / stats.spec_proposed_tokens)
            metrics.spec_accepted_length.set(
                stats.spec_accepted_tokens / stats.spec_verifications + 1)
        for wait_s in sched.queue_waits:
            metrics.queue_wait.observe(wait_s)
        sched.queue_waits.clear()
        # The labelled series stay out of the snapshot: their labels are open-ended (tenant
        # names, client-chosen priorities), folded and zeroed as only Prometheus needs, and the
        # frontend would be sent every tenant ever seen once a second; the live parameters and
        # tenant limits are configuration, which `surge admin get` already answers.
        self._export_queues(sched)
        self._export_tenants(sched)
        _export_limits(sched, cfg)

    def _advance(self, counter: Counter, series: str, total: int) -> None:
        """Counters only go up: add what a running total gained since the last export."""
        counter.inc(total - self._exported.get(series, 0))
        self._exported[series] = total

    def _export_queues(self, sched: Scheduler) -> None:
        # A (priority, tenant) queue that emptied reads 0 rather than its last count.
        queued: dict[tuple[str, str], int] = dict.fromkeys(self._queues_seen, 0)
        for seq in sched.waiting:
            # Clients choose priorities: far-out values share one label, so series stay few.
            label = str(seq.priority) if -100 <= seq.priority <= 100 else "other"
            key = (label, seq.tenant.name)
            queued[key] = queued.get(key, 0) + 1
        for (priority, tenant), count in queued.items():
            metrics.waiting.labels(priority, tenant).set(count)
        self._queues_seen |= set(queued)

    def _export_tenants(self, sched: Scheduler) -> None:
        admission = sched.admission
        for (tenant, limit), count in admission.rejected.items():
            self._advance(metrics.rejected.labels(tenant, limit), f"rejected {tenant} {limit}",
                          count)
        for name, tenant in admission.tenants.items():
            self._advance(metrics.tenant_served.labels(name), f"served {name}",
                          tenant.served_tokens)
            metrics.tenant_running.labels(name).set(tenant.num_running)


def _export_limits(sched: Scheduler, cfg: SurgeConfig) -> None:
    for name, section in LIVE_SECTION.items():
        value = getattr(getattr(cfg, section), name)
        if not isinstance(value, str):
            metrics.live_parameter.labels(name).set(float(value))
    for name in ("fcfs", "priority", "sjf"):
        metrics.policy.labels(name).set(float(name == cfg.scheduler.policy))
    admission = sched.admission
    for name in {*admission.tenants, *cfg.tenants}:
        for field, value in msgspec.to_builtins(admission.limits(name)).items():
            metrics.tenant_limit.labels(name, field).set(float(value))
