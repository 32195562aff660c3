"""Two data-parallel replicas behind one frontend (the real `surge serve` on the CPU, one core
each): prefix affinity, even spread, a tenant's rate limit over both, pools kept apart and
changed live, and a killed replica's requests finishing while the other serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from surge.admin import ask
from tests.server import ServerProcess
from tests.test_shutdown import _streams, _workers

pytestmark = pytest.mark.slow
PREFIX = list(range(1000, 1512))  # 512 tokens: 32 blocks of 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    config = root / "surge.toml"
    config.write_text("[routing]\nroute_balance_margin = 4\n")
    env = {"XDG_RUNTIME_DIR": str(root)}
    server = ServerProcess("--device", "cpu", "--data-parallel-size", "2", "--config",
                           str(config), "--max-num-seqs", "8", env=env,
                           kv_cache_memory="64MiB").wait_ready()
    server.root = str(root)
    server.config = config
    yield server
    assert server.stop() == 0


def _admin(server: ServerProcess, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "surge.cli", "admin", *args], check=True,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_RUNTIME_DIR": server.root}).stdout


def _replicas(server: ServerProcess) -> list[dict]:
    """Each replica's /stats, once both have reported since the last request ended."""
    time.sleep(1.2)  # a scheduler reports about once a second
    with urllib.request.urlopen(f"{server.url}/stats", timeout=10) as r:
        return json.load(r)["replicas"]


def _queried(server: ServerProcess) -> list[int]:
    return [r["prefix_queried_tokens"] for r in _replicas(server)]


def _complete(server: ServerProcess, tokens: list[int], max_tokens: int = 2,
              **extra: object) -> int:
    status, _ = server.post("/v1/completions", {"prompt": tokens, "max_tokens": max_tokens,
                                                "temperature": 0, **extra})
    return status


def _many(server: ServerProcess, prompts: list[list[int]], workers: int = 4,
          **extra: object) -> list[int]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda p: _complete(server, p, **extra), prompts))


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(server):
    before = _replicas(server)
    assert _complete(server, PREFIX + [7]) == 200  # one replica computes the prefix...
    assert _many(server, [PREFIX + [8, i] for i in range(7)]) == [200] * 7  # ...then reuses
    after = _replicas(server)
    queried = [a["prefix_queried_tokens"] - b["prefix_queried_tokens"]
               for a, b in zip(after, before, strict=True)]
    hits = [a["prefix_hit_tokens"] - b["prefix_hit_tokens"]
            for a, b in zip(after, before, strict=True)]
    holder = queried.index(max(queried))
    assert queried[1 - holder] == 0, queried  # all eight on one replica
    # As on a single replica: every request after the first finds the whole prefix cached.
    assert hits[holder] == 7 * 512, hits


