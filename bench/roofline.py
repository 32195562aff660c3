"""The compute roof for decoding this model on this machine, and surge's share of it.

Times every matrix product of one decode step (the model's own weights, in the serving dtype)
at batch 1, 8, 32, 64: the roof is batch / that time, in tokens/s, since a decode step can be
no faster than its GEMMs. With --url, runs `surge bench`'s fixed workload (input 128 / output
128) at each batch size as the concurrency and reports the measured throughput as a fraction
of the roof.

Usage: .venv/bin/python -m bench.roofline [--dtype auto] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from gpu_workers.loader import load_model
from gpu_workers.packed import PackedLinear, can_pack
from gpu_workers.worker import pick_dtype
from surge.bench import fixed_workload
from surge.config import ModelConfig
from surge.loadgen import closed_loop, summarize
from surge.model_files import resolve_model

BATCHES = (1, 8, 32, 64)


def gemm_seconds(weights: list[torch.Tensor], batch: int, repeats: int) -> float:
    """Median time of one pass over every weight at this batch size, on oneDNN-packed weights
    where the worker packs them too (the faster of the two ways to run them here)."""
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
    pack = can_pack(torch.device("cpu"), weights[0].dtype)
    layers = [(PackedLinear(w) if pack else partial(F.linear, weight=w), w.shape[1])
              for w in weights]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for layer, width in layers:
            layer(xs[width])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--url", default=None, help="also measure this surge server")
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    dtype = pick_dtype(ModelConfig(dtype=opts.dtype), torch.device("cpu"))
    model = load_model(resolve_model(opts.model), torch.device("cpu"), dtype)
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None:
        weights.append(model.embed.weight.detach())  # the tied head
    flops = 2 * sum(w.numel() for w in weights)
    print(f"{dtype}, {torch.get_num_threads()} threads; {flops / 1e9:.3f} GFLOP per token in "
          f"the linear layers (attention adds a little with context)")
    rows = []
    for batch in BATCHES:
        gemm_seconds(weights, batch, 3)  # warm up
        seconds = gemm_seconds(weights, batch, opts.repeats)
        rows.append({"batch": batch, "gflops": flops * batch / seconds / 1e9,
                     "roof_tok_s": batch / seconds})
    for row in rows:
        line = (f"batch {row['batch']:>3}: GEMM {row['gflops']:6.1f} GFLOP/s -> roof "
                f"{row['roof_tok_s']:7.1f} tok/s")
        if opts.url:
            bodies = fixed_workload(random.Random(0), max(2 * row["batch"], 8), 128, 128, 0)
            asyncio.run(closed_loop(opts.url, bodies[:1], 1))  # warm up
            results, wall = asyncio.run(closed_loop(opts.url, bodies, row["batch"]))
            measured = summarize(results, wall)["output_tok_s"]
            line += f"; surge {measured:6.1f} tok/s = {measured / row['roof_tok_s']:.0%}"
        print(line, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
