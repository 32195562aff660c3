"""The data-parallel router (server/router.py): affinity, margin, least loaded, its own
entries and the replicas' reports, pools, spill and no candidate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.router import OPTIMISTIC_TTL_S, NoReplica, Router
from surge.config_frontend import PoolConfig, RoutingConfig

BS = 4  # block size


def _router(n: int = 2, pools: dict[str, PoolConfig] | None = None, **routing: int) -> Router:
    return Router(n, BS, RoutingConfig(**routing), pools or {})


def _send(router: Router, rid: str, tokens: list[int], priority: int = 0,
          now: float = 0.0) -> int:
    hashes = router.hashes(tokens)
    replica = router.choose(hashes, priority, now)
    router.routed(rid, replica, hashes, now)
    return replica


PREFIX = list(range(100, 100 + 8 * BS))


def test_a_burst_sharing_a_prefix_lands_on_one_replica_before_any_report():
    router = _router(route_balance_margin=8)
    first = _send(router, "a", PREFIX + [1])
    assert all(_send(router, f"r{i}", PREFIX + [i]) == first for i in range(5))


def test_the_margin_sends_work_elsewhere_when_the_holder_is_too_busy():
    router = _router(route_balance_margin=2)
    chosen = [_send(router, f"r{i}", PREFIX + [i]) for i in range(6)]
    # 0, then two more on it (load 3 vs 0 > 2 breaks affinity), then the other one.
    assert chosen[:3] == [chosen[0]] * 3 and chosen[3] != chosen[0]


def test_reports_confirm_and_withdraw_what_a_replica_holds():
    router = _router()
    hashes = router.hashes(PREFIX)
    router.report(1, hashes, [])
    assert router.choose(hashes, 0, 0.0) == 1
    assert router.matched(1, hashes, 1e9) == len(hashes)  # reported entries do not expire
    router.report(1, [], hashes[4:])
    assert router.matched(1, hashes, 0.0) == 4


def test_the_routers_own_entries_expire_unless_reported():
    router = _router()
    replica = _send(router, "a", PREFIX)
    hashes = router.hashes(PREFIX)
    router.ended("a")
    assert router.matched(replica, hashes, OPTIMISTIC_TTL_S - 1) == len(hashes)
    router.choose(hashes, 0, OPTIMISTIC_TTL_S + 1)  # sweeps
    assert router.matched(replica, hashes, OPTIMISTIC_TTL_S + 1) == 0
    assert not router.holders


def test_a_fault_forgets_the_replica_and_keeps_new_work_off_it_until_it_is_back():
    router = _router()
    hashes = router.hashes(PREFIX)
    router.report(0, hashes, [])
    router.fault(0)
    assert router.matched(0, hashes, 0.0) == 0
    assert {_send(router, f"r{i}", [i] * 9) for i in range(4)} == {1}
    router.back(0)
    assert _send(router, "x", [7] * 9) == 0  # least loaded again


def test_route_prefix_blocks_zero_is_round_robin_over_equal_loads():
    router = _router(3, route_prefix_blocks=0)
    chosen = []
    for i in range(6):
        chosen.append(_send(router, f"r{i}", PREFIX))
        router.ended(f"r{i}")
    assert chosen == [0, 1, 2, 0, 1, 2]


POOLS = {"interactive": PoolConfig(replicas="0", max_priority=0),
         "batch": PoolConfig(replicas="1", min_priority=1)}


def test_pools_keep_each_class_on_its_replicas():
    router = _router(pools=POOLS)
    assert {_send(router, f"b{i}", [i] * 5, priority=10) for i in range(5)} == {1}
    assert {_send(router, f"i{i}", [i] * 5, priority=-3) for i in range(5)} == {0}


def test_a_saturated_pool_spills_only_where_spilling_is_allowed():
    pools = {**POOLS, "batch": PoolConfig(replicas="1", min_priority=1,
                                          spill_from="interactive")}
    router = _router(pools=pools, route_spill_waiting=2)
    assert [_send(router, f"i{i}", [i] * 5) for i in range(3)] == [0, 0, 1]
    # The batch pool saturated takes nobody's help: interactive does not take its overflow.
    assert {_send(router, f"b{i}", [i] * 5, priority=5) for i in range(6)} == {1}
    router.started("i0")
    assert _send(router, "i9", [9] * 5) == 0  # room at home again


def test_replicas_their_breakers_refuse_are_passed_over_and_their_pools_spill():
    pools = {"fast": PoolConfig(replicas="0", max_priority=0),
             "bulk": PoolConfig(replicas="1", min_priority=1, spill_from="fast")}
    router = _router(pools=pools)
    # Bulk's replica half-open (allowed, as a probe): priority 0 still goes home to fast.
    assert router.choose([], 0, 0.0, allowed=[0, 1]) == 0
    # Fast's replica open: its traffic spills to bulk, which takes fast's overflow.
    assert router.choose([], 0, 0.0, allowed=[1]) == 1
    # Bulk's open and fast takes no overflow: a clear 503 naming the breakers.
    with pytest.raises(NoReplica, match="circuit breakers are open"):
        router.choose([], 5, 0.0, allowed=[0])


def test_no_candidate_is_a_clear_error():
    router = _router(pools={"interactive": PoolConfig(replicas="0-1", max_priority=0)})
    with pytest.raises(NoReplica, match="no replica serves priority 7: the pools are "
                                        r"interactive \(-2147483648 to 0\)"):
        router.choose([], 7, 0.0)


def test_star_takes_the_overflow_of_priorities_no_pool_serves():
    router = _router(pools={"interactive": PoolConfig(replicas="0", max_priority=0),
                            "any": PoolConfig(replicas="1", min_priority=-5, max_priority=-5,
                                              spill_from="*")})
    assert router.choose([], 7, 0.0) == 1


_events = st.lists(st.tuples(st.sampled_from(["send", "start", "end", "report", "fault"]),
                             st.integers(0, 7), st.integers(0, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(_events, st.integers(0, 4), st.booleans())
def test_the_choice_is_always_a_candidate_and_counts_stay_exact(events, margin, pooled):
    pools = {"low": PoolConfig(replicas="0-1", max_priority=0),
             "high": PoolConfig(replicas="2", min_priority=1, spill_from="low")} \
        if pooled else {}
    router = _router(4, pools, route_balance_margin=margin, route_spill_waiting=2)
    live: dict[str, int] = {}
    for n, (kind, key, replica) in enumerate(events):
        if kind == "send":
            priority = key % 3 - 1
            hashes = router.hashes(PREFIX[: key * BS] + [n])
            chosen = router.choose(hashes, priority, float(n))
            assert chosen in router.candidates(priority)
            router.routed(f"r{n}", chosen, hashes, float(n))
            live[f"r{n}"] = chosen
        elif kind in ("start", "end") and live:
            rid = sorted(live)[key % len(live)]
            if kind == "start":
                router.started(rid)
            else:
                router.ended(rid)
                del live[rid]
        elif kind == "report":
            router.report(replica, router.hashes(PREFIX[: key * BS]), [])
        elif kind == "fault":
            router.fault(replica)
            router.back(replica)
        assert router.load == [list(live.values()).count(r) for r in range(4)]
        assert all(0 <= w <= ld for w, ld in zip(router.waiting, router.load, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=80), st.integers(1, 5))
def test_without_affinity_the_load_spread_stays_within_one(prompts, replicas):
    router = _router(replicas)
    for n, first in enumerate(prompts):
        _send(router, f"r{n}", [first + n * 1000] * 3)  # under one block: no affinity
        assert max(router.load) - min(router.load) <= 1
