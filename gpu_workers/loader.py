"""Load a model's weights from a GGUF file (dequantized) or a Hugging Face safetensors folder,
each cut by its Hugging Face name to the shard this tensor-parallel rank holds (the families'
configs are read by gpu_workers/families.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from gpu_workers.families import LlamaConfig, UnsupportedModel, architecture, read_family
from gpu_workers.llama import LlamaModel
from gpu_workers.moe import EXPERT_WEIGHT, MoE, expert_names, shard_expert
from gpu_workers.parallel import TensorParallel
from gpu_workers.pipeline import PipelineStage
from surge.gguf_header import GGUFHeaderError, read_header
from surge.log import show_progress
from surge.model_files import ModelFiles, gguf_metadata, weight_files

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# Where an architecture names its tensors otherwise: Phi-3's fused projections (split by
# _unfused as Hugging Face's are), Gemma's norms around attention and MLP.
_GGUF_ARCH_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
_GGUF_ARCH_NAMES["gemma3"] = _GGUF_ARCH_NAMES["gemma2"]
# Every expert's weights of a layer stacked in one tensor [experts, rows, columns].
_GGUF_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved for its rotary layout; restore rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


class Blocks(NamedTuple):
    """A GGUF tensor's own quantized form, by rows: Q4_1's per-block steps and minimums
    [rows, columns / 32] (values d * q + m, q in 0..15), or Q8_0's values (int8 [rows, columns])
    and per-block scales [rows, columns / 32] (values q * d)."""

    kind: str  # "q4_1" or "q8_0"
    first: torch.Tensor
    second: torch.Tensor


Tensors = Iterator[tuple[str, torch.Tensor, Blocks | None]]  # (HF name, weight, its blocks)


def _q4_1_blocks(raw: np.ndarray, rows: int) -> Blocks:
    blocks = raw.reshape(rows, -1, 20)  # f16 d, f16 m, 16 bytes of 4-bit values
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return Blocks("q4_1", torch.from_numpy(d), torch.from_numpy(m))


def _q8_0_blocks(raw: np.ndarray, rows: int) -> Blocks:
    blocks = raw.reshape(rows, -1, 34)  # f16 d, 32 int8 values
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return Blocks("q8_0", torch.from_numpy(q), torch.from_numpy(d))


def _dequantized(t: Any) -> torch.Tensor:
    """t's values in float32, as the gguf package computes them: Q4_1 and Q8_0 (llama.cpp's
    common forms, the bundled model's) in torch on every core, where gguf's numpy takes one core
    and most of a server's start-up; other types by gguf."""
    import gguf
    from gguf.quants import dequantize

    raw = np.asarray(t.data)
    rows, shape = int(np.prod(raw.shape[:-1])), (*raw.shape[:-1], -1)
    if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        d, m = _q4_1_blocks(raw, rows)[1:]
        q = torch.from_numpy(raw.reshape(rows, -1, 20)[..., 4:].copy())
        values = torch.cat((q & 15, q >> 4), dim=-1).float()  # byte i: columns i and i + 16
        return (values * d[..., None] + m[..., None]).reshape(shape)
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        q, d = _q8_0_blocks(raw, rows)[1:]
        return (q.view(rows, -1, 32).float() * d[..., None]).reshape(shape)
    return torch.from_numpy(np.array(dequantize(raw, t.tensor_type), dtype=np.float32))


def _blocks(t: Any, short: str, rows: int) -> Blocks | None:
    """What int4 keeps of the file's own grids: Q4_1 tensors, and a Q8_0 embedding or head
    (llama.cpp's common form of them) for a head run as the file holds it."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        return _q4_1_blocks(np.asarray(t.data), rows)
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and short in ("token_embd.weight",
                                                                     "output.weight"):
        return _q8_0_blocks(np.asarray(t.data), rows)
    return None


class _GGUFTensor(NamedTuple):
    """What the loader reads of gguf's ReaderTensor."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order (a row's length first)
    data: np.ndarray  # a view of the mapped file: typed, or the raw blocks of a quantized type


