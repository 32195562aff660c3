"""The C++ CPU kernels against their PyTorch references (kernels/cpu/), over hypothesis-drawn
shapes: block sizes, grouped-query ratios, head sizes, ragged lengths, padded tables whose
extra blocks hold other sequences' keys, float32 and bfloat16."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from bench import weight_mode
from gpu_workers.fused import fuse_layers
from gpu_workers.kernel_linear import KernelLinear, keeps_packed_copy, route_linears
from gpu_workers.loader import load_model
from gpu_workers.packed import can_pack
from gpu_workers.quant import quantize_model
from kernels import (
    attention,
    attention_cpu,
    matmul_cpu,
    rmsnorm,
    rmsnorm_cpu,
    sampling,
    sampling_cpu,
)
from kernels import matmul as matmul_ref
from kernels.cpu import extension
from tests.inprocess import InProcessEngine
from tests.prompts import CHAT, reference_prompts
from tests.server import ServerProcess
from tests.test_kernels import _paged

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
seeds = st.integers(0, 2**32 - 1)


def _cpu_flags() -> str:
    """This CPU's flags: the extension is built for them (-march=native)."""
    with open("/proc/cpuinfo") as f:
        return f.read()


def _oracle(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            *rest: object) -> torch.Tensor:
    """The reference kernel in float32 on the same (already rounded) inputs: the C++ kernels
    accumulate in float32, so in bfloat16 they are held to the output's own rounding, not to
    the reference's bfloat16 arithmetic (which drifts by more on an unlucky draw)."""
    return kernel(q.float(), k_cache.float(), v_cache.float(), *rest).to(q.dtype)


def test_the_extension_builds_where_a_compiler_exists():
    """CI fails here, not by a quiet fallback, if the C++ backend did not build; and where it
    built, auto serves on it."""
    assert extension() is not None or shutil.which("c++") is None
    picked = kernels.for_device(torch.device("cpu"))
    assert picked.name == ("cpu" if extension() is not None else "reference")
    assert str(picked) == "cpu kernels (auto on cpu)" or extension() is None


def test_each_cpu_and_checkout_gets_its_own_build(monkeypatch, tmp_path):
    """A build is for the CPU it was made on (-march=native) and names its checkout's paths:
    another CPU's flags, or the same sources at another path, build apart."""
    import io

    import kernels.cpu as module

    monkeypatch.delenv("SURGE_KERNEL_BUILD_DIR", raising=False)
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    monkeypatch.setattr(module, "open", lambda *_: io.StringIO(flags), raising=False)
    here = module.build_dir()
    assert here == module.build_dir() and here.parent == module.build_dir().parent
    flags = "flags\t\t: fpu sse2 avx2\n"  # the same checkout on a CPU without AVX-512
    assert module.build_dir() != here
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    monkeypatch.setattr(module, "__file__", str(tmp_path / "kernels" / "cpu" / "__init__.py"))
    assert module.build_dir() != here


# Head dims: the vector paths unroll 64 and 128; 80 takes their loops over 8- and 16-lane pieces.
shapes = st.tuples(st.sampled_from([1, 16, 32]), st.sampled_from([(4, 4), (9, 3), (8, 1)]),
                   st.sampled_from([64, 80, 128]),
                   st.sampled_from([torch.float32, torch.bfloat16]),
                   st.lists(st.integers(1, 80), min_size=1, max_size=5))
# (window, softcap): none, a sliding window shorter than most contexts, Gemma's soft cap.
extras = st.sampled_from([(0, 0.0), (7, 0.0), (0, 5.0), (20, 5.0)])


