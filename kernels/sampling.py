"""The picks of a row of logits (reference): the greedy one, and the seeded random one.

Randomness is a pure function of (seed, position, token id): a counter-based hash, not a
generator with state. So a seeded request gives the same tokens whatever batch it shares, and a
sequence recomputed after preemption or a worker restart samples exactly what it sampled before.
"""

from __future__ import annotations

import torch
from msgspec import Struct

_MASK = 0xFFFFFFFF


class SamplingColumns(Struct, kw_only=True):
    """The rows' sampling parameters the picks read, as tensors (gpu_workers.sampler's
    SamplingBatch adds the rest)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor  # the position of the token being sampled
    max_top_k: int  # the largest top_k asked for (0: none)
    any_top_p: bool
    any_min_p: bool


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64: each row's first largest value's index (its first NaN's, if
    it has one)."""
    return logits.argmax(dim=-1)


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
    # Both halves of the 64-bit seed count: seeds 5 and 5 + 2**32 must differ.
    row = _hash32(_hash32(seeds) ^ _hash32(seeds >> 32) * 0x2F ^ (positions * 0x9E3779B1 & _MASK))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash32(row[:, None] + ids[None, :] * 0x3C6EF372)
    # 23 bits plus a half step: exactly representable in float32 and never 0 or 1.
    return ((bits >> 9).float() + 0.5) / float(1 << 23)


def filter_logits(logits: torch.Tensor, b: SamplingColumns) -> torch.Tensor:
    """Temperature-scaled logits with -inf outside each row's top-k / top-p / min-p set."""
    logits = logits / torch.where(b.temperature > 0, b.temperature, 1.0)[:, None]
    if b.max_top_k:
        # Only as many top values as the largest top_k; rows without top_k keep every token.
        top = logits.topk(b.max_top_k, dim=-1).values
        kth = top.gather(1, (b.top_k.clamp(min=1) - 1)[:, None])
        kth = torch.where(b.top_k[:, None] > 0, kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if b.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (probs.cumsum(dim=-1) - probs >= b.top_p[:, None]) & (b.top_p < 1)[:, None]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if b.any_min_p:
        probs = logits.softmax(dim=-1)
        floor = b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def race(probs: torch.Tensor, b: SamplingColumns) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly; -1 for a row that
    does not sample (temperature 0) or has no distribution left (every token masked)."""
    scores = probs / -torch.log(uniform_noise(b.seeds, b.positions, probs.shape[1]))
    usable = (b.temperature > 0) & torch.isfinite(scores).all(dim=-1) & (scores.amax(dim=-1) > 0)
    return torch.where(usable, argmax(scores), -1)


def random_pick(logits: torch.Tensor, b: SamplingColumns) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64: each row's seeded draw from its filtered
    distribution (filter_logits), -1 where it has none (see race)."""
    return race(filter_logits(logits, b).softmax(dim=-1), b)
