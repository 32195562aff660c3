"""Overload control on a fake clock: the circuit breaker's states, and the degradation ladder
through a 3x overload ramp of the SLA simulation (tests/test_sla.py's Sim)."""

from __future__ import annotations

import math

import pytest

from scheduler.overload import Ladder, Step
from scheduler.scheduler import Scheduler
from server.breaker import Breakers, Ticket
from server.errors import ApiError
from surge import metrics
from surge.config import OverloadConfig, SchedulerConfig, SpeculativeConfig, TenantConfig
from surge.protocol import EngineRequest, SamplingParams, SeqResult, StepResult
from tests.test_sla import Sim


def test_the_breaker_opens_half_opens_and_closes_at_the_configured_points():
    now = [0.0]
    moves: list[str] = []
    cfg = OverloadConfig(breaker_failures=3, breaker_window_s=10, breaker_cooldown_s=5,
                         breaker_probes=2)
    breakers = Breakers(cfg, 1, on_change=lambda replica: moves.append(breaker.state),
                        clock=lambda: now[0])
    breaker = breakers.each[0]

    def admit() -> bool:
        """Let through: as a probe (True) or not (False)."""
        assert breakers.taking() == [0]
        ticket = Ticket()
        breakers.take(0, ticket)
        assert ticket.probe in (None, breaker)
        return ticket.probe is breaker

    def refused() -> ApiError:
        with pytest.raises(ApiError) as e:
            admit()
        assert e.value.status == 503
        return e.value

    for t in (0, 6, 12):  # the first has left the 10 s window when the third comes
        now[0] = t
        breaker.failure("worker 0 died")
    assert breaker.state == "closed" and admit() is False and breaker.problem is None
    now[0] = 13
    breaker.failure("worker 0 died")  # 6, 12, 13: three within the window
    assert breaker.state == "open"
    assert "3 engine failures within 10s" in breaker.problem
    assert refused().retry_after == 5
    now[0] = 17.5
    assert refused().retry_after == 1  # never 0: "retry at once" would be wrong
    now[0] = 18  # the cool-down is over: two probes pass, a third waits
    assert admit() is True and admit() is True
    assert breaker.state == "half-open" and breaker.problem is None  # it takes probes
    assert "half-open" in refused().message
    breaker.finished(True)
    breaker.finished(False)  # the second probe failed: open again, a new cool-down
    assert breaker.state == "open"
    now[0] = 22
    refused()
    now[0] = 23
    assert admit() is True
    breaker.finished(None)  # the client left: no verdict, and the slot is free again
    assert admit() is True and admit() is True
    breaker.failure("worker 0 died")  # an engine failure while half-open
    assert breaker.state == "open"
    breaker.finished(True)  # the two probes finish after all (recomputed): too late
    breaker.finished(True)
    assert breaker.state == "open"
    now[0] = 28
    assert admit() and admit()
    breaker.finished(True)
    breaker.finished(True)
    assert breaker.state == "closed" and admit() is False
    breaker.failure("worker 0 died")  # the old failures were forgotten on closing
    assert breaker.state == "closed"
    transitions = [m for i, m in enumerate(moves) if i == 0 or m != moves[i - 1]]
    assert transitions == ["open", "half-open", "open", "half-open", "open", "half-open",
                           "closed"]
    assert breaker.rejected == 4


def test_a_breaker_switched_off_live_closes():
    breakers = Breakers(OverloadConfig(breaker_failures=1), 1)
    breakers.failure(0, "worker 0 died")
    assert breakers.each[0].state == "open"
    breakers.configure(OverloadConfig(breaker_failures=0))
    assert breakers.each[0].state == "closed" and breakers.taking() == [0]
    breakers.failure(0, "worker 0 died")
    assert breakers.each[0].state == "closed"