@settings(max_examples=40, deadline=None)
@given(shapes, extras, seeds)
def test_decode_attention(shape, extra, seed):
    torch.manual_seed(seed)  # the same draw replays the same tensors (hypothesis shrinks on it)
    block_size, (h, kvh), d, dtype, lengths = shape
    window, softcap = extra
    k_cache, v_cache, tables, _, _ = _paged(lengths, block_size, kvh, d, num_blocks=512)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    # Unwritten slots hold 1e4 (see _paged): in bf16 they would swamp any leak, as intended.
    q = torch.randn(len(lengths), h, d).to(dtype)
    lens = torch.tensor(lengths)
    want = _oracle(attention.decode_attention, q, k_cache, v_cache,
                   attention.plan_decode(tables, lens, k_cache.float()), 0.3, window, softcap)
    got = attention_cpu.decode_attention(q, k_cache, v_cache,
                                         attention_cpu.plan_decode(tables, lens, k_cache), 0.3,
                                         window, softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# Contexts past the kernel's 512-key spans: a row of several spans merges them (and with a
# window, its first visible key need not start a span).
long_shapes = st.tuples(st.sampled_from([16, 32]), st.sampled_from([(9, 3), (8, 1)]),
                        st.sampled_from([64, 96, 128]),
                        st.sampled_from([torch.float32, torch.bfloat16]),
                        st.lists(st.integers(1, 1600), min_size=1, max_size=3))


@settings(max_examples=12, deadline=None)
@given(long_shapes, st.sampled_from([(0, 0.0), (700, 0.0), (0, 5.0)]), seeds)
def test_decode_attention_over_several_spans(shape, extra, seed):
    torch.manual_seed(seed)
    block_size, (h, kvh), d, dtype, lengths = shape
    k_cache, v_cache, tables, _, _ = _paged(lengths, block_size, kvh, d, num_blocks=320)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(len(lengths), h, d).to(dtype)
    lens = torch.tensor(lengths)
    want = _oracle(attention.decode_attention, q, k_cache, v_cache,
                   attention.plan_decode(tables, lens, k_cache.float()), 0.125, *extra)
    got = attention_cpu.decode_attention(q, k_cache, v_cache,
                                         attention_cpu.plan_decode(tables, lens, k_cache), 0.125,
                                         *extra)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_does_not_depend_on_the_batch(dtype):
    """The spans start at fixed positions and merge in order: a row alone, in a batch, and as
    a query of a prefill chunk give the same bits."""
    lengths = [1300, 40, 700]
    k_cache, v_cache, tables, _, _ = _paged(lengths, 16, 3, 64, num_blocks=160)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(3, 9, 64).to(dtype)
    lens = torch.tensor(lengths)
    together = attention_cpu.decode_attention(
        q, k_cache, v_cache, attention_cpu.plan_decode(tables, lens, k_cache), 0.125)
    for i in range(3):
        alone = attention_cpu.decode_attention(
            q[i:i + 1], k_cache, v_cache,
            attention_cpu.plan_decode(tables[i:i + 1], lens[i:i + 1], k_cache), 0.125)
        assert torch.equal(alone[0], together[i])
    # A prefill chunk's tokens are read in tiles of several rows (here across the end of a
    # span, at 512 keys): each token's row has the bits it has decoded alone.
    chunk = torch.randn(40, 9, 64).to(dtype)
    prefill = attention_cpu.prefill_attention(chunk, k_cache, v_cache, tables[:1],
                                              torch.tensor([0, 40]), torch.tensor([530]), 40,
                                              0.125)
    for j in range(40):
        alone = attention_cpu.decode_attention(
            chunk[j:j + 1], k_cache, v_cache,
            attention_cpu.plan_decode(tables[:1], torch.tensor([491 + j]), k_cache), 0.125)
        assert torch.equal(alone[0], prefill[j])


def _check_prefill(shape, extra, seed, data, longest: int, scale: float, num_blocks: int):
    """Chunks of up to `longest` tokens ending each context, C++ against the reference."""
    torch.manual_seed(seed)
    block_size, (h, kvh), d, dtype, context = shape
    query = [data.draw(st.integers(1, min(n, longest))) for n in context]
    k_cache, v_cache, tables, _, _ = _paged(context, block_size, kvh, d, num_blocks=num_blocks)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(sum(query), h, d).to(dtype)
    args = (q, k_cache, v_cache, tables, torch.tensor([0, *query]).cumsum(0),
            torch.tensor(context), max(query), scale, *extra)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(attention_cpu.prefill_attention(*args),
                               _oracle(attention.prefill_attention, *args), rtol=tol, atol=tol)


@settings(max_examples=30, deadline=None)
@given(shapes, extras, seeds, st.data())
def test_prefill_attention_with_cached_context(shape, extra, seed, data):
    _check_prefill(shape, extra, seed, data, longest=80, scale=0.25, num_blocks=512)


# Rows that begin with the same blocks (a shared prompt, up to past two spans) and go on with
# their own: the shared keys are read once for a tile of rows (cascade), then merged with each
# row's own. With a window the kernel reads each row alone (the window hides the far keys).
cascades = st.tuples(st.sampled_from([1, 16, 32]), st.sampled_from([(4, 4), (9, 3), (8, 1)]),
                     st.sampled_from([64, 80, 128]),
                     st.sampled_from([torch.float32, torch.bfloat16]), st.integers(1, 1100),
                     st.lists(st.integers(1, 80), min_size=1, max_size=24))


@settings(max_examples=30, deadline=None)
@given(cascades, extras, seeds)
def test_decode_attention_reads_shared_blocks_once_for_all_rows(shape, extra, seed):
    torch.manual_seed(seed)
    block_size, (h, kvh), d, dtype, shared_keys, own = shape
    shared = -(-shared_keys // block_size)
    lengths = [shared * block_size + n for n in own]
    k_cache, v_cache, tables, _, _ = _paged(lengths, block_size, kvh, d,
                                            num_blocks=sum(-(-n // block_size) for n in lengths))
    tables[:, :shared] = tables[0, :shared].clone()
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(len(lengths), h, d).to(dtype)
    lens = torch.tensor(lengths)
    want = _oracle(attention.decode_attention, q, k_cache, v_cache,
                   attention.plan_decode(tables, lens, k_cache.float()), 0.3, *extra)
    got = attention_cpu.decode_attention(
        q, k_cache, v_cache, attention_cpu.plan_decode(tables, lens, k_cache, shared), 0.3,
        *extra)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@settings(max_examples=10, deadline=None)
@given(long_shapes, st.sampled_from([(0, 0.0), (700, 0.0), (0, 5.0)]), seeds, st.data())
def test_prefill_attention_over_several_spans(shape, extra, seed, data):
    """Long chunks: a tile of a chunk's tokens may straddle a span's end, its earlier rows
    seeing none of the next span's keys."""
    _check_prefill(shape, extra, seed, data, longest=600, scale=0.125, num_blocks=320)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [64, 576, 1000])
def test_rms_norms(dtype, width):
    x, residual = torch.randn(7, width).to(dtype), torch.randn(7, width).to(dtype)
    weight = (torch.rand(width) + 0.5).to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(rmsnorm_cpu.rms_norm(x, weight, 1e-6),
                               rmsnorm.rms_norm(x, weight, 1e-6), rtol=tol, atol=tol)
    got = rmsnorm_cpu.add_rms_norm(x, residual, weight, 1e-6)
    want = rmsnorm.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the sum, rounded the same
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_residual_sum_rounds_as_torch_does(dtype):
    """Sums halfway between two neighbours (to even, up and down), past the largest finite
    value, and NaN, rounded by the vector paths (8 or 16 columns) and the scalar tail alike."""
    eps = torch.finfo(dtype).eps
    x = torch.tensor([1.0, 1.0 + 2 * eps, 1.0, float("nan"), torch.finfo(dtype).max, -3.0, 0.5,
                      1.0] * 3, dtype=dtype)[None]
    residual = torch.tensor([eps / 2, eps / 2, eps / 4, 1.0, torch.finfo(dtype).max, 2.0, -0.5,
                             -eps / 2] * 3, dtype=dtype)[None]
    weight = torch.ones(x.shape[1], dtype=dtype)
    got = rmsnorm_cpu.add_rms_norm(x, residual, weight, 1e-6)[1]
    torch.testing.assert_close(got, (x.float() + residual.float()).to(dtype), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("fused", [False, True])
def test_the_model_on_the_cpu_backend_keeps_the_reference_tokens(engine_model, tokenizer,
                                                                  reference, fused):
    """Greedy tokens in float32 through the C++ kernels, with chunked prefill and strangers in
    the batch, are transformers' own (four of the reference prompts, to stay quick): layer by
    layer, and one decoder_layer call a layer."""
    prompts = dict(list(reference_prompts(tokenizer).items())[:4])
    engine_model.ops = kernels.for_device(torch.device("cpu"), "cpu")
    if fused:
        assert fuse_layers(engine_model)
    try:
        engine = InProcessEngine(engine_model, max_num_batched_tokens=37)
        for name, ids in prompts.items():
            engine.add(name, ids, 32)
        for i, n in enumerate((1, 50, 130)):
            engine.add(f"stranger{i}", [100 + 7 * j for j in range(n)], 20)
        got = engine.run()
    finally:
        engine_model.ops, engine_model.fused = kernels.REFERENCE, None
    for name, ids in prompts.items():
        assert got[name] == reference.greedy(ids, 32), name


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_one_call_a_layer_gives_the_layer_by_layer_tokens(model_files, tokenizer, quantization):
    """bf16 as the worker prepares it (C++ products, int4/int8 ones where quantized): the fused
    layers call the same kernels on the same rows, and each row's attention does not depend on
    the rows beside it, so chunked prefill, strangers and decode give the same tokens."""
    ops = kernels.for_device(torch.device("cpu"), "cpu")
    model = load_model(model_files, torch.device("cpu"), torch.bfloat16,
                       keep_blocks=quantization == "int4")
    model.ops = ops
    if quantization != "none":
        quantize_model(model, quantization, 32, ops=ops)
    route_linears(model, ops)
    prompts = dict(list(reference_prompts(tokenizer).items())[:3])
    runs = []
    for fused in (False, True):
        model.fused = None
        assert fuse_layers(model) if fused else True
        engine = InProcessEngine(model, max_num_batched_tokens=29)
        for name, ids in prompts.items():
            engine.add(name, ids, 12)
        for i, n in enumerate((1, 40)):
            engine.add(f"stranger{i}", [100 + 7 * j for j in range(n)], 8)
        runs.append(engine.run())
    assert runs[0] == runs[1]


def test_int4_activation_bits_reach_the_fused_layers(model_files, tokenizer):
    """--quant-activation-bits 8 rounds the int4 products' x in one decoder_layer call a layer
    as in the Python layers (the same logits, to the bit), and moves the logits from 16 bits'
    where the build takes 8 (AVX-512 VNNI); where it does not, the two are the same."""
    from bench.quant_accuracy import prefill_hidden

    ops = kernels.for_device(torch.device("cpu"), "cpu")
    ids = next(iter(reference_prompts(tokenizer).values()))
    logits = {}
    for bits in (16, 8):
        model = load_model(model_files, torch.device("cpu"), torch.bfloat16, keep_blocks=True)
        model.ops = ops
        quantize_model(model, "int4", 32, ops=ops, activation_bits=bits)
        route_linears(model, ops)
        for fused in (False, True):
            model.fused = None
            assert fuse_layers(model) if fused else True
            logits[bits, fused] = model.logits(prefill_hidden(model, ids))
    assert torch.equal(logits[16, False], logits[16, True])
    assert torch.equal(logits[8, False], logits[8, True])
    takes_8 = matmul_cpu.activation_bits(len(ids), 8) == 8
    assert torch.equal(logits[8, True], logits[16, True]) != takes_8


@pytest.mark.skipif(matmul_cpu.has_amx() or matmul_cpu.activation_bits(5, 16, True)
                    == matmul_cpu.activation_bits(5),
                    reason="int4 and bf16 share the bf16 panels only on AVX-512 BF16 and VBMI "
                           "without AMX")
def test_int4_past_a_decode_step_is_bf16_servings(model_files, tokenizer):
    """The bundled file's Q4_1 steps and Q8_0 scales are fp16, so q * step and q * scale are
    exact in fp32 (+ min rounds once, in the loader and the decode alike) and the loader's bf16
    weights are the ones int4's panels decode: a
    prefill's hidden states and logits (the head the file's Q8_0 in int4) are bf16 serving's
    to the bit, as the worker prepares both."""
    from bench.quant_accuracy import prefill_hidden

    ops = kernels.for_device(torch.device("cpu"), "cpu")
    ids = next(iter(reference_prompts(tokenizer).values()))
    hidden, logits = [], []
    for quantization in ("none", "int4"):
        model = load_model(model_files, torch.device("cpu"), torch.bfloat16,
                           keep_blocks=quantization == "int4")
        model.ops = ops
        if quantization == "int4":
            quantize_model(model, "int4", 32, ops=ops)
        route_linears(model, ops, packed=keeps_packed_copy(torch.device("cpu"), torch.bfloat16))
        assert fuse_layers(model)
        hidden.append(prefill_hidden(model, ids))
        logits.append(model.logits(hidden[-1]))
    assert len(ids) > 4 and torch.equal(hidden[0], hidden[1])
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                    reason="oneDNN has no bf16 path on this CPU (AVX2 only): no packed copies")
def test_rows_past_the_cpp_products_read_the_packed_copy():
    """linear() gives rows past the C++ products to oneDNN on the packed copy it is handed (a
    copy of another weight here, to see which one was read), and fewer rows to the C++ product
    on the plain weight; W's panels it reads at every row count; KernelLinear hands its copy
    over."""
    from gpu_workers.kernel_linear import KernelLinear

    torch.manual_seed(0)
    weight, other = torch.randn(40, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    wrong = torch.ops.mkldnn._reorder_linear_weight(other, 1)
    ops = kernels.for_device(torch.device("cpu"), "cpu")
    for rows in (1, matmul_cpu.max_rows(), matmul_cpu.max_rows() + 1, 150):
        x = torch.randn(rows, 64).bfloat16()
        read = other if rows > matmul_cpu.max_rows() else weight
        torch.testing.assert_close(matmul_cpu.linear(x, weight, wrong), x @ read.T,
                                   rtol=2**-7, atol=1e-2)
        layer = KernelLinear(weight, ops, packed=True)
        torch.testing.assert_close(layer(x), x @ weight.T, rtol=2**-7, atol=1e-2)
        # On W's panels every row count: the plain weight is dropped, only its shape kept.
        assert layer.weight.is_meta == matmul_cpu.has_panels()
        assert layer.weight.shape == weight.shape
        if matmul_cpu.has_panels():
            torch.testing.assert_close(
                matmul_cpu.linear(x, weight, matmul_cpu.pack_panels(other)), x @ other.T,
                rtol=2**-7, atol=1e-2)


def _assert_within_bf16_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                                 ) -> None:
    """got is x W^T in bf16: one rounding of an fp32 sum to bf16, plus the fp32 sum's own error
    where terms cancel."""
    assert got.shape == (x.shape[0], weight.shape[0]) and got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    bound = 2**-8 * exact.abs() + 1e-6 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20), st.integers(1, 700), st.integers(1, 70), seeds)
def test_small_m_linear_is_within_bf16_rounding_of_the_exact_product(m, k, n, seed):
    """Every row count (past the threshold too), widths that are no multiple of a vector, and
    output counts that are no multiple of the kernel's block of W rows."""
    torch.manual_seed(seed)
    x, weight = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    got = extension().small_m_linear(x, weight)
    _assert_within_bf16_rounding(got, x, weight)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 24), st.integers(1, 70), seeds)
