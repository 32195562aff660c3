"""The picks through the C++ kernels (kernels/cpu/sampling.cpp), as kernels.sampling's."""

from __future__ import annotations

import torch

from kernels import sampling as reference
from kernels.cpu import extension


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return reference.argmax(logits)
    return extension().argmax_rows(logits)


def random_pick(logits: torch.Tensor, b: reference.SamplingColumns) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return reference.random_pick(logits, b)
    return extension().random_pick(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds,
                                   b.positions)
