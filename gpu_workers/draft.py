"""The draft model of speculative decoding, on the worker.

A separate draft model runs every step's tokens as the target does, into a KV cache of its own
laid out by the same block tables, so it knows every position the target knows. A draft made of
the target's own first layers needs neither: the target's forward already computes exactly its
K/V, so it works in the target's cache (its proposals' K/V, written past the sequence's end, are
overwritten when the target computes those positions).

After the target has verified a step, the draft proposes the next tokens for each sequence that
asks: greedily, one decode step at a time from the sequence's newest token. A greedy (one-hot)
proposal keeps the sampler's verification exact for any temperature (see sampler.sample).
"""

from __future__ import annotations

import msgspec
import torch
from torch import nn

from gpu_workers.families import too_many_layers
from gpu_workers.llama import AttentionMetadata, LlamaModel


def truncated(model: LlamaModel, num_layers: int) -> LlamaModel:
    """model's first num_layers layers with its embedding, final norm and head: the same
    weights, not a copy."""
    if problem := too_many_layers(num_layers, model.cfg.num_layers):
        raise ValueError(problem)
    with torch.device("meta"):
        draft = LlamaModel(msgspec.structs.replace(model.cfg, num_layers=num_layers), model.tp)
    draft.embed, draft.norm, draft.lm_head = model.embed, model.norm, model.lm_head
    draft.layers = nn.ModuleList(model.layers[:num_layers])
    draft.rope = model.rope
    return draft


def shares_layers(draft: LlamaModel, target: LlamaModel) -> bool:
    """Whether draft is the target's own first layers (see truncated)."""
    return all(a is b for a, b in zip(draft.layers, target.layers, strict=False))


class DraftModel:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 mirrors: bool) -> None:
        """mirrors: the draft keeps a cache of its own (kv_cache), fed every step's tokens;
        else kv_cache is the target's first layers."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.mirrors = mirrors
        self.no_prefill = torch.zeros(1, dtype=torch.int64, device=kv_cache.device)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The step's tokens through a separate draft, for its KV cache (no logits needed)."""
        if self.mirrors:
            self.model(input_ids, positions, meta, self.kv_cache)

    def propose(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                k: int) -> torch.Tensor:
        """[S, k] greedy proposals following tokens[i], the token at positions[i] of sequence
        i (block table tables[i], with slots for k positions from there)."""
        bs, proposals = self.block_size, []
        for _ in range(k):
            slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
            meta = AttentionMetadata.decode_only(slots, tables, positions + 1, self.no_prefill)
            hidden = self.model(tokens, positions, meta, self.kv_cache)
            tokens = self.model.logits(hidden).argmax(dim=-1)
            proposals.append(tokens)
            positions = positions + 1
        return torch.stack(proposals, dim=1)
