"""Greedy and temperature sampling for a whole batch at once.

Randomness is a pure function of (seed, position, token id): a counter-based hash, not a
generator with state. So a seeded request gives the same tokens whatever batch it shares, and a
sequence recomputed after preemption or a worker restart samples exactly what it sampled before.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (multipliers < 2**31, so products never overflow)."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x297A2D39) & _MASK
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] floats in (0, 1), fixed by each row's (seed, position)."""
    row = _hash32(_hash32(seeds) ^ (positions * 0x9E3779B1 & _MASK))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash32(row[:, None] + ids[None, :] * 0x3C6EF372)
    # 23 bits plus a half step: exactly representable in float32 and never 0 or 1.
    return ((bits >> 9).float() + 0.5) / float(1 << 23)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B]; temperature 0 means greedy."""
    greedy = logits.argmax(dim=-1)
    if not bool((temperatures > 0).any()):
        return greedy
    temps = torch.where(temperatures > 0, temperatures, 1.0)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly.
    race = probs / -torch.log(uniform_noise(seeds, positions, logits.shape[1]))
    return torch.where(temperatures > 0, race.argmax(dim=-1), greedy)
