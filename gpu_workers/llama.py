"""The Llama family (Llama 2/3, SmolLM, ...) over a flattened batch and a paged KV cache, and the
families that differ from it in small ways (Qwen2/3, Mistral, Phi-3, Gemma 2/3, and with
mixtures of experts Mixtral and Qwen3-MoE): each difference is one switch of LlamaConfig, set
from the checkpoint by gpu_workers/families.py."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from msgspec import Struct
from torch import nn

import kernels
from gpu_workers.families import LlamaConfig
from gpu_workers.moe import MoE
from gpu_workers.parallel import TensorParallel
from gpu_workers.pipeline import PipelineStage
from kernels import Kernels


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

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, window: int) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = tp.split(cfg.num_heads, "attention heads")
        self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)[1]
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        # A bias of its own, not the Linear's, so quantized and packed projections keep it.
        self.qkv_bias = nn.Parameter(torch.zeros(q + 2 * kv)) if cfg.qkv_bias else None
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.window, self.softcap = window, cfg.attn_softcap

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, decode: tuple | None, kv_cache: torch.Tensor,
                ops: Kernels) -> torch.Tensor:
        """decode: ops.plan_decode's plan for the decode rows (None without them)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.view(t, heads + 2 * kv_heads, d).split((heads, kv_heads, kv_heads), dim=1)
        if self.q_norm is not None:
            q.copy_(ops.rms_norm(q, self.q_norm, self.eps))
            k.copy_(ops.rms_norm(k, self.k_norm, self.eps))
        # Queries and keys are adjacent columns: rotated in one pass, and stored with v.
        k_cache, v_cache = kv_cache
        ops.rotate_and_store(qkv.view(t, heads + 2 * kv_heads, d)[:, : heads + kv_heads], v,
                             *rope, k_cache, v_cache, meta.slot_mapping)
        extra = dict(window=self.window, softcap=self.softcap)
        if meta.fixed_order:
            out = _fixed_order(q, k_cache, v_cache, meta, self.scale, **extra)
            return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))
        nd = meta.num_decode
        parts = []
        if nd:
            parts.append(ops.decode_attention(q[:nd], k_cache, v_cache, decode, self.scale,
                                              **extra))
        if nd < t:
            parts.append(ops.prefill_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_context_lens, meta.prefill_max_query_len, self.scale, **extra))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, -1)))


