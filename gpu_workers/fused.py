"""One call per decoder layer, where the kernel backend has it (`Kernels.decoder_layer`, the
cpu backend): each layer's weights are gathered once at load, and a step computes every row's
attention plan once for all layers. Only layers of the plain Llama shape take it (no biases,
q/k or sandwich norms, SiLU MLP, no tensor parallelism); a model with any other layer, and the
fixed-order attention of --deterministic, keep the Python layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.kernel_linear import KernelLinear
from gpu_workers.llama import MLP, AttentionMetadata, DecoderLayer, LlamaModel
from gpu_workers.quant import Int4Linear, Int8Linear
from kernels.attention_cpu import prefill_rows


def fuse_layers(model: LlamaModel) -> bool:
    """Give the model each layer's weights for ops.decoder_layer (model.fused) if its backend
    has one and every layer can take it; whether it did."""
    weights = [layer_weights(layer) for layer in model.layers]
    fusable = model.ops.decoder_layer is not None and all(w is not None for w in weights)
    model.fused = weights if fusable else None
    return fusable


def layer_weights(layer: DecoderLayer) -> tuple | None:
    """(input norm, qkv, o, MLP norm, gate_up, down, the int4 and int8 products' activation
    bits) as decoder_layer takes them, or None."""
    attn, mlp = layer.attn, layer.mlp
    if (attn.qkv_bias is not None or attn.q_norm is not None or attn.tp.size > 1
            or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
            or not isinstance(mlp, MLP) or mlp.act is not F.silu):
        return None
    projections = [_projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                            mlp.down_proj)]
    if any(p is None for p in projections):
        return None
    qkv, o, gate_up, down = projections
    bits = {p.activation_bits for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                        mlp.down_proj) if isinstance(p, Int4Linear | Int8Linear)}
    if len(bits) > 1:
        return None
    return (layer.input_norm, qkv, o, layer.mlp_norm, gate_up, down,
            bits.pop() if bits else 16)


def _projection(module: nn.Module) -> list[torch.Tensor] | None:
    """[W] or [W, oneDNN's copy], or [the blob pack_int8 or pack_int4 made]: what the C++
    products read."""
    if isinstance(module, KernelLinear) and module.packed is not None:
        return [module.weight, module.packed]
    if isinstance(module, KernelLinear) or isinstance(module, nn.Linear) and module.bias is None:
        return [module.weight]
    if isinstance(module, Int8Linear | Int4Linear) and module.cpp:
        return [module.packed]
    return None


def attention_rows(meta: AttentionMetadata, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(tables, seq_of, visible, shared_rows, shared_keys) for the whole step: decode rows read
    their own table rows, prefill tokens their chunk's, each seeing its context up to itself;
    the decode rows' shared leading blocks are read once for all of them (cascade)."""
    nd = meta.num_decode
    seq_of, visible = prefill_rows(meta.prefill_query_start, meta.prefill_context_lens)
    width = max(meta.decode_block_tables.shape[1], meta.prefill_block_tables.shape[1])
    tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in
                        (meta.decode_block_tables, meta.prefill_block_tables)])
    return (tables.to(torch.int64),
            torch.cat([torch.arange(nd, device=tables.device), seq_of + nd]),
            torch.cat([meta.decode_context_lens, visible]).to(torch.int64),
            nd, meta.decode_shared_blocks * block_size)


def run_layers(model: LlamaModel, x: torch.Tensor, residual: torch.Tensor | None,
               ropes: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
               kv_caches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's layers, one decoder_layer call each."""
    rows = attention_rows(meta, kv_caches.shape[-2])
    for layer, weights, kv_cache in zip(model.layers, model.fused, kv_caches, strict=True):
        attn = layer.attn
        x, residual = model.ops.decoder_layer(
            x, residual, *weights, *ropes[layer.rope_table], kv_cache[0], kv_cache[1],
            meta.slot_mapping, *rows, attn.num_heads, layer.eps, attn.scale, attn.window,
            attn.softcap)
    return x, residual
