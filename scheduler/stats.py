"""The scheduler's figures: running totals of the steps, EngineStats snapshots (one a second for
the frontend's /stats, one per `surge admin stats`), and the Prometheus metrics set from them."""

from __future__ import annotations

import time

import msgspec
from prometheus_client import Counter

from scheduler.scheduler import Scheduler
from scheduler.signals import Signals
from surge import metrics
from surge.config import AutoscaleConfig, SurgeConfig
from surge.config_live import LIVE_SECTION
from surge.protocol import BreakerState, EngineStats, RequestOutput, StepPlan, StepResult

# The snapshot's running totals that Prometheus counters follow (per model, engine-wide).
_MODEL_COUNTERS = (("generated_tokens", metrics.generated_tokens),
                   ("prefix_queried_tokens", metrics.prefix_queries),
                   ("prefix_hit_tokens", metrics.prefix_hits),
                   ("preemptions", metrics.preemptions))
_COUNTERS = (("spec_proposed_tokens", metrics.spec_proposed),
             ("spec_accepted_tokens", metrics.spec_accepted),
             ("spec_verifications", metrics.spec_verifications))
# Every limit admission can refuse for, so each tenant's rejection series starts at 0.
_LIMITS = ("max_concurrent", "max_queued", "max_queued_requests", "max_queued_tokens",
           "requests_per_min", "tokens_per_min", "timeout", "overload")


