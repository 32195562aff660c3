"""Paged attention over a flattened batch (reference implementations).

The KV cache of one layer is a pool of blocks per KV head, k_cache/v_cache [KVH, num_blocks,
block_size, D]; a sequence's tokens live in the blocks its block table lists, token i in block
i // block_size at offset i % block_size. Head-major, so a sequence's blocks gathered for one head
are one contiguous [tokens, D] matrix. Query heads H are a multiple of KV heads (grouped-query
attention). Some families add two things every kernel takes: a sliding window (a query at
position p sees only keys p - window < i <= p; 0: no window) and a soft cap on the scores
(softcap * tanh(s / softcap); 0: none).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Up to this many decoding sequences SDPA's fused CPU kernel is faster (less fixed cost per call);
# above it, batched matrix products are: SDPA runs a small GEMM per (sequence, head) for the one
# query row each has. Measured with SmolLM2 on a 2-core AVX-512 machine, context 192: whole
# steps 36.3 vs 37.5 ms at 8 sequences, 39.6 vs 38.1 ms at 12.
SDPA_MAX_DECODE = 8


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into cache slots slot_mapping [T] (block * block_size + offset)."""
    kvh, _, _, d = k_cache.shape
    k_cache.view(kvh, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kvh, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _rows(block_tables: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> the flattened pool's rows [B * KVH * nb], each (sequence, head) in
    turn, so that each gathers into one contiguous matrix."""
    kvh, n = k_cache.shape[:2]
    return (block_tables[:, None, :]
            + torch.arange(kvh, device=k_cache.device)[:, None] * n).reshape(-1)


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, b: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [b, KVH, blocks * block_size, D] of the pool rows (see _rows)."""
    kvh, n, bs, d = k_cache.shape
    # One index_select of whole blocks (several times faster on the CPU than advanced indexing).
    return tuple(c.view(kvh * n, bs, d).index_select(0, rows).view(b, kvh, -1, d)
                 for c in (k_cache, v_cache))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float = 0.0,
            product: Callable = torch.matmul) -> torch.Tensor:
    """q [..., G, D] against k [..., L, D]: scaled (and soft-capped) fp32 scores [..., G, L]."""
    s = product(q, k.transpose(-1, -2)).float().mul_(scale)
    return s.div_(softcap).tanh_().mul_(softcap) if softcap else s


def _fixed_order_matmul(a: torch.Tensor, b: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """a [..., R, K] @ b [..., K, C] with every sum taken in K order whatever R is: a BLAS
    product picks its kernel (and so its summation order) by the shapes, which on some CPUs
    (AMD's, under MKL) gives one row different bits alone than among others. Rows go in slices
    of `rows` to bound the [R, C, K] products held at once."""
    bt = b.transpose(-1, -2)[..., None, :, :]
    return torch.cat([(a[..., i:i + rows, None, :] * bt).sum(-1)
                      for i in range(0, a.shape[-2], rows)], dim=-2)


def _hidden(keys: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """True where a query at q_pos [..., 1] must not see key position keys [L]."""
    hidden = keys > q_pos
    return hidden | (keys <= q_pos - window) if window else hidden


class DecodePlan(NamedTuple):
    """What every layer's decode attention reads the same way in a step, worked out once."""

    rows: torch.Tensor  # each sequence's own blocks (past the shared ones), see _rows
    head_rows: torch.Tensor | None  # cascade: the shared blocks, once
    # None: one sequence, whose keys are sliced to its context. Up to SDPA_MAX_DECODE: an
    # additive mask [B, 1, 1, L] for SDPA. More, or cascade: True on the keys each one skips.
    mask: torch.Tensor | None
    length: int  # keys read per sequence: one sequence's context, else the gathered width
    block_tables: torch.Tensor  # as given, for layers with a window or soft cap
    context_lens: torch.Tensor


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor,
                shared_blocks: int = 0) -> DecodePlan:
    """Decode attention of sequences with these block tables [B, max_blocks] and context lens
    [B]. On the CPU, the first shared_blocks blocks may be the same for every sequence (and full
    in each): they are then read once for all queries (cascade attention)."""
    b, nb = block_tables.shape
    bs = k_cache.shape[2]
    if b == 1 and not shared_blocks:
        return DecodePlan(_rows(block_tables, k_cache), None, None, int(context_lens[0]),
                          block_tables, context_lens)
    head_rows = _rows(block_tables[:1, :shared_blocks], k_cache) if shared_blocks else None
    own = (nb - shared_blocks) * bs
    hidden = (torch.arange(own, device=k_cache.device)[None, :]
              >= (context_lens - shared_blocks * bs)[:, None])[:, None, None, :]
    if b <= SDPA_MAX_DECODE and not shared_blocks:
        hidden = torch.zeros(hidden.shape, dtype=k_cache.dtype,
                             device=k_cache.device).masked_fill_(hidden, float("-inf"))
    return DecodePlan(_rows(block_tables[:, shared_blocks:], k_cache), head_rows, hidden, own,
                      block_tables, context_lens)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan, scale: float, window: int = 0, softcap: float = 0.0
                     ) -> torch.Tensor:
    """One query token per sequence, q [B, H, D], attending to its context (see plan_decode)."""
    b, h, d = q.shape
    kvh = k_cache.shape[0]
    # Each KV head serves a group of query heads: the group is the "query length".
    qg = q.view(b, kvh, h // kvh, d)
    if window or softcap:
        # The plain path over whole tables: the plan's fast paths assume every key counts.
        k, v = _gather(k_cache, v_cache, _rows(plan.block_tables, k_cache), b)
        keys = torch.arange(k.shape[2], device=q.device)
        hidden = _hidden(keys, plan.context_lens[:, None] - 1, window)
        scores = _scores(qg, k, scale, softcap).masked_fill_(hidden[:, None, None], float("-inf"))
        return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, h, d)
    k, v = _gather(k_cache, v_cache, plan.rows, b)
    if plan.mask is None:
        n = plan.length
        return F.scaled_dot_product_attention(qg, k[:, :, :n], v[:, :, :n],
                                              scale=scale).reshape(b, h, d)
    if plan.mask.dtype != torch.bool:
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.mask,
                                              scale=scale).reshape(b, h, d)
    # In bf16 the scores are rounded to bf16 before the fp32 softmax, as Hugging Face's eager
    # attention does; SDPA keeps them in fp32.
    scores = _scores(qg, k, scale).masked_fill_(plan.mask, float("-inf"))
    if plan.head_rows is None:
        return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, h, d)
    # Cascade: the shared keys are scored for all queries at once ([1, KVH, B * G, D]), then one
    # softmax spans both parts, so the result is the plain one.
    k_head, v_head = _gather(k_cache, v_cache, plan.head_rows, 1)
    s = k_head.shape[2]
    everyone = qg.transpose(0, 1).reshape(1, kvh, -1, d)
    head_scores = _scores(everyone, k_head, scale).view(kvh, b, -1, s).transpose(0, 1)
    p = torch.cat([head_scores, scores], -1).softmax(-1).to(v.dtype)
    p_head, p_own = p.split([s, k.shape[2]], -1)
    out_head = torch.matmul(p_head.transpose(0, 1).reshape(1, kvh, -1, s), v_head)
    out = out_head.view(kvh, b, -1, d).transpose(0, 1) + torch.matmul(p_own, v)
    return out.reshape(b, h, d)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
    max_query_len: int, scale: float, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """Variable-length chunks q [T, H, D]: chunk i is q[query_start[i]:query_start[i + 1]], the
    last tokens of its sequence's context_lens[i] (earlier ones already cached), causal within
    the chunk. max_query_len bounds the chunks' lengths (it sizes the Triton grid)."""
    h = q.shape[1]
    kvh, _, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    bounds = query_start.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        n = end - start
        table = block_tables[i : i + 1, : -(-ctx // bs)]
        k, v = (c[:, :, :ctx] for c in _gather(k_cache, v_cache, _rows(table, k_cache), 1))
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if window or softcap:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            hidden = _hidden(torch.arange(ctx, device=q.device), q_pos, window)
            g = h // kvh
            scores = _scores(qi, k.repeat_interleave(g, 1), scale, softcap).masked_fill_(
                hidden, float("-inf"))
            o = torch.matmul(scores.softmax(-1).to(v.dtype), v.repeat_interleave(g, 1))
        elif ctx == n:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale,
                                               enable_gqa=h != kvh)
        else:
            # Query t sits at position ctx - n + t and sees every key up to and including it.
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=h != kvh)
        out[start:end] = o[0].transpose(0, 1)
    return out


