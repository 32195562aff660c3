"""Dense families as GGUF files, written as llama.cpp's converter writes each architecture
(tests/gguf_files.py), loaded by surge: the greedy tokens of transformers' own implementation
of the Hugging Face model, 4 prompts x 32 tokens."""

from __future__ import annotations

import pytest

from surge.model_files import context_length, gguf_rope, max_model_len, resolve_model
from tests.gguf_files import round_trip
from tests.tiny_families import WINDOW, save_tiny

pytestmark = pytest.mark.slow

# What llama.cpp fixes for Gemma, the tiny models are built to agree with: queries scaled by
# head_dim ** -0.5, and (Gemma 3) every sixth layer global.
_GEMMA = dict(query_pre_attn_scalar=16)
# family -> (its tiny model's overrides, the GGUF architecture)
CASES = {
    "mistral": ({}, "llama"),  # a window kept in llama.attention.sliding_window
    "llama3": ({}, "llama"),  # llama3 rope as llama.cpp's rope_freqs tensor
    "qwen2": ({}, "qwen2"),
    "qwen2-yarn": ({}, "qwen2"),  # rope.scaling.type yarn
    "qwen3": ({}, "qwen3"),
    "phi3": ({}, "phi3"),
    "phi3-longrope": ({}, "phi3"),  # rope_factors_short / _long tensors
    "gemma2": (_GEMMA, "gemma2"),
    "gemma3": (dict(_GEMMA, num_hidden_layers=6, sliding_window_pattern=6), "gemma3"),
}


@pytest.mark.parametrize("family", list(CASES))
def test_gguf_round_trip_gives_the_tokens_of_transformers(family, tmp_path):
    overrides, arch = CASES[family]
    save_tiny(str(tmp_path), family, **overrides)
    model, ours, expected = round_trip(str(tmp_path))
    cfg = model.cfg
    from gguf import GGUFReader

    assert GGUFReader(str(tmp_path / "model.gguf")).fields["general.architecture"].contents() \
        == arch
    assert cfg.qkv_bias == family.startswith("qwen2")
    assert cfg.tie_word_embeddings == (family in ("qwen2", "gemma2", "gemma3"))
    windowed = {"mistral": [True] * 2, "gemma2": [True, False],
                "gemma3": [True] * 5 + [False]}.get(family, [])
    assert cfg.window_layers == windowed
    assert cfg.sliding_window == (WINDOW if windowed else 0)
    assert (cfg.rope_scaling is not None) == (family in ("llama3", "qwen2-yarn", "phi3-longrope"))
    # The served length is the checkpoint's (a yarn scaling stretches both alike).
    assert max_model_len(resolve_model(str(tmp_path / "model.gguf"))) == \
        max_model_len(resolve_model(str(tmp_path))) == cfg.max_position_embeddings
    assert ours == expected


def test_a_yarn_gguf_serves_the_stretched_length():
    """Qwen2.5's GGUF keeps context_length 32768 beside yarn x4 over 32768: 131072 served, as
    its config.json gives."""
    meta = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    assert context_length(32768, gguf_rope(meta, "qwen2")) == 131072
    assert context_length(32768, gguf_rope({}, "qwen2")) == 32768
