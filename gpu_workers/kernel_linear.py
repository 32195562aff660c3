"""Linear layers whose product is the kernel backend's (the C++ small-M product on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_workers.llama import LlamaModel
from kernels import Kernels


class KernelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, ops: Kernels) -> None:
        super().__init__()
        self.weight = weight  # the plain weight, shared (a tied head reads the embedding's)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


def route_linears(model: LlamaModel, ops: Kernels) -> None:
    """Every bias-free nn.Linear, and a head tied to the embedding, runs on ops.linear."""
    model.replace_linears(lambda m: isinstance(m, nn.Linear) and m.bias is None,
                          lambda m: KernelLinear(m.weight.detach(), ops))
