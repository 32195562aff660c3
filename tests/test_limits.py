"""The frontend's global limits over data-parallel replicas (server/limits.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from server.limits import GlobalLimits
from surge.config import SchedulerConfig, TenantConfig
from surge.protocol import EngineRequest, RequestOutput, SamplingParams


def _req(rid: str, tenant: str = "t", prompt: int = 4, priority: int | None = None
         ) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[1] * prompt,
                         sampling=SamplingParams(max_tokens=8), arrival_time=0.0,
                         tenant=tenant, priority=priority)


def _limits(scheduler: SchedulerConfig | None = None, **tenant: float) -> GlobalLimits:
    return GlobalLimits({"t": TenantConfig(**tenant)}, scheduler or SchedulerConfig(), 0.0)


def test_requests_per_min_counts_every_replicas_requests():
    limits = _limits(requests_per_min=2)
    assert limits.admit([_req("a")], 0.0) is None
    assert limits.admit([_req("b")], 0.0) is None
    refusal = limits.admit([_req("c")], 0.0)
    assert refusal is not None and refusal.status == 429
    assert "tenant 't' is over its requests_per_min (2)" in refusal.error
    assert refusal.retry_after == 30.0  # one request of a bucket refilling 2 a minute
    assert limits.admit([_req("d")], 30.0) is None


def test_max_concurrent_frees_a_place_when_a_request_ends():
    limits = _limits(max_concurrent=2)
    for rid in "ab":
        assert limits.admit([_req(rid)], 0.0) is None
    limits.started("a", 0.5)
    refusal = limits.admit([_req("c")], 1.0)
    assert refusal is not None and "has 2 requests in flight" in refusal.error
    limits.ended("a", 2.0)
    assert limits.admit([_req("c")], 2.0) is None


def test_max_queued_counts_only_requests_not_started():
    limits = _limits(max_queued=1)
    assert limits.admit([_req("a")], 0.0) is None
    assert limits.admit([_req("b")], 0.0) is not None
    limits.started("a", 0.1)
    assert limits.admit([_req("b")], 0.2) is None


def test_global_queue_bounds_hold_over_all_tenants():
    limits = _limits(SchedulerConfig(max_queued_requests=2, max_queued_tokens=10))
    assert limits.admit([_req("a", "x")], 0.0) is None
    assert limits.admit([_req("b", "y")], 0.0) is None
    refusal = limits.admit([_req("c", "z")], 0.0)
    assert refusal is not None and "queue is full (2 requests" in refusal.error
    limits.ended("a", 0.0)  # refused by its replica, say: no longer queued
    refusal = limits.admit([_req("c", "z", prompt=7)], 0.0)
    assert refusal is not None and "max_queued_tokens=10" in refusal.error
    assert limits.admit([_req("c", "z", prompt=6)], 0.0) is None


def test_generated_tokens_count_against_tokens_per_min():
    limits = _limits(tokens_per_min=20)
    assert limits.admit([_req("a", prompt=4)], 0.0) is None
    limits.started("a", 0.0)
    limits.generated("a", 14, 0.0)
    refusal = limits.admit([_req("b", prompt=4)], 0.0)
    assert refusal is not None and "tokens_per_min" in refusal.error


def test_an_api_request_is_admitted_as_a_unit():
    limits = _limits(max_concurrent=3)
    assert limits.admit([_req("a1"), _req("a2")], 0.0) is None
    assert limits.admit([_req("b1"), _req("b2")], 0.0) is not None
    assert limits.admit([_req("c1")], 0.0) is None


def test_live_limits_apply_to_the_next_arrival():
    limits = _limits(max_concurrent=1)
    assert limits.admit([_req("a")], 0.0) is None
    assert limits.admit([_req("b")], 0.0) is not None
    limits.configure({"t": TenantConfig(max_concurrent=2)}, SchedulerConfig(), 1.0)
    assert limits.admit([_req("b")], 1.0) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "start", "end", "gen"]),
                          st.integers(0, 7), st.sampled_from(["t", "u"])), max_size=60))
def test_counts_match_the_requests_held(ops):
    """Whatever order replicas report in (duplicates, ends before starts), each tenant's counts
    equal its requests admitted and not ended, and max_concurrent is never exceeded."""
    limits = GlobalLimits({"t": TenantConfig(max_concurrent=3), "u": TenantConfig()},
                          SchedulerConfig(), 0.0)
    held: dict[str, str] = {}  # request id -> tenant
    for now, (op, n, tenant) in enumerate(ops):
        rid = f"r{n}"
        if op == "admit" and rid not in held:
            if limits.admit([_req(rid, tenant)], float(now)) is None:
                held[rid] = tenant
        elif op == "start":
            limits.started(rid, float(now))
        elif op == "end":
            limits.ended(rid, float(now))
            held.pop(rid, None)
        else:
            limits.generated(rid, 3, float(now))
        for name in ("t", "u"):
            counted = limits.admission.tenant(name, float(now))
            assert counted.num_waiting + counted.num_running == \
                sum(1 for t in held.values() if t == name)
        assert sum(1 for t in held.values() if t == "t") <= 3
        assert limits.waiting.num_tokens == 4 * len(limits.waiting)


def test_a_priority_the_tenant_may_not_ask_for_is_a_400_before_any_pool_is_chosen():
    """With pools by priority, one more urgent than a named tenant may ask for is its
    client's fault (400), not a missing pool (503); one a pool serves is routed."""
    import msgspec

    from server.fleet import Fleet
    from surge.config import PoolConfig
    from surge.config_load import load_config

    cfg = load_config({}, {})
    cfg = msgspec.structs.replace(
        cfg, tenants={"t": TenantConfig(priority=5)},
        pools={"only": PoolConfig(replicas="0-1", min_priority=0, max_priority=100)},
        model=msgspec.structs.replace(cfg.model, data_parallel_size=2))
    fleet = Fleet(cfg, 0.0)
    refusal = fleet.place([_req("a", priority=-5)], 0.0)
    assert not isinstance(refusal, int) and refusal.status == 400, refusal
    assert "may ask for priority 5 or above" in refusal.error
    assert isinstance(fleet.place([_req("b", priority=7)], 0.0), int)
    # default chooses freely: past the floor, and then no pool serves -5
    unrouted = fleet.place([_req("c", tenant="default", priority=-5)], 0.0)
    assert isinstance(unrouted, RequestOutput) and unrouted.status == 503
