"""The circuit breaker: while the engine keeps failing (worker deaths), answer new requests at
once with 503 rather than queue them into failures; after a cool-down let a few probe
requests through (half-open), and close once they all succeed. With data-parallel replicas
each has its own (Breakers): one replica failing sends new work to the others, and the
server refuses only when no replica's breaker takes a request."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

from server.errors import ApiError
from surge import metrics
from surge.config import OverloadConfig

log = logging.getLogger("surge.frontend")
_STATES = {"closed": 0, "half-open": 1, "open": 2}


class Breaker:
    def __init__(self, cfg: OverloadConfig, on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, replica: int | None = None
                 ) -> None:
        """on_change: called after every transition and rejection (the frontend tells the
        scheduler, for `surge admin stats`). replica: whose it is, with several."""
        self.cfg = cfg
        self.name = "circuit breaker" if replica is None else \
            f"replica {replica}'s circuit breaker"
        self.on_change = on_change
        self.clock = clock  # a fake one in the simulation tests
        self.state = "closed"
        self.reason = ""  # why it opened
        self.failures: deque[float] = deque()  # times of recent engine failures
        self.opened_at = 0.0
        self.probes = 0  # probe requests in flight (half-open)
        self.passed = 0  # probes that finished well since half-open
        self.rejected = 0

    def failure(self, reason: str) -> None:
        """The engine failed (a worker died): opens the breaker at breaker_failures within
        the window, or at once while half-open."""
        now = self.clock()
        self.failures.append(now)
        while self.failures[0] < now - self.cfg.breaker_window_s:
            self.failures.popleft()
        if self.state == "half-open":
            self._move("open", f"a probe failed: {reason}")
        elif self.state == "closed" and self.cfg.breaker_failures and \
                len(self.failures) >= self.cfg.breaker_failures:
            self._move("open", f"{len(self.failures)} engine failures within "
                               f"{self.cfg.breaker_window_s:g}s, the last: {reason}")

    def takes(self) -> str:
        """What it lets through now: "all" (closed), "probe" (half-open, a probe slot free) or
        "" (nothing)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cfg.breaker_cooldown_s:
            self._move("half-open", "the cool-down is over: trying probe requests")
        if self.state == "closed":
            return "all"
        return "probe" if self.state == "half-open" and self.probes < self.cfg.breaker_probes \
            else ""

    def finished(self, ok: bool | None) -> None:
        """A probe ended: ok True (it finished), False (the engine failed it), None (the
        client left, which says nothing about the engine)."""
        self.probes -= 1
        if self.state != "half-open" or ok is None:
            return
        if not ok:
            self._move("open", "a probe request failed")
            return
        self.passed += 1
        if self.passed >= self.cfg.breaker_probes:
            self.failures.clear()
            self._move("closed", f"{self.passed} probe requests finished")

    def configure(self, cfg: OverloadConfig) -> None:
        self.cfg = cfg
        if not cfg.breaker_failures and self.state != "closed":
            self._move("closed", "the breaker was switched off")

    @property
    def problem(self) -> str | None:
        """What /health reports (None: nothing, including half-open, which takes probes)."""
        return f"circuit breaker open: {self.reason}" if self.state == "open" else None

    def _move(self, state: str, why: str) -> None:
        if state == "open":
            self.opened_at, self.reason = self.clock(), why
        self.state, self.passed = state, 0
        metrics.breaker_transitions.labels(state).inc()
        (log.error if state == "open" else log.warning)("%s %s: %s", self.name, state, why)
        self.on_change()


def refusal(refusing: list[Breaker]) -> ApiError:
    """The 503 for a new request that each of these breakers refuses (counted in each)."""
    metrics.breaker_rejected.inc()
    for b in refusing:
        b.rejected += 1
        b.on_change()
    wait = min(b.cfg.breaker_cooldown_s - (b.clock() - b.opened_at) for b in refusing)
    why = f"circuit breaker {refusing[0].state}: {refusing[0].reason}" if len(refusing) == 1 \
        else "; ".join(f"{b.name} {b.state}: {b.reason}" for b in refusing)
    return ApiError(503, f"the engine is failing, so surge refuses new requests for now ({why})",
                    retry_after=float(max(1, math.ceil(wait))))


class Ticket:
    """A new request's way through the breakers: the breaker whose probe it became, if it did
    (Breakers.take), told how it ended."""

    def __init__(self) -> None:
        self.probe: Breaker | None = None

    def finished(self, ok: bool | None) -> None:
        if self.probe is not None:
            self.probe.finished(ok)
            self.probe = None


class Breakers:
    """One breaker a replica. A new request may go to a replica whose breaker is closed, or
    half-open with a probe slot free (then it is a probe); refused only when no replica
    takes it."""

    def __init__(self, cfg: OverloadConfig, replicas: int,
                 on_change: Callable[[int], None] = lambda replica: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """on_change(replica): after each of that replica's breaker's moves and rejections."""
        self.each = [Breaker(cfg, lambda r=r: self._changed(r, on_change), clock,
                             r if replicas > 1 else None) for r in range(replicas)]
        metrics.breaker_state.set(0)
        for state in _STATES:
            metrics.breaker_transitions.labels(state)

    def _changed(self, replica: int, on_change: Callable[[int], None]) -> None:
        # The gauge is the server's: open only while every replica's breaker is.
        metrics.breaker_state.set(min(_STATES[b.state] for b in self.each))
        on_change(replica)

    def taking(self) -> list[int]:
        """The replicas that take a new request now, or the 503 that refuses it."""
        if replicas := [r for r, b in enumerate(self.each) if b.takes()]:
            return replicas
        raise refusal(self.each)

    def take(self, replica: int, ticket: Ticket) -> None:
        """The request goes to replica (one of taking()'s): as its probe where it is
        half-open."""
        breaker = self.each[replica]
        if breaker.takes() == "probe":
            breaker.probes += 1
            ticket.probe = breaker

    def failure(self, replica: int, reason: str) -> None:
        self.each[replica].failure(reason)

    def configure(self, cfg: OverloadConfig) -> None:
        for b in self.each:
            b.configure(cfg)
