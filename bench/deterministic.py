"""What --deterministic costs: decode step time of the fixed-order attention against the usual
kernels on the same bf16 model (steps interleaved, so both see the same machine load), and a
long prompt's prefill.

Usage: .venv/bin/python -m bench.deterministic [--batches 1,16,64] [--context 256] [--steps 12]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.packed_weights import cpu_kind, decoding_engine, load, step_times
from surge.model_files import resolve_model
from tests.inprocess import InProcessEngine


def prefill_seconds(model: torch.nn.Module, length: int, fixed_order: bool) -> float:
    """One prompt of `length` tokens prefilled alone (the engine's first step)."""
    engine = InProcessEngine(model, num_blocks=2048, max_num_seqs=1,
                             max_num_batched_tokens=length, fixed_order=fixed_order)
    engine.add("long", [1000 + i % 5000 for i in range(length)], 1)
    plan = engine.scheduler.schedule()
    started = time.perf_counter()
    engine._run_plan(plan)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=1024)
    opts = parser.parse_args()
    model = load(resolve_model("default"), torch.bfloat16, packed=True)
    print(f"{cpu_kind()}, {torch.get_num_threads()} threads, bf16 packed SmolLM2")
    with torch.inference_mode():
        for batch in (int(b) for b in opts.batches.split(",")):
            t = step_times({"usual": decoding_engine(model, batch, opts.context),
                            "fixed": decoding_engine(model, batch, opts.context, True)},
                           opts.steps)
            print(f"batch {batch:3d} at context ~{opts.context}: step {t['usual'] * 1e3:.1f} ms, "
                  f"deterministic {t['fixed'] * 1e3:.1f} ms ({t['fixed'] / t['usual']:.2f}x)")
        usual, fixed = (min(prefill_seconds(model, opts.prompt, f) for _ in range(2))
                        for f in (False, True))
    print(f"prefill of {opts.prompt} tokens: {usual * 1e3:.0f} ms, deterministic "
          f"{fixed * 1e3:.0f} ms ({fixed / usual:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
