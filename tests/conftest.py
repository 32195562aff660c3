"""Shared fixtures: the default model's tokenizer, our model, and the transformers reference."""

from __future__ import annotations

import os

import pytest
import torch

from surge.model_files import ModelFiles, resolve_model

torch.set_num_threads(os.cpu_count() or 1)
# Without a GPU the Triton kernels run in Triton's interpreter, which is chosen when a kernel is
# defined: set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_files() -> ModelFiles:
    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer(model_files: ModelFiles):
    from server.tokenizer import Tokenizer

    return Tokenizer(model_files)


@pytest.fixture(scope="session")
def engine_model(model_files: ModelFiles):
    from gpu_workers.loader import load_model

    return load_model(model_files, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def reference(model_files: ModelFiles):
    from tests.reference import Reference

    return Reference(model_files)
