"""oneDNN-packed linear weights (bf16 on the CPU): the same tokens and logits as plain ones."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.loader import load_model
from gpu_workers.packed import PackedLinear, can_pack, pack_model
from tests.inprocess import InProcessEngine

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="this torch has no oneDNN linear packing")


def test_only_bf16_on_the_cpu_is_packed():
    assert not can_pack(torch.device("cpu"), torch.float32)
    assert not can_pack(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_packed_linear_is_bit_identical(batch):
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    x = torch.randn(batch, 3, 48, dtype=torch.bfloat16)
    out = PackedLinear(weight)(x)
    assert out.shape == (batch, 3, 96)
    assert torch.equal(out, torch.nn.functional.linear(x, weight))


def test_packed_model_generates_the_same_tokens(model_files):
    """The real model, bf16, tied head: the same greedy tokens for a batch of prompts."""
    outputs = []
    for packed in (False, True):
        model = load_model(model_files, torch.device("cpu"), torch.bfloat16)
        if packed:
            pack_model(model)
            assert isinstance(model.lm_head, PackedLinear)
            assert isinstance(model.layers[0].attn.qkv_proj, PackedLinear)
        engine = InProcessEngine(model, max_num_batched_tokens=256)
        for i in range(6):
            engine.add(f"r{i}", [1, 504 + 37 * i, 2000 + i, 99, 7 * i + 3] * (i + 1), 24)
        outputs.append(engine.run())
    assert outputs[0] == outputs[1]
