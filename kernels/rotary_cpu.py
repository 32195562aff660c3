"""Rotary embedding fused with the KV-cache store (kernels/cpu/rotary.cpp)."""

from __future__ import annotations

import torch

from kernels.cpu import extension


def rotate_and_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    extension().rotate_and_store(qk, v, cos, sin, k_cache, v_cache, slot_mapping)
