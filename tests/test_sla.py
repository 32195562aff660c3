"""SLA scheduling, simulated: the real Scheduler with a fake clock and a fake cost model (a step
takes a fixed time plus a little per token), thousands of requests in a few seconds."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.scheduler import Scheduler
from surge.config import OverloadConfig, SchedulerConfig, TenantConfig
from surge.protocol import EngineRequest, RequestOutput, SamplingParams, SeqResult, StepResult


class Sim:
    """Steps the scheduler one plan at a time; each step advances the clock by its cost."""

    def __init__(self, cfg: SchedulerConfig, tenants: dict[str, TenantConfig] | None = None,
                 num_blocks: int = 100_000, step_s: float = 0.02, per_token_s: float = 1e-4,
                 overload: OverloadConfig | None = None) -> None:
        self.now = 0.0
        self.sched = Scheduler(cfg, num_blocks, tenants or {}, clock=lambda: self.now,
                               overload=overload)
        self.step_s, self.per_token_s = step_s, per_token_s
        self.ids = itertools.count()
        self.tenant_of: dict[str, str] = {}
        self.started: dict[str, float] = {}  # first token out
        self.done: dict[str, RequestOutput] = {}  # terminal output (finished or error)
        self.served: dict[str, int] = {}  # tokens computed per tenant, within the window
        self.order: list[str] = []  # requests in the order they first ran
        self.replies: dict[str, RequestOutput] = {}  # acknowledgement or refusal
        self.generated: dict[str, int] = {}  # tokens out per request

    def submit(self, tenant: str = "default", prompt: int = 16, max_tokens: int = 16,
               priority: int | None = None, timeout: float | None = None
               ) -> tuple[str, RequestOutput | None]:
        rid = f"r{next(self.ids)}"
        self.tenant_of[rid] = tenant
        [reply] = self.sched.add_all([EngineRequest(
            request_id=rid, prompt_token_ids=[7] * prompt, arrival_time=self.now,
            tenant=tenant, priority=priority, timeout_s=timeout,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))])
        self.replies[rid] = reply
        if reply.finish_reason:
            self.done[rid] = reply
            return rid, reply
        return rid, None

    def step(self) -> None:
        for out in self.sched.expire():
            self.done[out.request_id] = out
        plan = self.sched.schedule()
        if plan is None:
            self.now += self.step_s
            return
        tokens = sum(len(s.token_ids) for s in plan.seqs)
        for item in plan.seqs:
            rid = self.sched.seqs[item.seq_id].request_id
            tenant = self.tenant_of[rid]
            self.served[tenant] = self.served.get(tenant, 0) + len(item.token_ids)
            if rid not in self.order:
                self.order.append(rid)
        cost = self.step_s + self.per_token_s * tokens
        self.sched.cost.record(tokens, cost)
        self.now += cost
        sampled = {s.seq_id: SeqResult([5]) for s in plan.seqs if s.sample}
        for out in self.sched.update(plan, StepResult(plan.step_id, sampled)):
            self.started.setdefault(out.request_id, self.now)
            self.generated[out.request_id] = self.generated.get(out.request_id, 0) + \
                len(out.new_token_ids)
            if out.finish_reason:
                self.done[out.request_id] = out

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.step()


def _cfg(**kw: object) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 256,
                              "max_queued_requests": 0, "max_queued_tokens": 0, **kw})


def test_more_urgent_requests_start_first():
    sim = Sim(_cfg(max_num_seqs=1, priority_aging_s=0))
    lax = [sim.submit(priority=5)[0] for _ in range(5)]
    urgent = [sim.submit(priority=-1)[0] for _ in range(3)]
    normal = [sim.submit()[0] for _ in range(3)]
    sim.run(60)
    assert len(sim.done) == 11
    # Nothing ran before every request had arrived: strictly by class, then arrival.
    assert sim.order == urgent + normal + lax


def test_fcfs_ignores_priority_and_sjf_runs_short_jobs_first():
    sim = Sim(_cfg(max_num_seqs=1, policy="fcfs"))
    ids = [sim.submit(priority=p)[0] for p in (5, 0, -3)]
    sim.run(20)
    assert sim.order == ids
    sim = Sim(_cfg(max_num_seqs=1, policy="sjf", priority_aging_s=0))
    long, short, medium = (sim.submit(max_tokens=n)[0] for n in (200, 5, 40))
    sim.run(60)
    assert sim.order == [short, medium, long]


def test_an_urgent_request_preempts_a_less_urgent_one_when_the_batch_is_full():
    for preemption in (True, False):
        sim = Sim(_cfg(max_num_seqs=2, priority_preemption=preemption, priority_aging_s=0))
        batch = [sim.submit(priority=10, max_tokens=500)[0] for _ in range(2)]
        sim.run(1)
        assert sim.sched.num_preemptions == 0
        urgent, _ = sim.submit(priority=0, max_tokens=5)
        sim.step()
        if preemption:
            # The latest lax arrival made room; the urgent one ran in the very next step.
            assert urgent in sim.order and sim.sched.num_preemptions == 1
            assert sim.sched.requests[batch[1]] in sim.sched.waiting
            sim.run(60)
            assert all(sim.done[r].finish_reason == "length" for r in [*batch, urgent])
        else:
            assert urgent not in sim.order and sim.sched.num_preemptions == 0


def test_urgent_requests_preempt_when_the_kv_cache_is_full():
    # 8 blocks of 16 tokens: the two batch requests hold them all.
    sim = Sim(_cfg(block_size=16, max_num_seqs=8, priority_aging_s=0, prefix_cache=False),
              num_blocks=8)
    batch = [sim.submit(priority=5, prompt=60, max_tokens=4)[0] for _ in range(2)]
    sim.step()
    assert set(sim.order) == set(batch) and sim.sched.blocks.num_free == 0
    urgent, _ = sim.submit(priority=0, prompt=30, max_tokens=2)
    sim.step()
    assert urgent in sim.order and sim.sched.num_preemptions == 1
    sim.run(30)
    assert all(sim.done[r].finish_reason == "length" for r in [*batch, urgent])


@pytest.mark.parametrize("aging_s", [0.0, 2.0])
def test_aging_ends_starvation(aging_s):
    """A lax request under an endless stream of urgent ones: with aging it starts within
    (its class distance + 1) aging periods plus a request's service time; without, never."""
    sim = Sim(_cfg(max_num_seqs=2, priority_aging_s=aging_s, priority_preemption=False))
    for _ in range(4):
        sim.submit(priority=0, max_tokens=10)
    sim.step()
    lax, _ = sim.submit(priority=3, max_tokens=10)
    for _ in range(3000):  # keep more urgent work queued at all times
        if len(sim.sched.waiting) < 6:
            sim.submit(priority=0, max_tokens=10)
        sim.step()
        if lax in sim.started:
            break
    if aging_s:
        # Class 3 -> 0 takes 3 periods; then it is the oldest of its class.
        assert sim.started[lax] - sim.started["r0"] <= (3 + 1) * aging_s + 1.0
    else:
        assert lax not in sim.started and sim.now > 60