def _fixed_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, **extra: float) -> torch.Tensor:
    """The step's attention, decode rows and each prefill chunk, in the fixed-order kernel."""
    nd = meta.num_decode
    parts = []
    if nd:
        visible = meta.decode_context_lens[:, None]
        parts.append(kernels.fixed_order_attention(
            q[:nd, None], k_cache, v_cache, meta.decode_block_tables, visible, scale,
            **extra)[:, 0])
    bounds = meta.prefill_query_start.tolist()
    for i, ctx in enumerate(meta.prefill_context_lens.tolist()):
        n = bounds[i + 1] - bounds[i]
        visible = torch.arange(ctx - n + 1, ctx + 1, device=q.device)[None]
        parts.append(kernels.fixed_order_attention(
            q[nd + bounds[i]: nd + bounds[i + 1]][None], k_cache, v_cache,
            meta.prefill_block_tables[i: i + 1], visible, scale, **extra)[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# LlamaConfig.activation -> the MLP's gate function.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """gate_up_proj column parallel, down_proj row parallel."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        ff = tp.split(cfg.intermediate_size, "MLP columns (intermediate_size)")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * ff, bias=False)
        self.down_proj = nn.Linear(ff, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor, ops: Kernels) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            hidden = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act(gate) * up
        return self.tp.all_reduce(self.down_proj(hidden))



class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, index: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        windowed = bool(cfg.window_layers) and cfg.window_layers[index]
        # Which of the model's rotary tables this layer reads (1: Gemma 3's local one).
        self.rope_table = int(windowed and cfg.local_rope_theta > 0)
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.attn = Attention(cfg, tp, cfg.sliding_window if windowed else 0)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = (MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                        cfg.experts_per_token, cfg.moe_renormalize, ACTIVATIONS[cfg.activation],
                        tp)
                    if cfg.num_experts and index not in cfg.dense_layers else MLP(cfg, tp))
        sandwich = cfg.sandwich_norms
        self.attn_out_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if sandwich else None
        self.mlp_out_norm = nn.Parameter(torch.ones(cfg.hidden_size)) if sandwich else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                decode: tuple | None, kv_cache: torch.Tensor, ops: Kernels
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, ops.rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = ops.add_rms_norm(x, residual, self.input_norm, self.eps)
        x = self.attn(x, rope, meta, decode, kv_cache, ops)
        if self.attn_out_norm is not None:
            x = ops.rms_norm(x, self.attn_out_norm, self.eps)
        x, residual = ops.add_rms_norm(x, residual, self.mlp_norm, self.eps)
        x = self.mlp(x, ops)
        if self.mlp_out_norm is not None:
            x = ops.rms_norm(x, self.mlp_out_norm, self.eps)
        return x, residual


class LlamaModel(nn.Module):
    """The model on one rank: with pipeline stages, only this stage's layers (kept under their
    global indices in `stage.layers`), the embedding on the first stage (and on the last as a
    tied head), the final norm and LM head on the last; replicated over tensor-parallel ranks."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage(layers=range(cfg.num_layers))
        first, last = self.stage.first, self.stage.last
        self.has_head = last
        # A weight of our own skips nn.Embedding's normal_ init, which on the meta device the
        # loader builds on imports torch._dynamo: 2.7 s of a worker's start-up.
        self.embed = (nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                   _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
                      if first or (last and cfg.tie_word_embeddings) else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp, i) for i in self.stage.layers)
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size)) if last else None
        self.lm_head = (None if cfg.tie_word_embeddings or not last
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.rope = torch.empty(0)  # [tables, positions, 2 * head_dim], see init_rope
        # The kernel backend every layer runs on (the worker picks it: kernels.for_device).
        self.ops = kernels.REFERENCE
        # Each layer's weights for ops.decoder_layer, one call a layer (gpu_workers/fused.py).
        self.fused: list[tuple] | None = None

    def replace_linears(self, match: Callable[[nn.Module], bool],
                        make: Callable[[nn.Module], nn.Module]) -> None:
        """Every module `match` accepts becomes make(module); so does a head tied to the
        embedding, given to make as a bias-free Linear over the embedding's own weight."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if match(child):
                    setattr(module, name, make(child))
        if self.lm_head is None and self.has_head:  # not on a pipeline stage before the last
            assert self.embed is not None
            tied = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False,
                             device="meta")
            tied.weight = self.embed.weight
            self.lm_head = make(tied)

    def init_rope(self) -> None:
        """Build the rotary tables (float32, on the weights' device: the global one, and Gemma 3's
        local one) once the weights are placed."""
        cfg = self.cfg
        tables = [kernels.rotary_cache(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                       cfg.rope_scaling)]
        if cfg.local_rope_theta:
            tables.append(kernels.rotary_cache(cfg.head_dim, cfg.max_position_embeddings,
                                               cfg.local_rope_theta))
        self.rope = torch.stack(tables).to(next(self.parameters()).device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; on a stage before the last, the
        [2, T, hidden] (x, residual) for the next stage, which passes them back as `states`."""
        residual = None
        if states is not None:  # from the previous stage
            x, residual = states[0], states[1]
        else:
            assert self.embed is not None
            x = self.embed(input_ids)
            if self.cfg.embed_scale != 1.0:
                # Rounded to the weights' dtype first, as Hugging Face's Gemma does.
                x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype).item()
        ropes = [kernels.rotary_angles(positions, table) for table in self.rope]
        ops = self.ops
        if self.fused is not None and not meta.fixed_order:
            from gpu_workers.fused import run_layers

            x, residual = run_layers(self, x, residual, ropes, meta, kv_caches)
        else:
            # Every layer's decode attention reads the same blocks of its own cache: planned
            # once.
            decode = (ops.plan_decode(meta.decode_block_tables, meta.decode_context_lens,
                                      kv_caches[0, 0], meta.decode_shared_blocks)
                      if meta.num_decode and not meta.fixed_order else None)
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, ropes[layer.rope_table], meta, decode,
                                    kv_cache, ops)
        if not self.stage.last:
            return torch.stack((x, residual))
        x, _ = ops.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            assert self.embed is not None
            logits = F.linear(hidden, self.embed.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.cfg.final_softcap
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits
