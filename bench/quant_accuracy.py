"""How much each quantization mode costs in accuracy: perplexity on a fixed text shipped in the
repo (bench/data/apache-2.0.txt), the share of its positions whose most likely next token is
the unquantized model's, and the share of greedy tokens that agree with the
unquantized model on the reference prompts, for none / int8 / int4 / fp8.

Usage: .venv/bin/python -m bench.quant_accuracy [--modes none,int8,int4,fp8] [--dtype float32]
       [--tokens 2048] [--new-tokens 32] [--group-size 32] [--kernel-backend cpu] [--alone]
       (int4a8, int8a8: int4 and int8 with --quant-activation-bits 8, on --kernel-backend cpu)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import kernels
from bench import weight_mode
from gpu_workers.llama import LlamaModel
from gpu_workers.loader import load_model
from gpu_workers.model_runner import ModelRunner
from gpu_workers.quant import quantize_model
from surge.model_files import resolve_model
from surge.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.inprocess import InProcessEngine

TEXT = os.path.join(os.path.dirname(__file__), "data", "apache-2.0.txt")


@torch.inference_mode()
def prefill_hidden(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """The final hidden state at every position of token_ids, in one prefill."""
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks, block_size, torch.device("cpu"),
                         model.embed.weight.dtype)
    seq = ScheduledSeq(0, token_ids, 0, list(range(num_blocks)), False,
                       SamplingParams(max_tokens=1), 0)
    step = runner.prepare(StepPlan(0, [seq]))
    return model(step.input_ids, step.positions, step.meta, runner.kv_cache)


@torch.inference_mode()
def perplexity(model: LlamaModel, token_ids: list[int]) -> tuple[float, torch.Tensor]:
    """exp of the mean next-token negative log-likelihood over token_ids, in one prefill, and
    the most likely next token at each position (teacher-forced: one differing pick does not
    move the later ones, as it does in a greedy continuation)."""
    n = len(token_ids)
    hidden = prefill_hidden(model, token_ids)
    targets = torch.tensor(token_ids[1:])
    nll, picks = 0.0, []
    for start in range(0, n - 1, 256):  # the logits of the whole text at once are too large
        logits = model.logits(hidden[start : min(start + 256, n - 1)])
        nll += torch.nn.functional.cross_entropy(
            logits, targets[start : start + 256], reduction="sum").item()
        picks.append(logits.argmax(dim=-1))
    return math.exp(nll / (n - 1)), torch.cat(picks)


def greedy(model: LlamaModel, prompts: dict[str, list[int]], n: int, alone: bool = False
           ) -> dict[str, list[int]]:
    """Each prompt's n greedy tokens, all prompts in one batch, or each alone (every decode
    step's products then have one row)."""
    engine = InProcessEngine(model, max_num_batched_tokens=4096,
                             **({"max_num_seqs": 1} if alone else {}))
    for name, ids in prompts.items():
        engine.add(name, ids, n)
    return engine.run()


def agreement(base: list[int], other: list[int]) -> int:
    """How many tokens two greedy outputs share before they part."""
    same = 0
    for a, b in zip(base, other, strict=False):
        if a != b:
            break
        same += 1
    return same


def load(mode: str, dtype: torch.dtype, group: int, backend: str = "reference") -> LlamaModel:
    """mode: none, int8, int4, fp8, or int4a8 / int8a8 (bench.weight_mode)."""
    quantization, bits = weight_mode(mode)
    model = load_model(resolve_model("default"), torch.device("cpu"), dtype,
                       keep_blocks=quantization == "int4")
    model.ops = kernels.for_device(torch.device("cpu"), backend)
    if quantization != "none":
        quantize_model(model, quantization, group, ops=model.ops, activation_bits=bits)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="none,int8,int4,fp8")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=2048, help="of the text, for perplexity")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size")
    parser.add_argument("--kernel-backend", default="reference", choices=["reference", "cpu"],
                        help="the quantized modes' kernels (cpu: the C++ int4 product)")
    parser.add_argument("--alone", action="store_true",
                        help="decode each prompt alone (one-row products, as at concurrency 1)")
    opts = parser.parse_args()
    from server.tokenizer import Tokenizer
    from tests.prompts import reference_prompts

    tokenizer = Tokenizer(resolve_model("default"))
    with open(TEXT) as f:
        text_ids = tokenizer.encode(f.read())[: opts.tokens]
    prompts = reference_prompts(tokenizer)
    dtype = getattr(torch, opts.dtype)
    print(f"{len(text_ids)} tokens of {os.path.relpath(TEXT)}; {len(prompts)} reference prompts "
          f"x {opts.new_tokens} greedy tokens; {opts.dtype}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'mode':6} {'perplexity':>10} {'vs none':>8} {'top-1 as none':>13} "
          f"{'prompts agreeing on 16':>23} {'tokens agreeing':>16} {'time':>6}")
    base_ppl, base_picks, base_out = None, None, None
    for mode in opts.modes.split(","):
        started = time.monotonic()
        model = load(mode, dtype, opts.group_size,
                     "reference" if mode == "none" else opts.kernel_backend)
        ppl, picks = perplexity(model, text_ids)
        out = greedy(model, prompts, opts.new_tokens, opts.alone)
        if base_out is None:
            base_ppl, base_picks, base_out = ppl, picks, out
        same = [agreement(base_out[k], out[k]) for k in prompts]
        first16 = sum(s >= min(16, opts.new_tokens) for s in same)
        print(f"{mode:6} {ppl:10.3f} {(ppl / base_ppl - 1) * 100:+7.2f}% "
              f"{(picks == base_picks).float().mean().item():13.1%} "
              f"{first16:>16} of {len(prompts):<4} "
              f"{sum(same) / (len(prompts) * opts.new_tokens):15.1%} "
              f"{time.monotonic() - started:5.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