def test_bf16_linear_is_within_bf16_rounding_of_the_exact_product(m, k32, n, seed):
    """The product for bf16 past the vector product where oneDNN has no bf16 path: any rows
    (one pass and many over each task's widened W rows), W rows no multiple of its 4."""
    torch.manual_seed(seed)
    x, weight = torch.randn(m, 32 * k32).bfloat16(), torch.randn(n, 32 * k32).bfloat16()
    got = extension().bf16_linear(x, weight)
    _assert_within_bf16_rounding(got, x, weight)
    for rows in (slice(0, 1), slice(0, m // 2 + 1), slice(m // 3, m)):  # same bits alone
        assert torch.equal(extension().bf16_linear(x[rows], weight), got[rows])
    if "avx512f" not in _cpu_flags():  # the 8-lane sums of the vector product (up to 4 rows)
        assert torch.equal(extension().small_m_linear(x, weight), got)


needs_panels = pytest.mark.skipif(not matmul_cpu.has_panels(),
                                  reason="no AVX-512 BF16 on this CPU: no panel product")


@needs_panels
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 350), st.integers(1, 150), seeds)
def test_panel_linear_is_within_bf16_rounding_of_the_exact_product(m, k2, n, seed):
    """Row counts over partial and several tiles of 8 and chunks of 256, any even width,
    output counts that are no multiple of a panel's 48; a row's bits are the same alone."""
    torch.manual_seed(seed)
    x, weight = torch.randn(m, 2 * k2).bfloat16(), torch.randn(n, 2 * k2).bfloat16()
    panels = matmul_cpu.pack_panels(weight)
    got = extension().panel_linear(x, panels, n)
    _assert_within_bf16_rounding(got, x, weight)  # an output left unwritten fails it
    for rows in (slice(0, 1), slice(0, m // 2 + 1), slice(m // 3, m)):
        assert torch.equal(extension().panel_linear(x[rows], panels, n), got[rows])


@needs_panels
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 200), st.integers(1, 4), seeds)
def test_panel_silu_linear_gives_silu_mul_of_the_panel_product(m, k2, pairs, seed):
    """gate_up's panels with SiLU * up applied as the tiles are stored: silu_mul's bits of
    panel_linear's output, at every row count; NaN where the gate is +-inf as silu_mul's."""
    torch.manual_seed(seed)
    n = 2 * 48 * pairs
    x, weight = torch.randn(m, 2 * k2).bfloat16(), torch.randn(n, 2 * k2).bfloat16()
    x[0, 0] = float("inf")
    panels = matmul_cpu.pack_panels(weight)
    got = extension().panel_silu_linear(x, panels, n)
    want = extension().silu_mul(extension().panel_linear(x, panels, n))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_panels
