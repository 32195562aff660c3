"""Paged attention through the C++ kernel (kernels/cpu/attention.cpp): K/V read in place, one
row per query, the same signatures as kernels.attention's."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.cpu import extension


class DecodePlan(NamedTuple):
    tables: torch.Tensor  # [B, max_blocks]
    seq_of: torch.Tensor  # [B]: row i reads table i
    visible: torch.Tensor  # [B]: the context each sees
    shared_keys: int  # the keys of the blocks every table begins with, read once for all rows


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor,
                shared_blocks: int = 0) -> DecodePlan:
    """As kernels.attention.plan_decode: the first shared_blocks blocks, the same in every
    table and full, are read once for all the queries (cascade)."""
    rows = torch.arange(block_tables.shape[0], device=block_tables.device)
    return DecodePlan(block_tables, rows, context_lens, shared_blocks * k_cache.shape[2])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan, scale: float, window: int = 0, softcap: float = 0.0
                     ) -> torch.Tensor:
    return extension().paged_attention(q, k_cache, v_cache, plan.tables, plan.seq_of,
                                       plan.visible, scale, window, softcap, len(q),
                                       plan.shared_keys)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
    max_query_len: int, scale: float, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    seq_of, visible = prefill_rows(query_start, context_lens)
    return extension().paged_attention(q, k_cache, v_cache, block_tables, seq_of, visible, scale,
                                       window, softcap, 0, 0)


def prefill_rows(query_start: torch.Tensor, context_lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prefill token's chunk (its table row) and how many keys it sees."""
    lens = query_start[1:] - query_start[:-1]
    seq_of = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    # Token j of chunk i is at position context_lens[i] - (query_start[i + 1] - j), and sees
    # every key up to and including it.
    visible = context_lens[seq_of] - query_start[1:][seq_of] + 1 + torch.arange(
        len(seq_of), device=lens.device)
    return seq_of, visible
