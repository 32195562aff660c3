"""Scheduler benchmarks against the real server, each a ratio of two runs in one session.

  prefix   32 concurrent requests sharing a 512-token prefix (+32 unique tokens, 32 out):
           TTFT with the prefix cache on vs off (--no-prefix-cache).
  overlap  64 concurrent decodes (16 in, 128 out): the share of the worker's time spent
           waiting for the next plan, with overlapped steps on vs off (--no-async-scheduling).

Usage: .venv/bin/python -m bench.scheduler_bench prefix|overlap [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys

from surge.bench import engine_stats
from surge.loadgen import closed_loop, summarize
from tests.server import ServerProcess


def prefix_workload(rng: random.Random) -> tuple[list[dict], dict]:
    shared = [rng.randrange(100, 49000) for _ in range(512)]
    bodies = [{"prompt": shared + [rng.randrange(100, 49000) for _ in range(32)],
               "max_tokens": 32, "temperature": 0, "ignore_eos": True} for _ in range(32)]
    warmup = {"prompt": shared + [7], "max_tokens": 1, "temperature": 0}
    return bodies, warmup


def overlap_workload(rng: random.Random) -> tuple[list[dict], dict]:
    bodies = [{"prompt": [rng.randrange(100, 49000) for _ in range(16)], "max_tokens": 128,
               "temperature": 0, "ignore_eos": True} for _ in range(64)]
    return bodies, {"prompt": [5, 6, 7], "max_tokens": 2}


def measure(args: list[str], bodies: list[dict], warmup: dict, concurrency: int,
            dtype: str) -> dict:
    server = ServerProcess(*args, dtype=dtype, kv_cache_memory="2GiB").wait_ready()
    try:
        asyncio.run(closed_loop(server.url, [warmup], 1))
        before = engine_stats(server.url)
        results, wall = asyncio.run(closed_loop(server.url, bodies, concurrency))
        after = engine_stats(server.url, after=before["time"] + wall)
        full = summarize(results, wall)
        out = {"ttft_p50_ms": full["ttft_ms"]["p50"], "output_tok_s": full["output_tok_s"],
               "errors": full["requests"] - full["ok"]}
        compute = after["worker_compute_s"] - before["worker_compute_s"]
        wait = after["worker_wait_s"] - before["worker_wait_s"]
        out["worker_idle_share"] = wait / (wait + compute) if compute else float("nan")
        out["steps"] = after["steps"] - before["steps"]
        queried = after["prefix_queried_tokens"] - before["prefix_queried_tokens"]
        hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        out["prefix_hit_rate"] = hits / queried if queried else 0.0
        return out
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["prefix", "overlap"])
    parser.add_argument("--dtype", default="auto")
    opts = parser.parse_args()
    rng = random.Random(0)
    if opts.workload == "prefix":
        bodies, warmup = prefix_workload(rng)
        runs = {"cache on": [], "cache off": ["--no-prefix-cache"]}
        concurrency, key = 32, "ttft_p50_ms"
    else:
        bodies, warmup = overlap_workload(rng)
        runs = {"overlap on": [], "overlap off": ["--no-async-scheduling"]}
        concurrency, key = 64, "worker_idle_share"
    table = {}
    for label, args in runs.items():
        table[label] = measure(args, bodies, warmup, concurrency, opts.dtype)
        print(label, json.dumps({k: round(v, 4) for k, v in table[label].items()}), flush=True)
    a, b = table.values()
    print(f"{opts.workload}: {key} {list(runs)[1]} / {list(runs)[0]} = "
          f"{b[key] / a[key]:.2f}x; output tok/s {a['output_tok_s']:.0f} vs "
          f"{b['output_tok_s']:.0f}; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
