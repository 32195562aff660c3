"""Paged attention over a flattened batch (Triton; same semantics as kernels.attention).

Layouts as there: k_cache/v_cache [KVH, num_blocks, block_size, D] (contiguous), block tables
[B, max_blocks] padded with 0, H = G * KVH query heads (query head h reads KV head h // G).
Scores are accumulated in fp32 and exponentiated in base 2 (the scale folds in log2(e)). A
sliding window and a soft cap on the scores as there (window 0, softcap 0: none).
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Decode: context tokens per program. Long contexts spread over many programs (B * KVH alone
# rarely fills a GPU) while the fp32 partials, [B, H, max_len / PARTITION_SIZE, D], stay small.
PARTITION_SIZE = 512
# Keys per loop step, and prefill queries per program: tl.dot needs 16 or more per side, and 64
# keeps a [64, 128] K/V tile of head_dim 128 within registers at four warps.
BLOCK_N = 64
PREFILL_BLOCK_M = 64


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kvh, d, k_stride_t, k_stride_h,
    v_stride_t, v_stride_h, cache_stride_head, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (T,): one program copies one token's keys and values, every KV head."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    c = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < kvh) & (c < d)
    dst = h * cache_stride_head + slot * d + c
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * k_stride_t + h * k_stride_h + c, mask=mask),
             mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * v_stride_t + h * v_stride_h + c, mask=mask),
             mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into cache slots slot_mapping [T] (block * block_size + offset)."""
    t, kvh, d = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, kvh, d, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d))


LOG2E = math.log2(math.e)  # the host's; kernels spell it out (globals must be constexpr)


