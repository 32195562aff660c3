"""Linear layers whose product is the kernel backend's (the C++ small-M product on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.llama import LlamaModel
from gpu_workers.packed import can_pack, packed_copy
from kernels import Kernels, matmul_cpu


class KernelLinear(nn.Module):
    """packed: also keep a packed copy of the weight (--pack-weights on a CPU without AMX): its
    panels where the build has panel_linear (AVX-512 BF16), which take every row count, so the
    plain weight is dropped; else oneDNN's blocked copy, for the rows past the C++ small-row
    product (1.2-1.3x the plain weight's product at 64-128 rows, for its memory once more)."""

    def __init__(self, weight: torch.Tensor, ops: Kernels, packed: bool = False,
                 panels: bool = True) -> None:
        super().__init__()
        self.ops = ops
        self.packed = packed_copy_for(weight, panels) if packed else None
        # The plain weight (a tied head's is the embedding's, which keeps it), or only its
        # shape where the panels serve every row count and nothing reads it.
        unread = self.packed is not None and not self.packed.is_mkldnn
        self.weight = weight.to("meta") if unread else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self.ops.linear(x, self.weight)
        return self.ops.linear(x, self.weight, self.packed)


def packed_copy_for(weight: torch.Tensor, panels: bool = True) -> torch.Tensor:
    """The copy ops.linear reads: W's panels (every row count), or oneDNN's copy (past the
    small-row products) where the build has none or `panels` is off (bench.cpu_backend_step's
    baseline)."""
    if panels and matmul_cpu.has_panels() and weight.shape[1] % 2 == 0:
        return matmul_cpu.pack_panels(weight)
    return packed_copy(weight)


def keeps_packed_copy(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether routed layers keep a packed copy for the rows past the C++ small-row products:
    where oneDNN reorders this dtype (every CPU with AVX-512 BF16 too), and not with AMX, whose
    tiles read the plain layout up to 128 rows and oneDNN's as fast past them."""
    return can_pack(device, dtype) and not matmul_cpu.has_amx()


def route_linears(model: LlamaModel, ops: Kernels, packed: bool = False,
                  panels: bool = True) -> None:
    """Every bias-free nn.Linear, and a head tied to the embedding, runs on ops.linear (with a
    packed copy of its weight if `packed`: packed_copy_for)."""
    model.replace_linears(lambda m: isinstance(m, nn.Linear) and m.bias is None,
                          lambda m: KernelLinear(m.weight.detach(), ops, packed, panels))