class StatsCollector:
    def __init__(self, model_name: str, autoscale: AutoscaleConfig | None = None,
                 replica: int = 0) -> None:
        self.model = model_name
        self.replica = replica
        engine = (model_name, str(replica))  # the labels of this engine's own series
        self.signals = Signals(autoscale or AutoscaleConfig(), time.time())
        # Created now, so every series reads 0 from the start rather than "No data".
        self.counters: list[tuple[str, Counter]] = [
            *((name, counter.labels(*engine)) for name, counter in _MODEL_COUNTERS),
            *_COUNTERS]
        self.running = metrics.running.labels(*engine)
        self.kv_used = metrics.kv_blocks_used.labels(*engine)
        self.kv_total = metrics.kv_blocks_total.labels(*engine)
        self.kv_usage = metrics.kv_usage.labels(*engine)
        self.queue_wait = metrics.queue_wait.labels(*engine)
        self.queued_tokens = metrics.queued_tokens.labels(str(replica))
        self.steps = 0
        self.scheduled_tokens = 0
        self.generated_tokens = 0
        self.finished_requests = 0
        self.worker_compute_s = 0.0
        self.worker_wait_s = 0.0
        self.worker_forward_s = 0.0
        self._exported: dict[str, int] = {}  # counter totals already exported, by series
        self._queues_seen: set[tuple[str, str]] = set()  # (priority, tenant) labels exported
        self.breaker = BreakerState("closed", 0)  # as the frontend last reported it

    def record_step(self, plan: StepPlan, result: StepResult, outputs: list[RequestOutput],
                    continuous: bool) -> None:
        """A finished step; continuous: the engine had work when the previous one ended."""
        tokens = sum(len(s.token_ids) for s in plan.seqs)
        self.steps += 1
        self.scheduled_tokens += tokens
        # Tokens, not outputs: an output carries several when proposals were accepted.
        self.generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        self.finished_requests += sum(o.finish_reason is not None for o in outputs)
        self.worker_compute_s += result.compute_s
        self.worker_forward_s += result.forward_s
        if continuous:  # the worker's wait before an idle engine's first step is not
            self.worker_wait_s += result.wait_s  # overhead, just an empty queue
        metrics.batch_size.observe(len(plan.seqs))
        metrics.step_tokens.observe(tokens)

    def snapshot(self, sched: Scheduler) -> EngineStats:
        blocks, spec, ladder = sched.blocks, sched.spec, sched.admission.ladder
        now, signals = time.time(), self.signals
        signals.update(now, sched.admission.arrived, self.generated_tokens,
                       self.finished_requests)
        return EngineStats(
            time=now, running=len(sched.running), waiting=len(sched.waiting),
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
            spec_verifications=spec.verifications,
            congested=ladder.congested, overload_level=ladder.level,
            degraded_requests=sum(ladder.degraded.values()),
            breaker=self.breaker.state, breaker_rejected=self.breaker.rejected,
            queue_drain_s=sched.admission.drain_seconds(sched.waiting, now),
            arrival_rate=signals.arrival_rate, capacity_tokens_s=signals.capacity_tokens_s,
            capacity_requests_s=signals.capacity_requests_s, forecast=signals.predictions(),
            replica=self.replica)

    def export(self, stats: EngineStats, sched: Scheduler, cfg: SurgeConfig) -> None:
        """Set the Prometheus metrics: the engine-wide ones from the snapshot, the labelled
        ones from the scheduler and cfg in the same pass."""
        self.running.set(stats.running)
        self.queued_tokens.set(stats.queued_tokens)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
        for name, counter in self.counters:
            self._advance(counter, name, getattr(stats, name))
        if stats.spec_proposed_tokens:
            metrics.spec_acceptance.set(stats.spec_accepted_tokens / stats.spec_proposed_tokens)
            metrics.spec_accepted_length.set(
                stats.spec_accepted_tokens / stats.spec_verifications + 1)
        for wait_s in sched.queue_waits:
            self.queue_wait.observe(wait_s)
        sched.queue_waits.clear()
        # The labelled series stay out of the snapshot: their labels are open-ended (tenant
        # names, client-chosen priorities), folded and zeroed as only Prometheus needs, and the
        # frontend would be sent every tenant ever seen once a second; the live parameters and
        # tenant limits are configuration, which `surge admin get` already answers.
        self._export_queues(sched)
        self._export_tenants(sched)
        _export_limits(sched, cfg)
        self._export_ladder(sched)
        metrics.queue_drain.set(stats.queue_drain_s)
        metrics.arrival_rate.set(stats.arrival_rate)
        metrics.capacity_tokens.set(stats.capacity_tokens_s)
        metrics.capacity_requests.set(stats.capacity_requests_s)
        for horizon, rate in stats.forecast.items():
            metrics.forecast_arrival_rate.labels(horizon).set(rate)

    def _advance(self, counter: Counter, series: str, total: int) -> None:
        """Counters only go up: add what a running total gained since the last export."""
        counter.inc(total - self._exported.get(series, 0))
        self._exported[series] = total

    def _export_queues(self, sched: Scheduler) -> None:
        # A (priority, tenant) queue that emptied reads 0 rather than its last count, and
        # each known tenant's default queue reads 0 before anything waits in it.
        known = {"default", *sched.admission.tenant_cfgs, *sched.admission.tenants}
        queued: dict[tuple[str, str], int] = dict.fromkeys(
            self._queues_seen | {(_priority_label(sched.admission.limits(name).priority), name)
                                 for name in known}, 0)
        for seq in sched.waiting:
            key = (_priority_label(seq.priority), seq.tenant.name)
            queued[key] = queued.get(key, 0) + 1
        for (priority, tenant), count in queued.items():
            metrics.waiting.labels(self.model, priority, tenant, str(self.replica)).set(count)
        self._queues_seen |= set(queued)

    def _export_tenants(self, sched: Scheduler) -> None:
        admission = sched.admission
        for name in {"default", *admission.tenant_cfgs, *admission.tenants}:
            for limit in _LIMITS:
                metrics.rejected.labels(name, limit)
        for (tenant, limit), count in admission.rejected.items():
            self._advance(metrics.rejected.labels(tenant, limit), f"rejected {tenant} {limit}",
                          count)
        for name, tenant in admission.tenants.items():
            self._advance(metrics.tenant_served.labels(name), f"served {name}",
                          tenant.served_tokens)
            metrics.tenant_running.labels(name).set(tenant.num_running)

    def _export_ladder(self, sched: Scheduler) -> None:
        ladder = sched.admission.ladder
        metrics.overload_level.set(ladder.level)
        metrics.congested.set(float(ladder.congested))
        for name, value in ladder.signals.items():
            metrics.overload_signal.labels(name).set(value)
        for step in ladder.steps:  # at 0 from the start
            metrics.degraded.labels(step.tenant, step.action)
        for step, count in ladder.degraded.items():
            self._advance(metrics.degraded.labels(*step), f"degraded {step}", count)


def _priority_label(priority: int) -> str:
    # Clients choose priorities: far-out values share one label, so series stay few.
    return str(priority) if -100 <= priority <= 100 else "other"


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
            # degrade is a word (the ladder's series show it); an unset min_priority, none
            if isinstance(value, int | float):
                metrics.tenant_limit.labels(name, field).set(float(value))

