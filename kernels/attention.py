"""Paged attention over a flattened batch (reference implementations).

The KV cache of one layer is a pool of blocks, k_cache/v_cache [num_blocks, block_size, KVH, D];
a sequence's tokens live in the blocks its block table lists, token i in block i // block_size at
offset i % block_size. Query heads H are a multiple of KV heads (grouped-query attention).
"""

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into cache slots slot_mapping [T] (block * block_size + offset)."""
    kvh, d = k.shape[1:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, KVH, max_blocks * block_size, D] keys/values."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    # index_select copies whole blocks; advanced indexing (cache[block_tables]) is several
    # times slower on the CPU for the same result.
    return cache.index_select(0, block_tables.reshape(-1)).view(b, nb * bs, kvh, d).transpose(1, 2)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    shared_blocks: int = 0,
) -> torch.Tensor:
    """One query token per sequence, q [B, H, D], attending to its first context_lens[b] tokens.
    On the CPU, the first shared_blocks blocks may be the same for every sequence (and full in
    each): they are then read once for all queries (cascade attention)."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    if shared_blocks:
        return _cascade(q, k_cache, v_cache, block_tables, context_lens, scale, shared_blocks)
    k = _gather(k_cache, block_tables)
    v = _gather(v_cache, block_tables)
    # Each KV head serves a group of query heads: lay the group out as the "query length".
    qg = q.view(b, kvh, h // kvh, d)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU attention that also returns each query's log-sum-exp of its scores."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def _cascade(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, shared_blocks: int,
) -> torch.Tensor:
    """The shared blocks attended by every query at once, each sequence's own blocks apart;
    the two parts merged by their log-sum-exp."""
    b, h, d = q.shape
    kvh, g = k_cache.shape[2], h // k_cache.shape[2]
    head = block_tables[:1, :shared_blocks]
    everyone = q.view(b, kvh, g, d).transpose(0, 1).reshape(1, kvh, b * g, d)
    out_head, lse_head = _attend(everyone, _gather(k_cache, head), _gather(v_cache, head), scale)
    out_head = out_head.view(kvh, b, g, d).transpose(0, 1)
    lse_head = lse_head.view(kvh, b, g).transpose(0, 1)
    tail = block_tables[:, shared_blocks:]
    k, v = _gather(k_cache, tail), _gather(v_cache, tail)
    lens = context_lens - shared_blocks * k_cache.shape[1]
    hidden = torch.arange(k.shape[2], device=q.device)[None, :] >= lens[:, None]
    mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
        hidden, float("-inf"))[:, None, None, :]
    out_tail, lse_tail = _attend(q.view(b, kvh, g, d), k, v, scale, mask)
    top = torch.maximum(lse_head, lse_tail)
    w_head, w_tail = (lse_head - top).exp()[..., None], (lse_tail - top).exp()[..., None]
    out = (out_head.float() * w_head + out_tail.float() * w_tail) / (w_head + w_tail)
    return out.to(q.dtype).reshape(b, h, d)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
    max_query_len: int, scale: float,
) -> torch.Tensor:
    """Variable-length chunks q [T, H, D]: chunk i is q[query_start[i]:query_start[i + 1]], the
    last tokens of its sequence's context_lens[i] (earlier ones already cached), causal within
    the chunk. max_query_len bounds the chunks' lengths (it sizes the Triton grid)."""
    h = q.shape[1]
    kvh = k_cache.shape[2]
    out = torch.empty_like(q)
    bounds = query_start.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = bounds[i], bounds[i + 1]
        n = end - start
        nb = -(-ctx // k_cache.shape[1])
        k = _gather(k_cache, block_tables[i : i + 1, :nb])[:, :, :ctx]
        v = _gather(v_cache, block_tables[i : i + 1, :nb])[:, :, :ctx]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ctx == n:
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