@pytest.mark.parametrize(("weights", "shapes"), [
    ((2, 1), ((100, 20), (10, 200))),  # A: long prompts, short outputs; B: the reverse
    ((1, 1), ((16, 16), (400, 100))),  # very different sizes, equal weights
    ((3, 1), ((32, 64), (32, 64))),
])
def test_weighted_fair_shares_while_backlogged(weights, shapes):
    tenants = {"a": TenantConfig(weight=weights[0]), "b": TenantConfig(weight=weights[1])}
    sim = Sim(_cfg(max_num_seqs=8, policy="fcfs"), tenants)

    def keep_backlogged() -> None:
        for name, (prompt, out) in zip("ab", shapes, strict=True):
            while sim.sched.admission.tenant(name, sim.now).num_waiting < 16:
                sim.submit(name, prompt=prompt, max_tokens=out)

    for _ in range(300):  # warm up to the steady state
        keep_backlogged()
        sim.step()
    sim.served.clear()
    for _ in range(4000):
        keep_backlogged()
        sim.step()
    share = sim.served["a"] / (sim.served["a"] + sim.served["b"])
    want = weights[0] / sum(weights)
    assert abs(share - want) <= 0.1 * want, (share, want, sim.served)


def test_an_idle_tenant_leaves_its_share_to_the_others_and_banks_no_credit():
    tenants = {"a": TenantConfig(weight=1), "b": TenantConfig(weight=1)}
    sim = Sim(_cfg(max_num_seqs=4, policy="fcfs"), tenants)
    for _ in range(1000):  # b idle: a gets everything
        while sim.sched.admission.tenant("a", sim.now).num_waiting < 4:
            sim.submit("a", max_tokens=32)
        sim.step()
    assert set(sim.served) == {"a"}
    sim.served.clear()
    for _ in range(1000):  # b returns: an even split from the start, not b alone for a while
        for name in "ab":
            while sim.sched.admission.tenant(name, sim.now).num_waiting < 4:
                sim.submit(name, max_tokens=32)
        sim.step()
        if sum(sim.served.values()) > 2000:
            break
    share = sim.served["b"] / sum(sim.served.values())
    assert 0.4 <= share <= 0.6, sim.served


