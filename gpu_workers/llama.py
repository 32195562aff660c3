"""The Llama family (Llama 2/3, SmolLM, ...) over a flattened batch and a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from msgspec import Struct
from torch import nn

import kernels
from gpu_workers.parallel import TensorParallel
from kernels import Kernels


class LlamaConfig(Struct, kw_only=True):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    max_position_embeddings: int
    tie_word_embeddings: bool


class AttentionMetadata(Struct, kw_only=True):
    """Where each token's K/V goes and what it attends to. Decode tokens (one per sequence) come
    first in the batch, then the prefill chunks."""

    slot_mapping: torch.Tensor  # [T]
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decode]
    decode_shared_blocks: int = 0  # leading blocks every decoding sequence has in common
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks]
    prefill_query_start: torch.Tensor  # [num_prefill + 1], from 0 (offsets into the prefill part)
    prefill_context_lens: torch.Tensor  # [num_prefill]
    prefill_max_query_len: int
    # --deterministic: every query attends in kernels.fixed_order_attention's fixed tiles.
    fixed_order: bool = False

    @classmethod
    def decode_only(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, no_prefill: torch.Tensor) -> AttentionMetadata:
        """One token per sequence, no prefill part (no_prefill: a [1] zero tensor, kept by the
        caller so a captured graph reads a fixed address)."""
        return cls(slot_mapping=slot_mapping, num_decode=len(slot_mapping),
                   decode_block_tables=block_tables, decode_context_lens=context_lens,
                   prefill_block_tables=block_tables[:0], prefill_query_start=no_prefill,
                   prefill_context_lens=context_lens[:0], prefill_max_query_len=0)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they are grouped on; qkv_proj is column
    parallel, o_proj row parallel (its partial sums reduced over the group)."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = tp.split(cfg.num_heads, "attention heads")
        self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, decode: tuple | None, kv_cache: torch.Tensor,
                ops: Kernels) -> torch.Tensor:
        """decode: ops.plan_decode's plan for the decode rows (None without them)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        # Queries and keys are adjacent columns: rotate them in one pass.
        q, k, v = qkv.view(t, heads + 2 * kv_heads, d).split((heads, kv_heads, kv_heads), dim=1)
        ops.apply_rotary_(qkv.view(t, heads + 2 * kv_heads, d)[:, : heads + kv_heads], *rope)
        k_cache, v_cache = kv_cache
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.fixed_order:
            out = _fixed_order(q, k_cache, v_cache, meta, self.scale)
            return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))
        nd = meta.num_decode
        parts = []
        if nd:
            parts.append(ops.decode_attention(q[:nd], k_cache, v_cache, decode, self.scale))
        if nd < t:
            parts.append(ops.prefill_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_context_lens, meta.prefill_max_query_len, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))


def _fixed_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The step's attention, decode rows and each prefill chunk, in the fixed-order kernel."""
    nd = meta.num_decode
    parts = []
    if nd:
        visible = meta.decode_context_lens[:, None]
        parts.append(kernels.fixed_order_attention(
            q[:nd, None], k_cache, v_cache, meta.decode_block_tables, visible, scale)[:, 0])
    bounds = meta.prefill_query_start.tolist()
    for i, ctx in enumerate(meta.prefill_context_lens.tolist()):
        n = bounds[i + 1] - bounds[i]
        visible = torch.arange(ctx - n + 1, ctx + 1, device=q.device)[None]
        parts.append(kernels.fixed_order_attention(
            q[nd + bounds[i]: nd + bounds[i + 1]][None], k_cache, v_cache,
            meta.prefill_block_tables[i: i + 1], visible, scale)[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class MLP(nn.Module):
    """gate_up_proj column parallel, down_proj row parallel."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        ff = tp.split(cfg.intermediate_size, "MLP columns (intermediate_size)")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * ff, bias=False)
        self.down_proj = nn.Linear(ff, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.attn = Attention(cfg, tp)
        self.post_attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                decode: tuple | None, kv_cache: torch.Tensor, ops: Kernels
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, ops.rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = ops.add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attn(x, rope, meta, decode, kv_cache, ops)
        x, residual = ops.add_rms_norm(x, residual, self.post_attn_norm, self.eps)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """The whole model on one rank; the embedding, norms and LM head are replicated."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.rope = torch.empty(0)
        # The kernel backend every layer runs on (the worker picks it: kernels.for_device).
        self.ops = kernels.REFERENCE

    def init_rope(self) -> None:
        """Build the rotary table (float32, on the weights' device) once the weights are placed."""
        cfg = self.cfg
        self.rope = kernels.rotary_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        ).to(self.embed.weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed(input_ids)
        residual = None
        rope = kernels.rotary_angles(positions, self.rope)
        # Every layer's decode attention reads the same blocks of its own cache: planned once.
        ops = self.ops
        decode = (ops.plan_decode(meta.decode_block_tables, meta.decode_context_lens,
                                      kv_caches[0, 0], meta.decode_shared_blocks)
                  if meta.num_decode and not meta.fixed_order else None)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, meta, decode, kv_cache, ops)
        x, _ = ops.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed.weight).float()
        return self.lm_head(hidden).float()
