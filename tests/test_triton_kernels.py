"""The Triton kernels against their PyTorch references, on the GPU or (conftest sets this up) in
Triton's interpreter. Each kernel's buffers start as NaN, so an element it leaves unwritten shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (Linux x86_64 only)")

import kernels
from bench.gpu_cases import planned_decode
from gpu_workers.families import LlamaConfig
from gpu_workers.llama import AttentionMetadata, LlamaModel
from gpu_workers.model_runner import kv_cache_shape
from kernels import attention, attention_triton, rmsnorm, rmsnorm_triton, rotary, rotary_triton
from tests.test_kernels import _paged

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter reads bfloat16 as garbage, so only a GPU checks it.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GQA = [(4, 4), (9, 3), (8, 1)]  # (query heads, KV heads)
T = TypeVar("T")
DECODE = planned_decode(attention.plan_decode, attention.decode_attention)
DECODE_TRITON = planned_decode(attention_triton.plan_decode, attention_triton.decode_attention)


def _nan_filled(alloc: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t = alloc(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    return poisoned


def _poisoned(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) (on DEVICE) with every tensor it gets from torch.empty(_like) NaN at first."""
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", _nan_filled(torch.empty))
        mp.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
        return fn(*args)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype: torch.dtype) -> None:
    """Rows of 40 (short of the power-of-two block), strided as a view of wider rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48, generator=g).to(dtype)[:, :40]
    r, w = torch.randn(3, 40, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    _close(_poisoned(rmsnorm_triton.rms_norm, x, w, 1e-6), rmsnorm.rms_norm(x, w, 1e-6))
    normed, total = _poisoned(rmsnorm_triton.add_rms_norm, x, r, w, 1e-6)
    want_normed, want_total = rmsnorm.add_rms_norm(x, r, w, 1e-6)
    _close(normed, want_normed)
    _close(total, want_total)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary_(dtype: torch.dtype) -> None:
    """Queries and keys of a fused projection rotated in place; the values beside them kept."""
    heads, kv_heads, d = 9, 3, 16
    qkv = torch.randn(5, heads + 2 * kv_heads, d, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(dtype)
    cos, sin = rotary.rotary_angles(torch.tensor([0, 1, 7, 30, 63]),
                                    rotary.rotary_cache(d, 64, 10000.0))
    got = qkv.to(DEVICE, copy=True)
    rotary_triton.apply_rotary_(got[:, : heads + kv_heads], cos.to(DEVICE), sin.to(DEVICE))
    rotary.apply_rotary_(qkv[:, : heads + kv_heads], cos, sin)
    _close(got, qkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv(dtype: torch.dtype) -> None:
    """Keys and values (views of the fused projection) into scattered slots, no others."""
    heads, kvh, d = 4, 2, 8
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, heads + 2 * kvh, d, generator=g).to(dtype)
    k, v = qkv[:, heads : heads + kvh], qkv[:, heads + kvh :]
    k_cache = torch.randn(kvh, 5, 4, d, generator=g).to(dtype)
    v_cache = torch.randn(kvh, 5, 4, d, generator=g).to(dtype)
    slots = torch.tensor([3, 17, 0, 9, 10, 19])
    got_k, got_v = k_cache.to(DEVICE, copy=True), v_cache.to(DEVICE, copy=True)
    attention_triton.store_kv(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    attention.store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(got_k.cpu(), k_cache, rtol=0, atol=0)
    torch.testing.assert_close(got_v.cpu(), v_cache, rtol=0, atol=0)


@pytest.mark.parametrize("partition", [16, attention_triton.PARTITION_SIZE])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("h", "kvh"), GQA)
def test_decode_attention(monkeypatch: pytest.MonkeyPatch, partition: int, block_size: int,
                          h: int, kvh: int) -> None:
    """Ragged lengths around block boundaries; at 16 tokens a partition, up to three of them
    (the longest), and more partitions than any sequence fills."""
    monkeypatch.setattr(attention_triton, "PARTITION_SIZE", partition)
    lengths = [1, 5, block_size, block_size + 1, 37]
    k_cache, v_cache, tables, _, _ = _paged(lengths, block_size, kvh, 8)
    # Wider than any sequence needs (a batch padded to a fixed shape): partitions past every
    # context.
    tables = torch.cat([tables, torch.zeros(len(lengths), 64 // block_size, dtype=torch.long)], 1)
    # The model passes queries as a view of its fused projection.
    q = torch.randn(len(lengths), h + 2 * kvh, 8)[:, :h]
    lens = torch.tensor(lengths)
    want = DECODE(q, k_cache, v_cache, tables, lens, 0.3)
    _close(_poisoned(DECODE_TRITON, q, k_cache, v_cache, tables, lens, 0.3), want)


def test_decode_attention_ignores_shared_blocks() -> None:
    """The cascade hint only shapes the CPU reference's work, never the result."""
    k_cache, v_cache, tables, _, _ = _paged([9, 12, 20], 4, 2, 8)
    q, lens = torch.randn(3, 4, 8), torch.tensor([9, 12, 20])
    want = DECODE(q, k_cache, v_cache, tables, lens, 0.3)
    _close(_poisoned(DECODE_TRITON, q, k_cache, v_cache, tables, lens, 0.3, 2), want)