def test_a_request_may_not_be_more_urgent_than_its_tenant_allows():
    """The body's priority is the client's; a named tenant's is the operator's: less urgent is
    always allowed, more urgent only down to min_priority. `default` (every request without
    API keys) chooses freely, as vLLM's clients do, unless its table sets min_priority."""
    tenants = {"batch": TenantConfig(priority=10), "vip": TenantConfig(priority=5, min_priority=0)}
    sim = Sim(_cfg(), tenants)
    _, refusal = sim.submit("batch", priority=-5)
    assert refusal is not None and refusal.status == 400
    assert "'batch' may ask for priority 10 or above" in refusal.error
    assert "tenants.batch.min_priority" in refusal.error
    assert sim.submit("batch", priority=50)[1] is None and sim.submit("batch")[1] is None
    assert sim.submit("vip", priority=0)[1] is None
    assert sim.submit("vip", priority=-1)[1] is not None
    # a tenant without a table: [tenants.default]'s, whose own priority is 0
    _, refusal = sim.submit("other", priority=-1)
    assert refusal is not None and "tenants.default.min_priority" in refusal.error
    assert sim.submit("default", priority=-1000)[1] is None
    fenced = Sim(_cfg(), {"default": TenantConfig(min_priority=-2)})
    assert fenced.submit("default", priority=-2)[1] is None
    assert fenced.submit("default", priority=-3)[1] is not None


@pytest.mark.parametrize("first", ["a", "b"])
def test_after_an_idle_spell_of_everyone_history_counts_for_no_one(first):
    """b is served alone, then everyone goes idle; when both come back, whichever is first,
    the split follows the weights from the start: b's service while nobody else wanted any is
    not held against it (nor a's absence credited to a)."""
    tenants = {"a": TenantConfig(weight=3), "b": TenantConfig(weight=1)}
    sim = Sim(_cfg(max_num_seqs=2, policy="fcfs"), tenants)
    for _ in range(8):
        sim.submit("b", max_tokens=64)
    while len(sim.done) < 8:
        sim.step()
    for _ in range(50):  # idle
        sim.step()
    sim.submit(first, max_tokens=12)
    sim.step()
    for name in "ab":
        for _ in range(12):
            sim.submit(name, max_tokens=12)
    sim.served.clear()
    while sum(sim.served.values()) < 8 * 28:  # 16 + 12 tokens a request: both stay backlogged
        sim.step()
    share = sim.served.get("b", 0) / sum(sim.served.values())
    assert 0.15 <= share <= 0.35, sim.served  # weight 1 of 4


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 120), st.floats(0.05, 2.0), st.integers(5, 60))
def test_requests_per_min_is_exact(per_min, gap_s, seconds):
    """Over any run, accepted requests never exceed the bucket (a minute's worth) plus the
    refill, and a client that waits the Retry-After it was given is accepted."""
    sim = Sim(_cfg(), {"t": TenantConfig(requests_per_min=per_min)})
    accepted = 0
    while sim.now < seconds:
        rid, refusal = sim.submit("t", max_tokens=1)
        if refusal is None:
            accepted += 1
        else:
            assert refusal.status == 429 and "requests_per_min" in refusal.error
            retry = refusal.retry_after
            assert retry is not None and retry >= 1
            # One second before the hint may still be too early; at the hint it must work.
            assert retry - 1 < (1 - sim.sched.admission.tenant("t", sim.now).requests.level) \
                * 60 / per_min + 1e-9
        sim.now += gap_s
    allowed = per_min + per_min * seconds / 60
    assert accepted <= math.floor(allowed + 1e-9)
    # and the bucket was not stingy: every request that fit was taken
    assert accepted >= min(math.floor(seconds / gap_s), math.floor(allowed)) - 1


