"""Two surge nodes behind nginx against one node directly (CPU, one core each, same run), and
prefix affinity against plain least connections on a shared-prefix workload.

1. Concurrency 32 (closed loop): output tokens/s and TTFT p50, one node directly vs two nodes
   through nginx (ops/nginx's template, rendered as tests/nginx.py does).
2. nginx's own cost: TTFT p50 of sequential requests, directly vs through nginx.
3. Shared prefixes: --groups system prompts of ~400 tokens, each used by --per-group requests
   (the groups in parallel, each group's requests one after another), through nginx with the
   group as X-Session-Id vs without it; prefix hit rate (both nodes' /stats) and TTFT p50.

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.scaleout_bench [--requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import urllib.request
from pathlib import Path

from surge.loadgen import closed_loop, summarize
from tests.nginx import NginxProcess
from tests.server import ServerProcess


def _node(core: int) -> ServerProcess:
    """A node on one core: its processes inherit the affinity set around their start."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return ServerProcess("--max-num-seqs", "32", dtype="bfloat16",
                             kv_cache_memory="256MiB")
    finally:
        os.sched_setaffinity(0, allowed)


def _prefix_stats(nodes: list[ServerProcess]) -> list[tuple[int, int]]:
    """(hit, queried) prompt tokens of each node."""
    out = []
    for node in nodes:
        with urllib.request.urlopen(f"{node.url}/stats", timeout=10) as r:
            stats = json.load(r)
        out.append((stats["prefix_hit_tokens"], stats["prefix_queried_tokens"]))
    return out


def _bodies(n: int, max_tokens: int, rng: random.Random) -> list[dict]:
    return [{"prompt": f"Item {rng.randrange(10**6)}: write a list of fruits.",
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0} for _ in range(n)]


async def _shared_prefix(url: str, groups: int, per_group: int, affinity: bool,
                         salt: str) -> dict:
    words = ["policy", "guideline", "clause", "section", "rule", "term", "provision"]
    rng = random.Random(salt)

    async def group(g: int) -> tuple[list, float]:
        system = f"[{salt}-{g}] " + " ".join(rng.choice(words) for _ in range(380))
        bodies = [{"messages": [{"role": "system", "content": system},
                                {"role": "user", "content": f"Question {i}: summarize."}],
                   "max_tokens": 8, "ignore_eos": True, "temperature": 0}
                  for i in range(per_group)]
        headers = {"X-Session-Id": f"{salt}-{g}"} if affinity else None
        return await closed_loop(url, bodies, 1, headers, path="/v1/chat/completions")

    runs = await asyncio.gather(*(group(g) for g in range(groups)))
    return summarize([r for results, _ in runs for r in results], max(w for _, w in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    opts = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    nodes = [_node(core) for core in cores]
    for node in nodes:
        node.wait_ready()
    nginx = NginxProcess([f"127.0.0.1:{n.port}" for n in nodes],
                         Path(tempfile.mkdtemp(prefix="surge-nginx-")))
    rng = random.Random(0)
    report: dict = {"cores": cores, "load_before": os.getloadavg()}
    try:
        asyncio.run(closed_loop(nginx.url, _bodies(8, 4, rng), 8))  # both nodes' first steps
        for label, url in (("one node direct", nodes[0].url), ("two nodes via nginx",
                                                                nginx.url)):
            results, wall = asyncio.run(closed_loop(url, _bodies(opts.requests, opts.max_tokens,
                                                                 rng), 32))
            report[f"c32 {label}"] = summarize(results, wall)
        for label, url in (("direct", nodes[0].url), ("via nginx", nginx.url)):
            results, wall = asyncio.run(closed_loop(url, _bodies(opts.sequential, 4, rng), 1))
            report[f"sequential {label}"] = summarize(results, wall)
        for affinity in (False, True):
            before = _prefix_stats(nodes)
            summary = asyncio.run(_shared_prefix(nginx.url, opts.groups, opts.per_group,
                                                 affinity, f"run-{affinity}"))
            after = _prefix_stats(nodes)
            hit, queried = ([a[i] - b[i] for a, b in zip(after, before, strict=True)]
                            for i in (0, 1))
            summary["prefix_hit_rate"] = sum(hit) / max(sum(queried), 1)
            summary["prompt_tokens_by_node"] = queried  # how evenly the groups were spread
            report[f"shared prefix {'affinity' if affinity else 'least_conn'}"] = summary
        report["load_after"] = os.getloadavg()
    finally:
        nginx.stop()
        for node in nodes:
            node.stop()
    print(json.dumps(report, indent=1))
    short = {k: {m: v[m] for m in ("ok", "errors", "output_tok_s", "ttft_ms", "prefix_hit_rate",
                                   "prompt_tokens_by_node")
                 if m in v} if isinstance(v, dict) else v for k, v in report.items()}
    print(json.dumps(short, indent=1))


if __name__ == "__main__":
    main()
