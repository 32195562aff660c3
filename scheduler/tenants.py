"""Per-tenant state: token buckets for rate limits, counts for quotas, virtual time for
weighted fair sharing."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from surge.config import TenantConfig


class TokenBucket:
    """Refills continuously at per_min a minute, holding at most per_min; 0 means unlimited.
    The level may go below zero (tokens generated after admission are charged as they come)."""

    def __init__(self, per_min: float, now: float) -> None:
        self.per_min = per_min
        self.level = per_min
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.per_min, self.level + (now - self.updated) * self.per_min / 60)
            self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds amount (0: it does now)."""
        if not self.per_min:
            return 0.0
        self._refill(now)
        return max(0.0, (amount - self.level) * 60 / self.per_min)

    def take(self, amount: float, now: float) -> None:
        if self.per_min:
            self._refill(now)
            self.level -= amount

    def set_rate(self, per_min: float, now: float) -> None:
        self._refill(now)
        self.level = per_min if not self.per_min else min(self.level, per_min)
        self.per_min = per_min


class RateMeter:
    """Events per second, counted from the first event of the last window_s seconds: over the
    whole window, a meter idle for most of it would read a trickle while it is in fact serving
    quickly (a Retry-After of 30 s for a queue that drains in one)."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.events: deque[float] = deque()

    def add(self, now: float) -> None:
        self.events.append(now)

    def rate(self, now: float) -> float:
        """0 when less than a second of service is known: too little to measure, and the
        callers' default (a short Retry-After) fits a meter that has only just started."""
        while self.events and self.events[0] < now - self.window_s:
            self.events.popleft()
        span = now - self.events[0] if self.events else 0.0
        return len(self.events) / span if span >= 1.0 else 0.0


class Tenant:
    def __init__(self, name: str, cfg: TenantConfig, now: float) -> None:
        self.name = name
        self.cfg = cfg
        self.requests = TokenBucket(cfg.requests_per_min, now)
        self.tokens = TokenBucket(cfg.tokens_per_min, now)
        self.num_waiting = 0
        self.num_running = 0
        # Tokens served divided by the weight: fair queueing admits the backlogged tenant
        # whose virtual time is lowest.
        self.vtime = 0.0
        self.served_tokens = 0
        self.finished = RateMeter()

    def configure(self, cfg: TenantConfig, now: float) -> None:
        self.cfg = cfg
        self.requests.set_rate(cfg.requests_per_min, now)
        self.tokens.set_rate(cfg.tokens_per_min, now)

    def serve(self, num_tokens: int) -> None:
        self.served_tokens += num_tokens
        self.vtime += num_tokens / self.cfg.weight

    def catch_up(self, tenants: Iterable[Tenant]) -> None:
        """A tenant back from idle starts at the lowest virtual time among the busy ones: no
        credit for the time away, or it would starve the others. Back to an idle engine, it
        starts level with the tenant served most: what anyone got while nobody else wanted
        anything counts for no one (those who come next catch up to it)."""
        if self.num_waiting + self.num_running:
            return
        tenants = list(tenants)
        busy = [t.vtime for t in tenants if t.num_waiting + t.num_running]
        self.vtime = max(self.vtime, min(busy) if busy else max(t.vtime for t in tenants))