def test_retry_after_is_honoured():
    sim = Sim(_cfg(), {"t": TenantConfig(requests_per_min=6)})  # one every 10 s
    for _ in range(6):
        assert sim.submit("t")[1] is None
    _, refusal = sim.submit("t")
    assert refusal is not None and refusal.retry_after == 10
    sim.now += refusal.retry_after
    assert sim.submit("t")[1] is None


def test_tokens_per_min_counts_prompt_and_generated_tokens():
    sim = Sim(_cfg(), {"t": TenantConfig(tokens_per_min=600)})  # 10 tokens a second
    assert sim.submit("t", prompt=500, max_tokens=200)[1] is None
    sim.run(5)  # 200 tokens generated: 500 + 200 taken, 50 refilled: below zero
    _, refusal = sim.submit("t", prompt=50)
    assert refusal is not None and refusal.status == 429 and "tokens_per_min" in refusal.error
    sim.now += refusal.retry_after
    assert sim.submit("t", prompt=50)[1] is None
    _, too_big = sim.submit("t", prompt=601)
    assert too_big is not None and too_big.status == 400


def test_tenant_quotas():
    sim = Sim(_cfg(max_num_seqs=1), {"t": TenantConfig(max_concurrent=3, max_queued=2)})
    assert all(sim.submit("t", max_tokens=50)[1] is None for _ in range(2))
    _, refusal = sim.submit("t")
    assert refusal is not None and "max_queued" in refusal.error
    sim.step()  # one starts: 1 running + 1 queued
    assert sim.submit("t")[1] is None
    _, refusal = sim.submit("t")
    assert refusal is not None and "max_concurrent" in refusal.error
    assert refusal.status == 429 and refusal.retry_after >= 1
    assert sim.submit("other")[1] is None  # other tenants are not affected


def test_global_queue_bounds_answer_at_once_with_a_measured_retry_after():
    sim = Sim(_cfg(max_num_seqs=2, max_queued_requests=10, max_queued_tokens=2000))
    refusals = []
    for _ in range(600):  # 10x more arrivals than the server drains
        for _ in range(2):
            _, refusal = sim.submit(max_tokens=20)
            if refusal is not None:
                refusals.append(refusal)
        sim.step()
    assert len(sim.sched.waiting) <= 10 and refusals
    # Draining 2 requests per 20 steps of ~20 ms: ~5 a second, so 1-2 s for a slot.
    assert all(r.status == 429 and r.retry_after in (1, 2) for r in refusals)
    _, refusal = Sim(_cfg(max_queued_tokens=100)).submit(prompt=101)
    assert refusal is not None and refusal.status == 400


def _group(n: int, tenant: str = "default") -> list[EngineRequest]:
    """n choices of one API request."""
    return [EngineRequest(request_id=f"g{n}-{i}", prompt_token_ids=[7] * 10, arrival_time=0.0,
                          tenant=tenant, sampling=SamplingParams(max_tokens=8))
            for i in range(n)]


@pytest.mark.parametrize(("bound", "cfg", "tenants"), [
    ("max_queued_requests", _cfg(max_num_seqs=1, max_queued_requests=6), {}),
    ("max_queued_tokens", _cfg(max_num_seqs=1, max_queued_tokens=60), {}),
    ("max_queued", _cfg(max_num_seqs=1), {"t": TenantConfig(max_queued=6)}),
    ("max_concurrent", _cfg(max_num_seqs=1), {"t": TenantConfig(max_concurrent=6)}),
    ("requests_per_min", _cfg(max_num_seqs=1), {"t": TenantConfig(requests_per_min=6)}),
])
def test_the_choices_of_one_request_are_admitted_as_a_unit(bound, cfg, tenants):
    """With room for 6 requests and 2 taken, 5 choices are refused together (nothing queued,
    no quota taken), 4 are admitted together; more than the bound itself is a 400."""
    sim = Sim(cfg, tenants)
    tenant = "t" if tenants else "default"
    assert not any(r.finish_reason for r in sim.sched.add_all(_group(2, tenant)))
    refused = sim.sched.add_all(_group(5, tenant))
    assert [r.request_id for r in refused] == [f"g5-{i}" for i in range(5)]
    assert all(r.status == 429 and bound in r.error for r in refused), refused
    assert len(sim.sched.requests) == 2
    # So the refusal took no quota.
    assert not any(r.finish_reason for r in sim.sched.add_all(_group(4, tenant)))
    assert len(sim.sched.requests) == 6
    never = Sim(cfg, tenants).sched.add_all(_group(7, tenant))
    assert all(r.status == 400 and bound in r.error for r in never), never


