"""`surge admin`: get/set round trips change live behaviour, invalid sets change nothing,
--persist, reload (SIGHUP), stats, drain."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request

import pytest

from tests.server import ServerProcess


def _admin(env: dict, port: int, *args: str) -> tuple[int, dict | str]:
    out = subprocess.run([sys.executable, "-m", "surge.cli", "admin", "--port", str(port),
                          *args], capture_output=True, text=True, env=env, timeout=60)
    try:
        return out.returncode, json.loads(out.stdout.split("\nwritten to")[0])
    except json.JSONDecodeError:
        return out.returncode, out.stdout + out.stderr


def _two_requests_at_once(url: str) -> list[tuple[float, float]]:
    """(first token, end) times of two streamed requests started together."""
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * 2

    def one(i: int) -> None:
        body = json.dumps({"prompt": f"Story {i}:", "max_tokens": 24, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        first = 0.0
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {") and not first:
                    first = time.monotonic()
        spans[i] = (first, time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(spans)


@pytest.mark.slow
def test_admin_round_trip(tmp_path):
    import os

    config = tmp_path / "surge.toml"
    config.write_text("[scheduler]\nmax_num_seqs = 64\n")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    server = ServerProcess("--config", str(config), env={"XDG_RUNTIME_DIR": str(tmp_path)})
    server.wait_ready()
    port = server.port
    try:
        code, got = _admin(env, port, "get")
        assert code == 0 and got["values"]["max_num_seqs"] == 64
        assert got["values"]["kernel_backend"] == "reference kernels (auto on cpu)"
        # Invalid sets are refused whole and change nothing.
        for bad in (["max_num_seqs=0"], ["max_num_seqs=2", "block_size=32"],
                    ["max_num_seqs=many"], ["no_such_thing=1"]):
            code, reply = _admin(env, port, "set", *bad)
            assert code == 1 and not reply["ok"] and reply["message"], (bad, reply)
        assert _admin(env, port, "get")[1]["values"]["max_num_seqs"] == 64
        # Both requests run side by side...
        (a_first, a_end), (b_first, b_end) = _two_requests_at_once(server.url)
        assert b_first < a_end
        # ...until max_num_seqs=1 serialises them, live, without a restart.
        code, reply = _admin(env, port, "set", "max_num_seqs=1", "--persist")
        assert code == 0 and reply["values"]["max_num_seqs"] == 1
        (a_first, a_end), (b_first, b_end) = _two_requests_at_once(server.url)
        assert b_first >= a_end - 0.05
        assert tomllib.loads(config.read_text())["scheduler"]["max_num_seqs"] == 1
        # reload re-reads the file (as SIGHUP does).
        config.write_text("[scheduler]\nmax_num_seqs = 5\nbatch_wait_ms = 3\n")
        assert _admin(env, port, "reload")[0] == 0
        deadline = time.monotonic() + 10
        while _admin(env, port, "get")[1]["values"]["max_num_seqs"] != 5:
            assert time.monotonic() < deadline, "reload did not apply"
            time.sleep(0.2)
        assert _admin(env, port, "get")[1]["values"]["batch_wait_ms"] == 3
        code, screen = _admin(env, port, "stats")
        assert code == 0, screen
        lines = screen.splitlines()
        assert lines[0].startswith(f"surge at http://127.0.0.1:{port}: 0 running, 0 waiting")
        assert lines[2].startswith("KV cache     0 / 364 blocks")
        assert re.match(r"TTFT +p50 \d+\.\d+ s +p95 \d+\.\d+ s", lines[3]), screen
        assert _admin(env, port, "drain")[0] == 0
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_quantiles_from_cumulative_buckets():
    from surge.admin import quantile

    buckets = [(0.1, 2.0), (0.5, 8.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * 3 / 6)
    assert quantile(buckets, 0.95) == pytest.approx(0.5 + 0.5 * 1.5 / 2)
    assert quantile([], 0.5) is None


def test_persist_writes_scheduler_values_and_tenant_tables(tmp_path):
    from surge.admin import _persist
    from surge.config import load_config

    config = tmp_path / "surge.toml"
    config.write_text('[server]\nport = 9001\n[tenants.batch]\npriority = 10\n')
    (tmp_path / "config").write_text(str(config))
    _persist(str(tmp_path), {"tenants.batch.weight": 3.0, "tenants.new.max_queued": 5,
                             "max_num_seqs": 2, "policy": "sjf"})
    cfg = load_config({"config": str(config)}, {})
    assert cfg.server.port == 9001 and cfg.scheduler.max_num_seqs == 2
    assert cfg.scheduler.policy == "sjf"
    assert cfg.tenants["batch"].weight == 3 and cfg.tenants["batch"].priority == 10
    assert cfg.tenants["new"].max_queued == 5
