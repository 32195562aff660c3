"""Kernel references against a dense, obviously-correct attention on random paged caches."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import kernels
from kernels import (
    add_rms_norm,
    attention,
    decode_attention,
    fixed_order_attention,
    plan_decode,
    prefill_attention,
    store_kv,
)


def _dense(q, k, v, q_positions, scale, window=0, softcap=0.0):
    """q [n, H, D] at q_positions over k/v [ctx, KVH, D]; each query sees keys <= its position
    (and, with a window, the last `window` of them only)."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    distance = q_positions[:, None] - torch.arange(k.shape[0])[None, :]
    mask = (distance < 0) | (distance >= window if window else False)
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _paged(lengths, block_size, kvh, d, num_blocks=64, seed=0):
    """Random K/V for sequences of the given lengths, scattered over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    # Unwritten slots hold a huge finite value: any of it leaking through the mask shows. (The
    # worker's pool starts zeroed, so stale slots are always finite.)
    k_cache = torch.full((kvh, num_blocks, block_size, d), 1e4)
    v_cache = torch.full_like(k_cache, 1e4)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size
                              for i in range(n)])
        store_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return k_cache, v_cache, padded, ks, vs


@pytest.mark.parametrize("path", ["sdpa", "matmul"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (9, 3), (8, 1)])
def test_decode_attention(monkeypatch, path, block_size, h, kvh):
    """Both CPU paths: SDPA for small batches, batched products for large ones."""
    monkeypatch.setattr(attention, "SDPA_MAX_DECODE", 10**6 if path == "sdpa" else 0)
    lengths = [1, 5, block_size, block_size + 1, 37]
    k_cache, v_cache, tables, ks, vs = _paged(lengths, block_size, kvh, 8)
    q = torch.randn(len(lengths), h, 8)
    plan = plan_decode(tables, torch.tensor(lengths), k_cache)
    out = decode_attention(q, k_cache, v_cache, plan, 0.3)
    for i, n in enumerate(lengths):
        want = _dense(q[i : i + 1], ks[i], vs[i], torch.tensor([n - 1]), 0.3)
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [1, 4, 9])
def test_decode_attention_of_one_sequence(length):
    """One sequence's keys are sliced to its length, not masked: blocks listed past it (a table
    padded wider) hold other keys that must not count."""
    k_cache, v_cache, tables, ks, vs = _paged([length, 20], 4, 3, 8)
    q = torch.randn(1, 9, 8)
    plan = plan_decode(tables[:1], torch.tensor([length]), k_cache)
    assert plan.mask is None
    out = decode_attention(q, k_cache, v_cache, plan, 0.3)
    want = _dense(q, ks[0], vs[0], torch.tensor([length - 1]), 0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("shared", "block_size"), [(1, 4), (3, 4), (2, 16)])
@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_over_shared_blocks(shared, block_size, h, kvh, dtype):
    """Sequences whose first blocks are the same ones (a shared prompt): reading those once for
    every query gives the same attention as reading them per sequence."""
    g = torch.Generator().manual_seed(shared)
    num_blocks, d = 64, 8
    k_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(kvh, num_blocks, block_size, d, generator=g).to(dtype)
    own = torch.randperm(num_blocks - shared, generator=g) + shared
    lengths = [shared * block_size + n for n in (1, 3, block_size, 2 * block_size + 1)]
    width = -(-max(lengths) // block_size)
    tables = torch.stack([torch.cat([torch.arange(shared), own[i * width : (i + 1) * width]])
                          [:width] for i in range(len(lengths))])
    q = torch.randn(len(lengths), h, d, generator=g).to(dtype)
    lens = torch.tensor(lengths)
    plain = decode_attention(q, k_cache, v_cache, plan_decode(tables, lens, k_cache), 0.3)
    cascade = decode_attention(q, k_cache, v_cache,
                               plan_decode(tables, lens, k_cache, shared_blocks=shared), 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cascade, plain, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize(("h", "kvh"), [(4, 2), (9, 3)])
def test_prefill_attention_with_cached_context(block_size, h, kvh):
    context = [7, 20, 33, 5]
    query = [7, 3, 17, 1]  # the first chunk is a fresh prompt; the others follow cached tokens
    k_cache, v_cache, tables, ks, vs = _paged(context, block_size, kvh, 8, seed=1)
    q = torch.randn(sum(query), h, 8)
    out = prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, *query]).cumsum(0),
                            torch.tensor(context), max(query), 0.25)
    start = 0
    for i, (n, ctx) in enumerate(zip(query, context, strict=True)):
        want = _dense(q[start : start + n], ks[i], vs[i], torch.arange(ctx - n, ctx), 0.25)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("block_size", [4, 16, 128])
@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (9, 3)])
def test_fixed_order_attention_is_attention(block_size, h, kvh):
    lengths = [1, 70, 150]
    k_cache, v_cache, tables, ks, vs = _paged(lengths, block_size, kvh, 8, seed=2)
    for i, n in enumerate(lengths):
        q = torch.randn(n, h, 8)
        out = fixed_order_attention(q[None], k_cache, v_cache, tables[i : i + 1],
                                    torch.arange(1, n + 1)[None], 0.3)[0]
        want = _dense(q, ks[i], vs[i], torch.arange(n), 0.3)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_attention_does_not_depend_on_the_batch(dtype):
    """--deterministic's promise: a query gives the same bits whether it is a decode row beside
    other sequences of other lengths, or one row of a prefill chunk of any length."""
    g = torch.Generator().manual_seed(3)
    lengths = [150, 9, 40, 100]
    k_cache, v_cache, tables, _, _ = _paged(lengths, 16, 3, 64, seed=3)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(150, 9, 64, generator=g).to(dtype)
    whole = fixed_order_attention(q[None], k_cache, v_cache, tables[:1],
                                  torch.arange(1, 151)[None], 0.125)[0]
    for pos in (0, 15, 16, 63, 64, 100, 149):
        others = torch.randn(3, 9, 64, generator=g).to(dtype)
        batch = fixed_order_attention(
            torch.cat([q[pos : pos + 1], others])[:, None], k_cache, v_cache, tables,
            torch.tensor([[pos + 1], [9], [40], [100]]), 0.125)[0, 0]
        assert torch.equal(batch, whole[pos]), pos
        lo = max(0, pos - 5)
        chunk = fixed_order_attention(q[lo : pos + 1][None], k_cache, v_cache, tables[:1],
                                      torch.arange(lo + 1, pos + 2)[None], 0.125)[0, -1]
        assert torch.equal(chunk, whole[pos]), pos


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 2.0), (16, 2.0)])
def test_window_and_softcap_in_every_attention_kernel(window, softcap):
    """Decode (both CPU paths, and over shared blocks), prefill chunks after cached context and
    the fixed-order kernel, each against the dense definition."""
    lengths = [3, 9, 20, 37]
    k_cache, v_cache, tables, ks, vs = _paged(lengths, 4, 3, 8, seed=4)
    lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), 9, 8)
    want = torch.cat([_dense(q[i : i + 1], ks[i], vs[i], torch.tensor([n - 1]), 0.3, window,
                             softcap) for i, n in enumerate(lengths)])
    for b in (1, len(lengths)):
        plan = plan_decode(tables[:b], lens[:b], k_cache)
        out = decode_attention(q[:b], k_cache, v_cache, plan, 0.3, window, softcap)
        torch.testing.assert_close(out, want[:b], rtol=1e-5, atol=1e-5)
    out = fixed_order_attention(q[:, None], k_cache, v_cache, tables, lens[:, None], 0.3,
                                window, softcap)[:, 0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    query = [3, 2, 11, 37]
    q = torch.randn(sum(query), 9, 8)
    starts = torch.tensor([0, *query]).cumsum(0)
    out = prefill_attention(q, k_cache, v_cache, tables, starts, lens, max(query), 0.3, window,
                            softcap)
    for i, (n, ctx) in enumerate(zip(query, lengths, strict=True)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want = _dense(q[rows], ks[i], vs[i], torch.arange(ctx - n, ctx), 0.3, window, softcap)
        torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)
    chunk = fixed_order_attention(q[None, starts[3]:], k_cache, v_cache, tables[3:],
                                  torch.arange(1, 38)[None], 0.3, window, softcap)[0]
    torch.testing.assert_close(chunk, out[starts[3]:], rtol=1e-5, atol=1e-5)


def test_add_rms_norm_matches_definition():
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    s = x + r
    torch.testing.assert_close(residual, s)
    torch.testing.assert_close(normed, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_no_other_distribution_installs_a_kernels_package():
    """Hugging Face's `kernels` (which transformers 5.25 requires) would share our package's name,
    and transformers would import ours in its place and fail at start-up."""
    owners = set(importlib.metadata.packages_distributions().get("kernels", []))
    assert owners <= {"surge"}, (
        f"the distributions {sorted(owners - {'surge'})} install a `kernels` package beside "
        "surge's: keep the dependency that pulls them in below that version (pyproject.toml)"
    )


def test_the_backend_is_a_value_picked_per_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = kernels.for_device(torch.device("cpu"), "reference")
    assert cpu.name == "reference" and cpu.decode_attention is decode_attention
    assert str(cpu) == "reference kernels (--kernel-backend)"
    with pytest.raises(ValueError, match="needs CUDA"):
        kernels.for_device(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="use one of"):
        kernels.for_device(torch.device("cpu"), "fast")
    # --deterministic keeps the batch-invariant reference, and refuses the C++ products.
    assert kernels.for_device(torch.device("cpu"), deterministic=True).name == "reference"
    with pytest.raises(ValueError, match="--deterministic needs products"):
        kernels.for_device(torch.device("cpu"), "cpu", deterministic=True)