def test_retry_after_an_idle_spell_comes_from_recent_service():
    """A queue that fills right after a long idle spell is measured by what it drains now, not
    over a window spent mostly idle (that read a trickle: Retry-After up to 30 s)."""
    sim = Sim(_cfg(max_num_seqs=2, max_queued_requests=10))
    assert sim.submit(max_tokens=20)[1] is None
    sim.run(5)
    sim.now += 25.0  # idle, still inside the meter's 30 s window
    refusals = []
    for _ in range(100):  # 10x more arrivals than the server drains, for about 2 s
        for _ in range(2):
            _, refusal = sim.submit(max_tokens=20)
            if refusal is not None:
                refusals.append(refusal.retry_after)
        sim.step()
    assert refusals and max(refusals) <= 2, refusals


def test_deadlines():
    sim = Sim(_cfg(max_num_seqs=1))
    sim.submit(max_tokens=400)  # 8+ s of work ahead of everyone
    sim.step()
    late, _ = sim.submit(timeout=1.0)
    sim.run(1.5)
    out = sim.done[late]
    assert out.finish_reason == "error" and out.status == 503 and "timeout" in out.error
    assert late not in sim.order
    # With a measured drain rate, a timeout that cannot be met is refused at arrival.
    sim = Sim(_cfg(max_num_seqs=1), {"t": TenantConfig(timeout_s=0.5)})
    for _ in range(200):
        sim.submit(max_tokens=10)
        sim.step()
    _, refusal = sim.submit("t")  # the tenant's default timeout applies
    assert refusal is not None and refusal.status == 503 and "within its timeout" in \
        refusal.error
    # A request that starts in time is not touched when its deadline passes later.
    sim = Sim(_cfg())
    rid, _ = sim.submit(max_tokens=200, timeout=0.1)
    sim.run(10)
    assert sim.done[rid].finish_reason == "length"


def test_live_weights_apply_from_the_next_step():
    tenants = {"a": TenantConfig(weight=1), "b": TenantConfig(weight=1)}
    sim = Sim(_cfg(max_num_seqs=8, policy="fcfs"), tenants)

    def run(steps: int) -> float:
        sim.served.clear()
        for _ in range(steps):
            for name in "ab":
                while sim.sched.admission.tenant(name, sim.now).num_waiting < 16:
                    sim.submit(name, max_tokens=24)
            sim.step()
        return sim.served["a"] / sum(sim.served.values())

    assert abs(run(2000) - 0.5) < 0.05
    sim.sched.configure(sim.sched.cfg, {"a": TenantConfig(weight=4), "b": TenantConfig()})
    run(300)
    assert abs(run(3000) - 0.8) < 0.08


def test_step_cost_fit():
    from scheduler.cost import StepCost

    cost = StepCost()
    assert cost.tokens_within(0.1) is None  # nothing measured yet
    for tokens in range(1, 40):
        cost.record(tokens, 0.02 + 0.001 * tokens)
    assert cost.tokens_within(0.1) == pytest.approx(80, abs=1)
    assert cost.tokens_within(0.01) == 1


@pytest.mark.parametrize("step_ms", [0.0, 60.0])
def test_interactive_steps_bound_urgent_ttft_under_a_flood(step_ms):
    """A flood of lax requests fills a 64-sequence batch (steps of ~85 ms); urgent requests
    arrive now and then. With interactive_step_ms, steps shrink to the target while both
    classes are about, and an urgent request's first token comes within about two of them."""
    sim = Sim(_cfg(max_num_seqs=64, interactive_step_ms=step_ms), per_token_s=1e-3)
    ttfts = []
    for i in range(1500):
        while sim.sched.admission.tenant("default", sim.now).num_waiting < 8:
            sim.submit(priority=10, prompt=32, max_tokens=128)
        if i % 25 == 0:
            rid, _ = sim.submit(priority=0, prompt=24, max_tokens=4)
            arrived = sim.now
            while rid not in sim.started:
                sim.step()
            ttfts.append(sim.started[rid] - arrived)
        sim.step()
    worst = max(ttfts[5:])
    if step_ms:
        assert worst <= 2 * step_ms / 1000 + 0.01, ttfts
    else:
        assert worst > 0.08  # the full batch's steps
