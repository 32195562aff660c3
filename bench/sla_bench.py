"""Interactive latency under a batch flood, on the real server.

Tenant A (batch, priority 10) keeps --flood streams busy (64 prompt tokens, 128 out); tenant B
(interactive, priority 0) sends --probes short requests one at a time, --gap seconds apart.
B's TTFT on the idle server is measured first, then while A saturates it, with the server's
throughput over that window (B's tokens are a sliver of it). Run once per --policy given
(priority vs fcfs shows what the classes buy).

Usage: .venv/bin/python -m bench.sla_bench [--policy priority fcfs] [--flood 64] [-- server args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

from surge.bench import engine_stats
from surge.keys import KeyStore
from surge.loadgen import Result, closed_loop, percentiles, send
from tests.server import ServerProcess

_PROBE = {"prompt": "Answer in one short sentence: what is the capital of France, and which "
                    "river runs through it?", "max_tokens": 16, "temperature": 0}
_BATCH = {"prompt": "Write a long, detailed story about a lighthouse keeper who finds a message "
                    "in a bottle. " * 3, "max_tokens": 128, "ignore_eos": True}


async def _probes(url: str, key: str, count: int, gap_s: float) -> list[Result]:
    import aiohttp

    results = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        for _ in range(count):
            results.append(await send(session, url, _PROBE))
            await asyncio.sleep(gap_s)
    return results


async def _loaded(url: str, keys: dict[str, str], flood: int, probes: int, gap_s: float
                  ) -> tuple[list[Result], dict]:
    """B's probes while A's flood runs; (B's results, the server's figures over them)."""
    stop = asyncio.Event()

    async def batch_client() -> None:
        while not stop.is_set():
            await closed_loop(url, [_BATCH], 1, {"Authorization": f"Bearer {keys['a']}"})

    flooders = [asyncio.create_task(batch_client()) for _ in range(flood)]
    await asyncio.sleep(8)  # let the flood fill the batch
    before = engine_stats(url)
    started = time.monotonic()
    results = await _probes(url, keys["b"], probes, gap_s)
    # Stats come about once a second: wait (briefly, the flood paused) for a fresh one.
    after = engine_stats(url, after=before["time"] + time.monotonic() - started)
    stop.set()
    await asyncio.gather(*flooders)
    span = max(after["time"] - before["time"], 1e-9)
    steps = max(after["steps"] - before["steps"], 1)
    window = {"tok_s": (after["generated_tokens"] - before["generated_tokens"]) / span,
              "step_ms": (after["worker_compute_s"] - before["worker_compute_s"]) / steps * 1e3,
              "tokens_per_step": (after["scheduled_tokens"] - before["scheduled_tokens"]) / steps,
              "preemptions": after["preemptions"] - before["preemptions"]}
    return results, window


def measure(policy: str, opts: argparse.Namespace, extra: list[str]) -> dict:
    root = tempfile.mkdtemp(prefix="surge-sla-")
    keys = KeyStore(os.path.join(root, "keys.json"))
    found = {"a": keys.add("batch")[1], "b": keys.add("interactive")[1]}
    config = os.path.join(root, "surge.toml")
    with open(config, "w") as f:
        f.write("[tenants.batch]\npriority = 10\n[tenants.interactive]\npriority = 0\n")
    server = ServerProcess("--config", config, "--api-keys-file", keys.path, "--policy", policy,
                           *extra, dtype=opts.dtype, kv_cache_memory="2GiB").wait_ready()
    try:
        asyncio.run(_probes(server.url, found["b"], 3, 0))  # warm up
        idle = asyncio.run(_probes(server.url, found["b"], opts.probes, opts.gap))
        loaded, window = asyncio.run(_loaded(server.url, found, opts.flood, opts.probes,
                                           opts.gap))
    finally:
        server.stop()
    errors = [r.error for r in idle + loaded if r.error]
    calm = percentiles([r.ttft for r in idle if not r.error])
    busy = percentiles([r.ttft for r in loaded if not r.error])
    return {"policy": policy, "idle_ttft_p50_ms": calm["p50"], "idle_ttft_p95_ms": calm["p95"],
            "loaded_ttft_p50_ms": busy["p50"], "loaded_ttft_p95_ms": busy["p95"],
            "p95_ratio": busy["p95"] / calm["p95"],
            **window, "errors": len(errors)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", nargs="+", default=["priority", "fcfs"])
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--gap", type=float, default=0.25)
    parser.add_argument("--dtype", default="auto")
    opts, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for policy in opts.policy:
        row = measure(policy, opts, extra)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
    print(f"server args: {' '.join(extra) or '(defaults)'}; load average "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
