"""The gated MLP's activation (reference): SiLU(gate) * up over the gate_up projection."""

import torch
import torch.nn.functional as F


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2F] (gate columns, then up columns) -> [T, F]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
