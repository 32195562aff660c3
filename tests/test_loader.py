"""The weight loader: what it keeps of a GGUF file beyond the dequantized values."""

from __future__ import annotations

import json
import os

import pytest
import torch

import kernels
from gpu_workers.loader import _dequantized, _gguf_file_tensors, _GGUFTensor, load_model
from gpu_workers.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    quantize_int4,
    quantize_model,
)
from kernels import matmul


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0"])
def test_gguf_tensors_dequantize_as_the_gguf_package_does(kind, model_files):
    """Our torch dequantizer (Q4_1, Q8_0) and the gguf package's fallback (any other type) give
    gguf's values bit for bit, on a 3-D expert stack as on a matrix; and on every tensor of the
    bundled file."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((3, 5, 96)).astype(np.float32)
    for x in (values, values[0]):
        raw = quantize(x, kind)
        got = _dequantized(_GGUFTensor("t", kind, x.shape[::-1], raw))
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got, torch.from_numpy(dequantize(raw, kind)))
    for t in _gguf_file_tensors(model_files.path):
        assert torch.equal(_dequantized(t).reshape(-1), torch.from_numpy(
            np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(-1)), t.name


def test_gguf_q4_1_blocks_are_kept_exactly(model_files):
    """int4 in groups of 32 on the bundled Q4_1 file reuses the file's own grid (steps and
    minimums read from its blocks, q and k rows un-permuted like the values): the quantized
    layers hold exactly the file's values."""
    model = load_model(model_files, torch.device("cpu"), torch.float32, keep_blocks=True)
    for linear in (model.layers[0].mlp.gate_up_proj, model.layers[3].attn.qkv_proj):
        grid = linear.q4_1
        assert grid.shape == (2, linear.weight.shape[0], linear.weight.shape[1] // 32)
        q, scales, zeros = quantize_int4(linear.weight, 32, grid)
        torch.testing.assert_close(dequantize_int4(q, scales, zeros, 32), linear.weight,
                                   rtol=0, atol=1e-6)
    quantize_model(model, "int4", 32)
    assert isinstance(model.layers[0].attn.qkv_proj, Int4Linear)


def test_gguf_q8_0_head_is_kept_for_int4_on_the_cpu_kernels(model_files):
    """The bundled file's embedding, its tied head, is Q8_0 (as llama.cpp writes them): int4
    keeps its int8 values and fp16 scales as read, and on the cpu kernels the head runs on
    them, the file's own values (a bf16 embedding rounds them). --quantize-lm-head still
    quantizes the head to the layers' int4; the reference kernels keep the tied head."""
    cpu = torch.device("cpu")
    model = load_model(model_files, cpu, torch.float32, keep_blocks=True)
    q, scales = model.embed.q8_0
    assert q.dtype == torch.int8 and q.shape == model.embed.weight.shape
    assert torch.equal(q.float() * scales.repeat_interleave(32, dim=1), model.embed.weight)
    quantize_model(model, "int4", 32)
    assert model.lm_head is None
    quantize_model(model, "int4", 32, ops=kernels.for_device(cpu, "cpu"))
    assert isinstance(model.lm_head, Int8Linear)
    x = torch.randn(2, model.cfg.hidden_size)
    torch.testing.assert_close(model.lm_head(x), matmul.int8_linear(x, q, scales),
                               rtol=1e-3, atol=1e-3)
    model.lm_head = None
    quantize_model(model, "int4", 32, head=True, ops=kernels.for_device(cpu, "cpu"))
    assert isinstance(model.lm_head, Int4Linear)


def test_our_gguf_header_reader_reads_what_the_gguf_package_reads(model_files, tmp_path):
    """Every key (but the vocabulary arrays it skips) and every tensor's type, shape and bytes,
    as gguf.GGUFReader gives them; a file that is not GGUF is refused (the callers then fall
    back to the package)."""
    import gguf
    import numpy as np

    from gpu_workers.loader import _gguf_file_tensors
    from surge.gguf_header import GGUFHeaderError, read_header
    from surge.model_files import gguf_metadata

    reader = gguf.GGUFReader(model_files.path)
    meta = gguf_metadata(model_files.path)
    assert meta == {k: f.contents() for k, f in reader.fields.items()
                    if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                 "tokenizer.ggml.token_type")}
    ours = _gguf_file_tensors(model_files.path)
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert tuple(mine.shape) == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFHeaderError):
        read_header(str(tmp_path / "x.gguf"))


def test_sharded_checkpoint_loads_the_shards_its_index_names(tmp_path):
    """A Qwen2 saved in shards of 50 kB (model.safetensors.index.json) beside a stray
    *.safetensors of another model's weights under the same names (sorted after the shards:
    read last, were every file read): only the indexed shards are read, and the tokens are
    transformers' own; an index naming a missing shard is refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from surge.model_files import SHARD_INDEX, ModelError, resolve_model, weight_files
    from tests.inprocess import InProcessEngine
    from tests.tiny_families import save_tiny

    folder = tmp_path / "sharded"
    save_tiny(str(folder), "qwen2", shard_size="50kB")
    shards = weight_files(str(folder))
    assert len(shards) > 2 and (folder / SHARD_INDEX).exists()
    save_tiny(str(tmp_path / "other"), "qwen2", seed=1)
    stray = load_file(str(tmp_path / "other" / "model.safetensors"))
    save_file(stray, str(folder / "stray.safetensors"))
    prompt = [5, 17, 42, 99, 3, 250, 7, 64, 128, 31, 9]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = InProcessEngine(load_model(resolve_model(str(folder)), torch.device("cpu"),
                                        torch.float32))
    engine.add("p", prompt, 16)
    assert engine.run()["p"] == expected
    index = json.loads((folder / SHARD_INDEX).read_text())
    for name in ("../other/model.safetensors", "/etc/passwd"):  # a shard outside the folder
        strange = {**index, "weight_map": {**index["weight_map"], "x.weight": name}}
        (folder / SHARD_INDEX).write_text(json.dumps(strange))
        with pytest.raises(ModelError, match="names shards outside its folder"):
            weight_files(str(folder))
    (folder / SHARD_INDEX).write_text(json.dumps(index))
    os.remove(shards[-1])
    with pytest.raises(ModelError, match=f"names shards that are missing: "
                                         f"{os.path.basename(shards[-1])}"):
        weight_files(str(folder))
