"""Pipeline parallelism: each stage's idle share with and without overlapped micro-batches.

Starts `surge serve --pipeline-parallel-size P` twice, overlapped (async scheduling: P steps in
flight, each a different micro-batch) and not (`--no-async-scheduling`: one step at a time, so
each stage waits while the others compute), runs the same `surge bench` load against each and
reads the workers' busy seconds from /metrics (`surge_worker_busy_seconds_total{rank}`): a
stage's idle share is 1 - its busy seconds over the bench's wall time. On the CPU each stage
gets its share of the cores (one each on 2 cores at P=2).

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.pipeline_bench [--stages 2]
       [--pipeline-layers 18,12] [--concurrency 16] [--num-requests 64] [--input-len 64]
       [--output-len 64] [--model default] [--device cpu] [--dtype auto] [--output result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.server import ServerProcess

MODES = {"overlapped": ("--async-scheduling",), "one step at a time": ("--no-async-scheduling",)}


def busy_seconds(url: str) -> dict[str, float]:
    """Each worker rank's busy seconds so far."""
    with urllib.request.urlopen(f"{url}/metrics") as r:
        text = r.read().decode()
    return {s.labels["rank"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "surge_worker_busy_seconds_total"}


def run_mode(opts: argparse.Namespace, flags: tuple[str, ...]) -> dict:
    split = ("--pipeline-layers", opts.pipeline_layers) if opts.pipeline_layers else ()
    server = ServerProcess("--model", opts.model, "--device", opts.device,
                           "--pipeline-parallel-size", str(opts.stages), *split, *flags,
                           dtype=opts.dtype, kv_cache_memory="1GiB").wait_ready(300)
    bench = [sys.executable, "-m", "surge.cli", "bench", "--url", server.url,
             "--prompt-format", "tokens", "--input-len", str(opts.input_len),
             "--output-len", str(opts.output_len), "--concurrency", str(opts.concurrency),
             "--no-progress"]
    try:
        # A short warm-up load first, so that first-call costs fall outside the measurement.
        subprocess.run([*bench, "--num-requests", "2"], check=True, capture_output=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            before = busy_seconds(server.url)
            subprocess.run([*bench, "--num-requests", str(opts.num_requests),
                            "--output", out.name], check=True, capture_output=True)
            after = busy_seconds(server.url)
            result = json.load(out)["results"][0]
    finally:
        server.stop()
    wall = result["wall_s"]
    idle = {rank: max(0.0, 1 - (after[rank] - before.get(rank, 0.0)) / wall)
            for rank in sorted(after, key=int)}
    return {"output_tok_s": result["output_tok_s"], "tpot_p50_ms": result["tpot_ms"]["p50"],
            "ok": result["ok"], "wall_s": wall, "idle_share": idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--pipeline-layers", help="the split, e.g. 18,12 (default: even)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output")
    opts = parser.parse_args()
    report: dict = {"load_average_start": os.getloadavg(), "stages": opts.stages}
    for name, flags in MODES.items():
        report[name] = run_mode(opts, flags)
    report["load_average_end"] = os.getloadavg()
    print(f"PP={opts.stages} (layers {opts.pipeline_layers or 'even'}), concurrency "
          f"{opts.concurrency}, {opts.num_requests} requests, "
          f"{opts.input_len} in / {opts.output_len} out, {opts.model} on {opts.device}:")
    for name in MODES:
        row = report[name]
        shares = "  ".join(f"rank {r} idle {s:5.1%}" for r, s in row["idle_share"].items())
        print(f"  {name:18} {row['output_tok_s']:8.1f} tok/s  TPOT p50 "
              f"{row['tpot_p50_ms']:6.1f} ms  {shares}  ({row['ok']} ok)")
    ratio = report["overlapped"]["output_tok_s"] / report["one step at a time"]["output_tok_s"]
    print(f"  overlapped / one at a time: {ratio:.2f}x")
    print(f"load average: start {report['load_average_start']}, "
          f"end {report['load_average_end']}")
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