def test_unrelated_requests_spread_evenly(server):
    before = _queried(server)
    prompts = [[2000 + 100 * i + k for k in range(64)] for i in range(8)]
    assert _many(server, prompts) == [200] * 8
    per = [(a - b) // 64 for a, b in zip(_queried(server), before, strict=True)]
    assert sum(per) == 8 and abs(per[0] - per[1]) <= 2, per


def test_a_tenants_rate_limit_holds_across_replicas(server):
    _admin(server, "set", "tenants.default.requests_per_min=6")
    try:
        statuses = _many(server, [[3000 + i] * 20 for i in range(12)])
    finally:
        _admin(server, "set", "tenants.default.requests_per_min=0")
    # One budget over both replicas, not 6 on each (a slow machine refills one or two).
    assert statuses.count(200) <= 8 and statuses.count(429) >= 4, statuses


def test_pools_keep_batch_traffic_off_the_interactive_replica_and_change_live(server):
    _admin(server, "set", "pools.interactive.replicas=0", "pools.interactive.max_priority=0",
           "pools.batch.replicas=1", "pools.batch.min_priority=1")
    try:
        before = _queried(server)
        prompts = [[4000 + 100 * i + k for k in range(32)] for i in range(6)]
        assert _many(server, prompts, priority=100) == [200] * 6  # batch-class priority
        after = _queried(server)
        assert after[0] == before[0] and after[1] - before[1] == 6 * 32
        assert _many(server, prompts[:3], priority=0) == [200] * 3
        assert _queried(server)[1] == after[1]  # interactive stays on replica 0
        # Live: the batch pool no longer serves priority 100, and nobody takes its overflow.
        _admin(server, "set", "pools.batch.min_priority=200")
        status, body = server.post("/v1/completions", {"prompt": [5] * 8, "max_tokens": 1,
                                                       "priority": 100})
        assert status == 503 and "no replica serves priority 100" in \
            body["error"]["message"], body
        _admin(server, "set", "pools.interactive.spill_from=*")
        assert _complete(server, [6] * 8, priority=100) == 200
    finally:  # both pools serve everything again
        _admin(server, "set", "pools.interactive.max_priority=2147483647",
               "pools.batch.min_priority=-2147483648")


def test_admin_stats_and_metrics_show_each_replica(server):
    out = _admin(server, "stats")
    assert "replica 0" in out and "replica 1" in out, out
    model = {"model_name": "SmolLM2-135M-Instruct"}
    for replica in ("0", "1"):
        assert server.metric("surge_kv_cache_blocks", **model, replica=replica) > 0
        assert server.metric("surge_prefix_cache_queried_tokens_total", **model,
                             replica=replica) > 0


def test_a_reload_reaches_every_replica(server):
    server.config.write_text("[routing]\nroute_balance_margin = 6\n")
    _admin(server, "reload")
    deadline = time.monotonic() + 30
    for address in ("admin", "admin-1"):  # each scheduler holds it
        while (got := ask(f"ipc://{_runtime_dir(server)}/{address}", "get").values
               ["route_balance_margin"]) != 6:
            assert time.monotonic() < deadline, (address, got)
            time.sleep(0.5)


def _runtime_dir(server: ServerProcess) -> str:
    (found,) = [p for p in os.listdir(server.root) if p.startswith("surge-")]
    return os.path.join(server.root, found)


def _health(server: ServerProcess) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        return json.load(r)


def test_a_killed_replicas_requests_finish_while_the_other_serves(server):
    # One death opens a replica's circuit breaker, for the rest of the test.
    _admin(server, "set", "breaker_failures=1", "breaker_cooldown_s=600")
    workers = _workers(server)
    assert set(workers) == {"surge: worker 0.0", "surge: worker 1.0"}, workers
    results = _streams(server, 6, 24, kill=workers["surge: worker 1.0"])
    assert all(len(text) > 0 for text, _ in results)  # every stream finished
    # The other replica kept serving meanwhile (its worker was never replaced).
    after = _workers(server)
    assert after["surge: worker 0.0"] == workers["surge: worker 0.0"]
    # Replica 1's breaker is open: new work goes to replica 0, and the server is degraded,
    # not down (one breaker for the server refused everything).
    health = _health(server)
    assert health["status"] == "degraded" and \
        "replica 1: circuit breaker open" in health["reason"], health
    # surge admin stats: replica 1's breaker on its line; the server's is closed.
    deadline = time.monotonic() + 10
    while "replica 1" not in (stats := _admin(server, "stats")) or \
            "breaker open" not in stats.split("replica 1", 1)[1].splitlines()[0]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)
    assert "overload     breaker closed" in stats
    before = _queried(server)
    assert [_complete(server, [9 + i] * 20) for i in range(4)] == [200] * 4
    after = _queried(server)
    assert after[1] == before[1] and after[0] - before[0] == 4 * 20
    _admin(server, "set", "breaker_failures=0")  # switched off: replica 1 serves again
    assert _health(server)["status"] == "ok"


def test_a_worker_dying_while_idle_is_noticed_before_any_request(server):
    _admin(server, "set", "breaker_failures=1")
    try:
        os.kill(_workers(server)["surge: worker 0.0"], signal.SIGKILL)
        # Nothing in flight: the scheduler hears of it at once (its breaker opens), rather
        # than on the first step planned after it, which it would blame for the death.
        deadline = time.monotonic() + 10
        while "replica 0: circuit breaker open" not in _health(server).get("reason", ""):
            assert time.monotonic() < deadline, _health(server)
            time.sleep(0.2)
        assert [_complete(server, [40 + i] * 20) for i in range(3)] == [200] * 3
    finally:
        _admin(server, "set", "breaker_failures=0")
