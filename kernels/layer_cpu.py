"""A Llama-shaped decoder layer in one C++ call (kernels/cpu/layer.cpp): see gpu_workers/fused.py
for which layers take it and what it is given."""

from __future__ import annotations

import torch

from kernels.cpu import extension


def decoder_layer(*args: object) -> list[torch.Tensor]:
    return extension().decoder_layer(*args)
