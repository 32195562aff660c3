"""Weight-only quantization of the linear layers, done once at load: int8 with one scale per
output channel, int4 with a scale and an offset per group of input columns, fp8 (e4m3) with one
scale per output channel. The products run on PyTorch's own low-bit operators where the device
has them; elsewhere on the dequantized weight (correct, not fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from gpu_workers.llama import LlamaModel
from kernels import Kernels
from kernels.matmul import Q4_BLOCK, pack_q4

_FP8_MAX = 448.0  # largest finite e4m3 value


def _has_op(name: str, device: torch.device) -> bool:
    """Whether this torch build has a kernel for aten::name on the device's backend."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", device.type.upper())


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales float32 [N]), w ~= q * scales[:, None]."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    q = (w.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group: int, grid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 in 0..15 [N, K], scales, zeros [N, K / group]) with
    w ~= (q - 8) * scale + zero, the convention of PyTorch's int4 operators. grid: the steps
    and minimums [2, N, K / group] to use (a GGUF file's own), else each group's range."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 group size {group} does not divide a layer's {k} input columns; "
                         "pick a --quant-group-size that does (e.g. 32, 64)")
    g = w.float().view(n, k // group, group)
    if grid is not None:
        scales, lo = grid[0].to(g.device), grid[1].to(g.device)
    else:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.view(n, k), scales, lo + 8 * scales


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    return ((q.float() - 8) * scales.repeat_interleave(group, dim=1)
            + zeros.repeat_interleave(group, dim=1))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q float8_e4m3fn [N, K], scales float32 [N])."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-8) / _FP8_MAX
    return (w.float() / scales[:, None]).to(torch.float8_e4m3fn), scales


class Int8Linear(nn.Module):
    """On a backend with its own int8 product (cpu, whole blocks of 32 columns) the scales stay
    fp32, in the layout its pack_int8 makes, and may be a GGUF Q8_0 tensor's own (`blocks`: q
    and a scale per block of 32 columns), its integer sums rounding x to activation_bits (8 or
    16, see --quant-activation-bits; past 4 rows at 16 bits on AVX-512 BF16 and VBMI, bf16
    panels of q * scale instead, kernels/cpu/quant_panels.cpp); PyTorch's operator takes one
    scale per output channel in the activations' dtype."""

    def __init__(self, weight: torch.Tensor, ops: Kernels = kernels.REFERENCE,
                 blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
                 activation_bits: int = 16) -> None:
        super().__init__()
        self.ops = ops
        self.activation_bits = activation_bits
        self.cpp = ops.int8_linear is not None and weight.shape[1] % 32 == 0
        if blocks is not None and not self.cpp:
            raise ValueError("int8 with a scale per block of 32 columns needs the cpu kernels")
        q, scales = blocks or quantize_int8(weight)
        if self.cpp:
            self.packed = nn.Buffer(ops.pack_int8(q, scales))
            return
        self.q = nn.Buffer(q)
        self.scales = nn.Buffer(scales.to(weight.dtype))
        self.fast = _has_op("_weight_int8pack_mm", weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (the model's tokens are flat) -> [T, out]."""
        if self.cpp:
            return self.ops.int8_linear(x, self.packed, self.activation_bits)
        if self.fast:
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        return F.linear(x, self.q.to(x.dtype)) * self.scales


class Int4Linear(nn.Module):
    """On a backend with its own int4 product (cpu, groups of a multiple of 32) the nibbles keep
    Q4_1's grid with fp32 steps and minimums (a GGUF's fp16 ones exactly), in the layout its
    pack_int4 makes, its integer sums rounding x to activation_bits (8 or 16, see
    --quant-activation-bits); elsewhere PyTorch's int4 operators, which take their scales and
    offsets in the activations' dtype."""

    def __init__(self, weight: torch.Tensor, group: int, grid: torch.Tensor | None = None,
                 ops: Kernels = kernels.REFERENCE, activation_bits: int = 16) -> None:
        super().__init__()
        self.group = group
        self.ops = ops
        self.activation_bits = activation_bits
        q, scales, zeros = quantize_int4(weight, group, grid)
        # The C++ product reads whole Q4_1 blocks; other groups take PyTorch's operator.
        self.cpp = ops.int4_linear is not None and group % Q4_BLOCK == 0
        if self.cpp:
            self.packed = nn.Buffer(ops.pack_int4(pack_q4(q), scales, zeros - 8 * scales))
            return
        # [K / group, N, 2]: the layout both operators read their scales and offsets in.
        self.scales_zeros = nn.Buffer(
            torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(weight.dtype))
        if weight.is_cuda:
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            self.packed = nn.Buffer(torch.ops.aten._convert_weight_to_int4pack(pairs, 8))
        else:
            self.packed = nn.Buffer(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.cpp:
            return self.ops.int4_linear(x, self.packed, self.activation_bits)
        if x.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group,
                                                      self.scales_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                          self.scales_zeros)


class FP8Linear(nn.Module):
    """On GPUs with fp8 tensor cores (compute capability 8.9+) activations are quantized per
    token and multiplied in fp8 (torch._scaled_mm); elsewhere the weight is dequantized."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scales = quantize_fp8(weight)
        self.q = nn.Buffer(q)
        self.scales = nn.Buffer(scales)
        self.fast = weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (8, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.fast:
            x_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / _FP8_MAX
            x8 = (x.float() / x_scales).to(torch.float8_e4m3fn)
            return torch._scaled_mm(x8, self.q.t(), scale_a=x_scales,
                                    scale_b=self.scales[None, :], out_dtype=x.dtype)
        return F.linear(x, (self.q.float() * self.scales[:, None]).to(x.dtype))


def quantized(linear: nn.Module, weight: torch.Tensor, mode: str, group: int,
              ops: Kernels = kernels.REFERENCE, activation_bits: int = 16) -> nn.Module:
    """The quantized replacement of `linear` (whose weight is `weight`), for the kernels
    `ops` (the C++ backend has int8 and int4 products of its own, which round x to
    activation_bits)."""
    weight = weight.detach()
    if mode == "int8":
        return Int8Linear(weight, ops, activation_bits=activation_bits)
    if mode == "int4":
        # A GGUF's Q4_1 blocks are groups of 32 on a grid of their own: keep exactly those.
        grid = getattr(linear, "q4_1", None)
        exact = group == 32 and grid is not None and not bool(grid.isnan().any())
        return Int4Linear(weight, group, grid if exact else None, ops, activation_bits)
    if mode == "fp8":
        return FP8Linear(weight)
    raise ValueError(f"unknown quantization {mode!r} (none, int8, int4, fp8)")


def quantize_model(model: LlamaModel, mode: str, group: int, head: bool = False,
                   ops: Kernels = kernels.REFERENCE, activation_bits: int = 16) -> None:
    """Every decoder-layer projection becomes a quantized linear; the embedding stays, and so
    does the LM head unless `head` (a tied head then gets a quantized copy of the embedding),
    or unless int4 keeps a GGUF's Q8_0 head as the file holds it (the loader's q8_0 blocks).
    activation_bits: what the C++ int4 and int8 products round x to (--quant-activation-bits)."""
    for layer in model.layers:
        for parent in (layer.attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name,
                            quantized(child, child.weight, mode, group, ops, activation_bits))
    if not model.has_head:
        return
    source = model.embed if model.lm_head is None else model.lm_head
    if head:
        model.lm_head = quantized(source, source.weight, mode, group, ops, activation_bits)
    elif (blocks := getattr(source, "q8_0", None)) is not None and ops.int8_linear is not None:
        model.lm_head = Int8Linear(source.weight, ops, blocks, activation_bits)
