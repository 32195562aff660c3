"""Autoscaling signals: the Holt-Winters forecast, the capacity meter, and both as a running
server exports them (/metrics, `surge admin capacity`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from scheduler.signals import HoltWinters, Signals
from surge.config import AutoscaleConfig
from tests.server import ServerProcess


def _daily(step: int, period: int) -> float:
    """Requests a second over a day of `period` steps: quiet nights, a midday peak, and 2%
    growth a day."""
    return (20 + 15 * math.sin(2 * math.pi * step / period)) * (1 + 0.02 * step / period)


def test_forecast_sees_the_peak_coming() -> None:
    period = 48
    model = HoltWinters(period, alpha=0.3, beta=0.05, gamma=0.3)
    for step in range(4 * period):
        model.observe(_daily(step, period))
    now = 4 * period
    for ahead in (1, 6, 12):
        expected = _daily(now - 1 + ahead, period)
        assert abs(model.predict(ahead) - expected) < 0.1 * expected, ahead
    # A quarter day before the peak the forecast already asks for the peak's capacity,
    # where the last value (what a reactive scaler sees) is far below it.
    assert model.predict(12) > 1.4 * _daily(now - 1, period)


def test_forecast_follows_a_trend_without_a_season() -> None:
    model = HoltWinters(0, alpha=0.5, beta=0.3, gamma=0.0)
    for step in range(60):
        model.observe(2.0 + 0.5 * step)
    assert model.predict(10) == pytest.approx(2.0 + 0.5 * 69, rel=0.02)
    assert HoltWinters(0, 0.5, 0.3, 0).predict(5) == 0.0  # nothing seen: nothing forecast


def test_signals_measure_arrivals_and_capacity() -> None:
    cfg = AutoscaleConfig(forecast_interval_s=5, forecast_season_s=0, capacity_window_s=60)
    signals = Signals(cfg, now=0.0)
    arrived = generated = finished = 0
    for second in range(1, 41):
        arrived += 3
        fast = second <= 20  # 100 tokens/s, then 20
        generated += 100 if fast else 20
        finished += 2 if fast else 1
        signals.update(float(second), arrived, generated, finished)
    assert signals.arrival_rate == pytest.approx(3.0)
    assert signals.predictions()["300"] == pytest.approx(3.0, rel=0.05)
    assert signals.capacity_tokens_s == pytest.approx(100.0)
    assert signals.capacity_requests_s == pytest.approx(2.0)
    signals.update(200.0, arrived, generated, finished)  # idle long past the window
    assert signals.arrival_rate == 0.0
    assert signals.capacity_tokens_s == 0.0


def _metrics(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for line in lines if line.startswith("surge_")
            for name, value in [line.rsplit(" ", 1)]}


def test_server_exports_the_signals() -> None:
    server = ServerProcess("--forecast-interval-s", "2", "--forecast-season-s", "0",
                           dtype="bfloat16").wait_ready()
    try:
        body = {"prompt": "Count:", "max_tokens": 8, "ignore_eos": True}
        done = threading.Event()

        def load() -> None:
            while not done.is_set():
                assert server.post("/v1/completions", body)[0] == 200

        with ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(load) for _ in range(4)]
            deadline = time.monotonic() + 120
            arrivals = 0.0  # the most seen: a slow machine may have intervals without any
            while True:  # until a 10 s span with finished requests has closed
                time.sleep(1)
                metrics = _metrics(server)
                arrivals = max(arrivals, metrics["surge_arrival_rate"])
                if (metrics["surge_capacity_requests_per_second"] > 0 and arrivals > 0) or \
                        time.monotonic() > deadline:
                    break
            done.set()
            for client in clients:
                client.result()
        assert metrics["surge_capacity_tokens_per_second"] > 0
        assert metrics["surge_capacity_requests_per_second"] > 0
        assert arrivals > 0
        assert metrics['surge_forecast_arrival_rate{horizon_s="300"}'] > 0
        assert "surge_queue_drain_seconds" in metrics
        admin = [sys.executable, "-m", "surge.cli", "admin", "capacity", "--port",
                 str(server.port)]
        values = json.loads(subprocess.run([*admin, "--json"], capture_output=True, text=True,
                                           check=True).stdout)
        assert values["capacity_tokens_s"] > 0 and values["waiting"] == 0
        assert set(values["forecast"]) == {"60", "300", "900"}
        text = subprocess.run(admin, capture_output=True, text=True, check=True).stdout
        assert "tokens/s" in text and "forecast" in text and "in 5 min" in text
    finally:
        server.stop()
