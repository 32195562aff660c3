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

from surge.config_load import load_config
from tests.server import ServerProcess


def _admin(env: dict, port: int, *args: str) -> tuple[int, dict | str]:
    out = subprocess.run([sys.executable, "-m", "surge.cli", "admin", "--port", str(port),
                          "--json", *args], capture_output=True, text=True, env=env, timeout=60)
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
    server = ServerProcess("--config", str(config), env={"XDG_RUNTIME_DIR": str(tmp_path),
                                                         "SURGE_PRIORITY_AGING_S": "5"})
    server.wait_ready()
    port = server.port
    try:
        code, got = _admin(env, port, "get")
        assert code == 0 and got["values"]["max_num_seqs"] == 64
        assert got["values"]["kernel_backend"] == "cpu kernels (auto on cpu)"
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
        # (--persist before the pairs: argparse alone would stop taking them at the flag)
        code, reply = _admin(env, port, "set", "--persist", "max_num_seqs=1")
        assert code == 0 and reply["values"]["max_num_seqs"] == 1
        (a_first, a_end), (b_first, b_end) = _two_requests_at_once(server.url)
        assert b_first >= a_end - 0.05
        assert tomllib.loads(config.read_text())["scheduler"]["max_num_seqs"] == 1
        # A key a SURGE_* variable sets too: written, with a note that the variable wins.
        noted = _admin_text(env, port, "set", "--persist", "priority_aging_s=7")
        assert noted.returncode == 0 and "note: priority_aging_s is also set by " \
            "SURGE_PRIORITY_AGING_S, which beats the config file" in noted.stderr, noted.stderr
        # A config file this user may not write (here: a folder in its place, which root
        # cannot write either): refused before anything is applied, naming the file.
        kept = config.read_bytes()
        config.unlink()
        config.mkdir()
        try:
            code, reply = _admin(env, port, "set", "--persist", "max_num_seqs=2")
            assert code == 2 and "cannot write the server's config file" in reply, reply
            assert str(config) in reply and "nothing was changed" in reply
            assert _admin(env, port, "get")[1]["values"]["max_num_seqs"] == 1
        finally:
            config.rmdir()
            config.write_bytes(kept)
        # reload re-reads the file (as SIGHUP does): what it says replaces every live edit,
        # a tenant set live and not persisted included.
        assert _admin(env, port, "set", "tenants.passing.weight=3")[0] == 0
        config.write_text("[scheduler]\nmax_num_seqs = 5\nbatch_wait_ms = 3\n"
                          "block_size = 32\n[tenants.kept]\nweight = 2\n")
        # It waits for the outcome: applied when it returns, naming what changed and what
        # only a restart applies.
        code, said = _admin(env, port, "reload")
        assert code == 0 and said.startswith("reloaded: ") and "max_num_seqs" in said, said
        # (undone live edits too: the passing tenant set above, which the file does not have)
        assert "tenants.passing.weight" in said and "kernel_backend" not in said, said
        assert "not applied, as only a restart does: block_size" in said
        values = _admin(env, port, "get")[1]["values"]
        assert values["max_num_seqs"] == 5
        assert values["batch_wait_ms"] == 3 and values["tenants.kept.weight"] == 2
        assert not any(k.startswith("tenants.passing.") for k in values), values
        # A file the server refuses: the reload says so (it used to report success).
        config.write_text("[scheduler]\nmax_num_seqs = 7\n[scheduler]\nmax_num_seqs = 8\n")
        code, said = _admin(env, port, "reload")
        assert code == 1 and "reload refused, nothing changed" in said, said
        assert _admin(env, port, "get")[1]["values"]["max_num_seqs"] == 5
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


