"""The greedy pick of a row of logits (reference)."""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64: each row's first largest value's index (its first NaN's, if
    it has one)."""
    return logits.argmax(dim=-1)
