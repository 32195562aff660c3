"""The weight loader: what it keeps of a GGUF file beyond the dequantized values."""

from __future__ import annotations

import torch

from gpu_workers.loader import load_model
from gpu_workers.quant import Int4Linear, dequantize_int4, quantize_int4, quantize_model


def test_gguf_q4_1_blocks_are_kept_exactly(model_files):
    """int4 in groups of 32 on the bundled Q4_1 file reuses the file's own grid (steps and
    minimums read from its blocks, q and k rows un-permuted like the values): the quantized
    layers hold exactly the file's values."""
    model = load_model(model_files, torch.device("cpu"), torch.float32, keep_q4_1=True)
    for linear in (model.layers[0].mlp.gate_up_proj, model.layers[3].attn.qkv_proj):
        grid = linear.q4_1
        assert grid.shape == (2, linear.weight.shape[0], linear.weight.shape[1] // 32)
        q, scales, zeros = quantize_int4(linear.weight, 32, grid)
        torch.testing.assert_close(dequantize_int4(q, scales, zeros, 32), linear.weight,
                                   rtol=0, atol=1e-6)
    quantize_model(model, "int4", 32)
    assert isinstance(model.layers[0].attn.qkv_proj, Int4Linear)


def test_our_gguf_header_reader_reads_what_the_gguf_package_reads(model_files, tmp_path):
    """Every key (but the vocabulary arrays it skips) and every tensor's type, shape and bytes,
    as gguf.GGUFReader gives them; a file that is not GGUF is refused (the callers then fall
    back to the package)."""
    import gguf
    import numpy as np
    import pytest

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