def _admin_text(env: dict, port: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surge.cli", "admin", "--port", str(port),
                           *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.slow
def test_admin_table_errors_persist_and_top(tmp_path):
    import os

    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    server = ServerProcess(env={"XDG_RUNTIME_DIR": str(tmp_path)}).wait_ready()
    try:
        # get: an aligned table for people (--json for scripts).
        table = _admin_text(env, server.port, "get")
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()
        assert header.split() == ["NAME", "VALUE", "SECTION"]
        row = next(r for r in rows if r.startswith("max_num_seqs "))
        assert row.split() == ["max_num_seqs", "128", "scheduler"]
        assert row.index("128") == header.index("VALUE")
        assert len({r.rstrip().rindex(" ") for r in rows}) == 1  # SECTION aligned too
        # get NAME ...: those only; an unknown one is named.
        one = _admin_text(env, server.port, "get", "max_num_seqs", "policy")
        assert one.returncode == 0 and [r.split()[0] for r in one.stdout.splitlines()] == \
            ["NAME", "max_num_seqs", "policy"], one
        unknown = _admin_text(env, server.port, "get", "max_num_seq")
        assert unknown.returncode == 2 and "no live parameter max_num_seq" in unknown.stderr
        # A refused set: one line with the reason, nothing on stdout.
        bad = _admin_text(env, server.port, "set", "max_num_seqs=0")
        assert bad.returncode == 1 and not bad.stdout
        assert bad.stderr.count("\n") == 1 and "max_num_seqs" in bad.stderr
        assert bad.stderr.startswith("surge admin: set refused, nothing changed: ")
        # --persist without a config file fails before anything is applied.
        persist = _admin_text(env, server.port, "set", "max_num_seqs=3", "--persist")
        assert persist.returncode == 2 and "--persist needs" in persist.stderr
        assert _admin(env, server.port, "get")[1]["values"]["max_num_seqs"] == 128
        ok = _admin_text(env, server.port, "set", "max_num_seqs=64")
        assert ok.returncode == 0 and ok.stdout.splitlines()[-1].split() == \
            ["max_num_seqs", "64", "scheduler"]
        _two_requests_at_once(server.url)
        top = _admin_text(env, server.port, "top", "--iterations", "2")
        assert top.returncode == 0, top.stderr
        frames = [f for f in top.stdout.split("\n\n") if f.strip()]
        assert len(frames) == 2 and all(f.startswith("surge top  ") for f in frames)
        # The first screen: latencies since the server started (the two requests).
        lines = frames[0].splitlines()
        assert lines[2] == "tokens/s   - generated   - steps/s"
        assert lines[4].startswith("latency since the server started")
        assert re.match(r"  TTFT +\d+\.\d{3} s +\d+\.\d{3} s +\d+\.\d{3} s", lines[5]), lines
        # The next: rates and latencies over the seconds top has watched (idle ones).
        lines = frames[1].splitlines()
        assert lines[1].startswith("requests   0 running   0 waiting")
        assert re.match(r"tokens/s   \d+\.\d generated   \d+\.\d steps/s", lines[2]), lines
        assert lines[3].startswith("KV cache   0 / 364 blocks (0%)   prefix hit rate ")
        assert lines[4].startswith("latency, last ")
        assert lines[5].split() == ["TTFT", "no", "requests"]
    finally:
        server.stop()


def test_top_frame_counts_the_last_minute_only():
    from collections import deque

    from surge.admin_top import Sample, frame

    stats = {"running": 2, "waiting": 1, "queued_tokens": 40, "generated_tokens": 100,
             "steps": 10, "kv_blocks_used": 91, "kv_blocks_total": 364,
             "prefix_queried_tokens": 100, "prefix_hit_tokens": 20, "preemptions": 0}
    old = {"surge_time_to_first_token_seconds": [(0.1, 50.0), (1.0, 50.0), (float("inf"), 50.0)]}
    # Since the first sample: 10 more requests, all between 0.1 s and 1 s.
    new = {"surge_time_to_first_token_seconds": [(0.1, 50.0), (1.0, 60.0), (float("inf"), 60.0)]}
    window = deque([Sample(0.0, stats, old), Sample(2.0, {**stats, "generated_tokens": 150,
                                                           "steps": 14,
                                                           "prefix_queried_tokens": 200,
                                                           "prefix_hit_tokens": 95}, new)])
    lines = frame("http://x", window).splitlines()
    assert lines[1] == "requests   2 running   1 waiting   40 queued prompt tokens"
    assert lines[2] == "tokens/s   25.0 generated   2.0 steps/s"
    assert lines[3] == "KV cache   91 / 364 blocks (25%)   prefix hit rate 75.0%   preemptions 0"
    assert lines[4].startswith("latency, last 2s")
    assert lines[5].split() == ["TTFT", "0.550", "s", "0.955", "s", "0.991", "s"]
    assert lines[6].split() == ["inter-token", "no", "requests"]


def test_quantiles_from_cumulative_buckets():
    from surge.admin import quantile

    buckets = [(0.1, 2.0), (0.5, 8.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * 3 / 6)
    assert quantile(buckets, 0.95) == pytest.approx(0.5 + 0.5 * 1.5 / 2)
    assert quantile([], 0.5) is None


def test_persist_writes_scheduler_values_and_tenant_tables(tmp_path):
    from surge.admin import _persist
    from surge.config_load import load_config

    config = tmp_path / "surge.toml"
    config.write_text('# operator notes\n[server]\nport = 9001  # our port\n'
                      '[tenants.batch]\npriority = 10\n[tenants.default]\nmax_concurrent = 4\n'
                      'webhook_urls = "https://hooks.example/default"\n')
    (tmp_path / "config").write_text(str(config))
    _persist(str(tmp_path), {"tenants.batch.weight": 3.0, "tenants.new.max_queued": 5,
                             "max_num_seqs": 2, "policy": "sjf"})
    cfg = load_config({"config": str(config)}, {})
    assert cfg.server.port == 9001 and cfg.scheduler.max_num_seqs == 2
    assert cfg.scheduler.policy == "sjf"
    assert cfg.tenants["batch"].weight == 3 and cfg.tenants["batch"].priority == 10
    assert cfg.tenants["new"].max_queued == 5
    # A new table starts from [tenants.default]'s, as the server made it: the same after a restart.
    assert cfg.tenants["new"].max_concurrent == 4 and cfg.tenants["batch"].max_concurrent == 0
    assert cfg.tenants["new"].webhook_urls == ""  # its webhooks are its own
    _persist(str(tmp_path), {"tenants.batch.min_priority": -3})
    assert load_config({"config": str(config)}, {}).tenants["batch"].min_priority == -3
    _persist(str(tmp_path), {"tenants.batch.min_priority": None})  # `set ...=none`
    assert load_config({"config": str(config)}, {}).tenants["batch"].min_priority is None
    text = config.read_text()  # the rest of the file as it was
    assert text.startswith("# operator notes\n[server]\nport = 9001  # our port\n"), text


def test_set_takes_flag_spellings_but_keeps_tenant_names():
    from surge.admin import _pairs

    assert _pairs(["max-num-seqs=3", "tenants.team-a.max-queued=5", "pools.gpu-0.weight=2"]) == {
        "max_num_seqs": "3", "tenants.team-a.max_queued": "5", "pools.gpu-0.weight": "2"}
    # A live parameter may be written after its section, as the TOML file has it.
    assert _pairs(["scheduler.max_num_seqs=2", "overload.breaker-probes=1"]) == {
        "max_num_seqs": "2", "breaker_probes": "1"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _pairs(["max_num_seqs"])


def test_set_of_an_option_that_is_not_live_says_it_needs_a_restart():
    from scheduler.admin import updated

    cfg = load_config({}, {})
    for key in ("port", "block_size", "max_body_bytes", "max_worker_restarts"):
        assert updated(cfg, {key: "1"}).startswith(f"{key} needs a restart"), key
    assert updated(cfg, {"frobnicate": "1"}).startswith("frobnicate is not a parameter")