@triton.jit
def _attend_tile(
    q, row_max, row_sum, acc, k_ptr, v_ptr, table_ptr, first, visible_end, q_pos, c, d,
    cache_stride_block, cache_stride_slot, scale_log2, window, softcap, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the queries q over keys [first, first + BLOCK_N) of one KV
    head (k_ptr, v_ptr), read through the block table: the keys before visible_end, at or
    before a query's position q_pos and (window > 0) after q_pos - window count for it."""
    n = first + tl.arange(0, BLOCK_N)
    valid = n < visible_end
    # Lanes past visible_end leave the table alone: its row may end before their block.
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = block * cache_stride_block + (n % BLOCK_SIZE) * cache_stride_slot
    kv_mask = valid[:, None] & (c < d)[None, :]
    k = tl.load(k_ptr + rows[:, None] + c[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if softcap > 0:
        # softcap * tanh(x / softcap) on the natural-log scores, tanh(y) = 1 - 2 / (e^2y + 1).
        s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp2(2.0 * s / softcap) + 1.0))
    seen = valid[None, :] & (n[None, :] <= q_pos[:, None])
    seen = seen & ((window == 0) | (n[None, :] > q_pos[:, None] - window))
    s = tl.where(seen, s, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(s, axis=1))
    # A query whose window starts past this tile has seen nothing yet: keep its sums at 0.
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.exp2(s - safe_max[:, None])
    alpha = tl.exp2(row_max - safe_max)
    # Unseen lanes must read as 0, not stale cache contents: 0 * NaN would still be NaN.
    v = tl.load(v_ptr + rows[:, None] + c[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum * alpha + tl.sum(p, axis=1), acc


# Triton compiles a variant for each int argument that is 1 or a multiple of 16; the block
# table's width (here and in the prefill kernel) and the partition count (the reduction) change
# from step to step, and a variant first met while serving stalls that step by a compile (the
# warm-up and graph capture see only a few widths).
@triton.jit(do_not_specialize=["table_stride"])
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, max_ptr, sum_ptr, acc_ptr,
    scale_log2, window, softcap, q_stride_b, q_stride_h, table_stride, cache_stride_head,
    cache_stride_block, cache_stride_slot, group, d, BLOCK_SIZE: tl.constexpr,
    PARTITION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (B, KVH, P): program (b, j, p) attends the G query heads of KV head j of sequence b,
    the rows of one tile (BLOCK_G >= 16 for tl.dot), to its context tokens
    [p * PARTITION, (p + 1) * PARTITION), and leaves that partition's max, sum of exponentials
    and unnormalised output in the partials [B, H, P(, D)]; one wholly past the context leaves
    (-inf, 0, 0), which the reduction does not read."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    parts = tl.num_programs(2)
    ctx = tl.load(context_lens_ptr + b)
    # A partition wholly before the window reads nothing.
    start = tl.maximum(part * PARTITION, tl.where(window > 0, ctx - window, 0))
    end = tl.minimum(part * PARTITION + PARTITION, ctx)
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_mask = g < group
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + c[None, :],
                mask=g_mask[:, None] & (c < d)[None, :], other=0.0)
    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + ctx - 1  # the new token is the context's last
    table = block_tables_ptr + b * table_stride
    for first in range(start, end, BLOCK_N):
        row_max, row_sum, acc = _attend_tile(
            q, row_max, row_sum, acc, k_cache_ptr + kv_head * cache_stride_head,
            v_cache_ptr + kv_head * cache_stride_head,
            table, first, end, q_pos, c, d, cache_stride_block, cache_stride_slot, scale_log2,
            window, softcap, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)
    stat = (b * tl.num_programs(1) * group + heads) * parts + part
    tl.store(max_ptr + stat, row_max, mask=g_mask)
    tl.store(sum_ptr + stat, row_sum, mask=g_mask)
    tl.store(acc_ptr + stat[:, None] * d + c[None, :], acc, mask=g_mask[:, None] & (c < d)[None, :])


@triton.jit(do_not_specialize=["parts"])
def _decode_reduce_kernel(
    max_ptr, sum_ptr, acc_ptr, context_lens_ptr, out_ptr, parts, d, PARTITION: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (B, H): program (b, h) merges the partitions of query head h of sequence b that
    hold any of its context, one at a time, rescaling the running sums to the largest max so
    far (no block of partitions whose size would make a kernel variant per context length)."""
    b = tl.program_id(0).to(tl.int64)
    row = b * tl.num_programs(1) + tl.program_id(1)
    used = tl.cdiv(tl.load(context_lens_ptr + b), PARTITION)
    c = tl.arange(0, BLOCK_D)
    top = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for i in range(used):
        part_max = tl.load(max_ptr + row * parts + i)
        new_top = tl.maximum(top, part_max)
        # A partition wholly before a sliding window has no key (max -inf, sum 0): weighed
        # from 0 until a finite max comes, as -inf minus -inf would be NaN.
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        kept, weight = tl.exp2(top - base), tl.exp2(part_max - base)
        total = total * kept + weight * tl.load(sum_ptr + row * parts + i)
        acc = acc * kept + weight * tl.load(acc_ptr + (row * parts + i) * d + c, mask=c < d,
                                            other=0.0)
        top = new_top
    tl.store(out_ptr + row * d + c, (acc / total).to(out_ptr.dtype.element_ty), mask=c < d)


def _dot_precision(dtype: torch.dtype) -> str:
    # TF32 would cost fp32 models three decimal digits against the reference; the setting only
    # applies to fp32 inputs.
    return "ieee" if dtype == torch.float32 else "tf32"


def _head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


class DecodePlan(NamedTuple):
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor,
                shared_blocks: int = 0) -> DecodePlan:
    """As kernels.attention.plan_decode; the kernel reads the tables itself, and shared_blocks
    (the CPU reference's cascade) does not change the result."""
    return DecodePlan(block_tables, context_lens)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan, scale: float, window: int = 0, softcap: float = 0.0
                     ) -> torch.Tensor:
    """One query token per sequence, q [B, H, D], attending to its first context_lens[b] tokens.
    The partition count follows from the table's width alone, so nothing waits for the device."""
    block_tables, context_lens = plan
    b, h, d = q.shape
    kvh, _, block_size, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    parts = triton.cdiv(block_tables.shape[1] * block_size, PARTITION_SIZE)
    maxes = torch.empty(b, h, parts, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    partial_out = torch.empty(b, h, parts, d, dtype=torch.float32, device=q.device)
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    _decode_partial_kernel[(b, kvh, parts)](
        q, k_cache, v_cache, block_tables, context_lens, maxes, sums, partial_out,
        scale * LOG2E, window, softcap, q.stride(0), q.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], h // kvh, d, BLOCK_SIZE=block_size, PARTITION=PARTITION_SIZE,
        BLOCK_N=min(BLOCK_N, PARTITION_SIZE),
        BLOCK_G=max(16, triton.next_power_of_2(h // kvh)), BLOCK_D=_head_block(d),
        DOT_PRECISION=_dot_precision(q.dtype))
    _decode_reduce_kernel[(b, h)](
        maxes, sums, partial_out, context_lens, out, parts, d, PARTITION=PARTITION_SIZE,
        BLOCK_D=_head_block(d))
    return out


@triton.jit(do_not_specialize=["table_stride"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr, out_ptr,
    scale_log2, window, softcap, q_stride_t, q_stride_h, table_stride, cache_stride_head,
    cache_stride_block, cache_stride_slot, group, d, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (N, cdiv(max_query_len, BLOCK_M), H): program (i, j, h) computes query head h of
    tokens [j * BLOCK_M, (j + 1) * BLOCK_M) of chunk i; tiles past the chunk's end exit."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    t = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    # Chunk token t sits at position ctx - q_len + t and sees every key up to it.
    q_pos = ctx - q_len + t
    c = tl.arange(0, BLOCK_D)
    io_mask = (t < q_len)[:, None] & (c < d)[None, :]
    tokens = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + c[None, :],
                mask=io_mask, other=0.0)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    kv_offset = (head // group).to(tl.int64) * cache_stride_head
    # No key after the tile's last query is visible to any of it.
    visible_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
    # Nor any key before the window of the tile's first query.
    visible_start = tl.where(window > 0, tl.maximum(0, ctx - q_len + tile * BLOCK_M - window + 1),
                             0)
    for first in range(visible_start, visible_end, BLOCK_N):
        row_max, row_sum, acc = _attend_tile(
            q, row_max, row_sum, acc, k_cache_ptr + kv_offset, v_cache_ptr + kv_offset, table,
            first, visible_end, q_pos, c, d, cache_stride_block, cache_stride_slot, scale_log2,
            window, softcap, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)
    heads = tl.num_programs(2)
    out = acc / row_sum[:, None]
    tl.store(out_ptr + (tokens[:, None] * heads + head) * d + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
    max_query_len: int, scale: float, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """Variable-length chunks q [T, H, D]: chunk i is q[query_start[i]:query_start[i + 1]], the
    last tokens of its sequence's context_lens[i] (earlier ones already cached), causal within
    the chunk. max_query_len bounds the chunks' lengths (it sizes the grid)."""
    t, h, d = q.shape
    kvh, _, block_size, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    grid = (context_lens.shape[0], triton.cdiv(max_query_len, PREFILL_BLOCK_M), h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start, context_lens, out,
        scale * LOG2E, window, softcap, q.stride(0), q.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], h // kvh, d, BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_D=_head_block(d),
        DOT_PRECISION=_dot_precision(q.dtype))
    return out
