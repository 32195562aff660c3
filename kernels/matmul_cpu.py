"""x W^T through the C++ products, as kernels.matmul's: `linear` picks the product by rows in
C++ (kernels/cpu/layer.cpp: AMX tiles, the vector product, W's panels or oneDNN, whichever is
fastest for them), and kernels/cpu/int4.cpp and int8.cpp take quantized weights, repacked once
(pack_int4, pack_int8)."""

from __future__ import annotations

from functools import cache

import torch

from kernels.cpu import extension


@cache
def has_amx() -> bool:
    """Whether the build has the AMX product and the kernel lets this process use the tiles."""
    ext = extension()
    return ext is not None and ext.amx_available()


@cache
def has_panels() -> bool:
    """Whether the build has panel_linear (AVX-512 BF16): the product on W's panels, where the
    model keeps them (gpu_workers.kernel_linear)."""
    ext = extension()
    return ext is not None and ext.panels_available()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (bf16, K even) in panel_linear's layout, a copy linear() reads at every row
    count (on CPUs without AMX)."""
    return extension().panel_pack(weight)


def max_rows() -> int | None:
    """The most rows of x the C++ bf16 products take before oneDNN's; None where this CPU has
    no oneDNN bf16 path (they take every row count, as MKL's past widen_rows)."""
    rows = extension().cpp_rows()
    return None if rows < 0 else rows


def widen_rows() -> int:
    """The most rows of x the bf16, int4 and int8 tiles take: past them (prefill chunks) W is
    dequantized whole for MKL's fp32 product, and a row's bits depend on its call's rows
    (not int4 and int8 on AVX-512 VNNI, whose integer sums take every row count)."""
    return extension().widen_rows()


def describe_rows(packed: bool = False) -> str:
    """The products' share, for the worker's start-up line (packed: the model keeps packed
    copies, gpu_workers.kernel_linear.packed_copy_for)."""
    if packed and has_panels():
        return "C++ products on W in panels at every row count"
    rows = max_rows()
    if rows is None:  # no oneDNN bf16 path: the tiles, then MKL on W widened
        return f"C++ products up to {widen_rows()} rows, MKL's on W widened past them"
    return f"C++ products up to {rows} rows{', oneDNN-packed copies past them' if packed else ''}"


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None
           ) -> torch.Tensor:
    """packed: a copy of weight, its panels (pack_panels: every row count) or oneDNN's blocked
    copy (the rows past max_rows)."""
    return extension().linear(x, weight, packed)


def pack_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """kernels.matmul.int4_linear's weights (Q4_1 nibbles pack_q4 made, scales and minimums
    [N, groups]) in int4_linear's own layout: one uint8 tensor, one stream to read."""
    return extension().int4_pack(packed, scales, mins)


def int4_linear(x: torch.Tensor, weights: torch.Tensor, activation_bits: int = 16
                ) -> torch.Tensor:
    """x W^T for W as pack_int4 packed it, as kernels.matmul.int4_linear computes it, x rounded
    to activation_bits (8 or 16) where the product sums in integers (see activation_bits); on
    bf16 panels (a bf16 x past 4 rows, AVX-512 BF16 and VBMI) each weight rounded to bf16."""
    return extension().int4_linear(x, weights, activation_bits)


def activation_bits(rows: int, asked: int = 16, bf16_x: bool = False) -> int:
    """The bits int4_linear and int8_linear round x to, a block of 32 columns, to sum in
    integers for a call of `rows` rows of x, asked for `asked` (8 or 16); 0 where they read x
    as it is (kernels/cpu/integer_product.h: AVX2 builds without AVX-512 16 bits at every row
    count; AVX-512 VNNI builds as asked past the decode tile of 4, but a bf16 x (bf16_x) at 16
    on AVX-512 BF16 and VBMI builds: bf16 panels, quant_panels.cpp)."""
    return extension().activation_bits(rows, asked, bf16_x)


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """kernels.matmul.int8_linear's weights (q int8 [N, K], scales [N] or [N, groups]) in
    int8_linear's own layout: one int8 tensor, one stream to read."""
    return extension().int8_pack(q, scales[:, None] if scales.dim() == 1 else scales)


def int8_linear(x: torch.Tensor, weights: torch.Tensor, activation_bits: int = 16
                ) -> torch.Tensor:
    """x W^T for W as pack_int8 packed it, as kernels.matmul.int8_linear computes it, x rounded
    to activation_bits (8 or 16) where the product sums in integers (see activation_bits); on
    bf16 panels (a bf16 x past 4 rows, AVX-512 BF16 and VBMI) each weight rounded to bf16."""
    return extension().int8_linear(x, weights, activation_bits)
