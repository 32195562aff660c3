"""MoE checkpoints as GGUF files, written with the gguf package's writer from the tiny Hugging
Face models (Qwen3-MoE as `qwen3moe`, Mixtral as `llama` with experts), loaded by surge: the
greedy tokens of transformers' own implementation of the Hugging Face model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.inprocess import InProcessEngine
from tests.test_families import N_TOKENS, _prompts
from tests.tiny_families import save_tiny

pytestmark = pytest.mark.slow

# HF per-layer suffix -> GGUF tensor name (the experts are stacked separately).
_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
            "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows interleaved as llama.cpp's converter writes Llama's (the loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(folder: str, path: str) -> None:
    """The float32 model in `folder` as a GGUF file of llama.cpp's architecture for it."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    arch = "qwen3moe" if c["model_type"] == "qwen3_moe" else "llama"
    weights = load_file(os.path.join(folder, "model.safetensors"))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    writer.add_expert_count(c["num_local_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        writer.add_expert_weights_norm(c["norm_topk_prob"])
    writer.add_tensor("token_embd.weight", weights.pop("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", weights.pop("model.norm.weight"))
    writer.add_tensor("output.weight", weights.pop("lm_head.weight"))
    stacks: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, w in weights.items():
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        rest = rest.removesuffix(".weight")
        if ".experts." in rest:
            expert, kind = rest.split(".experts.")[1].split(".")
            stacks.setdefault(f"blk.{layer}.{_EXPERTS[kind]}.weight", []).append((int(expert), w))
            continue
        if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = c["num_attention_heads" if "q_" in rest else "num_key_value_heads"]
            w = _llama_cpp_order(w, heads)
        writer.add_tensor(f"blk.{layer}.{_NAMES[rest]}.weight", w)
    for name, parts in stacks.items():
        writer.add_tensor(name, np.stack([w for _, w in sorted(parts, key=lambda p: p[0])]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_round_trip_gives_the_tokens_of_transformers(family, tmp_path):
    """llama.cpp's qwen3moe has no dense layers and renormalises the top-k weights: the tiny
    Qwen3-MoE is written so, to be the same model in both formats."""
    from transformers import AutoModelForCausalLM

    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model

    overrides = dict(mlp_only_layers=[], norm_topk_prob=True) if family == "qwen3_moe" else {}
    save_tiny(str(tmp_path), family, **overrides)
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(str(tmp_path), path)
    model = load_model(resolve_model(path), torch.device("cpu"), torch.float32)
    assert model.cfg.num_experts == (8 if family == "qwen3_moe" else 4)
    assert model.cfg.moe_renormalize and model.cfg.dense_layers == []
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    engine = InProcessEngine(model)
    expected = {}
    with torch.inference_mode():
        for name, ids in _prompts().items():
            engine.add(name, ids, N_TOKENS)
            expected[name] = hf.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS,
                                         do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, len(ids):].tolist()
    assert engine.run() == expected
