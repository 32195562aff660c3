"""Signals for autoscalers: the rate a node served at its best lately (its capacity), and the
arrival rate forecast minutes ahead (Holt-Winters with a daily season), so that a deployment
can add nodes before a peak rather than during it."""

from __future__ import annotations

import math
from collections import deque

from surge.config import AutoscaleConfig

# Horizons of the published forecast, in seconds.
HORIZONS_S = (60, 300, 900)
# Capacity is measured over spans this long: shorter ones would read a burst as capacity.
_SPAN_S = 10.0


class HoltWinters:
    """Additive Holt-Winters over equally spaced values, with a season of `period` values
    (0: level and trend only). The first season is collected whole and read as the season's
    shape around its mean (the classic start); until then the forecast is level and trend."""

    def __init__(self, period: int, alpha: float, beta: float, gamma: float) -> None:
        self.period, self.alpha, self.beta, self.gamma = period, alpha, beta, gamma
        self.level: float | None = None
        self.trend = 0.0
        self.season: list[float] = []
        self.first: list[float] = []  # the first season's values
        self.count = 0

    def observe(self, value: float) -> None:
        index = self.count % self.period if self.period else 0
        shift = self.season[index] if self.season else 0.0
        if self.level is None:
            self.level = value
        else:
            last = self.level
            self.level = self.alpha * (value - shift) + (1 - self.alpha) * (last + self.trend)
            self.trend = self.beta * (self.level - last) + (1 - self.beta) * self.trend
        if self.season:
            self.season[index] = self.gamma * (value - self.level) + (1 - self.gamma) * shift
        elif self.period:
            self.first.append(value)
            if len(self.first) == self.period:
                mean = sum(self.first) / self.period
                self.season = [v - mean for v in self.first]
                # The trend learnt so far is the season's own slope, not growth.
                self.level, self.trend = mean, 0.0
                self.first = []
        self.count += 1

    def predict(self, ahead: int) -> float:
        """The value expected `ahead` values from now (1: the next one); never negative."""
        if self.level is None:
            return 0.0
        shift = self.season[(self.count + ahead - 1) % self.period] if self.season else 0.0
        return max(0.0, self.level + ahead * self.trend + shift)


class Signals:
    def __init__(self, cfg: AutoscaleConfig, now: float) -> None:
        self.cfg = cfg
        period = round(cfg.forecast_season_s / cfg.forecast_interval_s)
        self.forecast = HoltWinters(period, cfg.forecast_alpha, cfg.forecast_beta,
                                    cfg.forecast_gamma)
        self.arrival_rate = 0.0  # requests a second over the last closed interval
        self.capacity_tokens_s = 0.0
        self.capacity_requests_s = 0.0
        self._interval = (now, 0)  # the open interval's start, and arrivals before it
        self._span = (now, 0, 0)  # the open span's start, generated and finished before it
        self._spans: deque[tuple[float, float, float]] = deque()  # (end, tokens/s, requests/s)

    def update(self, now: float, arrived: int, generated: int, finished: int) -> None:
        """Totals since start: requests arrived, tokens generated, requests finished."""
        interval_s = self.cfg.forecast_interval_s
        start, before = self._interval
        while now - start >= interval_s:  # an idle spell closes several intervals, all but
            self.arrival_rate = (arrived - before) / interval_s  # the first of them empty
            self.forecast.observe(self.arrival_rate)
            start, before = start + interval_s, arrived
        self._interval = (start, before)
        began, tokens, requests = self._span
        if now - began >= _SPAN_S:
            span_s = now - began
            self._spans.append((now, (generated - tokens) / span_s, (finished - requests) / span_s))
            self._span = (now, generated, finished)
            while self._spans[0][0] < now - self.cfg.capacity_window_s:
                self._spans.popleft()
            self.capacity_tokens_s = max(s[1] for s in self._spans)
            self.capacity_requests_s = max(s[2] for s in self._spans)

    def predictions(self) -> dict[str, float]:
        """The arrival rate (requests/s) expected at each horizon, by its seconds."""
        interval_s = self.cfg.forecast_interval_s
        return {str(h): self.forecast.predict(max(1, math.ceil(h / interval_s)))
                for h in HORIZONS_S}
