"""The mixture-of-experts products: the reference against every expert applied densely, and the
Triton grouped GEMM against the reference (on the GPU, or in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import moe

pytest.importorskip("triton", reason="the Triton kernels need triton (Linux x86_64 only)")

from gpu_workers.families import LlamaConfig  # noqa: E402
from kernels import moe_triton  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402
    DTYPES,
    _close,
    _poisoned,
    triton_model_matches_reference,
)


def _case(tokens: int, experts: int, top_k: int, held: int | None = None, seed: int = 0
          ) -> tuple[torch.Tensor, ...]:
    """x, w13, w2, weights, experts; with `held`, only experts below it are on this rank (the
    others are -1). F = 24 and H = 40 are not multiples of any block size."""
    g = torch.Generator().manual_seed(seed)
    h, f = 40, 24
    x = torch.randn(tokens, h, generator=g)
    w13 = torch.randn(experts, 2 * f, h, generator=g) / h**0.5
    w2 = torch.randn(experts, h, f, generator=g) / f**0.5
    scores = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, ids = scores.topk(top_k, dim=-1)
    if held is not None:
        ids = torch.where(ids < held, ids, -1)
    return x, w13, w2, weights, ids


def _dense(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert on every token, kept where the router chose it."""
    gate, up = torch.einsum("th,efh->tef", x, w13).chunk(2, dim=-1)
    y = torch.einsum("tef,ehf->teh", F.silu(gate) * up, w2)
    mix = torch.zeros(x.shape[0], w13.shape[0])
    held = ids >= 0
    mix.scatter_add_(1, ids.clamp(min=0), weights * held)
    return torch.einsum("te,teh->th", mix, y)


@pytest.mark.parametrize("held", [None, 3])
def test_reference_is_the_dense_mixture(held: int | None) -> None:
    x, w13, w2, weights, ids = _case(23, 6, 2, held)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids, F.silu),
                               _dense(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_reference_in_bfloat16_pads_rows_without_changing_them() -> None:
    """bfloat16 on the CPU runs each expert on row counts rounded up; the rows are unchanged."""
    x, w13, w2, weights, ids = (t.bfloat16() if t.is_floating_point() else t
                                for t in _case(37, 4, 2))
    got = moe.fused_moe(x, w13, w2, weights, ids, F.silu).float()
    want = _dense(*(t.float() if t.is_floating_point() else t for t in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_sorted_pairs_group_each_expert_in_whole_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, -1], [1, 2], [-1, -1]])
    order = moe_triton.sort_pairs(ids, 4, block_m=4)
    pairs, blocks = order.pairs.tolist(), order.block_expert.tolist()
    n = ids.numel()
    for b, expert in enumerate(blocks):
        rows = [p for p in pairs[b * 4: (b + 1) * 4] if p < n]
        if expert < 0:
            assert rows == []
        else:
            assert rows and all(ids.flatten()[p] == expert for p in rows)
    held = sorted(p for p in pairs if p < n)
    assert held == [p for p in range(n) if ids.flatten()[p] >= 0]  # each held pair once


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "held"),
                         [(1, 4, 2, None), (7, 8, 2, None), (37, 4, 2, None), (300, 4, 1, None),
                          (19, 8, 2, 4)],
                         ids=["decode", "small", "prefill", "large-blocks", "expert-parallel"])
def test_grouped_gemm_matches_reference(dtype: torch.dtype, tokens: int, experts: int,
                                        top_k: int, held: int | None) -> None:
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, held)
    x, w13, w2, weights = (t.to(dtype) for t in (x, w13, w2, weights))
    got = _poisoned(moe_triton.fused_moe, x, w13, w2, weights, ids, F.silu)
    _close(got, moe.fused_moe(x, w13, w2, weights, ids, F.silu))


@torch.inference_mode()
def test_moe_model_forward_matches_reference_kernels() -> None:
    """A tiny random Mixtral-like model (4 experts, top 2) through mixed prefill and decode
    steps on the Triton backend, against the reference backend."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
                      num_experts=4, experts_per_token=2, moe_intermediate_size=32,
                      moe_renormalize=True)
    model = triton_model_matches_reference(cfg)
    assert model.ops.fused_moe is moe_triton.fused_moe
