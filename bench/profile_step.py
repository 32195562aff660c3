"""Where a decode step's time goes: the model runner alone (no server), --batch sequences of
--context tokens decoding, profiled with torch.profiler; the table is sorted by self time.

Usage: .venv/bin/python -m bench.profile_step [--batch 64] [--context 192] [--no-pack]
       [--kernel-backend cpu [--quantization int4]]
       (bf16 as the worker prepares it; --no-pack is for the reference)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cpu_backend_step import load
from gpu_workers.loader import load_model
from gpu_workers.packed import can_pack, pack_model
from gpu_workers.worker import pick_dtype
from surge.config import ModelConfig
from surge.model_files import resolve_model
from tests.inprocess import InProcessEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-pack", action="store_true", help="plain (not oneDNN-packed) weights")
    parser.add_argument("--kernel-backend", default="reference", choices=("reference", "cpu"))
    parser.add_argument("--quantization", default="none", choices=("none", "int4", "int8"),
                        help="with --kernel-backend cpu: the C++ low-bit products")
    opts = parser.parse_args()
    dtype = pick_dtype(ModelConfig(dtype=opts.dtype), torch.device("cpu"))
    packed = False
    if opts.kernel_backend == "cpu":
        mode = "bf16" if opts.quantization == "none" else opts.quantization
        dtype, model = torch.bfloat16, load(mode, "cpu")
    else:
        model = load_model(resolve_model("default"), torch.device("cpu"), dtype)
        packed = not opts.no_pack and can_pack(torch.device("cpu"), dtype)
        if packed:
            pack_model(model)
    engine = InProcessEngine(model, num_blocks=4096, max_num_seqs=opts.batch,
                             max_num_batched_tokens=opts.batch * opts.context)
    for i in range(opts.batch):
        engine.add(f"r{i}", [1000 + (i * 7 + j) % 5000 for j in range(opts.context)],
                   max_tokens=10_000)
    sched = engine.scheduler
    for _ in range(2):  # prefill, then one decode to warm up
        plan = sched.schedule()
        sched.update(plan, engine._run_plan(plan))
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(opts.steps):
            plan = sched.schedule()
            started = time.perf_counter()
            result = engine._run_plan(plan)
            times.append(time.perf_counter() - started)
            sched.update(plan, result)
    step = statistics.median(times)
    print(f"{dtype}{' packed' if packed else ''}, {opts.kernel_backend} kernels, "
          f"quantization {opts.quantization}, "
          f"{torch.get_num_threads()} threads: "
          f"batch {opts.batch} at context "
          f"~{opts.context}: step {step * 1000:.1f} ms median (profiled) = "
          f"{opts.batch / step:.0f} tok/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
