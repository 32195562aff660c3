"""A tiny random Llama saved as a Hugging Face safetensors folder, for fast tests."""

from __future__ import annotations

import torch


def save_tiny_llama(folder: str, *, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                    vocab: int = 256, tie: bool = False, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16 * heads, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=vocab - 1,
                      bos_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Larger weights than the default init make the greedy path depend on every layer.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(folder, safe_serialization=True)


@torch.inference_mode()
def hf_greedy(folder: str, prompt: list[int], n: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    for _ in range(n):
        token = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()
