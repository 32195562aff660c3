"""The C++ CPU kernels against what they replace, timed alternately in one process.

Linear products on the bundled model's shapes (and a Llama-8B-sized one): the C++ kernels
(kernels/cpu/gemv.cpp, kernels/cpu/panels.cpp where the CPU has AVX-512 BF16, and
kernels/cpu/amx.cpp where it has AMX) against oneDNN on packed weights and plain F.linear,
and the int4 product (kernels/cpu/int4.cpp, groups of 32) on the same weight, in
microseconds, in GB/s of bf16 weights read beside the machine's measured copy bandwidth, and
the fastest bf16 product in GFLOP/s beside its measured GEMM peak (oneDNN on a
1024 x 2048 x 2048 product, the most the bf16 products reach: a batched step's roof); and
decode attention over the paged KV cache (64 sequences at context 512 by default, the bundled
model's 9 query / 3 KV heads of 64), the C++ kernel against the reference, in GB/s of K/V read
(each call on the next of 12 layers' caches, 300 MB, as a step reads them: from memory, not
from the last-level cache); with --shared, decode rows that begin with the same blocks, read
once for all (cascade) against once per row; with --prefill, prefill attention of fresh
prompts, in GFLOP/s.

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.cpu_kernels_bench [--rows 1,4,8,16,64]
       [--repeats 30] [--threads N] [--attention-dtype float32] [--block-size 16] [--shared KEYS]
       [--prefill 512,2048] [--output result.json]

Each product repeats on one W, which stays in the caches (the small shapes' "c++ GB/s" passes
the memory's): a model's step streams each layer's W from memory, which shifts the rows where
oneDNN overtakes the C++ product, and favours oneDNN over the panels, which prefetch W
(bench.cpu_backend_step times whole steps; --against onednn for the panels).

Where oneDNN has no bf16 path (AVX2-only CPUs) there are no packed weights: that column is nan.

With one thread the figures hold while another process has the other core: a two-thread
parallel region waits for both cores (a busy one costs a scheduler slice, milliseconds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_workers import host_memory
from gpu_workers.packed import PackedLinear, can_pack
from gpu_workers.quant import quantize_int4, quantize_int8
from kernels import attention, attention_cpu
from kernels.cpu import extension
from kernels.matmul import pack_q4

# (name, in, out): SmolLM2-135M's projections, its head, and one Llama-8B MLP product.
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152), ("8b_down", 14336, 4096)]


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of a large tensor copy (bytes read + written), the best of a few."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = min(_once(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() / best / 1e9


def gemm_peak(repeats: int = 5) -> float:
    """GFLOP/s of a large bf16 product (1024 rows of 2048 by a 2048 x 2048 W) on oneDNN's
    packed weights (plain F.linear where oneDNN has no bf16 path), the best of a few."""
    weight, x = torch.randn(2048, 2048).bfloat16(), torch.randn(1024, 2048).bfloat16()
    product = (PackedLinear(weight) if can_pack(weight.device, weight.dtype)
               else lambda x: F.linear(x, weight))
    product(x)
    best = min(_once(lambda: product(x)) for _ in range(repeats))
    return 2 * x.shape[0] * weight.numel() / best / 1e9


def _once(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def time_alternately(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each, the candidates taking turns so load changes hit them alike."""
    for fn in fns.values():
        fn()  # warm up: oneDNN builds its kernel on first use
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_once(fn))
    return {name: statistics.median(t) for name, t in times.items()}