def _prefill_case(block_size: int, h: int, kvh: int, dtype: torch.dtype, index: torch.dtype
                  ) -> tuple:
    """Two fresh prompts and three chunks after cached context, one longer than a query tile."""
    context, query = [7, 20, 33, 5, 90], [7, 3, 17, 1, 70]
    assert max(query) > attention_triton.PREFILL_BLOCK_M
    k_cache, v_cache, tables, _, _ = _paged(context, block_size, kvh, 8, num_blocks=160, seed=1)
    q = torch.randn(sum(query), h + 2 * kvh, 8)[:, :h]
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables.to(index),
            torch.tensor([0, *query]).cumsum(0).to(index), torch.tensor(context, dtype=index),
            max(query), 0.25)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("h", "kvh"), GQA)
def test_prefill_attention(block_size: int, h: int, kvh: int) -> None:
    args = _prefill_case(block_size, h, kvh, torch.float32, torch.int64)
    _close(_poisoned(attention_triton.prefill_attention, *args),
           attention.prefill_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_attention_in_half_precision_with_int32_indices(monkeypatch: pytest.MonkeyPatch,
                                                        dtype: torch.dtype) -> None:
    """fp16 (and bf16 on a GPU) with int32 block tables, offsets and lengths."""
    args = _prefill_case(4, 9, 3, dtype, torch.int32)
    _close(_poisoned(attention_triton.prefill_attention, *args),
           attention.prefill_attention(*args))
    monkeypatch.setattr(attention_triton, "PARTITION_SIZE", 16)
    q, k_cache, v_cache, tables, _, lens = args[:6]
    decode = (q[: len(lens)], k_cache, v_cache, tables, lens, 0.3)
    _close(_poisoned(DECODE_TRITON, *decode), DECODE(*decode))


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (70, 0.0), (0, 2.0), (9, 2.0)])
def test_window_and_softcap(monkeypatch: pytest.MonkeyPatch, window: int, softcap: float
                            ) -> None:
    """Windows shorter than a chunk, than a key tile and than a decode partition, and soft
    capping, in prefill and decode."""
    args = _prefill_case(4, 9, 3, torch.float32, torch.int64)
    _close(_poisoned(attention_triton.prefill_attention, *args, window, softcap),
           attention.prefill_attention(*args, window, softcap))
    monkeypatch.setattr(attention_triton, "PARTITION_SIZE", 16)
    q, k_cache, v_cache, tables, _, lens = args[:6]
    q = q[: len(lens)]
    want = attention.decode_attention(q, k_cache, v_cache, attention.plan_decode(
        tables, lens, k_cache), 0.3, window, softcap)

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        plan = attention_triton.plan_decode(tables, lens, k_cache)
        return attention_triton.decode_attention(q, k_cache, v_cache, plan, 0.3, window, softcap)

    _close(_poisoned(decode, q, k_cache, v_cache, tables, lens), want)


def _step(seqs: list[tuple[list[int], int, list[int]]], block_size: int
          ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) on DEVICE for (token ids, first position, block table)
    per sequence, decodes first."""
    lens = [len(ids) for ids, _, _ in seqs]
    nd = lens.count(1)
    spans = [range(start, start + len(ids)) for ids, start, _ in seqs]
    tables = [table for _, _, table in seqs]
    slots = [table[p // block_size] * block_size + p % block_size
             for table, span in zip(tables, spans, strict=True) for p in span]
    context = [span.stop for span in spans]

    def padded(tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, device=DEVICE).view(len(tables), width)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=DEVICE)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots), num_decode=nd,
        decode_block_tables=padded(tables[:nd]), decode_context_lens=tensor(context[:nd]),
        prefill_block_tables=padded(tables[nd:]),
        prefill_query_start=tensor([0, *lens[nd:]]).cumsum(0),
        prefill_context_lens=tensor(context[nd:]), prefill_max_query_len=max(lens[nd:]))
    ids = [t for ids, _, _ in seqs for t in ids]
    return tensor(ids), tensor([p for span in spans for p in span]), meta


def _two_steps(model: LlamaModel, block_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states of two steps (two fresh prompts; then a decode, a chunk after cached
    context and a fresh prompt) and the KV cache after them."""
    cache = torch.zeros(kv_cache_shape(model, 16, block_size), device=DEVICE)
    a, b, c = [0, 1, 2], [3, 4, 5, 6], [7, 8]
    steps = [[(list(range(1, 6)), 0, a), (list(range(20, 31)), 0, b)],
             [([9], 5, a), ([40, 41, 42], 11, b), ([50, 51, 52, 53], 0, c)]]
    hidden = [model(*_step(seqs, block_size), cache).cpu() for seqs in steps]
    return hidden, cache.cpu()


