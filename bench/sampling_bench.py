"""The sampler's picks on each kernel backend (reference vs the C++ `cpu` one), timed
alternately in one process over the same logits: greedy, temperature, top-p, top-k, min-p, and
whether both backends picked the same tokens.

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.sampling_bench [--rows 64]
       [--vocab 49152] [--spread 2.5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import kernels
from gpu_workers.sampler import SamplingBatch, sample
from surge.protocol import SamplingParams, ScheduledSeq

CASES = [("greedy", {"temperature": 0.0}), ("temperature 0.7", {"temperature": 0.7}),
         ("temperature 1.0", {"temperature": 1.0}),
         ("0.7, top_p 0.9", {"temperature": 0.7, "top_p": 0.9}),
         ("0.7, top_k 50", {"temperature": 0.7, "top_k": 50}),
         ("0.7, min_p 0.05", {"temperature": 0.7, "min_p": 0.05})]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--spread", type=float, default=2.5,
                        help="the logits' standard deviation (larger: a peakier distribution)")
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    cpu = torch.device("cpu")
    backends = {name: kernels.for_device(cpu, name) for name in ("reference", "cpu")}
    torch.manual_seed(0)
    logits = torch.randn(opts.rows, opts.vocab) * opts.spread
    print(f"{opts.rows} rows x {opts.vocab} logits (std {opts.spread}), "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    for name, params in CASES:
        seqs = [ScheduledSeq(i, [1], 10, [0], True, SamplingParams(max_tokens=10, **params), i)
                for i in range(opts.rows)]
        batch = SamplingBatch.build(seqs, [10] * opts.rows, opts.vocab, cpu)
        times: dict[str, list[float]] = {b: [] for b in backends}
        for _ in range(opts.repeats + 1):  # the first round warms up
            for b, ops in backends.items():
                started = time.perf_counter()
                sample(logits, batch, ops)
                times[b].append(time.perf_counter() - started)
        ref, cpp = (statistics.median(times[b][1:]) * 1e3 for b in backends)
        same = torch.equal(*(sample(logits, batch, ops)[0] for ops in backends.values()))
        print(f"{name}: reference {ref:.2f} ms, cpu {cpp:.2f} ms ({ref / cpp:.1f}x), "
              f"same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