# The read roof of decode attention's memory access: every K and V row a row's keys see, in
# block-table order, summed as bytes by a plain loop over (sequence, KV head) on every thread. No
# attention kernel can read the same rows faster than this one reads them.
_READ_ROWS = """
#include <torch/extension.h>
#include <ATen/Parallel.h>

int64_t read_rows(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& tables, int64_t context) {
  const int64_t kv_heads = k_cache.size(0), blocks = k_cache.size(1), block = k_cache.size(2);
  const int64_t row = k_cache.stride(2) * k_cache.element_size(), seqs = tables.size(0);
  const auto* k = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* v = static_cast<const uint8_t*>(v_cache.data_ptr());
  const int64_t* table = tables.data_ptr<int64_t>();
  std::vector<uint64_t> sums(seqs * kv_heads);
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t s = unit / kv_heads, h = unit % kv_heads;
      uint64_t sum = 0;
      for (int64_t t = 0; t < context; ++t) {
        const int64_t at = ((h * blocks + table[s * tables.size(1) + t / block]) * block
                            + t % block) * row;
        for (int64_t b = 0; b < row; b += 8)
          sum += *reinterpret_cast<const uint64_t*>(k + at + b)
                 + *reinterpret_cast<const uint64_t*>(v + at + b);
      }
      sums[unit] = sum;
    }
  });
  uint64_t total = 0;
  for (const uint64_t s : sums) total += s;
  return static_cast<int64_t>(total);
}
"""


