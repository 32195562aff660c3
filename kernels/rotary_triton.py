"""Rotary position embedding, Hugging Face (rotate-half) layout (Triton; as kernels.rotary)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, heads, half, x_stride_t, x_stride_h, angle_stride_t,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Grid (T,): one program rotates every head of one token, both halves at once."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < heads)[:, None] & (i < half)[None, :]
    cos = tl.load(cos_ptr + t * angle_stride_t + i, mask=i < half, other=0.0)[None, :]
    # Each row is (c, c) and (-s, s) (see kernels.rotary.rotary_cache): the first halves of
    # cos and the second of sin are read.
    sin = tl.load(sin_ptr + t * angle_stride_t + half + i, mask=i < half, other=0.0)[None, :]
    first = x_ptr + t * x_stride_t + h[:, None] * x_stride_h + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(first + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] in place (queries and keys side by side, in one call) by each
    token's angles (see kernels.rotary.rotary_angles)."""
    t, heads, d = x.shape
    # Strided over tokens and heads (a view of the fused projection); each head's D contiguous.
    assert x.stride(2) == 1 and cos.stride(2) == 1 and cos.stride() == sin.stride()
    _rotary_kernel[(t,)](
        x, cos, sin, heads, d // 2, x.stride(0), x.stride(1), cos.stride(0),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=triton.next_power_of_2(d // 2))
