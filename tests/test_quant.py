"""Weight-only quantization: round trips within their bounds, each quantized linear against the
float product, and the real model's accuracy (greedy agreement, perplexity) per mode."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.quant import (
    FP8Linear,
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_model,
)


def _weight(n: int = 96, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of all scales


def test_int8_round_trip_is_within_half_a_step():
    w = _weight()
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    err = (q.float() * scales[:, None] - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_is_within_half_a_step(group):
    w = _weight()
    q, scales, zeros = quantize_int4(w, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    err = (dequantize_int4(q, scales, zeros, group) - w).abs()
    assert bool((err <= scales.repeat_interleave(group, dim=1) / 2 + 1e-5).all())


def test_int4_group_must_divide_the_columns():
    with pytest.raises(ValueError, match="does not divide a layer's 128 input columns"):
        quantize_int4(_weight(), 48)


def test_fp8_round_trip_keeps_three_mantissa_bits():
    w = _weight()
    q, scales = quantize_fp8(w)
    back = q.float() * scales[:, None]
    # e4m3 rounds to 3 mantissa bits (relative error <= 1/16) above its subnormal range.
    normal = w.abs() >= scales[:, None] * 2**-6
    assert bool(((back - w).abs() <= w.abs() / 16 + 1e-7)[normal].all())


@pytest.mark.parametrize(("layer", "kernel_tol", "float_tol"), [
    (Int8Linear, 1e-5, 0.01),
    (lambda w: Int4Linear(w, 32), 1e-4, 0.08),
    (FP8Linear, 1e-5, 0.04),
])
def test_quantized_linear_against_float(layer, kernel_tol, float_tol):
    """float32 inputs: the operator equals the product with its own dequantized weight, and
    stays within a relative error bound of the float layer."""
    w = _weight(seed=1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    lin = layer(w)
    out = lin(x)
    exact = x @ w.T
    rel = float((out - exact).norm() / exact.norm())
    assert rel < float_tol, rel
    if isinstance(lin, Int8Linear):
        deq = lin.q.float() * lin.scales[:, None]
    elif isinstance(lin, Int4Linear):
        deq = dequantize_int4(*quantize_int4(w, 32), 32)
    else:
        deq = lin.q.float() * lin.scales[:, None]
    torch.testing.assert_close(out, x @ deq.T, rtol=kernel_tol, atol=kernel_tol * 10)


def test_bf16_inputs_run_on_the_low_bit_operators():
    w = _weight(seed=3).to(torch.bfloat16)
    x = torch.randn(7, 128).to(torch.bfloat16)
    exact = x.float() @ w.float().T
    for lin in (Int8Linear(w), Int4Linear(w, 64), FP8Linear(w)):
        out = lin(x)
        assert out.dtype == torch.bfloat16 and out.shape == (7, 96)
        assert float((out.float() - exact).norm() / exact.norm()) < 0.1


@pytest.fixture(scope="module")
def bf16_model(model_files):
    """The serving dtype: PyTorch's low-bit CPU operators are fast in bf16, slow in fp32."""
    from gpu_workers.loader import load_model

    return load_model(model_files, torch.device("cpu"), torch.bfloat16)


@pytest.fixture(scope="module")
def float_greedy(tokenizer, bf16_model):
    from bench.quant_accuracy import greedy
    from tests.prompts import reference_prompts

    prompts = reference_prompts(tokenizer)
    return prompts, greedy(bf16_model, prompts, 16)


@pytest.mark.slow
def test_int8_greedy_agrees_with_float_on_most_prompts(model_files, float_greedy):
    from bench.quant_accuracy import greedy
    from gpu_workers.loader import load_model

    prompts, expected = float_greedy
    model = load_model(model_files, torch.device("cpu"), torch.bfloat16)
    quantize_model(model, "int8", 32)
    assert isinstance(model.layers[0].attn.qkv_proj, Int8Linear)
    got = greedy(model, prompts, 16)
    agreeing = [name for name in prompts if got[name] == expected[name]]
    print(f"\n  int8: {len(agreeing)} of {len(prompts)} prompts give the float model's first "
          f"16 greedy tokens")
    assert len(agreeing) > len(prompts) // 2, agreeing


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "bound"), [("int8", 0.01), ("int4", 0.05)])
def test_perplexity_increase_is_bounded(model_files, tokenizer, bf16_model, mode, bound):
    """On the first 512 tokens of the shipped text (bench.quant_accuracy reports the whole).
    int4 in groups of 32, the default: the bundled model is itself Q4_1, so coarser groups
    re-quantize 4-bit values onto a worse grid (groups of 64: +31%)."""
    from bench.quant_accuracy import TEXT, perplexity
    from gpu_workers.loader import load_model

    with open(TEXT) as f:
        ids = tokenizer.encode(f.read())[:512]
    base, _ = perplexity(bf16_model, ids)
    model = load_model(model_files, torch.device("cpu"), torch.bfloat16, keep_blocks=True)
    quantize_model(model, mode, 32)
    ppl, _ = perplexity(model, ids)
    print(f"\n  {mode}: perplexity {ppl:.3f} vs {base:.3f} ({(ppl / base - 1) * 100:+.2f}%)")
    assert ppl <= base * (1 + bound)


def test_prefix_cache_hits_with_quantized_weights(tmp_path):
    """The prefix cache knows nothing of weights: with int4 layers, requests sharing a prompt
    prefix reuse its blocks and give the tokens they give with the cache off."""
    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model
    from tests.inprocess import InProcessEngine
    from tests.tiny_model import save_tiny_llama

    save_tiny_llama(str(tmp_path), heads=4, kv_heads=2, vocab=256)
    model = load_model(resolve_model(str(tmp_path)), torch.device("cpu"), torch.float32)
    quantize_model(model, "int4", 32)
    shared = [(5 * i) % 250 + 1 for i in range(40)]
    prompts = {f"p{i}": shared + [i + 1, i + 2] for i in range(4)}
    runs = {}
    for cache in (True, False):
        engine = InProcessEngine(model, num_blocks=64, block_size=4, prefix_cache=cache)
        for name, ids in prompts.items():
            engine.add(name, ids, 8)
            runs.setdefault(cache, {}).update(engine.run())
        if cache:
            assert engine.scheduler.blocks.hit_tokens >= 3 * 40
    assert runs[True] == runs[False]