def test_a_replicas_breaker_sends_work_to_the_others_and_takes_probes_when_half_open():
    now = [0.0]
    told: list[int] = []
    breakers = Breakers(OverloadConfig(breaker_failures=2, breaker_cooldown_s=5,
                                       breaker_probes=1), 3, told.append, lambda: now[0])
    first, second, third = breakers.each
    for _ in range(2):
        breakers.failure(1, "worker 1.0 died")
    assert second.state == "open" and (first.state, third.state) == ("closed", "closed")
    assert told == [1] and "replica 1's" in second.name
    # Replica 1 takes no new work while the others do: no 503.
    assert breakers.taking() == [0, 2]
    assert metrics.breaker_state._value.get() == 0  # the server still serves
    now[0] = 5  # after the cool-down it takes one probe, and the request routed there is it
    assert breakers.taking() == [0, 1, 2] and second.state == "half-open"
    elsewhere, probe = Ticket(), Ticket()
    breakers.take(0, elsewhere)
    breakers.take(1, probe)
    assert elsewhere.probe is None and probe.probe is second
    assert breakers.taking() == [0, 2]  # its one slot is taken
    probe.finished(True)
    assert second.state == "closed" and breakers.taking() == [0, 1, 2]
    # Every replica's breaker open: refused, each counts it, the wait is the soonest probe's.
    for replica in (0, 1, 2):
        now[0] = 10 + replica
        breakers.failure(replica, f"worker {replica}.0 died")
        breakers.failure(replica, f"worker {replica}.0 died")
    assert metrics.breaker_state._value.get() == 2
    with pytest.raises(ApiError) as e:
        breakers.taking()
    assert e.value.status == 503 and e.value.retry_after == 3
    assert "replica 0's circuit breaker open: 2 engine failures" in e.value.message
    assert "replica 2's circuit breaker open" in e.value.message
    assert [b.rejected for b in breakers.each] == [1, 1, 1]


def test_the_ladder_takes_the_least_important_tenant_first():
    tenants = {"chat": TenantConfig(weight=4, degrade="cap"),
               "batch": TenantConfig(degrade="cap-then-refuse"),
               "bulk": TenantConfig(priority=5, degrade="refuse"),
               "vip": TenantConfig(weight=0.5)}  # never degrades, whatever its weight
    ladder = Ladder(OverloadConfig(), tenants, 0.0)
    assert ladder.steps == [Step("bulk", "refuse"), Step("batch", "cap"),
                            Step("batch", "refuse"), Step("chat", "cap")]


def test_the_ladder_moves_one_step_per_interval_with_hysteresis():
    cfg = OverloadConfig(ttft_slo_s=1.0, ladder_interval_s=1.0, ladder_recover=0.5,
                         ladder_calm_intervals=1)
    tenants = {"a": TenantConfig(degrade="cap-then-refuse"), "b": TenantConfig(degrade="cap")}
    ladder = Ladder(cfg, tenants, 0.0)
    levels = []
    # TTFT p95 per interval: over, over, over (no step left), between, calm while the demand
    # is still far above what the engine served, calm and fitting x3.
    for t, ttft, asked in ((1, 2.0, 0), (2, 1.5, 0), (3, 3.0, 0), (4, 4.0, 0), (5, 0.8, 0),
                           (6, 0.2, 1000), (7, 0.2, 10), (8, 0.2, 10), (9, 0.2, 10),
                           (10, 0.2, 10)):
        ladder.ttfts = [ttft] * 20
        ladder.requested, ladder.generated = asked, 100
        ladder.judge(float(t), 0.0, 0.0)
        ladder.judge(t + 0.5, 0.0, 0.0)  # within the interval: nothing moves
        levels.append(ladder.level)
    assert levels == [1, 2, 3, 3, 3, 3, 2, 1, 0, 0]
    assert ladder.capacity == 100
    ladder.configure(OverloadConfig(ttft_slo_s=1.0, ladder_interval_s=1.0,
                                    ladder_calm_intervals=2), tenants)
    ladder.level, ladder.calm, levels = 2, 0, []
    for t, ttft in ((11, 0.2), (12, 0.9), (13, 0.2), (14, 0.2), (15, 0.2), (16, 0.2)):
        ladder.ttfts = [ttft] * 20
        ladder.judge(float(t), 0.0, 0.0)
        levels.append(ladder.level)
    assert levels == [2, 2, 2, 1, 1, 0]  # two calm judgements in a row per step back
    ladder.level = 2
    assert ladder.actions("a") == {"cap", "refuse"} and ladder.actions("b") == set()


