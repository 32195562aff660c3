"""oneDNN-packed linear weights (bf16 on the CPU): as accurate as plain ones, on every CPU.

Which kernels oneDNN runs for the packed layout depends on the CPU: with AVX-512 BF16 alone
(AMD EPYC) the results are bit-identical to the plain path's; with AMX (Intel Xeon) tile
products accumulate in another order, the last bf16 bit differs, and greedy tokens part from
the plain path's after some steps. So these tests hold both paths to the float32 model, not
to each other's bits.
"""

from __future__ import annotations

import pytest
import torch

from bench.quant_accuracy import greedy, prefill_hidden
from gpu_workers.loader import load_model
from gpu_workers.packed import PackedLinear, can_pack, pack_model
from tests.prompts import reference_prompts

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="this torch has no oneDNN linear packing")
GREEDY_TOKENS = 16


def test_only_bf16_on_the_cpu_is_packed():
    assert not can_pack(torch.device("cpu"), torch.float32)
    assert not can_pack(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_packed_linear_is_within_bf16_rounding_of_the_exact_product(tokens):
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    x = torch.randn(tokens, 48, dtype=torch.bfloat16)
    out = PackedLinear(weight)(x)
    assert out.shape == (tokens, 96) and out.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    # One rounding to bf16 (8 significant bits) of an fp32 sum: half a unit in the last place,
    # plus the fp32 accumulation's own error where terms cancel.
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-4 * exact.abs().max())


@pytest.fixture(scope="module")
def models(model_files):
    plain = load_model(model_files, torch.device("cpu"), torch.bfloat16)
    packed = load_model(model_files, torch.device("cpu"), torch.bfloat16)
    pack_model(packed)
    assert isinstance(packed.lm_head, PackedLinear)
    assert isinstance(packed.layers[0].attn.qkv_proj, PackedLinear)
    return plain, packed


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return reference_prompts(tokenizer)


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(prefill_hidden(model, ids)).float()


def test_packed_logits_are_as_close_to_float32_as_plain_ones(models, engine_model, prompts):
    """Teacher-forced over every position of three prompts (chat, raw, 1,000+ tokens): the
    packed model's distance from the float32 logits is the plain bf16 model's, within 25%."""
    plain, packed = models
    for name in ("chat0", "raw1", "long"):
        exact = _logits(engine_model, prompts[name])
        rms = {label: (_logits(model, prompts[name]) - exact).pow(2).mean().sqrt().item()
               for label, model in (("plain", plain), ("packed", packed))}
        print(f"\n  {name}: RMS logit error vs float32, plain {rms['plain']:.4f}, "
              f"packed {rms['packed']:.4f}")
        assert rms["packed"] <= 1.25 * rms["plain"], (name, rms)


def test_packed_and_plain_greedy_tokens_agree_with_float32(models, engine_model, prompts):
    """As the other bf16 tests judge: the first 16 greedy tokens of most reference prompts
    are the float32 model's, packed as plain (bf16 drifts after 25+ tokens on some prompts)."""
    expected = greedy(engine_model, prompts, GREEDY_TOKENS)
    agreeing = {}
    for label, model in zip(("plain", "packed"), models, strict=True):
        got = greedy(model, prompts, GREEDY_TOKENS)
        agreeing[label] = [name for name in prompts if got[name] == expected[name]]
        print(f"\n  {label}: {len(agreeing[label])} of {len(prompts)} prompts give the float32 "
              f"model's first {GREEDY_TOKENS} greedy tokens")
    for label, names in agreeing.items():
        assert len(names) > len(prompts) // 2, (label, names)
    assert len(agreeing["packed"]) >= len(agreeing["plain"]) - 2, agreeing


@pytest.mark.parametrize("inner", ["plain", "packed"])
def test_fixed_rows_give_a_row_the_same_bits_in_any_batch(inner):
    """--deterministic's products: a row alone, among 5 others, and among 40 (three slices, the
    last padded) gives the same bits and the rows keep their order."""
    from torch import nn

    from gpu_workers.packed import FIXED_ROWS, FixedRowsLinear

    torch.manual_seed(0)
    weight = torch.randn(96, 64).bfloat16()
    plain = nn.Linear(64, 96, bias=False)
    plain.weight = nn.Parameter(weight)
    layer = FixedRowsLinear(plain if inner == "plain" else PackedLinear(weight))
    x = torch.randn(40, 64).bfloat16()
    alone = layer(x[7:8])
    assert alone.shape == (1, 96)
    assert torch.equal(layer(x[2:8])[-1], alone[0])
    assert torch.equal(layer(x)[7], alone[0]) and layer(x).shape == (40, 96)
    assert 40 % FIXED_ROWS  # the last slice is padded
