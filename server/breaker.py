"""The circuit breaker: while the engine keeps failing (worker deaths), answer new requests at
once with 503 rather than queue them into failures; after a cool-down let a few probe
requests through (half-open), and close once they all succeed."""

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
                 clock: Callable[[], float] = time.monotonic) -> None:
        """on_change: called after every transition and rejection (the frontend tells the
        scheduler, for `surge admin stats`)."""
        self.cfg = cfg
        self.on_change = on_change
        self.clock = clock  # a fake one in the simulation tests
        self.state = "closed"
        self.reason = ""  # why it opened
        self.failures: deque[float] = deque()  # times of recent engine failures
        self.opened_at = 0.0
        self.probes = 0  # probe requests in flight (half-open)
        self.passed = 0  # probes that finished well since half-open
        self.rejected = 0
        metrics.breaker_state.set(0)
        for state in _STATES:
            metrics.breaker_transitions.labels(state)

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

    def admit(self) -> bool:
        """Let a new request through (True: as a probe, report it to finished()), or raise
        the 503 that refuses it."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cfg.breaker_cooldown_s:
            self._move("half-open", "the cool-down is over: trying probe requests")
        if self.state == "closed":
            return False
        if self.state == "half-open" and self.probes < self.cfg.breaker_probes:
            self.probes += 1
            return True
        self.rejected += 1
        metrics.breaker_rejected.inc()
        self.on_change()
        wait = self.cfg.breaker_cooldown_s - (self.clock() - self.opened_at)
        raise ApiError(503, f"the engine is failing, so surge refuses new requests for now "
                            f"(circuit breaker {self.state}: {self.reason})",
                       retry_after=float(max(1, math.ceil(wait))))

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
        metrics.breaker_state.set(_STATES[state])
        metrics.breaker_transitions.labels(state).inc()
        (log.error if state == "open" else log.warning)("circuit breaker %s: %s", state, why)
        self.on_change()
