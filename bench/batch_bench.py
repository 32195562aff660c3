"""A Batch API batch and interactive latency beside it, on the real server.

Uploads --lines short completion lines (max_tokens 8) and runs them as one batch; meanwhile
an interactive client sends --probes streamed requests one at a time, --gap seconds apart.
Reports the batch's lines/s and the probes' TTFT during the batch against the same probes on
the idle server (measured first, in the same run).

Usage: .venv/bin/python -m bench.batch_bench [--lines 2000] [-- server args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import openai

from surge.loadgen import Result, client_session, percentiles, send
from tests.server import ServerProcess

_PROBE = {"prompt": "The three largest cities of France are", "max_tokens": 8,
          "ignore_eos": True, "temperature": 0}


async def _probes(url: str, count: int, gap_s: float) -> list[Result]:
    async with client_session(None) as session:
        results = []
        for _ in range(count):
            results.append(await send(session, url, _PROBE))
            await asyncio.sleep(gap_s)
    return results


def _batch_file(lines: int) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": f"Item {i}: a short note about the number {i} is", "max_tokens": 8,
                 "temperature": 0}}) + "\n" for i in range(lines)).encode()


async def _during(url: str, client: openai.OpenAI, batch_id: str, probes: int,
                  gap_s: float) -> tuple[list[Result], bool]:
    """The probes while the batch runs; and whether it was still running after the last."""
    results = await _probes(url, probes, gap_s)
    status = await asyncio.to_thread(lambda: client.batches.retrieve(batch_id).status)
    return results, status == "in_progress"


def measure(opts: argparse.Namespace, extra: list[str]) -> dict:
    root = tempfile.mkdtemp(prefix="surge-batch-bench-")
    server = ServerProcess("--state-dir", os.path.join(root, "state"), *extra,
                           dtype=opts.dtype, kv_cache_memory="2GiB").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        asyncio.run(_probes(server.url, 3, 0))  # warm up
        idle = asyncio.run(_probes(server.url, opts.probes, opts.gap))
        upload = client.files.create(file=("bench.jsonl", _batch_file(opts.lines)),
                                     purpose="batch")
        started = time.monotonic()
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).status == "validating":
            time.sleep(0.05)
        time.sleep(2)  # let the batch fill its lines in flight
        loaded, overlapped = asyncio.run(_during(server.url, client, batch.id, opts.probes,
                                                 opts.gap))
        while (batch := client.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "expired", "cancelled"):
            time.sleep(0.2)
        wall = time.monotonic() - started
    finally:
        server.stop()
    calm = percentiles([r.ttft for r in idle if not r.error])
    busy = percentiles([r.ttft for r in loaded if not r.error])
    counts = batch.request_counts
    return {"status": batch.status, "lines": opts.lines,
            "completed": counts.completed if counts else None,
            "failed": counts.failed if counts else None, "wall_s": wall,
            "lines_per_s": opts.lines / wall,
            "idle_ttft_p50_ms": calm["p50"], "idle_ttft_p95_ms": calm["p95"],
            "batch_ttft_p50_ms": busy["p50"], "batch_ttft_p95_ms": busy["p95"],
            "p95_ratio": busy["p95"] / calm["p95"], "probes_all_during_batch": overlapped,
            "probe_errors": sum(1 for r in idle + loaded if r.error)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--gap", type=float, default=0.25)
    parser.add_argument("--dtype", default="auto")
    opts, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    row = measure(opts, extra)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)
    print(f"server args: {' '.join(extra) or '(defaults)'}; load average "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
