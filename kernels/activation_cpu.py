"""SiLU(gate) * up in one pass through the C++ kernel (kernels/cpu/activation.cpp)."""

from __future__ import annotations

import torch

from kernels.cpu import extension


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    return extension().silu_mul(x)
