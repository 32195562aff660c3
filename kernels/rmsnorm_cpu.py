"""RMSNorm through the C++ kernels (kernels/cpu/norm.cpp), as kernels.rmsnorm's."""

from __future__ import annotations

import torch

from kernels.cpu import extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return extension().rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass."""
    out, summed = extension().add_rms_norm(x, residual, weight, eps)
    return out, summed
