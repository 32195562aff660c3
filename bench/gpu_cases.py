"""The kernel cases of the device check (bench/gpu_check.py): each Triton kernel's inputs on
the check's shapes, the bytes it must move, and how to read its result."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kernels.rotary import rotary_angles, rotary_cache


@dataclass(frozen=True)
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]  # the longest in each batch; the others are shorter
    prefill: tuple[tuple[int, int], ...]  # (chunk tokens, context tokens including the chunk)
    tokens: int  # for store_kv, the norms and rotary
    hidden: int
    dtypes: tuple[torch.dtype, ...]


# Llama-3-8B's attention and hidden size. The prefill step is four 1,024-token chunks: a fresh
# prompt and three after cached context.
H200 = Shapes(32, 8, 128, 16, (1, 16, 64, 256), (512, 4096),
              ((1024, 1024), (1024, 2048), (1024, 4096), (1024, 8192)), 4096, 4096,
              (torch.bfloat16, torch.float16))
# Seconds in the interpreter (which reads bf16 as garbage), yet grouped heads, ragged lengths
# over several blocks and a chunk longer than a prefill tile (64 queries).
SMOKE = Shapes(4, 2, 16, 4, (1, 3), (5, 37), ((70, 90), (7, 7)), 8, 64, (torch.float32,))



def planned_decode(plan_decode: Callable, decode_attention: Callable) -> Callable:
    """decode_attention over block tables and lengths, as the cases pass them: planned (one
    implementation's plan_decode), then run."""
    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor, scale: float, shared_blocks: int = 0
               ) -> torch.Tensor:
        plan = plan_decode(tables, lens, k_cache, shared_blocks)
        return decode_attention(q, k_cache, v_cache, plan, scale)

    return decode


