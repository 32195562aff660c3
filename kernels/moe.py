"""Mixture-of-experts products, the reference: the token-expert pairs grouped by expert, one
gated-MLP product per expert (the oracle of kernels/moe_triton.py's grouped GEMM).

Layouts: x [T, H]; w13 [E, 2F, H] (each expert's gate rows, then its up rows); w2 [E, H, F];
weights and experts [T, top_k], an expert -1 being one this rank does not hold (its pair adds
nothing here).
"""

from collections.abc import Callable

import torch


def _padded_rows(n: int, x: torch.Tensor) -> int:
    """Rows an expert's product runs on. oneDNN builds a kernel per shape for reduced precision
    on the CPU (~1 ms each), and each step gives the experts new row counts: rounded up (powers
    of two to 64, then multiples of 64) they take few shapes."""
    if x.device.type != "cpu" or x.dtype == torch.float32:
        return n
    return 1 << (n - 1).bit_length() if n <= 64 else -(-n // 64) * 64


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """sum over each token's experts e of weight * w2[e] @ (act(gate) * up)."""
    # Summed in float32: index_add_ of bfloat16 on the CPU is ~100x slower, and rounds more.
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = experts.flatten()
    top_k = experts.shape[1]
    for e in flat.unique().tolist():
        if e < 0:
            continue
        pairs = (flat == e).nonzero()[:, 0]
        tokens = pairs // top_k
        rows = x.new_zeros(_padded_rows(len(tokens), x), x.shape[1])
        rows[: len(tokens)] = x[tokens]
        gate, up = (rows @ w13[e].T).chunk(2, dim=-1)
        y = ((act(gate) * up) @ w2[e].T)[: len(tokens)]
        out.index_add_(0, tokens, (y * weights.flatten()[pairs, None]).float())
    return out.to(x.dtype)
