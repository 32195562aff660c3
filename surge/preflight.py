"""Start-up mistakes found before any process starts or any weight is read: each is a
ConfigError of one line that says how to fix it."""

from __future__ import annotations

import math
import os
import socket

from surge.config import ConfigError, SurgeConfig
from surge.config_load import parse_memory
from surge.kernel_choice import refused
from surge.model_files import (
    ModelError,
    ModelFiles,
    gguf_metadata,
    hf_config,
    resolve_model,
    resolve_tokenizer,
)


def preflight(cfg: SurgeConfig) -> None:
    """Raise ConfigError for the first mistake found (cfg.model has its devices resolved)."""
    try:
        files = resolve_model(cfg.model.model)
        if cfg.model.tokenizer:
            resolve_tokenizer(cfg.model.tokenizer)
        if cfg.speculative.draft_model:
            resolve_model(cfg.speculative.draft_model, "--draft-model")
    except ModelError as e:
        raise ConfigError(str(e)) from None
    _check_pipeline(cfg, files)
    _check_shape(cfg, files)
    _check_kernels(cfg)
    _check_kv_cache(cfg, files)
    _check_port(cfg.server.host, cfg.server.port)


def _check_port(host: str, port: int) -> None:
    """Bind and let go, as the frontend will (SO_REUSEADDR: a port in TIME_WAIT is free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} cannot be listened on ({e.strerror}); give an "
                          "address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise ConfigError(
                    f"port {port} on {host} is not free ({e.strerror}): another server (maybe "
                    f"another surge) listens there; stop it or choose another with --port"
                ) from None


def _block_bytes(files: ModelFiles, cfg: SurgeConfig) -> int:
    """The fewest bytes one KV block can take on one rank (16-bit unless float32 is asked)."""
    if files.gguf_file:
        meta = gguf_metadata(files.path)
        arch = meta["general.architecture"]
        layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.rope.dimension_count",
                                int(meta[f"{arch}.embedding_length"]) // heads))
    else:
        hf = hf_config(files.folder)
        layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads", heads)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    ranks = max(cfg.model.tensor_parallel_size, 1)
    element = 4 if cfg.model.dtype == "float32" else 2
    # A pipeline stage holds its own layers' cache: the largest stage's share counts.
    layers = -(-layers // cfg.model.pipeline_parallel_size)
    return (layers * 2 * math.ceil(kv_heads / ranks) * cfg.scheduler.block_size * head_dim
            * element)


def _check_pipeline(cfg: SurgeConfig, files: ModelFiles) -> None:
    """The layer split over --pipeline-parallel-size, and what does not go with stages."""
    model = cfg.model
    if model.pipeline_parallel_size == 1 and not model.pipeline_layers:
        return
    from gpu_workers.families import read_family
    from gpu_workers.pipeline import stage_layers

    try:
        stage_layers(read_family(files)[0].num_layers, model.pipeline_parallel_size,
                     model.pipeline_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_shape(cfg: SurgeConfig, files: ModelFiles) -> None:
    """The model's shape against the flags: heads and MLP columns over the tensor-parallel
    ranks, a draft cut from more layers than the model has."""
    tp, spec = cfg.model.tensor_parallel_size, cfg.speculative
    cut = spec.draft_model is None and spec.draft_layers > 0
    if tp <= 1 and not cut:
        return
    from gpu_workers.families import read_family, too_many_layers, unsplit

    shape = read_family(files)[0]
    splits = [(shape.num_heads, "attention heads")]
    if not shape.num_experts:  # experts split their own way (moe.py)
        splits.append((shape.intermediate_size, "MLP columns (intermediate_size)"))
    problems = [unsplit(total, tp, what) for total, what in splits if tp > 1]
    problems.append(too_many_layers(spec.draft_layers, shape.num_layers) if cut else None)
    if problem := next((p for p in problems if p), None):
        raise ConfigError(problem)


def _check_kernels(cfg: SurgeConfig) -> None:
    """--kernel-backend against the device and --deterministic (kernels.for_device's rule)."""
    if problem := refused(cfg.model.kernel_backend, cfg.model.device, cfg.model.deterministic):
        raise ConfigError(problem)


def _check_kv_cache(cfg: SurgeConfig, files: ModelFiles) -> None:
    value = cfg.scheduler.kv_cache_memory
    parse_memory(value, 0)  # the format, whatever the device
    fraction = value.strip().replace(".", "", 1).isdigit()
    if fraction and cfg.model.device == "cuda":
        return  # free GPU memory is known only to the workers
    budget = parse_memory(value, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if cfg.model.device == "cpu" and budget > memory:
        raise ConfigError(
            f"kv_cache_memory={value} ({budget} bytes) is more than this machine's memory "
            f"({memory / 2**30:.1f} GiB); lower it (e.g. --kv-cache-memory 0.5, half the "
            f"free memory)")
    if cfg.model.device == "cpu":
        budget //= max(cfg.model.group_size, 1)  # the CPU ranks share it
    need = _block_bytes(files, cfg)
    if budget < need:
        raise ConfigError(
            f"kv_cache_memory={value} ({budget} bytes per rank) holds no KV block: one block of "
            f"{cfg.scheduler.block_size} tokens takes {need / 2**20:.2f} MiB for this model; "
            f"raise it (e.g. --kv-cache-memory 256MiB)")
