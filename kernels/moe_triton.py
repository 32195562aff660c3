"""Mixture-of-experts products as two grouped GEMMs over the token-expert pairs sorted by expert
(Triton; same semantics as kernels.moe), after vLLM's fused_moe.

The pairs are sorted by expert and each expert's run padded to a whole number of BLOCK_M rows,
so every row block of the grouped GEMM reads one expert's weights. The layout is built with
fixed-size tensor operations only (no host synchronisation), so a CUDA graph can hold it.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 32


class Sorted(NamedTuple):
    pairs: torch.Tensor  # [padded]: pair ids grouped by expert; n_pairs marks padding
    block_expert: torch.Tensor  # [padded / block_m]: each row block's expert, -1 for none


def sort_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> Sorted:
    """The pairs (token * top_k + slot) grouped by expert, each group padded to block_m rows;
    pairs of expert -1 are left out."""
    flat = experts.flatten()
    n = flat.numel()
    e = torch.where(flat < 0, num_experts, flat)  # the experts not held sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, e, torch.ones_like(e))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = torch.cat([padded_end.new_zeros(1), padded_end])  # [E + 1]; the last: no row
    order = torch.argsort(e, stable=True)
    sorted_e = e[order]
    first = counts.cumsum(0) - counts  # where each expert's run begins in `order`
    size = n + num_experts * (block_m - 1)
    size = triton.cdiv(size, block_m) * block_m
    rank = torch.arange(n, device=flat.device) - first[sorted_e]
    dest = torch.where(sorted_e < num_experts, start[sorted_e] + rank, size)
    pairs = torch.full((size + 1,), n, dtype=torch.int32, device=flat.device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Sorted(pairs[:size], block_expert)


# The pair count changes with every step's tokens: as an ordinary int argument, Triton would
# compile a variant when it is 1 or a multiple of 16, stalling the step that first sees it.
@triton.jit(do_not_specialize=["n_pairs"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, pairs_ptr, block_expert_ptr, n_pairs, n, k,
    a_stride, b_stride_e, b_stride_n, c_stride, ROWS_PER_A: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (row blocks, column blocks): C[pair] = A[pair // ROWS_PER_A] @ B[expert].T for the
    pairs of one row block (all of one expert), times the pair's weight when MUL_WEIGHT."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < n_pairs
    row = pair // ROWS_PER_A
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * b_stride_e
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + row[:, None] * a_stride + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < k), other=0.0)
        b = tl.load(b_base + cols[None, :] * b_stride_n + ks[:, None],
                    mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0)
        # float32 stays float32 (no TF32): the oracle is the reference's exact products.
        acc += tl.dot(a, b, input_precision="ieee" if IEEE else "tf32")
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pair[:, None] * c_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < n))


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
                  order: Sorted, n_pairs: int, rows_per_a: int, mul_weight: bool,
                  block_m: int) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (order.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, order.pairs, order.block_expert, n_pairs, n, k, a.stride(0),
        b.stride(0), b.stride(1), c.stride(0), ROWS_PER_A=rows_per_a, MUL_WEIGHT=mul_weight,
        IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    t, top_k = experts.shape
    n_pairs = t * top_k
    # Few pairs per expert (decode) would leave most of a large row block as padding.
    block_m = 16 if n_pairs <= 16 * w13.shape[0] else 64
    order = sort_pairs(experts, w13.shape[0], block_m)
    x = x.contiguous()
    flat_weights = weights.contiguous().view(-1)
    gate_up = torch.empty(n_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, flat_weights, order, n_pairs, top_k, False, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = act(gate) * up
    # Pairs of experts held elsewhere are never written: they must add nothing.
    down = torch.zeros(n_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden, w2, down, flat_weights, order, n_pairs, 1, True, block_m)
    return down.view(t, top_k, -1).sum(dim=1)