def test_panel_silu_linear_refuses_halves_that_are_not_whole_panels():
    panels = matmul_cpu.pack_panels(torch.randn(100, 64).bfloat16())
    with pytest.raises(RuntimeError, match="each half a whole number of panels"):
        extension().panel_silu_linear(torch.randn(3, 64).bfloat16(), panels, 100)


@needs_panels
def test_panel_linear_refuses_what_it_was_not_packed_for():
    panels = matmul_cpu.pack_panels(torch.randn(100, 64).bfloat16())
    with pytest.raises(RuntimeError, match="panels as panel_pack made them"):
        extension().panel_linear(torch.randn(3, 96).bfloat16(), panels, 100)
    with pytest.raises(RuntimeError, match="panels as panel_pack made them"):
        extension().panel_linear(torch.randn(3, 64).bfloat16(), panels, 40)
    with pytest.raises(RuntimeError, match="K even"):
        matmul_cpu.pack_panels(torch.randn(4, 63).bfloat16())


def test_panels_are_built_where_the_cpu_has_avx512_bf16():
    """A build on an AVX-512 BF16 machine without them would quietly fall back to oneDNN."""
    assert matmul_cpu.has_panels() == ("avx512_bf16" in _cpu_flags())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 140), st.integers(1, 24), st.integers(1, 80), seeds)
def test_amx_linear_is_within_bf16_rounding_of_the_exact_product(m, k32, n, seed):
    """Row counts over one, two and several x tiles (and past AMX_ROWS), widths of any number
    of tiles, output counts that are no multiple of the 32-row W block."""
    if not matmul_cpu.has_amx():
        pytest.skip("no AMX tiles on this CPU: the AVX-512 / AVX2 product serves instead")
    torch.manual_seed(seed)
    x, weight = torch.randn(m, 32 * k32).bfloat16(), torch.randn(n, 32 * k32).bfloat16()
    got = extension().amx_linear(x, weight)
    _assert_within_bf16_rounding(got, x, weight)


def test_amx_is_found_where_the_cpu_has_it():
    """A build on an AMX machine that did not take the tiles would quietly lose them."""
    flags = _cpu_flags()
    assert matmul_cpu.has_amx() == ("amx_bf16" in flags and "avx512_bf16" in flags)


def test_linear_takes_the_cpp_products_up_to_their_row_counts():
    """AMX tiles (2 to 128 rows) where the CPU has them, else the vector product up to 4 rows;
    past them oneDNN, or where oneDNN has no bf16 path (AVX2-only CPUs) bf16_linear (its tiles
    up to widen_rows, the fp32 product on W widened past them)."""
    weight = torch.randn(40, 64).bfloat16()
    cpp_rows = matmul_cpu.max_rows()
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (cpp_rows is None) == (not onednn and not matmul_cpu.has_amx())
    widen = matmul_cpu.widen_rows()
    for rows in (1, 4, 5, 128, 129, widen, widen + 1):
        x = torch.randn(rows, 64).bfloat16()
        if matmul_cpu.has_amx() and 1 < rows <= cpp_rows:
            want = extension().amx_linear(x, weight)
        elif rows <= 4:
            want = extension().small_m_linear(x, weight)
        elif not onednn and rows <= widen:
            want = extension().bf16_linear(x, weight)
        elif not onednn:  # a prefill chunk: W widened, MKL's fp32 product
            want = (x.float() @ weight.float().T).bfloat16()
        else:
            want = torch.nn.functional.linear(x, weight)
        assert torch.equal(matmul_cpu.linear(x, weight), want), rows
    x32 = torch.randn(2, 64)
    assert torch.equal(matmul_cpu.linear(x32, weight.float()),
                       torch.nn.functional.linear(x32, weight.float()))


