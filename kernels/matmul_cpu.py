"""x W^T through the C++ products, as kernels.matmul's: bf16 on AMX tiles (kernels/cpu/amx.cpp)
from 2 up to AMX_ROWS rows where the CPU has them, kernels/cpu/gemv.cpp for one row (and up to
SMALL_M_ROWS without AMX); more rows go to oneDNN, which is faster there
(bench.cpu_kernels_bench); and kernels/cpu/int4.cpp and int8.cpp on quantized weights."""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from kernels.cpu import extension

# Up to this many rows the AVX-512 / AVX2 product, which reads W once at the memory's pace,
# beats oneDNN; past it oneDNN's blocked GEMM, which reuses each W tile over many rows, wins.
SMALL_M_ROWS = 4
# AMX tiles read W in its plain layout at any row count, but past this many rows each W tile
# passes over more of x than the cache holds, and oneDNN's blocking wins (prefill chunks). For
# one row the vector product is faster: a tile pass computes 16 rows, 15 of them zeros.
AMX_ROWS = 128


@cache
def has_amx() -> bool:
    """Whether the build has the AMX product and the kernel lets this process use the tiles."""
    ext = extension()
    return ext is not None and ext.amx_available()


def max_rows() -> int:
    """The most rows of x the C++ bf16 products take (the worker's start-up line names it)."""
    return AMX_ROWS if has_amx() else SMALL_M_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.bfloat16:
        rows = x.shape[0]
        if 1 < rows <= AMX_ROWS and x.shape[1] % 32 == 0 and has_amx():
            return extension().amx_linear(x, weight)
        if rows <= SMALL_M_ROWS:
            return extension().small_m_linear(x, weight)
    return F.linear(x, weight)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor) -> torch.Tensor:
    return extension().int4_linear(x, packed, scales, mins)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return extension().int8_linear(x, q, scales)
