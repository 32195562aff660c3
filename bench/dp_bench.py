"""Data parallelism on the CPU: two replicas of one core each against one engine on both cores
(same run, one server at a time), and cache-aware routing against round robin.

1. Closed loop at --concurrency (64): output tokens/s and TTFT p50, DP=1 vs DP=2.
2. Shared prefixes (bench.scaleout_bench's workload: --groups system prompts of ~400 tokens,
   each used by --per-group requests one after another, the groups in parallel): TTFT p50 and
   the prefix hit rate, DP=1, DP=2 routed by prefix (route_prefix_blocks 32) and DP=2 with
   route_prefix_blocks 0 (no affinity: the least loaded replica, ties in turn, which for this
   workload is round robin).

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.dp_bench [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import urllib.request

from bench.scaleout_bench import _bodies, _shared_prefix
from surge.admin import ask_all
from surge.loadgen import closed_loop, summarize
from surge.runtime import admin_addresses, find_server
from tests.server import ServerProcess


def _server(replicas: int, max_num_seqs: int) -> ServerProcess:
    return ServerProcess("--device", "cpu", "--data-parallel-size", str(replicas),
                         "--max-num-seqs", str(max_num_seqs), dtype="bfloat16",
                         kv_cache_memory="256MiB").wait_ready()


def _prefix(server: ServerProcess) -> tuple[int, int]:
    """(hit, queried) prompt tokens over every replica."""
    with urllib.request.urlopen(f"{server.url}/stats", timeout=10) as r:
        stats = json.load(r)
    return stats["prefix_hit_tokens"], stats["prefix_queried_tokens"]


def _set(server: ServerProcess, **values: object) -> None:
    reply = ask_all(admin_addresses(find_server(server.port)), "set",
                    {k: str(v) for k, v in values.items()})
    assert reply.ok, reply.message


def _shared(server: ServerProcess, opts: argparse.Namespace, salt: str) -> dict:
    before = _prefix(server)
    summary = asyncio.run(_shared_prefix(server.url, opts.groups, opts.per_group, False, salt))
    after = _prefix(server)
    summary["prefix_hit_rate"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    opts = parser.parse_args()
    # The servers' runtime dirs go here, so the admin calls find them.
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="surge-dp-bench-")
    cores = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cores)  # DP=2: one core per replica's worker
    rng = random.Random(0)
    report: dict = {"cores": cores, "load_before": os.getloadavg()}
    for replicas in (1, 2):
        server = _server(replicas, max(opts.concurrency // replicas, 1))
        try:
            asyncio.run(closed_loop(server.url, _bodies(8, 4, rng), 8))  # first steps
            results, wall = asyncio.run(closed_loop(
                server.url, _bodies(opts.requests, opts.max_tokens, rng), opts.concurrency))
            report[f"c{opts.concurrency} DP={replicas}"] = summarize(results, wall)
            report[f"shared prefix DP={replicas}"] = _shared(server, opts, f"dp{replicas}")
            if replicas > 1:
                _set(server, route_prefix_blocks=0)
                report["shared prefix DP=2 round robin"] = _shared(server, opts, "rr")
        finally:
            server.stop()
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    short = {k: {m: v[m] for m in ("ok", "errors", "output_tok_s", "ttft_ms", "prefix_hit_rate")
                 if m in v} if isinstance(v, dict) else v for k, v in report.items()}
    print(json.dumps(short, indent=1))


if __name__ == "__main__":
    main()
