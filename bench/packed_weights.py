"""Plain vs oneDNN-packed bf16 linear weights on this CPU: runner step time (the two models
stepped alternately, so both see the same machine load), logit differences, and greedy agreement
of each with the float32 model on the reference prompts. The figures behind --pack-weights.

Usage: .venv/bin/python -m bench.packed_weights [--batches 1,64] [--steps 12] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.quant_accuracy import agreement, greedy, prefill_hidden
from gpu_workers.llama import LlamaModel
from gpu_workers.loader import load_model
from gpu_workers.packed import can_pack, pack_model
from server.tokenizer import Tokenizer
from surge.model_files import ModelFiles, resolve_model
from tests.inprocess import InProcessEngine
from tests.prompts import reference_prompts


def cpu_kind() -> str:
    """The model name and the bf16 features that decide which oneDNN kernels run."""
    name, flags = "unknown CPU", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name == "unknown CPU":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    features = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(features) or 'no bf16 instructions'})"


def decoding_engine(model: LlamaModel, batch: int, context: int,
                    fixed_order: bool = False) -> InProcessEngine:
    """An engine with `batch` sequences past their prefill, ready for decode steps."""
    engine = InProcessEngine(model, num_blocks=2048, max_num_seqs=batch,
                             max_num_batched_tokens=batch * context, fixed_order=fixed_order)
    for i in range(batch):
        engine.add(f"r{i}", [1000 + (i * 7 + j) % 5000 for j in range(context)], 10_000)
    for _ in range(2):
        plan = engine.scheduler.schedule()
        engine.scheduler.update(plan, engine._run_plan(plan))
    return engine


def step_times(engines: dict[str, InProcessEngine], steps: int) -> dict[str, float]:
    """Median decode step of each engine (see decoding_engine), their steps interleaved."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            plan = engine.scheduler.schedule()
            started = time.perf_counter()
            result = engine._run_plan(plan)
            times[name].append(time.perf_counter() - started)
            engine.scheduler.update(plan, result)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def prompt_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, in one prefill."""
    return model.logits(prefill_hidden(model, ids)).float()


def load(files: ModelFiles, dtype: torch.dtype, packed: bool) -> LlamaModel:
    model = load_model(files, torch.device("cpu"), dtype)
    if packed:
        pack_model(model)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=32)
    opts = parser.parse_args()
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        print("this torch has no oneDNN linear packing", file=sys.stderr)
        return 1
    files = resolve_model("default")
    print(f"{cpu_kind()}, {torch.get_num_threads()} threads")
    models = {"plain": load(files, torch.bfloat16, False),
              "packed": load(files, torch.bfloat16, True)}
    for batch in (int(b) for b in opts.batches.split(",")):
        t = step_times({name: decoding_engine(m, batch, opts.context)
                        for name, m in models.items()}, opts.steps)
        print(f"batch {batch:3d} at context ~{opts.context}: step plain {t['plain'] * 1e3:.1f} ms,"
              f" packed {t['packed'] * 1e3:.1f} ms (packed {t['plain'] / t['packed']:.2f}x)")

    prompts = reference_prompts(Tokenizer(files))
    worst = max(
        (prompt_logits(models["packed"], ids) - prompt_logits(models["plain"], ids)).abs().max()
        for ids in prompts.values())
    print(f"largest |packed - plain| logit over every position of {len(prompts)} prompts: "
          f"{worst:.3f}")
    float_tokens = greedy(load(files, torch.float32, False), prompts, opts.new_tokens)
    for name, model in models.items():
        got = greedy(model, prompts, opts.new_tokens)
        shared = [agreement(float_tokens[p], got[p]) for p in prompts]
        whole = sum(s == opts.new_tokens for s in shared)
        print(f"{name:6s} vs float32, first {opts.new_tokens} greedy tokens: {whole} of "
              f"{len(prompts)} prompts agree throughout; tokens before parting "
              f"min {min(shared)}, median {statistics.median(shared):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
