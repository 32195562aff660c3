"""A mixture-of-experts model against a dense one of the same active size, on this machine.

Builds two tiny random Qwen3 checkpoints with the bundled model's tokenizer: Qwen3-MoE (8
experts of 256 columns, top 2, in every layer) and dense Qwen3 with 512 MLP columns (the two
experts a token uses), the attention the same. Then:

- serving: `surge serve` on each in turn, `surge bench` against it (same workload), output
  tokens/s and the ratio;
- per step: one MLP block's forward on decode- and prefill-sized batches, the MoE block on the
  reference kernels, on the Triton kernels where CUDA is present, and the dense MLP.

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.moe_bench [--device cpu]
       [--concurrency 8] [--output result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import kernels
from gpu_workers.loader import load_model
from gpu_workers.worker import pick_dtype
from surge.config import ModelConfig
from surge.model_files import resolve_model
from tests.server import ServerProcess
from tests.tiny_families import save_tiny_served

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=2048)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, mlp_only_layers=[],
           norm_topk_prob=True)
DENSE = dict(intermediate_size=512)


def serve_and_bench(folder: str, concurrency: int, device: str) -> dict:
    server = ServerProcess("--model", folder, "--device", device, dtype="auto",
                           kv_cache_memory="1GiB").wait_ready(300)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "surge.cli", "bench", "--url", server.url,
                            "--prompt-format", "tokens", "--input-len", "128",
                            "--output-len", "64", "--num-requests", str(4 * concurrency),
                            "--concurrency", str(concurrency), "--no-progress",
                            "--output", out.name], check=True)
            result = json.load(out)["results"][0]
    finally:
        server.stop()
    return {"output_tok_s": result["output_tok_s"], "tpot_p50_ms": result["tpot_ms"]["p50"],
            "ok": result["ok"]}


def _time(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def per_step(moe_folder: str, dense_folder: str, device: torch.device) -> dict:
    """ms per MLP block forward, by batch tokens and path (the dense MLP unpacked, as the
    experts are), on one thread as a CPU worker of a 2-core machine runs."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = pick_dtype(ModelConfig(), device)  # the serving dtype
    moe = load_model(resolve_model(moe_folder), device, dtype).layers[0].mlp
    dense = load_model(resolve_model(dense_folder), device, dtype).layers[0].mlp
    paths = {"moe reference": lambda x: moe(x, kernels.backend("reference", "bench"))}
    if device.type == "cuda":
        paths["moe triton"] = lambda x: moe(x, kernels.backend("triton", "bench"))
    paths["dense"] = dense
    table = {}
    for tokens in (1, 8, 32, 512):
        x = torch.randn(tokens, SHAPE["hidden_size"], device=device, dtype=dtype)
        table[tokens] = {name: 1e3 * _time(lambda f=f, x=x: f(x), 50 if tokens < 512 else 10)
                         for name, f in paths.items()}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        moe, dense = os.path.join(root, "moe"), os.path.join(root, "dense")
        save_tiny_served(moe, "qwen3_moe", **SHAPE, **MOE)
        save_tiny_served(dense, "qwen3", **SHAPE, **DENSE)
        report = {"load_average_start": os.getloadavg()}
        steps = per_step(moe, dense, torch.device(opts.device))
        report["per_step_ms"] = steps
        print(f"\nper step, one MLP block (ms): {'tokens':>6} " +
              " ".join(f"{n:>14}" for n in next(iter(steps.values()))))
        for tokens, row in steps.items():
            print(f"{'':31}{tokens:>6} " + " ".join(f"{v:>14.3f}" for v in row.values()))
        served = {name: serve_and_bench(folder, opts.concurrency, opts.device)
                  for name, folder in (("moe", moe), ("dense", dense))}
        report["serving"] = served
    report["load_average_end"] = os.getloadavg()
    print(f"\nserving, concurrency {opts.concurrency}, 128 in / 64 out:")
    for name, row in served.items():
        print(f"  {name:6} {row['output_tok_s']:8.1f} tok/s  TPOT p50 {row['tpot_p50_ms']:.1f} ms"
              f"  ({row['ok']} ok)")
    print(f"  moe / dense: {served['moe']['output_tok_s'] / served['dense']['output_tok_s']:.2f}x")
    print(f"load average: start {report['load_average_start']}, "
          f"end {report['load_average_end']}")
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