# --deterministic attention sums a query's keys in tiles of this many (rounded to whole blocks),
# in order: the tile, not the batch or the chunk, fixes the order of every floating-point sum.
FIXED_TILE = 64


def fixed_order_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, visible: torch.Tensor, scale: float,
                          window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [B, n, H, D]: n queries of each of B sequences; query j of sequence i sees its first
    visible[i, j] keys. An online softmax in float32 over fixed tiles of keys, so a query's
    result does not depend on what else is in the step (a decode row and the same position
    recomputed inside a prefill chunk agree to the bit)."""
    b, n, h, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    g = h // kvh
    tile = max(1, FIXED_TILE // bs) * bs
    pad = -block_tables.shape[1] % (tile // bs)
    # Padding columns read block 0; every key they give is masked.
    tables = F.pad(block_tables, (0, pad))
    k, v = _gather(k_cache, v_cache, _rows(tables, k_cache), b)
    rows = q.view(b, n, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, n * g, d).float()
    seen = visible[:, None, :, None].expand(b, 1, n, g).reshape(b, 1, n * g, 1)
    m = torch.full((b, kvh, n * g, 1), float("-inf"), device=q.device)
    total = torch.zeros_like(m)
    acc = torch.zeros(b, kvh, n * g, d, device=q.device)
    # One sequence's queries come in position order, so those that see nothing of a tile are
    # the first rows: they are left out of it (for them it would change nothing anyway).
    chunk = visible[0] if b == 1 else None
    for start in range(0, int(visible.max()), tile):
        lo = 0 if chunk is None else int(torch.searchsorted(chunk, start, right=True)) * g
        keys = torch.arange(start, start + tile, device=q.device)
        s = _scores(rows[:, :, lo:], k[:, :, start:start + tile].float(), scale, softcap,
                    _fixed_order_matmul)
        s = s.masked_fill_(_hidden(keys, seen[:, :, lo:] - 1, window), float("-inf"))
        # A tile a query cannot see leaves its sums exactly as they were (exp(0) = 1, p = 0);
        # before its window's first key (the maximum still -inf) it adds nothing either.
        m_new = torch.maximum(m[:, :, lo:], s.amax(-1, keepdim=True))
        m_safe = m_new.nan_to_num(neginf=0.0)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m[:, :, lo:] - m_safe)
        total[:, :, lo:] = total[:, :, lo:] * alpha + p.sum(-1, keepdim=True)
        acc[:, :, lo:] = acc[:, :, lo:] * alpha + _fixed_order_matmul(
            p, v[:, :, start:start + tile].float())
        m[:, :, lo:] = m_new
    out = (acc / total).to(q.dtype).view(b, kvh, n, g, d).permute(0, 2, 1, 3, 4)
    return out.reshape(b, n, h, d)