def _overload_run(ladder: bool) -> tuple[Sim, list[float], list[int]]:
    """Chat (1 request / 2 s, 16 tokens) beside batch (400 tokens each) at half the engine's
    capacity, then 3x it for 60 s, then half again. Same priority, so fair sharing alone keeps
    chat ahead in the queue, but each of its requests waits for a seat a batch request leaves.
    The TTFTs of chat requests arriving from 10 s into the overload (the ladder has reacted by
    then) to its end, and the ladder's level each 2 s."""
    tenants = {"chat": TenantConfig(weight=4),
               "batch": TenantConfig(degrade="cap-then-refuse", degrade_max_tokens=16)}
    overload = OverloadConfig(ttft_slo_s=0.5, max_queue_drain_s=2, ladder_interval_s=2) \
        if ladder else OverloadConfig()
    sim = Sim(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                              max_queued_requests=0, max_queued_tokens=0),
              tenants, overload=overload)
    capacity = 8 / (sim.step_s + 8 * sim.per_token_s) / 400  # batch requests a second
    next_batch = next_chat = 0.0
    chat: list[tuple[str, float]] = []
    levels = []
    next_level = 0.0
    while sim.now < 140:
        rate = capacity * (3.0 if 20 <= sim.now < 80 else 0.5)
        while next_batch <= sim.now:
            sim.submit("batch", prompt=16, max_tokens=400)
            next_batch += 1 / rate
        while next_chat <= sim.now:
            rid, refusal = sim.submit("chat", prompt=16, max_tokens=16)
            assert refusal is None
            chat.append((rid, sim.now))
            next_chat += 2.0
        while next_level <= sim.now:
            levels.append(sim.sched.admission.ladder.level)
            next_level += 2.0
        sim.step()
    overloaded = [sim.started[rid] - t for rid, t in chat if 30 <= t < 80 and rid in sim.started]
    return sim, overloaded, levels


def _p95(values: list[float]) -> float:
    values = sorted(values)
    return values[math.ceil(0.95 * len(values)) - 1]


def test_the_ladder_keeps_interactive_ttft_under_its_slo_through_a_3x_overload():
    _, without, levels_off = _overload_run(ladder=False)
    sim, with_ladder, levels = _overload_run(ladder=True)
    assert set(levels_off) == {0}
    print(f"chat TTFT p95 in the overload: {_p95(without):.2f}s without the ladder, "
          f"{_p95(with_ladder):.2f}s with it; levels every 2s: {levels}")
    assert _p95(without) > 0.5, without  # the SLO is broken without the ladder
    assert _p95(with_ladder) <= 0.5, with_ladder
    # Batch was degraded (capped first), chat never was; every degraded reply said so.
    ladder = sim.sched.admission.ladder
    assert ladder.degraded[Step("batch", "cap")] > 0
    capped = [r for r in sim.replies.values() if r.degraded]
    assert capped and all(r.degraded == "max_tokens=16" for r in capped)
    assert all(sim.generated.get(r.request_id, 0) <= 16 for r in capped)
    refused = [r for r in sim.replies.values() if r.finish_reason == "error"]
    assert all(r.status == 429 and "overload" in r.error and r.retry_after for r in refused)
    # Requests admitted before a step never lose tokens: every uncapped batch request that
    # finished got its 400.
    whole = [rid for rid, r in sim.replies.items() if not r.finish_reason and not r.degraded
             and sim.tenant_of[rid] == "batch" and rid in sim.done]
    assert whole and all(sim.generated[rid] == 400 for rid in whole)
    assert levels[15] >= 1, levels  # it reacted within 10 s of the overload's start (t=20)
    # Up during the overload, held through it, and back down after it without climbing
    # again: the level never rises after its first step down.
    peak = levels.index(max(levels))
    assert max(levels) >= 1 and levels[-1] == 0, levels
    assert all(a >= b for a, b in zip(levels[peak:], levels[peak + 1:], strict=False)), levels


def test_a_congested_engine_stops_speculating_and_starts_again():
    now = [0.0]
    sched = Scheduler(SchedulerConfig(), 1000, clock=lambda: now[0],
                      speculative=SpeculativeConfig(speculative_method="ngram"),
                      overload=OverloadConfig(max_queue_drain_s=1.0, ladder_interval_s=1.0))
    for i in range(3):
        sched.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=[5, 6] * 8,
                                arrival_time=0.0, sampling=SamplingParams(max_tokens=50)))
    plan = sched.schedule()
    sched.update(plan, StepResult(plan.step_id, {s.seq_id: SeqResult([5]) for s in plan.seqs}))
    assert sched.speculating()
    sched.add(EngineRequest(request_id="late", prompt_token_ids=[1] * 8, arrival_time=0.0,
                            sampling=SamplingParams(max_tokens=5)))
    sched.admission.drained.events.clear()  # nothing drains: the queue's age is its drain time
    now[0] = 3.0
    sched.admission.judge(sched.waiting, sched.blocks, now[0])
    assert sched.admission.ladder.congested and not sched.speculating()
    sched.abort(["late"])
    now[0] = 4.0
    sched.admission.judge(sched.waiting, sched.blocks, now[0])
    assert not sched.admission.ladder.congested and sched.speculating()
