"""Each rope scaling's table against transformers' own rotary embedding, position by position
as a sequence grows (how Hugging Face moves dynamic and longrope frequencies), past the
original context too."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.families import config_from_hf
from kernels.rotary import rotary_cache

ORIGINAL = 32
SCALINGS = {
    "linear": ("LlamaConfig", dict(rope_type="linear", factor=2.0)),
    "llama3": ("LlamaConfig", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8)),
    "dynamic": ("LlamaConfig", dict(rope_type="dynamic", factor=3.0)),
    "yarn": ("LlamaConfig", dict(rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=ORIGINAL)),
    "yarn-mscale": ("LlamaConfig", dict(rope_type="yarn", factor=8.0, mscale=0.707,
                                        mscale_all_dim=0.707, beta_fast=16, beta_slow=2,
                                        original_max_position_embeddings=ORIGINAL)),
    "longrope": ("Phi3Config", dict(rope_type="longrope",
                                    short_factor=[1.0 + i / 8 for i in range(8)],
                                    long_factor=[1.0 + i for i in range(8)])),
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_table_rows_are_transformers_cos_and_sin(name):
    import transformers

    cls, rope = SCALINGS[name]
    extra = dict(original_max_position_embeddings=ORIGINAL, max_position_embeddings=4 * ORIGINAL,
                 pad_token_id=0) if cls == "Phi3Config" else dict(max_position_embeddings=ORIGINAL)
    hf_cfg = getattr(transformers, cls)(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_theta": 10000.0, **rope}, **extra)
    ours = config_from_hf(hf_cfg)
    table = rotary_cache(ours.head_dim, ours.max_position_embeddings, ours.rope_theta,
                         ours.rope_scaling)
    module = {"LlamaConfig": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
              "Phi3Config": transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding}[cls]
    hf = module(config=hf_cfg)
    x = torch.zeros(1, 1, ours.head_dim)
    half = ours.head_dim // 2
    for p in range(ours.max_position_embeddings):  # one position a step, as in generation
        cos, sin = hf(x, torch.tensor([[p]]))
        row = table[p]
        # float32 both; dynamic's frequencies may be an ulp apart (a vectorised pow where
        # theirs is scalar), an error the angle multiplies by the position.
        tol = 2e-7 * (p + 1)
        assert (row[: ours.head_dim] - cos[0, 0]).abs().max() <= tol, (name, p)
        assert (row[ours.head_dim + half:] - sin[0, 0, half:]).abs().max() <= tol, (name, p)
    # Stretching scalings serve past the original context.
    stretched = {"dynamic": 3 * ORIGINAL, "yarn": 4 * ORIGINAL, "yarn-mscale": 8 * ORIGINAL}
    assert ours.max_position_embeddings == stretched.get(name, hf_cfg.max_position_embeddings)