def attention_rates(seqs: int, context: int, repeats: int, layers: int, dtype: torch.dtype,
                    shared: int = 0, block: int = 16, heads: int = 9, kv_heads: int = 3,
                    dim: int = 64) -> dict[str, float]:
    """Seconds of one layer's decode attention, C++ and reference, and (without `shared`) of
    reading its K/V rows alone (the roof), on shuffled blocks. Each call reads the next of
    `layers` caches, as a step reads each layer's in turn: with enough layers the K/V comes from
    memory, not from a cache the last call warmed. With `shared` keys (whole blocks) at the head
    of every table, the same blocks (a shared prompt): the C++ kernel reads them once for all
    rows (cascade), and cpp_per_row is the same kernel told nothing of it."""
    from torch.utils.cpp_extension import load_inline

    roof = load_inline("surge_read_rows", _READ_ROWS, functions=["read_rows"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"])
    blocks = seqs * (-(-context // block))
    cpu = torch.device("cpu")  # in 2 MiB pages, as the worker's cache (host_memory.zeros)
    caches = [tuple(host_memory.zeros((kv_heads, blocks + 1, block, dim), dtype, cpu).normal_()
                    for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(blocks).view(seqs, -1)
    shared_blocks = shared // block
    tables[:, :shared_blocks] = tables[0, :shared_blocks].clone()
    lens = torch.full((seqs,), context)
    q = torch.randn(seqs, heads, dim, dtype=dtype)
    plans = {"cpp": attention_cpu.plan_decode(tables, lens, caches[0][0], shared_blocks),
             "cpp_per_row": attention_cpu.plan_decode(tables, lens, caches[0][0]),
             "reference": attention.plan_decode(tables, lens, caches[0][0], shared_blocks)}
    turns = itertools.count()  # one count for all: no call reads a cache the call before warmed

    def run(name: str, kernel: Callable) -> None:
        k_cache, v_cache = caches[next(turns) % layers]
        kernel(q, k_cache, v_cache, plans[name], 0.125)

    def read() -> None:
        k_cache, v_cache = caches[next(turns) % layers]
        roof.read_rows(k_cache, v_cache, tables, context)

    fns = {"cpp": lambda: run("cpp", attention_cpu.decode_attention),
           "reference": lambda: run("reference", attention.decode_attention)}
    if shared_blocks:  # the roof reads each row's rows: not a bound on reading shared ones once
        fns["cpp_per_row"] = lambda: run("cpp_per_row", attention_cpu.decode_attention)
    else:
        fns["read_roof"] = read
    return time_alternately(fns, repeats)


def prefill_rates(length: int, repeats: int, dtype: torch.dtype, block: int = 16,
                  heads: int = 9, kv_heads: int = 3, dim: int = 64) -> dict[str, float]:
    """Seconds of one layer's prefill attention over a fresh prompt of `length` tokens (one
    chunk, its K/V already in shuffled blocks), C++ and reference."""
    blocks = -(-length // block)
    k_cache, v_cache = (torch.randn(kv_heads, blocks, block, dim, dtype=dtype) for _ in "kv")
    tables = torch.randperm(blocks)[None]
    q = torch.randn(length, heads, dim, dtype=dtype)
    args = (q, k_cache, v_cache, tables, torch.tensor([0, length]), torch.tensor([length]),
            length, 0.125)
    return time_alternately({"cpp": lambda: attention_cpu.prefill_attention(*args),
                             "reference": lambda: attention.prefill_attention(*args)}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--attention", default="64x512",
                        help="decode attention: SEQSxCONTEXT ('' skips it)")
    parser.add_argument("--attention-layers", type=int, default=12,
                        help="caches the attention calls take in turn (1: the same, warm one)")
    parser.add_argument("--attention-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--block-size", type=int, default=16,
                        help="decode attention: tokens per KV block (the cache's --block-size)")
    parser.add_argument("--shared", type=int, default=0,
                        help="decode attention: keys every sequence begins with (a shared prompt)")
    parser.add_argument("--prefill", default="",
                        help="prefill attention of fresh prompts of these lengths, e.g. 512,2048")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = extension()
    if ext is None:
        raise SystemExit("the C++ kernels did not build")
    bandwidth, peak = copy_bandwidth(), gemm_peak()
    amx = ext.amx_available()
    print(f"{torch.get_num_threads()} threads, C++ products built for {ext.gemv_isa()}"
          f"{' and AMX' if amx else ''}, copy bandwidth {bandwidth:.1f} GB/s, GEMM peak "
          f"{peak:.0f} GFLOP/s, load average {os.getloadavg()[0]:.1f}")
    print(f"{'shape':>8} {'rows':>4} {'c++ us':>9} {'panel us':>9} {'amx us':>9} "
          f"{'onednn us':>9} {'plain us':>9} {'int4 us':>9} {'int4a8 us':>9} {'int8 us':>9} "
          f"{'int8a8 us':>9} {'c++ GB/s':>8} {'panel':>7} {'amx':>7} "
          f"{'onednn':>7} {'bf16 GFLOP/s':>12}")
    rows_out = []
    rows = [int(r) for r in args.rows.split(",") if r]  # '' skips the products
    for name, k, n in SHAPES if rows else []:
        weight = torch.randn(n, k).bfloat16()
        packed = PackedLinear(weight) if can_pack(weight.device, weight.dtype) else None
        panels = ext.panel_pack(weight) if ext.panels_available() else None
        q, scales, zeros = quantize_int4(weight, 32)
        q4 = ext.int4_pack(pack_q4(q), scales, zeros - 8 * scales)
        # int8 with a scale a block of 32 columns, as a GGUF's Q8_0 head
        q8 = ext.int8_pack(quantize_int8(weight)[0], torch.rand(n, k // 32))
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            fns = {
                "cpp": lambda x=x, w=weight: ext.small_m_linear(x, w),
                "plain": lambda x=x, w=weight: F.linear(x, w),
                "int4": lambda x=x, q4=q4: ext.int4_linear(x, q4),
                "int4a8": lambda x=x, q4=q4: ext.int4_linear(x, q4, 8),
                "int8": lambda x=x, q8=q8: ext.int8_linear(x, q8),
                "int8a8": lambda x=x, q8=q8: ext.int8_linear(x, q8, 8),
            }
            if packed is not None:
                fns["onednn"] = lambda x=x, p=packed: p(x)
            if panels is not None:
                fns["panel"] = lambda x=x, p=panels, n=n: ext.panel_linear(x, p, n)
            if amx and k % 32 == 0:
                fns["amx"] = lambda x=x, w=weight: ext.amx_linear(x, w)
            t = time_alternately(fns, args.repeats)
            gbs = {key: weight.numel() * 2 / s / 1e9 for key, s in t.items()}
            fastest = min(t[key] for key in ("cpp", "panel", "amx", "onednn", "plain")
                          if key in t)
            gflops = 2 * m * weight.numel() / fastest / 1e9
            nan = float("nan")
            print(f"{name:>8} {m:>4} {t['cpp'] * 1e6:>9.1f} {t.get('panel', nan) * 1e6:>9.1f} "
                  f"{t.get('amx', nan) * 1e6:>9.1f} "
                  f"{t.get('onednn', nan) * 1e6:>9.1f} {t['plain'] * 1e6:>9.1f} "
                  f"{t['int4'] * 1e6:>9.1f} {t['int4a8'] * 1e6:>9.1f} {t['int8'] * 1e6:>9.1f} "
                  f"{t['int8a8'] * 1e6:>9.1f} {gbs['cpp']:>8.1f} {gbs.get('panel', nan):>7.1f} "
                  f"{gbs.get('amx', nan):>7.1f} {gbs.get('onednn', nan):>7.1f} "
                  f"{gflops:>5.0f} ({gflops / peak:.0%})")
            rows_out.append({"shape": name, "in": k, "out": n, "rows": m, "bf16_gflops": gflops,
                             **{f"{key}_us": s * 1e6 for key, s in t.items()},
                             **{f"{key}_gbs": g for key, g in gbs.items()}})
    attn = {}
    if args.attention:
        seqs, context = (int(v) for v in args.attention.split("x"))
        dtype = getattr(torch, args.attention_dtype)
        # K and V, 3 KV heads of 64; shared blocks counted once
        keys = seqs * context - (seqs - 1) * (args.shared // args.block_size * args.block_size)
        kv_bytes = 2 * keys * 3 * 64 * dtype.itemsize
        t = attention_rates(seqs, context, args.repeats, args.attention_layers, dtype,
                            args.shared, args.block_size)
        attn = {f"{key}_us": s * 1e6 for key, s in t.items()}
        attn.update({f"{key}_gbs": kv_bytes / s / 1e9 for key, s in t.items()})
        print(f"decode attention, {seqs} sequences at context {context} ({kv_bytes / 1e6:.1f} MB "
              f"of {args.attention_dtype} K/V, blocks of {args.block_size}): "
              f"C++ {t['cpp'] * 1e6:.0f} us = {attn['cpp_gbs']:.1f} GB/s "
              f"({attn['cpp_gbs'] / bandwidth:.0%} of copy bandwidth), "
              f"reference {t['reference'] * 1e6:.0f} us = "
              f"{attn['reference_gbs']:.1f} GB/s; {args.attention_layers} layers' caches in turn")
        if "read_roof" in t:
            print(f"  reading the same rows alone {t['read_roof'] * 1e6:.0f} us = "
                  f"{attn['read_roof_gbs']:.1f} GB/s ({attn['read_roof_gbs'] / bandwidth:.0%}; the "
                  f"C++ kernel at {attn['cpp_gbs'] / attn['read_roof_gbs']:.0%} of it)")
        else:
            print(f"  the first {args.shared} keys shared by all (counted once above): read once "
                  f"for all rows {t['cpp'] * 1e6:.0f} us, once per row "
                  f"{t['cpp_per_row'] * 1e6:.0f} us ({t['cpp_per_row'] / t['cpp']:.2f}x)")
    prefill = []
    for length in (int(v) for v in args.prefill.split(",") if v):
        dtype = getattr(torch, args.attention_dtype)
        t = prefill_rates(length, args.repeats, dtype)
        flops = 2 * 2 * 9 * 64 * length * (length + 1) / 2  # q.k and p.v over the causal half
        prefill.append({"length": length, **{f"{key}_us": s * 1e6 for key, s in t.items()},
                        **{f"{key}_gflops": flops / s / 1e9 for key, s in t.items()}})
        print(f"prefill attention, a fresh prompt of {length} tokens ({args.attention_dtype}): "
              f"C++ {t['cpp'] * 1e6:.0f} us = {prefill[-1]['cpp_gflops']:.1f} GFLOP/s, reference "
              f"{t['reference'] * 1e6:.0f} us = {prefill[-1]['reference_gflops']:.1f} GFLOP/s")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"copy_gbs": bandwidth, "gemm_peak_gflops": peak, "isa": ext.gemv_isa(),
                       "amx": amx, "rows": rows_out, "attention": attn, "prefill": prefill,
                       "attention_dtype": args.attention_dtype}, f, indent=1)


if __name__ == "__main__":
    main()
