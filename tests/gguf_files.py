"""A tiny Hugging Face model (tests/tiny_families.py) written as a GGUF file the way llama.cpp's
converter writes its architecture: its tensor names and key/values, Llama's Q/K rows in
llama.cpp's rotary order, Gemma's norms stored as 1 + w, rotary factors as tensors."""

from __future__ import annotations

import math
import os

import numpy as np

# Hugging Face model_type -> GGUF general.architecture
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
                 "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2",
                 "gemma3_text": "gemma3"}
# HF per-layer suffix -> GGUF tensor name (the experts are stacked separately).
_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
            "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows interleaved as llama.cpp's converter writes Llama's (the loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _write_keys(writer, c, arch: str) -> None:  # noqa: ANN001 (gguf and transformers objects)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]  # llama.cpp fixes the windowed layers' base at 10000
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "sliding_window", None) and arch in ("llama", "gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
    if getattr(c, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if rope.get("rope_type") == "yarn":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter
        original = c.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_weights_norm(c.norm_topk_prob)


def _rope_tensors(c) -> dict[str, np.ndarray]:  # noqa: ANN001 (a transformers config)
    """llama3 rope as rope_freqs (each frequency's divisor, from transformers' own frequencies),
    LongRoPE as its two factor lists."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        dim = scaled.shape[0] * 2
        plain = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        return {"rope_freqs.weight": (plain / scaled).numpy()}
    if rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    return {}


def write_gguf(folder: str, path: str) -> None:
    """The float32 model in `folder` as a GGUF file of llama.cpp's architecture for it."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    arch = ARCHITECTURES[c.model_type]
    gemma = arch.startswith("gemma")
    names = _NAMES | (_GEMMA_NAMES if gemma else {})
    weights = load_file(os.path.join(folder, "model.safetensors"))
    if gemma:  # llama.cpp's converter folds Gemma's (1 + w) into the stored norms
        weights = {n: w + 1 if n.endswith("norm.weight") else w for n, w in weights.items()}
    writer = gguf.GGUFWriter(path, arch)
    _write_keys(writer, c, arch)
    writer.add_tensor("token_embd.weight", weights.pop("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", weights.pop("model.norm.weight"))
    if "lm_head.weight" in weights:  # absent when tied
        writer.add_tensor("output.weight", weights.pop("lm_head.weight"))
    for name, w in _rope_tensors(c).items():
        writer.add_tensor(name, w)
    stacks: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, w in weights.items():
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        rest, kind = rest.rsplit(".", 1)  # kind: weight or bias
        if ".experts." in rest:
            expert, part = rest.split(".experts.")[1].split(".")
            stacks.setdefault(f"blk.{layer}.{_EXPERTS[part]}.weight", []).append((int(expert), w))
            continue
        if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _llama_cpp_order(w, c.num_attention_heads if "q_" in rest
                                 else c.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{names[rest]}.{kind}", w)
    for name, parts in stacks.items():
        writer.add_tensor(name, np.stack([w for _, w in sorted(parts, key=lambda p: p[0])]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def round_trip(folder: str) -> tuple[object, dict[str, list[int]], dict[str, list[int]]]:
    """The model in `folder` written as GGUF and loaded by surge: (surge's model, its greedy
    tokens for tests/test_families' prompts, transformers' generate's for the folder)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model
    from tests.inprocess import InProcessEngine
    from tests.test_families import N_TOKENS, _prompts

    path = os.path.join(folder, "model.gguf")
    write_gguf(folder, path)
    model = load_model(resolve_model(path), torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = InProcessEngine(model)
    expected = {}
    with torch.inference_mode():
        for name, ids in _prompts().items():
            engine.add(name, ids, N_TOKENS)
            expected[name] = hf.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS,
                                         do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, len(ids):].tolist()
    return model, engine.run(), expected
