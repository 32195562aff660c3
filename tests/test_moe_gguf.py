"""MoE checkpoints as GGUF files, written with the gguf package's writer from the tiny Hugging
Face models (Qwen3-MoE as `qwen3moe`, Mixtral as `llama` with experts), loaded by surge: the
greedy tokens of transformers' own implementation of the Hugging Face model."""

from __future__ import annotations

import pytest

from tests.gguf_files import round_trip
from tests.tiny_families import save_tiny

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_round_trip_gives_the_tokens_of_transformers(family, tmp_path):
    """llama.cpp's qwen3moe has no dense layers and renormalises the top-k weights: the tiny
    Qwen3-MoE is written so, to be the same model in both formats."""
    overrides = dict(mlp_only_layers=[], norm_topk_prob=True) if family == "qwen3_moe" else {}
    save_tiny(str(tmp_path), family, **overrides)
    model, ours, expected = round_trip(str(tmp_path))
    assert model.cfg.num_experts == (8 if family == "qwen3_moe" else 4)
    assert model.cfg.moe_renormalize and model.cfg.dense_layers == []
    assert ours == expected
