"""StatsCollector: the snapshot of a scheduler after a few steps, and the Prometheus figures
set from it (read back from prometheus_client's registry, as changes since the test began)."""

from __future__ import annotations

import time

import msgspec
from prometheus_client import REGISTRY

from scheduler import admin
from scheduler.scheduler import Scheduler
from scheduler.stats import StatsCollector
from surge.config import SchedulerConfig, SurgeConfig, TenantConfig
from surge.protocol import (
    AdminRequest,
    EngineRequest,
    EngineStats,
    RequestOutput,
    SamplingParams,
    SeqResult,
    StepPlan,
    StepResult,
)

# Counters and histograms are process-wide: the test compares them with their start values.
# The scheduler's own engine series also name its data-parallel replica.
M = {"model_name": "m", "replica": "0"}
_TOTALS = [("surge_batch_size_count", {}), ("surge_step_tokens_sum", {}),
           ("surge_queue_wait_seconds_count", M), ("surge_prefix_cache_hit_tokens_total", M),
           ("surge_rejected_requests_total", {"tenant": "acme", "limit": "max_concurrent"}),
           ("surge_tenant_served_tokens_total", {"tenant": "acme"}),
           ("surge_generated_tokens_total", M)]


def _value(metric: str, /, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def _gained(start: list[float]) -> list[float]:
    return [_value(name, **labels) - v for (name, labels), v in zip(_TOTALS, start, strict=True)]


def _request(rid: str, length: int, tenant: str, priority: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(range(1, length + 1)),
                         arrival_time=time.time(), tenant=tenant, priority=priority,
                         sampling=SamplingParams(max_tokens=8, temperature=0.0))


def _step(sched: Scheduler, stats: StatsCollector, continuous: bool) -> StepPlan:
    """Plan a step and feed back what a fake worker would answer: one token per sequence."""
    plan = sched.schedule()
    assert plan is not None
    result = StepResult(plan.step_id, {s.seq_id: SeqResult([7]) for s in plan.seqs if s.sample},
                        compute_s=0.25, forward_s=0.125, wait_s=0.5)
    stats.record_step(plan, result, sched.update(plan, result), continuous)
    return plan


def test_snapshot_and_metrics_come_from_the_same_figures():
    cfg = SurgeConfig(scheduler=SchedulerConfig(block_size=4, max_num_seqs=2),
                      tenants={"acme": TenantConfig(weight=2.0, max_concurrent=2)})
    sched = Scheduler(cfg.scheduler, 32, cfg.tenants)
    stats = StatsCollector("m")
    start = [_value(name, **labels) for name, labels in _TOTALS]
    # Before any traffic every series exists, at 0: panels show 0, not "No data".
    stats.export(stats.snapshot(sched), sched, cfg)
    for name, labels in [("surge_waiting_requests", {**M, "priority": "0", "tenant": "default"}),
                         ("surge_waiting_requests", {**M, "priority": "0", "tenant": "acme"}),
                         ("surge_rejected_requests_total", {"tenant": "default",
                                                            "limit": "max_queued"}),
                         ("surge_preemptions_total", M), ("surge_kv_cache_usage_ratio", M),
                         ("surge_running_requests", M)]:
        assert REGISTRY.get_sample_value(name, labels) == 0.0, (name, labels)
    assert sched.add(_request("a", 6, "acme", 0)) is None
    assert sched.add(_request("b", 5, "default", 0)) is None  # a's first block is cached
    assert sched.add(_request("c", 3, "acme", 500)) is None  # waits: two seats, less urgent
    assert sched.add(_request("d", 3, "acme", 0)) is not None  # acme's max_concurrent
    first = _step(sched, stats, continuous=False)  # an idle engine's wait is not counted
    second = _step(sched, stats, continuous=True)
    assert [len(p.seqs) for p in (first, second)] == [2, 2]

    snap = stats.snapshot(sched)
    assert (snap.running, snap.waiting, snap.queued_tokens) == (2, 1, 3)
    assert (snap.steps, snap.scheduled_tokens, snap.generated_tokens) == (2, 6 + 1 + 2, 4)
    assert (snap.prefix_queried_tokens, snap.prefix_hit_tokens) == (6 + 5, 4)
    assert (snap.worker_compute_s, snap.worker_forward_s, snap.worker_wait_s) == \
        (0.5, 0.25, 0.5)
    assert (snap.kv_blocks_used, snap.kv_blocks_total) == (3, 32)  # a's two, b's second

    stats.export(snap, sched, cfg)
    assert (_value("surge_running_requests", **M),
            _value("surge_queued_prompt_tokens", replica="0")) == (2, 3)
    assert (_value("surge_kv_cache_blocks_used", **M), _value("surge_kv_cache_blocks", **M)) == \
        (3, 32)
    assert _value("surge_kv_cache_usage_ratio", **M) == 3 / 32
    # Two steps of 2 sequences, 9 tokens; a and b started; 4 prefix hits; d refused; acme's
    # a served 6 + 1; one token per sequence and step.
    gained = _gained(start)
    assert gained == [2, 9, 2, 4, 1, 7, 4]
    assert _value("surge_waiting_requests", **M, priority="other", tenant="acme") == 1
    assert _value("surge_tenant_running_requests", tenant="acme") == 1
    assert _value("surge_tenant_limit", tenant="acme", limit="weight") == 2.0
    assert _value("surge_live_parameter", name="max_num_seqs") == 2
    assert _value("surge_scheduling_policy", policy="priority") == 1

    # The next export adds only what changed since: the queue that emptied reads 0, and the
    # counters do not count the same tokens twice.
    sched.abort(["c"])
    stats.export(stats.snapshot(sched), sched, cfg)
    assert _value("surge_waiting_requests", **M, priority="other", tenant="acme") == 0
    assert _gained(start) == gained

    # `surge admin stats` answers with the same fields as /stats, less the message tag.
    reply, _ = admin.handle(AdminRequest("stats"), cfg, snap, {})
    builtins = msgspec.to_builtins(snap)
    assert builtins.pop("type") == "EngineStats" and reply.values == builtins


def test_generated_tokens_count_tokens_not_outputs():
    """With speculation one output carries every token a sequence gained in the step."""
    stats = StatsCollector("m")
    plan = StepPlan(0, [])
    stats.record_step(plan, StepResult(0, {}), [RequestOutput("a", [5, 6, 7]),
                                                RequestOutput("b", [8])], continuous=True)
    assert stats.generated_tokens == 4


def test_replicas_stats_add_up_with_the_worst_levels():
    from surge.replica_stats import total

    a = msgspec.to_builtins(EngineStats(time=1.0, running=2, waiting=1, kv_blocks_used=3,
                                        kv_blocks_total=10, prefix_queried_tokens=8,
                                        prefix_hit_tokens=4, preemptions=0, steps=5,
                                        scheduled_tokens=9, generated_tokens=7,
                                        worker_compute_s=0.5, worker_wait_s=0.1,
                                        overload_level=1, forecast={"60": 1.0}, breaker="open",
                                        breaker_rejected=3))
    b = {**a, "time": 2.0, "running": 1, "overload_level": 0, "replica": 1, "congested": True,
         "forecast": {"60": 2.0}}
    out = total([a, b])
    # One replica's breaker open (its rejections none: the other took every request).
    assert total([a, {**b, "breaker": "closed", "breaker_rejected": 0}])["breaker"] == "closed"
    assert (out["running"], out["kv_blocks_total"], out["generated_tokens"]) == (3, 20, 14)
    assert (out["time"], out["overload_level"], out["congested"]) == (2.0, 1, True)
    assert (out["breaker"], out["breaker_rejected"], out["forecast"]) == ("open", 3,
                                                                         {"60": 3.0})
    assert out["type"] == "EngineStats" and "replica" not in out
    assert out["replicas"] == [a, b]
