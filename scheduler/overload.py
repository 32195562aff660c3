"""The degradation ladder: while the engine is congested, the least important tenants' new
requests get a smaller max_tokens, then 429, one step per interval. A step is undone the same
way, only once every signal is well below its threshold and the work arriving, counted as if
nothing were degraded, fits well within the output rate the engine reached while congested:
degrading is what made the signals calm, so they alone would undo it into the same overload.
Requests already admitted are never touched."""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import NamedTuple

from surge.config import OverloadConfig, TenantConfig

log = logging.getLogger("surge.scheduler")

# The steps each `degrade` setting allows, mildest first.
_STEPS = {"never": (), "cap": ("cap",), "refuse": ("refuse",),
          "cap-then-refuse": ("cap", "refuse")}


class Step(NamedTuple):
    tenant: str  # a [tenants.NAME] table; "default" stands for every tenant without one
    action: str  # "cap" | "refuse"

    def __str__(self) -> str:
        return f"{self.action} tenant {self.tenant!r}"


class Ladder:
    def __init__(self, cfg: OverloadConfig, tenants: dict[str, TenantConfig],
                 now: float) -> None:
        self.level = 0  # how many of self.steps apply
        self.congested = False  # the last judgement found a signal over its threshold
        self.ttfts: list[float] = []  # first-token delays since the last judgement
        self.degraded: Counter[Step] = Counter()  # requests degraded, by step
        self.signals: dict[str, float] = {}  # the last judgement's measurements
        self.reason = ""  # the signal behind the last move, for refusals and the log
        # Output tokens asked for by arrivals (before any cap, refused ones too) and generated,
        # since the last judgement; and the most tokens a second seen while congested.
        self.requested = 0
        self.generated = 0
        self.capacity = 0.0
        self.calm = 0  # judgements in a row that would undo a step
        self._judged = now
        self.configure(cfg, tenants)

    def configure(self, cfg: OverloadConfig, tenants: dict[str, TenantConfig]) -> None:
        self.cfg = cfg
        # Least important first: a larger priority value (served later), then a smaller weight.
        order = sorted((n for n, t in tenants.items() if t.degrade != "never"),
                       key=lambda n: (-tenants[n].priority, tenants[n].weight, n))
        self.steps = [Step(n, action) for n in order for action in _STEPS[tenants[n].degrade]]
        self.level = min(self.level, len(self.steps))

    @property
    def conservative(self) -> bool:
        """While congested or degraded the scheduler stops speculating: proposals spend
        compute that only pays when the batch is small (see Scheduler.speculating)."""
        return self.congested or self.level > 0

    def actions(self, tenant: str) -> set[str]:
        """The steps in force for a tenant's new requests (tenant: its table's name)."""
        return {s.action for s in self.steps[: self.level] if s.tenant == tenant}

    def judge(self, now: float, queue_drain_s: float, kv_use: float) -> None:
        """Once per ladder interval: a step up while a signal is over its threshold, a step
        down once all have been below ladder_recover of theirs, and the demand has fitted
        (see above), for ladder_calm_intervals judgements in a row; else hold."""
        cfg = self.cfg
        span = now - self._judged
        if span < cfg.ladder_interval_s:
            return
        self._judged = now
        ttfts, self.ttfts = sorted(self.ttfts), []
        demand, rate = self.requested / span, self.generated / span
        self.requested = self.generated = 0
        measured = {"queue_drain_s": queue_drain_s, "kv_use": kv_use}
        if ttfts:
            measured["ttft_p95_s"] = ttfts[min(len(ttfts) - 1, math.ceil(0.95 * len(ttfts)) - 1)]
        self.signals = measured
        limits = {"ttft_p95_s": cfg.ttft_slo_s, "queue_drain_s": cfg.max_queue_drain_s,
                  "kv_use": cfg.max_kv_use}
        if not any(limits.values()):
            self.congested, self.level = False, 0  # every signal switched off (live)
            return
        # No first token in the interval: no latency seen (a stalled queue shows in its drain).
        ratios = {name: measured.get(name, 0.0) / limit for name, limit in limits.items()
                  if limit}
        signal, worst = max(ratios.items(), key=lambda item: item[1])
        why = f"{signal} {measured.get(signal, 0.0):.3g} against {limits[signal]:g}"
        self.reason = why
        if (worst > 1) != self.congested:
            self.congested = worst > 1
            log.warning("engine %s: %s", "congested (no speculation)" if self.congested
                        else "no longer congested", why)
        if self.congested:
            self.capacity = max(self.capacity, rate)
        calm = worst < cfg.ladder_recover and demand < cfg.ladder_recover * self.capacity
        self.calm = self.calm + 1 if calm else 0
        if self.congested and self.level < len(self.steps):
            log.warning("overload: %s; degradation step %d: %s", why, self.level + 1,
                        self.steps[self.level])
            self.level += 1
        elif self.level and self.calm >= cfg.ladder_calm_intervals:
            self.calm = 0  # the next step back waits as long
            self.level -= 1
            log.info("overload easing: %s, %.0f output tokens/s asked of %.0f served while "
                     "congested; undone step %d: %s", why, demand, self.capacity,
                     self.level + 1, self.steps[self.level])
