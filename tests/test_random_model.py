"""bench/random_model.py: the device check's stand-in for the default model (its real weights
exceed what a device call carries) has the default model's tokenizer and every weight shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import random_model
from gpu_workers.loader import load_model
from server.tokenizer import Tokenizer
from surge.model_files import resolve_model


@pytest.mark.slow
def test_the_stand_in_has_the_default_models_shapes_and_tokenizer(tmp_path: Path) -> None:
    real = resolve_model("default")
    random_model.export(real.path, str(tmp_path))
    assert not (tmp_path / "model.safetensors").exists()  # what travels: config and tokenizer
    random_model.fill(str(tmp_path))
    stand_in = resolve_model(str(tmp_path))
    assert stand_in.gguf_file is None
    text = "The capital of France is"
    assert Tokenizer(stand_in).hf.encode(text) == Tokenizer(real).hf.encode(text)
    want = load_model(real, torch.device("cpu"), torch.float32)
    got = load_model(stand_in, torch.device("cpu"), torch.float32)
    shapes = {name: p.shape for name, p in want.named_parameters()}
    assert {name: p.shape for name, p in got.named_parameters()} == shapes
    assert not all(torch.equal(p, q) for p, q in zip(got.parameters(), want.parameters(),
                                                     strict=True))