def _gguf_file_tensors(path: str) -> list[Any]:
    """The file's tensors as views of the mapped file, as gguf's reader gives them, from our own
    header reader (gguf's reads every vocabulary entry first: seconds)."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    try:
        header = read_header(path, skip=("",))  # no array is needed: skip them all
    except GGUFHeaderError:
        return gguf.GGUFReader(path).tensors
    mapped = np.memmap(path, mode="r")
    typed = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
             gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
             gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
             gguf.GGMLQuantizationType.I64: np.int64}
    tensors = []
    for t in header.tensors:
        kind = gguf.GGMLQuantizationType(t.type)
        shape = tuple(reversed(t.dims))
        count = int(np.prod(t.dims))
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = mapped[t.offset : t.offset + count * size // block]
        data = raw.view(typed[kind]).reshape(shape) if kind in typed else \
            raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(_GGUFTensor(t.name, kind, t.dims, data))
    return tensors


def _gguf_tensors(tensors: list[Any], cfg: LlamaConfig, arch: str,
                  stage: PipelineStage) -> Tensors:
    """Each of the GGUF reader's tensors (ReaderTensor) this stage holds by its Hugging Face
    name, dequantized (Llama's Q/K rows are in llama.cpp's rotary order, as its converter
    writes them)."""
    names = _GGUF_NAMES | _GGUF_ARCH_NAMES.get(arch, {})
    permuted = arch == "llama"

    for t in tqdm(tensors, desc="loading weights", unit="tensor", leave=False,
                 disable=not show_progress()):
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        short = m.group(2) if m else t.name
        if m and short in _GGUF_EXPERTS:
            stacked = _dequantized(t)
            name = f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_GGUF_EXPERTS[short]}.weight"
            if not stage.holds(name):
                continue
            for e, w in enumerate(stacked):
                yield name.format(e), w, None
            continue
        if short not in names:
            continue
        name = names[short]
        if m:
            name = f"model.layers.{m.group(1)}.{name}"
        if not stage.holds(name):
            continue  # another stage's: never dequantized here
        w = _dequantized(t)
        blocks = _blocks(t, short, w.shape[0])
        heads = {"attn_q.weight": cfg.num_heads, "attn_k.weight": cfg.num_kv_heads}.get(short)
        if heads and permuted:
            w = _unpermute(w, heads)
            blocks = blocks and blocks._replace(first=_unpermute(blocks.first, heads),
                                                second=_unpermute(blocks.second, heads))
        yield name, w, blocks


def _gguf_rope_factors(tensors: dict[str, Any], cfg: LlamaConfig, meta: dict) -> None:
    """Rotary frequencies divided per dimension by factors stored as tensors: Llama 3's
    rope_freqs (its llama3 scaling, precomputed) and Phi-3's LongRoPE pair, as the longrope
    scaling (the short factors inside the original context, the long ones past it)."""
    def factors(name: str) -> list[float]:
        return np.asarray(tensors[name].data, dtype=np.float32).tolist()

    arch = meta["general.architecture"]
    if "rope_freqs.weight" in tensors:
        if cfg.rope_scaling:
            raise UnsupportedModel(f"GGUF {arch}: rope_freqs and rope.scaling.type together")
        same = factors("rope_freqs.weight")
        cfg.rope_scaling = {"rope_type": "longrope", "short_factor": same, "long_factor": same,
                            "original_max_position_embeddings": cfg.max_position_embeddings,
                            "attention_factor": 1.0}
    elif "rope_factors_long.weight" in tensors:
        original = meta.get(f"{arch}.rope.scaling.original_context_length",
                            cfg.max_position_embeddings)
        cfg.rope_scaling = {
            "rope_type": "longrope", "short_factor": factors("rope_factors_short.weight"),
            "long_factor": factors("rope_factors_long.weight"),
            "original_max_position_embeddings": int(original),
            "attention_factor": float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0))}


def _safetensors(folder: str, stage: PipelineStage) -> Tensors:
    from safetensors import safe_open

    files = weight_files(folder)
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    for file in tqdm(files, desc="loading weights", unit="file", leave=False,
                     disable=not show_progress()):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if stage.holds(name):  # another stage's is never read
                    yield name, f.get_tensor(name), None


def _unfused(tensors: Tensors, cfg: LlamaConfig) -> Tensors:
    """Phi-3's fused qkv_proj and gate_up_proj as the separate projections other families have
    (the model fuses them again, each rank's share of each part)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, w, blocks in tensors:
        m = re.fullmatch(r"(.+)\.(qkv_proj|gate_up_proj)\.(weight|bias)", name)
        if not m:
            yield name, w, blocks
            continue
        module, fused, kind = m.groups()
        if fused == "qkv_proj":
            parts, sizes = ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
        else:
            parts, sizes = ("gate_proj", "up_proj"), (w.shape[0] // 2,) * 2
        pieces = zip(*(t.split(sizes) for t in (w, *(blocks or ()))), strict=True)
        for part, (piece, *grid) in zip(parts, pieces, strict=True):
            yield f"{module}.{part}.{kind}", piece, tuple(grid) or None


_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_renamed(tensors: Tensors) -> Tensors:
    """Mixtral's block_sparse_moe weights under the names Qwen3-MoE gives the same ones."""
    for name, w, blocks in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"\.experts\.(\d+)\.(w[123])\.",
                      lambda m: f".experts.{m.group(1)}.{_MIXTRAL_EXPERT[m.group(2)]}.", name)
        yield name, w, blocks


def _destination(model: LlamaModel, name: str) -> tuple[torch.Tensor, int] | None:
    """HF parameter name -> (our tensor, row offset into it) on this rank; None for tensors we
    do not use."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return None if model.embed is None else (model.embed.weight, 0)
    if name == "model.norm.weight":
        return None if model.norm is None else (model.norm, 0)
    if name == "lm_head.weight":
        return (None if model.lm_head is None else (model.lm_head.weight, 0))
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or int(m.group(1)) not in model.stage.layers:
        return None
    layer = model.layers[int(m.group(1)) - model.stage.layers.start]
    attn, mlp = layer.attn, layer.mlp
    if isinstance(mlp, MoE) and m.group(2).startswith("mlp."):
        return mlp.place(m.group(2))
    # This rank's widths, as its layers were built.
    q, kv = attn.num_heads * cfg.head_dim, attn.num_kv_heads * cfg.head_dim
    places = {
        "input_layernorm.weight": (layer.input_norm, 0),
        "self_attn.q_proj.weight": (attn.qkv_proj.weight, 0),
        "self_attn.k_proj.weight": (attn.qkv_proj.weight, q),
        "self_attn.v_proj.weight": (attn.qkv_proj.weight, q + kv),
        "self_attn.o_proj.weight": (attn.o_proj.weight, 0),
    }
    if not isinstance(mlp, MoE):
        ff = mlp.down_proj.in_features
        places |= {"mlp.gate_proj.weight": (mlp.gate_up_proj.weight, 0),
                   "mlp.up_proj.weight": (mlp.gate_up_proj.weight, ff),
                   "mlp.down_proj.weight": (mlp.down_proj.weight, 0)}
    if cfg.sandwich_norms:  # Gemma's post_attention_layernorm norms the attention's output
        places |= {"post_attention_layernorm.weight": (layer.attn_out_norm, 0),
                   "pre_feedforward_layernorm.weight": (layer.mlp_norm, 0),
                   "post_feedforward_layernorm.weight": (layer.mlp_out_norm, 0)}
    else:
        places["post_attention_layernorm.weight"] = (layer.mlp_norm, 0)
    if cfg.qkv_bias:
        places |= {"self_attn.q_proj.bias": (attn.qkv_bias, 0),
                   "self_attn.k_proj.bias": (attn.qkv_bias, q),
                   "self_attn.v_proj.bias": (attn.qkv_bias, q + kv)}
    if cfg.qk_norm:
        places |= {"self_attn.q_norm.weight": (attn.q_norm, 0),
                   "self_attn.k_norm.weight": (attn.k_norm, 0)}
    return places.get(m.group(2))


def shard(name: str, w: torch.Tensor, cfg: LlamaConfig, tp: TensorParallel) -> torch.Tensor:
    """The part of a full weight (`name` is its Hugging Face per-layer suffix) rank tp.rank
    holds: output rows of column-parallel layers, input columns of row-parallel ones."""
    if EXPERT_WEIGHT.fullmatch(name):
        return shard_expert(name, w, tp)
    if tp.size == 1:
        return w
    d = cfg.head_dim
    h = tp.split(cfg.num_heads, "attention heads")
    first_kv, kvl = tp.kv_heads(cfg.num_kv_heads)
    ff = tp.split(cfg.intermediate_size, "MLP columns (intermediate_size)")
    rank = tp.rank
    if name.endswith(".bias"):  # cut as its weight's rows
        name = name.removesuffix(".bias") + ".weight"
    if name == "self_attn.q_proj.weight":
        return w[rank * h * d : (rank + 1) * h * d]
    if name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return w[first_kv * d : (first_kv + kvl) * d]
    if name == "self_attn.o_proj.weight":
        return w[:, rank * h * d : (rank + 1) * h * d]
    if name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return w[rank * ff : (rank + 1) * ff]
    if name == "mlp.down_proj.weight":
        return w[:, rank * ff : (rank + 1) * ff]
    return w  # embedding, norms, LM head: replicated


def load_model(files: ModelFiles, device: torch.device, dtype: torch.dtype,
               tp: TensorParallel | None = None, keep_blocks: bool = False,
               stage: PipelineStage | None = None) -> LlamaModel:
    """Build the model (this rank's part of it: its tensor-parallel shard of its pipeline
    stage's layers) on `device` in `dtype` and fill every weight from the files, reading only
    this stage's; keep_blocks: remember a GGUF's own grids too, Q4_1 layers and a Q8_0 head
    (for int4 quantization, gpu_workers/quant.py)."""
    cfg, norm_offset = read_family(files)
    stage = stage or PipelineStage(layers=range(cfg.num_layers))
    if files.gguf_file:
        found = _gguf_file_tensors(files.path)
        names = {t.name: t for t in found}
        cfg.tie_word_embeddings = "output.weight" not in names
        cfg.qkv_bias = "blk.0.attn_q.bias" in names
        if not cfg.vocab_size:
            cfg.vocab_size = int(names["token_embd.weight"].shape[-1])
        _gguf_rope_factors(names, cfg, gguf_metadata(files.path))
        tensors = _unfused(_gguf_tensors(found, cfg, architecture(files), stage), cfg)
    else:
        tensors = _mixtral_renamed(_unfused(_safetensors(files.folder, stage), cfg))
    if stage.layers.stop > cfg.num_layers:
        raise ValueError(f"pipeline stage layers {stage.layers.start}-{stage.layers.stop - 1} "
                         f"past the model's {cfg.num_layers} layers")
    with torch.device("meta"):
        model = LlamaModel(cfg, tp, stage)
    model = model.to_empty(device=device).to(dtype)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.load.zero_()  # to_empty left it unset
    filled: set[str] = set()
    owners = {id(m.weight): m for m in model.modules()
              if isinstance(m, torch.nn.Linear | torch.nn.Embedding)}
    with torch.no_grad():
        for name, w, blocks in tensors:
            dest = _destination(model, name)
            if dest is None:
                continue
            tensor, row = dest
            if norm_offset and name.endswith("norm.weight"):
                w = w.float() + norm_offset
            w = shard(name.split(".", 3)[-1], w, cfg, model.tp)  # the per-layer suffix
            tensor[row : row + w.shape[0]].copy_(w)
            filled.add(name)
            if keep_blocks and blocks is not None and model.tp.size == 1 and id(tensor) in owners:
                _keep_blocks(owners[id(tensor)], row, blocks)
    if missing := _expected_names(model) - filled:
        raise ValueError(f"weights missing from {files.path}: {sorted(missing)[:5]}")
    model.init_rope()
    return model.eval()


def _keep_blocks(module: torch.nn.Module, row: int, blocks: Blocks) -> None:
    """Remember the file's own grid for the rows a quantized tensor filled, so int4 keeps the
    file's values exactly (gpu_workers/quant.py reads it): a Q4_1 grid as module.q4_1, a whole
    Q8_0 embedding or head as module.q8_0 (values, scales)."""
    if blocks.kind == "q8_0":
        if row == 0 and blocks.first.shape == module.weight.shape:
            module.q8_0 = (blocks.first, blocks.second)
        return
    out, k = module.weight.shape
    if not hasattr(module, "q4_1"):
        module.q4_1 = torch.full((2, out, k // 32), float("nan"))
    module.q4_1[0, row : row + blocks.first.shape[0]] = blocks.first
    module.q4_1[1, row : row + blocks.second.shape[0]] = blocks.second


def _expected_names(model: LlamaModel) -> set[str]:
    """The weights this rank's model (its stage's part) is filled from."""
    cfg, tp = model.cfg, model.tp
    names = {"model.embed_tokens.weight"} if model.embed is not None else set()
    if model.norm is not None:
        names.add("model.norm.weight")
    if model.lm_head is not None:
        names.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo")]
    if cfg.sandwich_norms:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if cfg.qkv_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    experts = expert_names(cfg.num_experts, tp)
    for i in model.stage.layers:
        mlp = experts if cfg.num_experts and i not in cfg.dense_layers else dense
        names.update(f"model.layers.{i}.{n}" for n in per_layer + mlp)
    return names
