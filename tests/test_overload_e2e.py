"""Overload control through the real server: a worker that keeps crashing opens the circuit
breaker (503 in milliseconds, /health says why, probes close it again), and a real overload
of two tenants moves the degradation ladder (capped answers say so; /metrics and `surge admin
stats` show it; it steps back down once the load is gone)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from surge.keys import KeyStore
from tests.server import ServerProcess

pytestmark = pytest.mark.slow
CRASH_TOKEN = 49000  # a token no greedy answer here produces (see test_poison)


def _call(url: str, path: str, body: dict | None = None, key: str | None = None
          ) -> tuple[int, dict[str, str], dict]:
    """GET (or POST body): status, headers, JSON answer."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}{path}", data=data,
                                                           headers=headers), timeout=300) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def _metrics(url: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}
                                     if key else {})
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _admin(root: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "surge.cli", "admin", *args], check=True,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_RUNTIME_DIR": root}).stdout


def test_a_crashing_worker_opens_the_breaker_and_probes_close_it(tmp_path):
    root = str(tmp_path)
    (tmp_path / "surge.toml").write_text("[overload]\nbreaker_cooldown_s = 3\n"
                                         "breaker_probes = 1\n")
    server = ServerProcess("--config", str(tmp_path / "surge.toml"),
                           "--max-worker-restarts", "5",
                           env={"XDG_RUNTIME_DIR": root,
                                "SURGE_TEST_CRASH_TOKEN": str(CRASH_TOKEN)}).wait_ready()
    normal = {"prompt": "Count from 1:", "max_tokens": 4, "temperature": 0}
    try:
        # Live, and it reaches the frontend: two failures open it (the default is three).
        assert "breaker_failures" in _admin(root, "set", "breaker_failures=2")
        status, _, refused = _call(server.url, "/v1/completions",
                                   {"prompt": [1, 2, CRASH_TOKEN], "max_tokens": 4})
        assert status == 400, refused  # it crashed the worker twice (see test_poison)
        started = time.monotonic()
        status, headers, body = _call(server.url, "/v1/completions", normal)
        elapsed = time.monotonic() - started
        assert status == 503 and elapsed < 0.5, (status, elapsed, body)
        assert "circuit breaker open" in body["error"]["message"]
        assert 1 <= int(headers["Retry-After"]) <= 3
        status, _, health = _call(server.url, "/health")
        assert status == 503 and health["status"] == "unhealthy"
        assert "circuit breaker open: 2 engine failures" in health["reason"]
        assert "breaker open (1 refused)" in _admin(root, "stats")
        # After the cool-down one probe goes through (it waits for the restarted worker),
        # finishes, and closes the breaker.
        time.sleep(3)
        status, _, answer = _call(server.url, "/v1/completions", normal)
        assert status == 200, answer
        assert _call(server.url, "/health")[:3:2] == (200, {"status": "ok"})
        metrics = _metrics(server.url)
        moves = {state: metrics[("surge_breaker_transitions_total", (("state", state),))]
                 for state in ("open", "half-open", "closed")}
        assert moves == {"open": 1, "half-open": 1, "closed": 1}
        assert metrics[("surge_breaker_rejected_requests_total", ())] == 1
        assert metrics[("surge_breaker_state", ())] == 0
    finally:
        assert server.stop() == 0, server.output()
    log = server.output()
    assert "circuit breaker open: 2 engine failures" in log and "circuit breaker closed" in log


CONFIG = """
[tenants.batch]
degrade = "cap"
degrade_max_tokens = 3
[tenants.interactive]
weight = 4
[overload]
ttft_slo_s = 0.001
ladder_interval_s = 0.5
"""


def test_a_real_overload_moves_the_ladder_and_it_steps_back(tmp_path):
    """Any first token counts as congested here (a 1 ms TTFT SLO), so a burst of batch
    streams is an overload: the next batch request is capped, interactive is not, and the
    ladder steps back down once the burst is over."""
    root = str(tmp_path)
    (tmp_path / "surge.toml").write_text(CONFIG)
    store = KeyStore(str(tmp_path / "keys.json"))
    keys = {name: store.add(name)[1] for name in ("batch", "interactive", "admin")}
    server = ServerProcess("--config", str(tmp_path / "surge.toml"), "--api-keys-file",
                           store.path, env={"XDG_RUNTIME_DIR": root}).wait_ready()
    burst = {"prompt": "Write a story about a lighthouse.", "max_tokens": 8,
             "ignore_eos": True, "temperature": 0}
    ask = {"prompt": "Count from 1:", "max_tokens": 12, "ignore_eos": True, "temperature": 0}

    async def overload() -> tuple[list[tuple[int, dict, dict]], dict, dict, str]:
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            async def post(body: dict, key: str) -> tuple[int, dict, dict]:
                async with session.post(f"{server.url}/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status, dict(r.headers), await r.json()

            async def batch_client() -> None:  # new first tokens in every interval
                while not stop.is_set():
                    await post(burst, keys["batch"])

            flood = [asyncio.create_task(batch_client()) for _ in range(4)]
            await asyncio.sleep(2.0)  # the ladder has judged the first tokens by now
            capped = await asyncio.gather(post(ask, keys["batch"]),
                                          post(ask, keys["interactive"]))
            async with session.ws_connect(f"{server.url}/v1/stream", headers={
                    "Authorization": f"Bearer {keys['batch']}"}) as ws:
                await ws.send_json({"type": "request", "id": "w", "endpoint": "completions",
                                    "body": ask})
                while (frame := await ws.receive_json())["type"] != "done":
                    pass
            # Still overloaded: the metrics (exported once a second) and the admin's view.
            await asyncio.sleep(1.2)
            metrics = await asyncio.to_thread(_metrics, server.url, keys["admin"])
            stats = await asyncio.to_thread(_admin, root, "stats")
            stop.set()
            await asyncio.gather(*flood)
            return list(capped), frame, metrics, stats

    try:
        (batch, interactive), done, metrics, stats = asyncio.run(overload())
        # The load is gone: without first tokens the signal is calm, and nothing is asked.
        deadline = time.monotonic() + 30
        while _metrics(server.url, keys["admin"])[("surge_overload_level", ())] and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        after = _metrics(server.url, keys["admin"])
        status, headers, late = _call(server.url, "/v1/completions", ask, keys["batch"])
    finally:
        assert server.stop() == 0, server.output()
    assert batch[0] == 200 and batch[1]["X-Surge-Degraded"] == "max_tokens=3", batch
    assert batch[2]["usage"]["completion_tokens"] == 3
    assert batch[2]["choices"][0]["finish_reason"] == "length"
    assert interactive[0] == 200 and "X-Surge-Degraded" not in interactive[1]
    assert interactive[2]["usage"]["completion_tokens"] == 12
    assert done["degraded"] == "max_tokens=3" and done["usage"]["completion_tokens"] == 3
    assert metrics[("surge_overload_level", ())] >= 1
    assert metrics[("surge_degraded_requests_total",
                    (("action", "cap"), ("tenant", "batch")))] >= 2
    assert metrics[("surge_degraded_responses_total", (("model_name", "SmolLM2-135M-Instruct"),
                                                       ))] >= 1
    assert "degradation level 1" in stats, stats
    assert after[("surge_overload_level", ())] == 0
    assert status == 200 and "X-Surge-Degraded" not in headers
    assert late["usage"]["completion_tokens"] == 12
    log = server.output()
    assert "degradation step 1: cap tenant 'batch'" in log and "undone step 1" in log