@pytest.mark.slow
def test_a_bf16_model_on_cpp_products_agrees_with_float32_as_plain_bf16(model_files,
                                                                      engine_model, tokenizer):
    """Each short reference prompt decoded alone, so every step's products have one row and go
    through the C++ kernel: the first 16 greedy tokens are the float32 model's on most
    prompts, as often as plain bf16's are (the bar tests/test_packed.py holds packing to)."""
    cpu = torch.device("cpu")
    plain = load_model(model_files, cpu, torch.bfloat16)
    routed = load_model(model_files, cpu, torch.bfloat16)
    ops = kernels.for_device(cpu, "cpu")
    route_linears(routed, ops)
    routed.ops = ops
    assert isinstance(routed.layers[0].mlp.down_proj, KernelLinear)
    assert routed.lm_head.weight.data_ptr() == routed.embed.weight.data_ptr()  # tied, no copy
    # The short prompts: three decoded models' worth of steps must stay quick on 2 cores.
    prompts = {name: ids for name, ids in reference_prompts(tokenizer).items() if len(ids) < 200}

    def alone(model) -> dict[str, list[int]]:
        engine = InProcessEngine(model, max_num_seqs=1)  # one sequence, one row, a step
        for name, ids in prompts.items():
            engine.add(name, ids, 16)
        return engine.run()

    expected = alone(engine_model)
    agreeing = {label: sum(got[name] == expected[name] for name in prompts)
                for label, got in (("plain", alone(plain)), ("routed", alone(routed)))}
    print(f"\n  prompts agreeing with float32 over 16 tokens: {agreeing}")
    assert agreeing["routed"] > len(prompts) // 2, agreeing
    assert agreeing["routed"] >= agreeing["plain"] - 2, agreeing


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 100),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.floats(0.1, 60.0), seeds)
def test_silu_mul_is_the_reference_in_one_pass(rows, width, dtype, spread, seed):
    """Widths that are no multiple of a vector, and gates far out on both sides (where e^-g
    overflows or vanishes), within one rounding of the float64 value."""
    from kernels import activation, activation_cpu

    torch.manual_seed(seed)
    x = (torch.randn(rows, 2 * width) * spread).to(dtype)
    got = activation_cpu.silu_mul(x)
    assert got.shape == (rows, width) and got.dtype == dtype
    exact = activation.silu_mul(x.double())
    rounding = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 1e-6)
    # float16 has nothing below 2^-24 (tiny products round to 0 or to it), and past its largest
    # finite value a product is inf, as the reference's.
    tiny = 2**-24 if dtype == torch.float16 else 1e-30
    largest = torch.finfo(dtype).max
    close = (got.double() - exact).abs() <= rounding * exact.abs() + tiny
    assert close[exact.abs() <= largest].all()
    assert got[exact.abs() > largest * 1.001].isinf().all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(4, 4), (9, 3), (8, 1)]), st.sampled_from([64, 128]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seeds)
def test_rotate_and_store_is_rotary_then_store(tokens, heads, dim, dtype, seed):
    """On a view of the qkv projection (rows strided), into shuffled slots of a cache whose
    other slots must stay untouched: the fused kernel against the reference's two passes."""
    from kernels import rotary

    torch.manual_seed(seed)
    h, kvh = heads
    qkv = torch.randn(tokens, (h + 2 * kvh) * dim).to(dtype)
    positions = torch.randint(0, 500, (tokens,))
    cos, sin = rotary.rotary_angles(positions, rotary.rotary_cache(dim, 512, 10000.0))
    k_cache = torch.full((kvh, 8, 16, dim), float("nan"), dtype=dtype)
    slots = torch.randperm(8 * 16)[:tokens]
    done = {}
    for name, ops in (("cpp", kernels.for_device(torch.device("cpu"), "cpu")),
                      ("reference", kernels.REFERENCE)):
        x, kc, vc = qkv.clone(), k_cache.clone(), k_cache.clone()
        heads_view = x.view(tokens, h + 2 * kvh, dim)
        ops.rotate_and_store(heads_view[:, : h + kvh], heads_view[:, h + kvh:], cos, sin, kc, vc,
                             slots)
        done[name] = (x, kc, vc)
    tolerance = dict(rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype], equal_nan=True)
    for got, want in zip(done["cpp"], done["reference"], strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    # Exactly the slots given were written; every other one still holds its poison.
    written = torch.zeros(8 * 16, dtype=torch.bool)
    written[slots] = True
    assert not done["cpp"][1].view(kvh, -1, dim)[:, written].isnan().any()
    assert done["cpp"][1].view(kvh, -1, dim)[:, ~written].isnan().all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 200), st.sampled_from(["plain", "ties", "nan", "-inf"]),
       seeds)
def test_argmax_picks_as_torch_does(rows, vocab, poison, seed):
    """The first largest value's index, the first NaN's in a row with one, 0 in a row of -inf;
    widths that are no multiple of 16 and rows shorter than a vector."""
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab)
    if poison == "ties":  # a few values, so the largest comes up several times in a row
        logits = torch.randint(0, 3, (rows, vocab)).float()
    elif poison == "nan":
        spots = torch.randint(0, rows * vocab, (max(1, rows * vocab // 50),))
        logits.view(-1)[spots] = float("nan")
    elif poison == "-inf":
        logits[0] = float("-inf")
    assert torch.equal(sampling_cpu.argmax(logits), logits.argmax(dim=-1))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 3000), st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.8]),
       st.sampled_from([0, 1, 2, 40]), st.sampled_from([1.0, 0.95, 0.5, 0.01]),
       st.sampled_from([0.0, 0.05, 0.5]),
       st.sampled_from(["plain", "nan", "masked", "spread", "huge", "ties"]), seeds)
