"""A linear layer's product x W^T, bias-free, on plain, int8 and int4 weights (reference)."""

import torch
import torch.nn.functional as F

Q4_BLOCK = 32  # columns a Q4_1 block packs into 16 bytes


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> [N, K / 2] uint8 in GGUF Q4_1's order: byte i of a block of 32
    columns holds column i (low nibble) and column i + 16 (high nibble)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // Q4_BLOCK, Q4_BLOCK)
    half = Q4_BLOCK // 2
    return (blocks[..., :half] | blocks[..., half:] << 4).reshape(n, k // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    n, half_k = packed.shape
    blocks = packed.view(n, half_k * 2 // Q4_BLOCK, Q4_BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, half_k * 2)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> torch.Tensor:
    """x W^T with W = q * scale + min per group of columns (scales, mins [N, groups]), in
    float32 from the nibbles on."""
    group = packed.shape[1] * 2 // scales.shape[1]
    w = (unpack_q4(packed).float() * scales.float().repeat_interleave(group, dim=1)
         + mins.float().repeat_interleave(group, dim=1))
    return F.linear(x.float(), w).to(x.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x W^T with W = q * scale per output row (q int8 [N, K], scales [N]) or per group of
    columns (scales [N, groups]), in float32."""
    scales = scales.float()
    if scales.dim() == 1:
        scales = scales[:, None]
    group = q.shape[1] // scales.shape[1]
    return F.linear(x.float(), q.float() * scales.repeat_interleave(group, dim=1)).to(x.dtype)
