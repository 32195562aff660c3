"""Linear layers whose product is the kernel backend's (the C++ small-M product on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.llama import LlamaModel
from gpu_workers.packed import can_pack, packed_copy
from kernels import Kernels, matmul_cpu


class KernelLinear(nn.Module):
    """packed: also keep oneDNN's blocked copy of the weight, for the rows past the C++
    products (--pack-weights on a CPU without AMX: 1.2-1.3x at 64-128 rows, for the weight's
    memory once more)."""

    def __init__(self, weight: torch.Tensor, ops: Kernels, packed: bool = False) -> None:
        super().__init__()
        self.weight = weight  # the plain weight, shared (a tied head reads the embedding's)
        self.ops = ops
        self.packed = packed_copy(weight) if packed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self.ops.linear(x, self.weight)
        return self.ops.linear(x, self.weight, self.packed)


def keeps_packed_copy(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether routed layers keep oneDNN's copy for the rows past the C++ products: where oneDNN
    reorders this dtype, and not with AMX, whose tiles read the plain layout up to 128 rows and
    oneDNN's as fast past them."""
    return can_pack(device, dtype) and not matmul_cpu.has_amx()


def route_linears(model: LlamaModel, ops: Kernels, packed: bool = False) -> None:
    """Every bias-free nn.Linear, and a head tied to the embedding, runs on ops.linear (with a
    oneDNN-packed copy of its weight if `packed`)."""
    model.replace_linears(lambda m: isinstance(m, nn.Linear) and m.bias is None,
                          lambda m: KernelLinear(m.weight.detach(), ops, packed))