def test_random_pick_picks_as_the_reference(rows, vocab, temperature, top_k, top_p, min_p,
                                            poison, seed):
    """The same filters and the same noise: the same tokens (float scores that tie within
    rounding could part, which random logits never draw); -1 where the reference has no pick:
    temperature 0, a NaN, every token masked. Row 0 keeps the defaults (no filter). With ties
    top-k keeps every token equal to the k-th (top-p's sort orders ties arbitrarily: off)."""
    from gpu_workers.sampler import SamplingBatch
    from surge.protocol import SamplingParams, ScheduledSeq

    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab) * (8 if poison == "spread" else 2)
    if poison == "nan":
        logits[rows // 2, seed % vocab] = float("nan")
    elif poison == "masked":
        logits[rows // 2] = float("-inf")
        logits[0, : vocab // 2] = float("-inf")
    elif poison == "huge":  # finite logits whose logits / T overflow: no distribution
        logits[rows // 2, 0] = 3e38
    elif poison == "ties":
        logits = torch.randint(0, 6, (rows, vocab)).float()
        top_p = 1.0
    params = [SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p)] * rows
    params[0] = SamplingParams(max_tokens=1, temperature=temperature or 1.0)
    seqs = [ScheduledSeq(i, [1], 0, [], True, p, seed + i * 2**31) for i, p in enumerate(params)]
    batch = SamplingBatch.build(seqs, [seed % 1000 + i for i in range(rows)], vocab,
                                torch.device("cpu"))
    want = sampling.random_pick(logits, batch)
    assert torch.equal(sampling_cpu.random_pick(logits, batch), want)
    if temperature == 0:
        assert (want[1:] == -1).all()


def test_q4_packing_round_trips():
    q = torch.randint(0, 16, (5, 96))
    packed = matmul_ref.pack_q4(q)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(matmul_ref.unpack_q4(packed), q.to(torch.uint8))


def _as_read(x: torch.Tensor, quantization: str, rows: int | None = None) -> torch.Tensor:
    """x (float64) as the int4 or int8 product (int4a8, int8a8: asked for 8-bit activations)
    reads it in a call of `rows` rows (x's own by default; a bf16 x past a decode step is
    read as it is where the build has bf16 panels for it). Where it sums in integers
    (matmul_cpu.activation_bits), each block of 32 columns is rounded (to nearest even) to
    multiples of a step: to 16 bits, a power of two that puts the block's largest |x| in
    [2^14, 2^15) steps; to 8, the largest over 127 (fp32, as x times the step's fp32 inverse),
    never under the least normal float."""
    weights, asked = weight_mode(quantization)
    bits = matmul_cpu.activation_bits(rows or x.shape[0], asked, x.dtype == torch.bfloat16)
    if not bits:
        return x.double()
    blocks = x.float().view(x.shape[0], -1, 32)
    largest = blocks.abs().amax(dim=2, keepdim=True)
    if bits == 16:
        step = torch.exp2((torch.frexp(largest).exponent - 15).clamp(min=-126).double())
        rounded = (blocks.double() / step).round().clamp(-2**15, 2**15 - 1) * step
    else:
        step = (largest / 127).clamp(min=torch.finfo(torch.float32).tiny)
        rounded = (blocks * (1 / step)).round().clamp(-127, 127).double() * step.double()
    return torch.where(largest > 0, rounded, 0.0).view_as(x)


def _w_as_read(w: torch.Tensor, x: torch.Tensor, quantization: str) -> torch.Tensor:
    """W (float64) as the product multiplies it: where int4 or int8 takes a bf16 x on bf16
    panels (x read as it is where the integer sums would round it), each fp32 weight rounded
    once to bf16, as bf16 serving of the same file has it."""
    asked = weight_mode(quantization)[1]
    rows = x.shape[0]
    on_panels = (x.dtype == torch.bfloat16
                 and matmul_cpu.activation_bits(rows, asked, True)
                 != matmul_cpu.activation_bits(rows, asked))
    return w.float().bfloat16().double() if on_panels else w


def _assert_near_the_reference(got: torch.Tensor, reference: torch.Tensor, x: torch.Tensor,
                               w: torch.Tensor, quantization: str) -> None:
    """The reference backend's product (kernels.matmul, x as it is) within one rounding to
    x's dtype, plus what the product's reading of x and W can move it."""
    read = _as_read(x, quantization)
    slack = ((read - x.double()).abs() @ w.abs().T
             + read.abs() @ (_w_as_read(w, x, quantization) - w).abs().T)
    bound = 2**-7 * reference.double().abs() + 1e-4 + slack
    assert ((got.double() - reference.double()).abs() <= bound).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 20), st.integers(1, 50),
       st.sampled_from([32, 64]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from(["int4", "int4a8"]), seeds)
def test_int4_linear_is_the_dequantized_product(m, groups, n, group, dtype, quantization, seed):
    """Against the exact product of the dequantized weight: the steps and minimums reach
    the sums unrounded (fp32; on bf16 panels each weight rounded once to bf16), whatever the
    rows, groups of 32 or 64 columns, dtype, and activation bits (x as the integer sums read
    it, _as_read; W as the product multiplies it, _w_as_read)."""
    torch.manual_seed(seed)
    k = groups * group
    q = torch.randint(0, 16, (n, k))
    scales = torch.rand(n, k // group) * 0.1 + 1e-3
    mins = -torch.rand(n, k // group)
    x = torch.randn(m, k).to(dtype)
    got = matmul_cpu.int4_linear(x, matmul_cpu.pack_int4(matmul_ref.pack_q4(q), scales, mins),
                                 weight_mode(quantization)[1])
    assert got.shape == (m, n) and got.dtype == dtype
    w = (q.double() * scales.double().repeat_interleave(group, 1)
         + mins.double().repeat_interleave(group, 1))
    exact = _as_read(x, quantization) @ _w_as_read(w, x, quantization).T
    rounding = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 0.0)
    bound = rounding * exact.abs() + 1e-6 * (x.double().abs() @ w.abs().T) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    reference = matmul_ref.int4_linear(x, matmul_ref.pack_q4(q), scales, mins)
    _assert_near_the_reference(got, reference, x, w, quantization)


def test_int4_past_a_decode_step_sums_a_bf16_x_as_it_is():
    """On AVX-512 BF16 (with VBMI) int4 at 16-bit activations multiplies a bf16 x past 4 rows
    on bf16 panels of its dequantized weights, x unrounded: a value 2^-20 of its block's
    largest, which the 16-bit integer sums round to nothing, still counts. Where a build's
    integer sums take x (at 8 bits, or without those panels) they round it away."""
    torch.manual_seed(3)
    n, k = 50, 64
    q = torch.randint(1, 16, (n, k))
    q[:, 0] = 0  # the block's largest x meets W = 0: the tiny value is all of the sum
    scales, mins = torch.rand(n, 2) * 0.1 + 1e-3, torch.zeros(n, 2)
    weights = matmul_cpu.pack_int4(matmul_ref.pack_q4(q), scales, mins)
    x = torch.zeros(9, k, dtype=torch.bfloat16)
    x[:, 0], x[:, 1] = 1.0, 2.0**-20
    flags = set(_cpu_flags().split())
    on_panels = {"avx512_bf16", "avx512vbmi"} <= flags
    assert (matmul_cpu.activation_bits(9, 16, True) == 0) == on_panels
    w = q.double() * scales.double().repeat_interleave(32, 1)
    for bits in (16, 8):
        got = matmul_cpu.int4_linear(x, weights, bits).double()
        mode = "int4" if bits == 16 else "int4a8"
        exact = _as_read(x, mode) @ _w_as_read(w, x, mode).T
        assert ((got - exact).abs() <= 2**-8 * exact.abs()).all(), bits
        kept = matmul_cpu.activation_bits(9, bits, True) == 0  # x read as it is
        assert kept == (on_panels and bits == 16) or "avx512_vnni" not in flags, bits
        assert (got != 0).all() == kept, bits


@pytest.mark.skipif(matmul_cpu.activation_bits(5, 16, True) == matmul_cpu.activation_bits(5),
                    reason="no bf16 panels for int4 and int8 in this build (AVX-512 BF16, VBMI)")
@settings(max_examples=30, deadline=None)
@given(st.integers(5, 40), st.integers(1, 6), st.integers(1, 100),
       st.sampled_from(["int4", "int8", "int8 a row"]), seeds)
def test_low_bit_on_panels_is_bf16_servings_product(m, blocks, n, quantization, seed):
    """Where int4 or int8 takes a bf16 x on bf16 panels (past the decode tile), its bits are
    the bf16 panels' product of the weights bf16 serving of the same file multiplies: q * step
    + min (int4), q * scale (int8: a scale a block of 32, a Q8_0 head's, or a row), rounded
    once to fp32 and once to bf16."""
    torch.manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(m, k).bfloat16()
    if quantization == "int4":
        q = torch.randint(0, 16, (n, k))
        scales, mins = torch.rand(n, blocks) * 0.1 + 1e-3, -torch.rand(n, blocks)
        got = matmul_cpu.int4_linear(x, matmul_cpu.pack_int4(matmul_ref.pack_q4(q), scales,
                                                             mins))
        w = (q.double() * scales.double().repeat_interleave(32, 1)
             + mins.double().repeat_interleave(32, 1))  # exact in float64
    else:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales = torch.rand(n, blocks if quantization == "int8" else 1) * 0.01
        got = matmul_cpu.int8_linear(x, matmul_cpu.pack_int8(q, scales))
        w = q.double() * scales.double().repeat_interleave(k // scales.shape[1], 1)
    panels = matmul_cpu.pack_panels(w.float().bfloat16())
    assert torch.equal(got, extension().panel_linear(x, panels, n))


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_low_bit_products_take_empty_shapes(quantization):
    """No rows of x, or a weight of no rows, give an empty product at every row count (the
    panels' task split once divided by zero there)."""
    (weights,), product, _ = _low_bit(quantization, 0, 64)
    for m in (0, 1, 5, 9):
        assert product(torch.randn(m, 64).bfloat16(), weights).shape == (m, 0)
    (weights,), product, _ = _low_bit(quantization, 5, 64)
    assert product(torch.randn(0, 64).bfloat16(), weights).shape == (0, 5)
    if matmul_cpu.has_panels():
        panels = matmul_cpu.pack_panels(torch.randn(5, 64).bfloat16())
        assert extension().panel_linear(torch.randn(0, 64).bfloat16(), panels, 5).shape == (0, 5)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_low_bit_weights_refuse_another_width(quantization):
    """The products read the record layout their pack made; an x of another width is refused,
    naming both widths, rather than read past the weights."""
    (weights,), product, _ = _low_bit(quantization, 5, 64)
    assert weights.shape[0] == 5
    with pytest.raises(RuntimeError, match="packed for 64 columns, x has 96"):
        product(torch.randn(1, 96), weights)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 50),
       st.sampled_from([0, 32, 64]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from(["int8", "int8a8"]), seeds)
def test_int8_linear_is_the_dequantized_product(m, blocks, n, group, dtype, quantization, seed):
    """Against the float64 product of the dequantized weight (x as the product reads it):
    the scales, one a row (group 0) or one a group of 32 or 64 columns (a GGUF's Q8_0 is 32),
    reach the sums unrounded (fp32; on bf16 panels each weight rounded once to bf16, W as the
    product multiplies it, _w_as_read), whatever the rows, widths, dtype and activation bits."""
    from gpu_workers.quant import quantize_int8

    torch.manual_seed(seed)
    k = 64 * blocks
    q, scales = quantize_int8(torch.randn(n, k))
    if group:
        scales = torch.rand(n, k // group) * 0.01 + 1e-4
    x = torch.randn(m, k).to(dtype)
    got = matmul_cpu.int8_linear(x, matmul_cpu.pack_int8(q, scales), weight_mode(quantization)[1])
    assert got.shape == (m, n) and got.dtype == dtype
    per_column = scales[:, None] if scales.dim() == 1 else scales
    w = q.double() * per_column.double().repeat_interleave(k // per_column.shape[1], 1)
    exact = _as_read(x, quantization) @ _w_as_read(w, x, quantization).T
    rounding = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(dtype, 0.0)
    bound = rounding * exact.abs() + 1e-6 * (x.double().abs() @ w.abs().T) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    _assert_near_the_reference(got, matmul_ref.int8_linear(x, q, scales), x, w, quantization)


def _low_bit(quantization: str, n: int, k: int) -> tuple[tuple, Callable, torch.Tensor]:
    """(weights, their C++ product, W dequantized in float64) for int4 or int8 (int4a8,
    int8a8: the product asked for 8-bit activations)."""
    from gpu_workers.quant import quantize_int8

    quantization, bits = weight_mode(quantization)
    if quantization == "int8":
        q, scales = quantize_int8(torch.randn(n, k))
        weights = (matmul_cpu.pack_int8(q, scales),)
        return (weights, partial(matmul_cpu.int8_linear, activation_bits=bits),
                q.double() * scales.double()[:, None])
    q = torch.randint(0, 16, (n, k))
    scales, mins = torch.rand(n, k // 32) * 0.1, -torch.rand(n, k // 32)
    weights = (matmul_cpu.pack_int4(matmul_ref.pack_q4(q), scales, mins),)
    w = (q.double() * scales.double().repeat_interleave(32, 1)
         + mins.double().repeat_interleave(32, 1))
    return weights, partial(matmul_cpu.int4_linear, activation_bits=bits), w


@pytest.mark.parametrize("quantization", ["int4", "int4a8", "int8", "int8a8"])
def test_low_bit_rows_have_the_same_bits_alone_and_in_a_batch(quantization):
    """Up to 2 rows (4 with AVX-512: a decode step) W is read into registers, past them it goes
    through a buffer (AVX2: fp32 tiles; AVX-512 VNNI: integer sums with a W row a lane), so the
    slices below have 5 rows or more; within each a row's bits do not depend on the other rows,
    up to widen_rows rows. Across them too where both read x alike (activation_bits) and sum
    in fp32; where one sums in integers, the two agree to fp32 rounding if both read x rounded,
    else to what x's rounding moves."""
    torch.manual_seed(0)
    weights, product, w = _low_bit(quantization, 37, 3 * 64)
    x = torch.randn(19, 3 * 64)
    for dtype in (torch.bfloat16, torch.float32):
        batch = product(x.to(dtype), *weights)
        for rows in (slice(3, 8), slice(7, 13), slice(5, 14), slice(2, 19)):
            assert torch.equal(product(x[rows].to(dtype), *weights), batch[rows])
        pair = product(x[:2].to(dtype), *weights)
        for row in range(2):
            assert torch.equal(product(x[row:row + 1].to(dtype), *weights), pair[row:row + 1])
        if dtype != torch.float32:
            continue
        bits = (matmul_cpu.activation_bits(2, weight_mode(quantization)[1]),
                matmul_cpu.activation_bits(19, weight_mode(quantization)[1]))
        if bits == (0, 0):
            assert torch.equal(pair, batch[:2])
        elif bits[0] == bits[1]:
            torch.testing.assert_close(pair, batch[:2], rtol=1e-5, atol=1e-5)
        else:
            moved = (_as_read(x[:2], quantization, 19) - x[:2].double()).abs() @ w.abs().T
            assert ((pair.double() - batch[:2].double()).abs()
                    <= moved + 1e-5 * (1 + batch[:2].double().abs())).all()


@pytest.mark.parametrize("quantization", ["int4", "int4a8", "int8", "int8a8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 11])
def test_low_bit_products_keep_a_non_finite_activation_to_its_row(quantization, rows):
    """A NaN or an infinity in x makes its own row's outputs non-finite, as fp32 sums would,
    rather than an integer's garbage; the other rows (one with a block of zeros) keep theirs."""
    torch.manual_seed(2)
    weights, product, w = _low_bit(quantization, 9, 96)
    x = torch.randn(rows, 96)
    x[-1, 32:64] = 0
    x[0, 5] = float("nan")
    if rows > 1:
        x[1, 40] = float("inf")
    got = product(x, *weights)
    assert not got[: min(rows, 2)].isfinite().any()
    if rows > 2:
        exact = _as_read(x[2:], quantization, rows) @ w.T
        bound = 1e-6 * (x[2:].double().abs() @ w.abs().T) + 1e-30
        assert ((got[2:].double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("quantization", ["int4", "int4a8", "int8", "int8a8"])
def test_low_bit_products_past_widen_rows_are_the_dequantized_product(quantization):
    """A prefill chunk's rows (past widen_rows) take MKL's product on W dequantized whole
    (AVX-512 VNNI builds: the integer sums still; a bf16 x, bf16 panels where the build has
    them): still the dequantized weights, within bf16 rounding of the exact product
    of x and W as the product reads them, on either side of widen_rows."""
    torch.manual_seed(1)
    n, k = 37, 96
    weights, product, w = _low_bit(quantization, n, k)
    for m in (matmul_cpu.widen_rows(), matmul_cpu.widen_rows() + 1):
        x = torch.randn(m, k).bfloat16()
        got = product(x, *weights)
        exact = _as_read(x, quantization) @ _w_as_read(w, x, quantization).T
        bound = 2**-8 * exact.abs() + 1e-6 * (x.double().abs() @ w.abs().T) + 1e-30
        assert got.shape == (m, n) and ((got.double() - exact).abs() <= bound).all(), m


def test_int8_layers_take_the_cpp_product_on_the_cpu_backend():
    """Int8Linear keeps fp32 scales for the C++ product, per row or a Q8_0 tensor's per block;
    on the reference it is PyTorch's, per row only."""
    from gpu_workers.quant import Int8Linear, quantize_int8

    w = torch.randn(24, 64)
    ops = kernels.for_device(torch.device("cpu"), "cpu")
    cpp = Int8Linear(w.bfloat16(), ops)
    assert cpp.packed.dtype == torch.int8
    x = torch.randn(3, 64).bfloat16()
    q, scales = quantize_int8(w.bfloat16())
    torch.testing.assert_close(cpp(x), matmul_ref.int8_linear(x, q, scales),
                               rtol=2**-7, atol=1e-4)
    plain = Int8Linear(w.bfloat16())
    assert plain.scales.dtype == torch.bfloat16
    torch.testing.assert_close(plain(x).float(), cpp(x).float(), rtol=2e-2, atol=2e-2)
    blocks = (q, torch.rand(24, 2) * 0.01)
    torch.testing.assert_close(Int8Linear(w, ops, blocks)(x), matmul_ref.int8_linear(x, *blocks),
                               rtol=2**-7, atol=1e-4)
    with pytest.raises(ValueError, match="per block of 32 columns needs the cpu kernels"):
        Int8Linear(w, blocks=blocks)


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "ranks", "dtype"),
                         [("none", 1, "bfloat16"), ("int4", 1, "bfloat16"),
                          ("int4a8", 1, "bfloat16"), ("int8", 1, "bfloat16"),
                          ("none", 3, "float32")])
def test_surge_serve_on_the_cpu_backend(quantization, ranks, dtype, tokenizer):
    """The worker's own set-up: bf16 linear layers routed to the C++ products (int4 and int8
    ones to the C++ low-bit products; int4a8: int4 with --quant-activation-bits 8, which the
    start-up line names where the build takes it), and the C++ attention split over 3 gloo
    ranks (in float32: transformers' own answer); one request and four at once (the small-M
    path, or W's panels, whose sums are the same at any row count) answer alike. In bf16 this
    prompt's first token is a near-tie (" Paris" leads by 0.08 in float32, under a bf16
    logit's step of 0.125 there), which any rounding in the layers can turn: the server must
    answer what the same set-up gives in-process."""
    weights, bits = weight_mode(quantization)
    a8 = bits == 8
    srv = ServerProcess("--kernel-backend", "cpu", "--quantization", weights,
                        "--quant-activation-bits", str(bits),
                        "--tensor-parallel-size", str(ranks), dtype=dtype).wait_ready()
    try:
        log = srv.output()
        assert "cpu kernels (--kernel-backend)" in log
        # With int4 layers, the LM head still takes the bf16 products.
        packed = keeps_packed_copy(torch.device("cpu"), torch.bfloat16)
        assert (matmul_cpu.describe_rows(packed) in log) == (dtype == "bfloat16")
        assert (f"{weights} weights" in log) == (weights != "none")
        takes_8 = a8 and matmul_cpu.activation_bits(64, 8) == 8
        assert ("(activations rounded to 8 bits a block past 4 rows)" in log) == takes_8
        assert ("--quant-activation-bits 8 has no effect here" in log) == (a8 and not takes_8)
        assert re.search(r"KV cache \d+ MiB \(\d+ MiB of it in 2 MiB pages, \d+ MiB asked\)", log)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)

        def ask(_: int = 0) -> str:
            r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT[0],
                                               temperature=0, max_tokens=30)
            return r.choices[0].message.content

        alone = ask()
        if dtype == "float32":
            assert alone == "The capital of France is Paris."  # transformers' own answer
        else:
            from bench.cpu_backend_step import load

            model = load("bf16" if quantization == "none" else quantization, "cpu")
            ids = tokenizer.apply_chat_template(CHAT[0])
            engine = InProcessEngine(model)
            engine.add("alone", ids, 30)
            tokens = engine.run()["alone"]
            ends = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
            assert alone == tokenizer.hf.decode(tokens[: ends[0] if ends else None]), alone
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == [alone] * 4
    finally:
        assert srv.stop() == 0, srv.output()
