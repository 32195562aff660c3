"""A tiny random model of each family surge serves, its quirks switched on, saved as a Hugging
Face safetensors folder: 2 layers (Qwen3-MoE: 3), hidden 64, 4 query heads over 2 KV heads."""

from __future__ import annotations

import torch

WINDOW = 8  # shorter than the test prompts plus their answers
ORIGINAL = 48  # the original context of the stretched-rope families: the prompts fit in it

# family -> (transformers config class, its quirks)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    # Scalings that stretch the context: past ORIGINAL tokens the prompts' answers cross it.
    "llama-dynamic": ("LlamaConfig", dict(max_position_embeddings=ORIGINAL, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "qwen2-yarn": ("Qwen2Config", dict(max_position_embeddings=4 * ORIGINAL, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0,
        original_max_position_embeddings=ORIGINAL))),
    # Hugging Face's Phi-3 recomputes a sequence's whole cache with the long factors when it
    # crosses the original context (surge rotates only the positions past it by them): here
    # the sequences stay inside it; tests/test_rotary_scalings.py checks the long factors.
    "phi3-longrope": ("Phi3Config", dict(
        pad_token_id=0, max_position_embeddings=512, original_max_position_embeddings=128,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                             short_factor=[1.0 + i / 8 for i in range(8)],
                             long_factor=[1.0 + i for i in range(8)]))),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW,
                                        query_pre_attn_scalar=24, sliding_window_pattern=2,
                                        final_logit_softcapping=3.0, rope_parameters=dict(
                                            full_attention=dict(rope_type="default",
                                                                rope_theta=1e6),
                                            sliding_attention=dict(rope_type="default",
                                                                   rope_theta=1e4)))),
    # 8 experts, top-2 weights as softmaxed (norm_topk_prob off), the middle layer dense.
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_hidden_layers=3, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
    # 4 experts, top-2 weights renormalised to sum to 1.
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def save_tiny(folder: str, family: str, seed: int = 0, shard_size: str | None = None,
              **overrides: object) -> None:
    """overrides: config fields over the family's tiny ones (e.g. a larger vocab_size);
    shard_size: the weights in shards of at most this size, with an index file."""
    import transformers

    cls, quirks = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{
        **dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=0, eos_token_id=255),
        **quirks, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    # Every weight random (biases and norms too, which start as 0 or 1), larger than the default
    # init so that the greedy path depends on every layer. Gemma scales its embeddings by 8 here:
    # smaller ones keep them from drowning the layers' output.
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if "norm" in name or name.endswith("bias") else 0.1
            if gemma:
                std = 0.02 if "embed" in name else 2 * std
            p.normal_(1.0 if "norm" in name and not gemma else 0.0, std)
    model.save_pretrained(folder, safe_serialization=True,
                          **({"max_shard_size": shard_size} if shard_size else {}))


def save_tiny_served(folder: str, family: str, **overrides: object) -> None:
    """A tiny model `surge serve` can serve: the bundled model's vocabulary, its tokenizer
    files saved beside the weights."""
    from server.tokenizer import Tokenizer
    from surge.model_files import tokenizer_files

    save_tiny(folder, family, **{"vocab_size": 49152, "eos_token_id": 2, **overrides})
    Tokenizer(tokenizer_files("default", None)).hf.save_pretrained(folder)