def _returned(args: tuple, result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


@dataclass
class Case:
    kernel: str  # its name in kernels/, reference and Triton alike
    shape: str
    dtype: torch.dtype
    inputs: Callable[[], tuple]  # the same arguments at every call (a fixed seed)
    nbytes: int  # what the kernel must read and write at least
    # What to compare: the returned tensors, or the arguments an in-place kernel writes.
    outputs: Callable[[tuple, Any], tuple[torch.Tensor, ...]] = _returned


def _randn(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=g.device).to(dtype)


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _paged(g: torch.Generator, lengths: list[int], s: Shapes, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K and V caches holding sequences of these lengths in shuffled blocks, and their
    block tables (padded with 0)."""
    counts = torch.tensor([-(-n // s.block_size) for n in lengths], device=g.device)
    blocks = torch.randperm(int(counts.sum()), generator=g, device=g.device)
    tables = torch.zeros(len(lengths), int(counts.max()), dtype=torch.int64, device=g.device)
    # A boolean mask assigns in row-major order: each row gets its own run of blocks.
    tables[torch.arange(tables.shape[1], device=g.device) < counts[:, None]] = blocks
    shape = (s.kv_heads, len(blocks), s.block_size, s.head_dim)
    return _randn(g, shape, dtype), _randn(g, shape, dtype), tables


def _qkv(g: torch.Generator, tokens: int, s: Shapes, dtype: torch.dtype) -> torch.Tensor:
    """A fused projection's output [T, H + 2 * KVH, D]: the model hands kernels views of it."""
    return _randn(g, (tokens, s.heads + 2 * s.kv_heads, s.head_dim), dtype)


def _store_kv_case(s: Shapes, dtype: torch.dtype, device: torch.device) -> Case:
    def inputs() -> tuple:
        g = _generator(device)
        qkv = _qkv(g, s.tokens, s, dtype)
        # Twice the slots needed, so the written ones are scattered.
        caches = _randn(g, (2, s.kv_heads, 2 * s.tokens // s.block_size, s.block_size,
                            s.head_dim), dtype)
        slots = torch.randperm(2 * s.tokens, generator=g, device=device)[: s.tokens]
        return (qkv[:, s.heads : s.heads + s.kv_heads], qkv[:, s.heads + s.kv_heads :],
                caches[0], caches[1], slots)

    nbytes = 4 * s.tokens * s.kv_heads * s.head_dim * dtype.itemsize + 8 * s.tokens
    return Case("store_kv", f"{s.tokens} tokens", dtype, inputs, nbytes,
                lambda args, _: (args[2], args[3]))


def _decode_case(s: Shapes, dtype: torch.dtype, device: torch.device, batch: int, context: int
                 ) -> Case:
    rng = random.Random(batch * context)
    lengths = [context] + [rng.randint(context // 2 + 1, context) for _ in range(batch - 1)]

    def inputs() -> tuple:
        g = _generator(device)
        k_cache, v_cache, tables = _paged(g, lengths, s, dtype)
        q = _qkv(g, batch, s, dtype)[:, : s.heads]
        return (q, k_cache, v_cache, tables, torch.tensor(lengths, device=device),
                s.head_dim ** -0.5)

    # The queries and the output, and the keys and values each sequence attends.
    nbytes = (2 * batch * s.heads + 2 * sum(lengths) * s.kv_heads) * s.head_dim * dtype.itemsize
    return Case("decode_attention", f"batch {batch}, context <= {context}", dtype, inputs,
                nbytes)


def _prefill_case(s: Shapes, dtype: torch.dtype, device: torch.device) -> Case:
    chunks, contexts = zip(*s.prefill, strict=True)

    def inputs() -> tuple:
        g = _generator(device)
        k_cache, v_cache, tables = _paged(g, list(contexts), s, dtype)
        q = _qkv(g, sum(chunks), s, dtype)[:, : s.heads]
        query_start = torch.tensor([0, *chunks], device=device).cumsum(0)
        return (q, k_cache, v_cache, tables, query_start, torch.tensor(contexts, device=device),
                max(chunks), s.head_dim ** -0.5)

    nbytes = (2 * sum(chunks) * s.heads + 2 * sum(contexts) * s.kv_heads) * s.head_dim
    return Case("prefill_attention", f"chunks {chunks}, contexts {contexts}", dtype, inputs,
                nbytes * dtype.itemsize)


def _norm_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    def inputs(fused: bool) -> tuple:
        g = _generator(device)
        x, residual = _randn(g, (2, s.tokens, s.hidden), dtype)
        weight = _randn(g, (s.hidden,), dtype)
        return (x, residual, weight, 1e-5) if fused else (x, weight, 1e-5)

    size = s.tokens * s.hidden * dtype.itemsize
    shape = f"{s.tokens} x {s.hidden}"
    yield Case("rms_norm", shape, dtype, partial(inputs, False), 2 * size)
    yield Case("add_rms_norm", shape, dtype, partial(inputs, True), 4 * size)


def _rotary_case(s: Shapes, dtype: torch.dtype, device: torch.device) -> Case:
    heads = s.heads + s.kv_heads

    def inputs() -> tuple:
        g = _generator(device)
        positions = torch.randint(0, 2 * s.tokens, (s.tokens,), generator=g, device=device)
        cos, sin = rotary_angles(positions, rotary_cache(s.head_dim, 2 * s.tokens, 500000.0)
                                 .to(device))
        return _qkv(g, s.tokens, s, dtype)[:, :heads], cos, sin

    # Queries and keys rotated in place, and an fp32 cos and sin a token.
    nbytes = s.tokens * s.head_dim * (2 * heads * dtype.itemsize + 4)
    return Case("apply_rotary_", f"{s.tokens} tokens x {heads} heads", dtype, inputs, nbytes,
                lambda args, _: args[:1])


def cases(s: Shapes, device: torch.device) -> Iterator[Case]:
    for dtype in s.dtypes:
        yield _store_kv_case(s, dtype, device)
        for batch in s.decode_batches:
            for context in s.decode_contexts:
                yield _decode_case(s, dtype, device, batch, context)
        yield _prefill_case(s, dtype, device)
        yield from _norm_cases(s, dtype, device)
        yield _rotary_case(s, dtype, device)
