"""x W^T through the C++ products, as kernels.matmul's: kernels/cpu/gemv.cpp for a few rows of
bf16 (more rows go to oneDNN, which is faster there: bench.cpu_kernels_bench), and
kernels/cpu/int4.cpp and int8.cpp on quantized weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import extension

# Up to this many rows the C++ product, which reads W once at the memory's pace, beats oneDNN;
# past it oneDNN's blocked GEMM, which reuses each W tile over many rows, wins.
SMALL_M_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= SMALL_M_ROWS and x.dtype == weight.dtype == torch.bfloat16:
        return extension().small_m_linear(x, weight)
    return F.linear(x, weight)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> torch.Tensor:
    return extension().int4_linear(x, packed, scales, mins)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return extension().int8_linear(x, q, scales)