@torch.inference_mode()
def test_model_forward_matches_reference_kernels() -> None:
    """A tiny random Llama (grouped-query heads) through mixed prefill and decode steps."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False)
    model = triton_model_matches_reference(cfg)
    assert model.ops.decode_attention is attention_triton.decode_attention


def triton_model_matches_reference(cfg: LlamaConfig) -> LlamaModel:
    """A random model of cfg through mixed steps gives the same hidden states and KV cache on
    the Triton kernels as on the reference ones; the model, its ops the Triton bundle's."""
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    for p in model.parameters():
        p.normal_(0.0, 0.3)
    model.to(DEVICE).init_rope()
    triton = kernels.for_device(DEVICE, "triton")
    model.ops = kernels.for_device(DEVICE, "reference")
    want, want_cache = _two_steps(model, 4)
    model.ops = triton
    got, got_cache = _two_steps(model, 4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-4, atol=1e-4)
    return model


def _variant_of(fn: object, kwargs: dict) -> Callable:
    """Triton's own binder for fn with the decorator's options (do_not_specialize...): the
    argument specialization a compiled kernel is keyed by, read on the CPU."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(fn, **kwargs)
    return create_function_from_signature(jit.signature, jit.params, BaseBackend)


@torch.inference_mode()
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_serving_compiles_no_kernel_the_warm_up_did_not(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path, family: str) -> None:
    """Triton compiles a kernel again for each alignment of a pointer argument and each int
    argument that is 1 or a multiple of 16; while serving, each such compile stalls a step (the
    H200 check saw 8 in its first two levels). Real steps of ragged, mixed batches whose
    tables grow through widths 1 and 16 and whose decode spans 1 to 5 partitions launch each
    kernel with a specialization the start-up's warm-up already launched; with experts, steps
    of few and of many routed pairs (the grouped product's two row-block sizes)."""
    from triton.runtime.interpreter import InterpretedFunction

    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model
    from tests.inprocess import InProcessEngine
    from tests.tiny_families import save_tiny
    from tests.tiny_model import save_tiny_llama

    if family == "llama":
        save_tiny_llama(str(tmp_path), heads=4, kv_heads=2, vocab=256)
    else:  # 4 experts, 2 a token: past 32 tokens a step takes the larger row blocks
        save_tiny(str(tmp_path), family)
    model = load_model(resolve_model(str(tmp_path)), DEVICE, torch.float32)
    model.ops = kernels.for_device(DEVICE, "triton")
    monkeypatch.setattr(attention_triton, "PARTITION_SIZE", 16)
    binders: dict[object, Callable] = {}
    variants: dict[str, set] = {}
    run = InterpretedFunction.run

    def recorded(self: InterpretedFunction, *args: object, grid: object, warmup: bool,
                 **kwargs: object) -> object:
        if self.fn not in binders:
            binders[self.fn] = _variant_of(self.fn, self.kwargs)
        key = tuple(binders[self.fn](*args, **kwargs)[1])
        variants.setdefault(self.fn.__name__, set()).add(key)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    budget = 48
    engine = InProcessEngine(model, num_blocks=128, block_size=4,
                             max_num_batched_tokens=budget)
    engine.runner.warm_up(budget)  # as the worker does on CUDA
    warmed = {name: set(keys) for name, keys in variants.items()}
    assert {"_store_kv_kernel", "_decode_partial_kernel", "_decode_reduce_kernel",
            "_prefill_kernel", "_rotary_kernel", "_rms_norm_kernel"} <= warmed.keys()
    if family == "mixtral":
        assert len(warmed["_grouped_gemm_kernel"]) == 4  # both products, both row blocks
    for i, n in enumerate((3, 17, 40, 9, 64)):
        engine.add(f"p{i}", [(5 * i + j) % 250 + 1 for j in range(n)], 4 + 2 * i)
    engine.run()
    assert {name: keys - warmed.get(name, set()) for name, keys in variants.items()} == \
        dict.fromkeys(variants, set())
