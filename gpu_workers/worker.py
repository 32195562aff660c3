"""The worker process: load the model, size the KV cache, then run every step plan it is sent."""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import torch
import zmq
from torch import nn

import kernels
from gpu_workers import host_memory
from gpu_workers.devices import place
from gpu_workers.draft import shares_layers, truncated
from gpu_workers.families import read_family
from gpu_workers.fused import fuse_layers
from gpu_workers.kernel_linear import keeps_packed_copy, route_linears
from gpu_workers.llama import LlamaModel
from gpu_workers.loader import load_model
from gpu_workers.model_runner import Launched, ModelRunner, kv_block_bytes
from gpu_workers.moe import expert_loads, take_expert_load
from gpu_workers.packed import PackedLinear, can_pack, fix_row_counts, pack_model
from gpu_workers.parallel import init_groups
from gpu_workers.pipeline import describe_split, stage_layers
from gpu_workers.quant import FP8Linear, Int4Linear, Int8Linear, quantize_model
from kernels import matmul_cpu
from shm.ring import RingBuffer, RingClosed
from surge import metrics
from surge.config import ModelConfig, SpeculativeConfig, SurgeConfig
from surge.config_load import parse_memory
from surge.grammar import Matchers
from surge.model_files import resolve_model
from surge.process import child_setup
from surge.protocol import PlanMessage, Shutdown, WorkerFailed, WorkerReady, encode
from surge.runtime import Channels

log = logging.getLogger("surge.worker")
_TEST_CRASH_EXIT = 86


def _test_crash_token() -> int | None:
    """A test hook, for the crash-recovery tests only: with SURGE_TEST_CRASH_TOKEN=ID set, a
    worker exits at once (code 86) on any step that feeds token ID. Unset, it does nothing."""
    value = os.environ.get("SURGE_TEST_CRASH_TOKEN")
    return int(value) if value else None


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if device.type == "cuda" or _cpu_has_bf16():
        return torch.bfloat16
    # Without bf16 instructions the C++ products still step bf16 faster than fp32 (an AVX2-only
    # AMD EPYC, bench.cpu_backend_step: 1.3-2.3x at 1-64 sequences); PyTorch's own bf16 GEMM
    # does not.
    if kernels.for_device(device, cfg.kernel_backend, cfg.deterministic).name == "cpu":
        return torch.bfloat16
    return torch.float32


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_worker(cfg: SurgeConfig, channels: Channels, rank: int, status: Any,
               generation: int = 0) -> None:
    """Rank `rank` of the group (pipeline stage rank // T, tensor-parallel rank rank % T;
    cfg.model resolved by devices.resolve); the group's rendezvous file is new for each
    `generation` of workers."""
    child_setup(channels.name("worker", rank), cfg)
    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.connect(channels.results)
    ring = RingBuffer(channels.plan_ring, reader=rank)
    try:
        runner, ready = _load(cfg, rank, channels.runtime_dir, generation, channels.replica)
        ready.generation = generation
        device = runner.device
        crash_token = _test_crash_token()
        ring.skip_to_end()
        results.send(encode(ready))
        status.put((channels.name("worker", rank), ready.description))
        decoder = msgspec.msgpack.Decoder(PlanMessage)
        idle_since = time.perf_counter()
        pending: tuple[Launched, float, float] | None = None  # launched, started, idle before
        busy = metrics.worker_busy.labels(str(rank))
        idle = metrics.worker_idle.labels(str(rank))
        # Each stage's rank 0 counts its own layers' routing.
        loads = expert_loads(runner.model) if runner.model.tp.rank == 0 else []

        def finish() -> None:
            nonlocal pending, idle_since
            assert pending is not None
            launched, started, wait_s = pending
            result = runner.finish(launched)
            now = time.perf_counter()
            metrics.step_time.labels(str(rank)).observe(now - started)
            # Time blocked on a neighbouring stage is idle time too (the pipeline's bubble).
            blocked = runner.link.take_wait() if runner.link is not None else 0.0
            busy.inc(max(0.0, now - started - blocked))
            idle.inc(wait_s + blocked)
            if device.type == "cuda":
                metrics.device_memory.labels(str(rank)).set(torch.cuda.memory_allocated(device))
            if loads:
                _count_expert_load(loads)
            if runner.samples:
                result.compute_s = now - started
                result.forward_s, result.wait_s = runner.forward_s, wait_s
                results.send(encode(result))
            pending = None
            idle_since = time.perf_counter()

        while True:
            if pending is not None and not ring.poll():
                finish()  # nothing to prepare meanwhile
                continue
            msg = decoder.decode(ring.get())
            if isinstance(msg, Shutdown):
                break
            if crash_token is not None and any(crash_token in s.token_ids for s in msg.seqs):
                os._exit(_TEST_CRASH_EXIT)  # the test hook: die as a crashing kernel would
            started = time.perf_counter()
            wait_s = started - idle_since if pending is None else 0.0
            # Step N+1's inputs are packed and sent while step N computes.
            step = runner.prepare(msg)
            if pending is not None:
                finish()
            pending = (runner.launch(step), started, wait_s)
    except (SystemExit, RingClosed):
        pass
    except BaseException as e:
        log.error("worker failed:\n%s", traceback.format_exc())
        results.send(encode(WorkerFailed(rank, f"{type(e).__name__}: {e}",
                                         generation=generation)))
        raise SystemExit(1) from e
    finally:
        ring.close()
        ctx.destroy(linger=500)
        status.close()
        status.join_thread()  # what it put is sent before the process ends (exit_process)


def _huge_page_note(kv_cache: torch.Tensor) -> str:
    """The start-up line's word on how much of a CPU KV cache got 2 MiB pages (see
    host_memory.zeros): fewer than asked where the kernel found memory too fragmented."""
    if kv_cache.device.type != "cpu":
        return ""
    asked, got = (n / 2**20 for n in host_memory.huge_pages(kv_cache))
    return f" ({got:.0f} MiB of it in 2 MiB pages, {asked:.0f} MiB asked)"


def _activation_note(cfg: ModelConfig, ops: kernels.Kernels) -> str:
    """The start-up line's word on --quant-activation-bits 8, which only the cpu kernels' int4
    and int8 products on AVX-512 VNNI take (past a decode step's 4 rows)."""
    if cfg.quantization not in ("int4", "int8") or cfg.quant_activation_bits == 16:
        return ""
    if ops.name == "cpu" and matmul_cpu.activation_bits(64, 8) == 8:
        return " (activations rounded to 8 bits a block past 4 rows)"
    return (" (--quant-activation-bits 8 has no effect here: only the cpu kernels on AVX-512 "
            "VNNI take it; activations keep 16 bits or their dtype)")


def _fixed_rows(model: LlamaModel, prepare: Callable[[LlamaModel], None] | None) -> None:
    """--deterministic: the model's products, packed or plain, each in fixed-shape slices."""
    if prepare is not None:
        prepare(model)
    fix_row_counts(model, (nn.Linear, PackedLinear, Int8Linear, Int4Linear, FP8Linear))


def _load(cfg: SurgeConfig, rank: int, runtime_dir: str, generation: int, replica: int = 0
          ) -> tuple[ModelRunner, WorkerReady]:
    device = place(cfg.model, rank, replica)
    files = resolve_model(cfg.model.model)
    splits = stage_layers(read_family(files)[0].num_layers, cfg.model.pipeline_parallel_size,
                          cfg.model.pipeline_layers)
    # Each data-parallel replica's group meets at its own rendezvous file.
    tp, stage = init_groups(rank, cfg.model.tensor_parallel_size, splits, device,
                            f"{runtime_dir}/tp{replica or ''}-{generation}",
                            cfg.model.enable_expert_parallel)
    dtype = pick_dtype(cfg.model, device)
    started = time.monotonic()
    quant = cfg.model.quantization
    model = load_model(files, device, dtype, tp, keep_blocks=quant == "int4", stage=stage)
    ops = kernels.for_device(device, cfg.model.kernel_backend, cfg.model.deterministic)
    if quant != "none":
        quantize_model(model, quant, cfg.model.quant_group_size, cfg.model.quantize_lm_head,
                       ops, cfg.model.quant_activation_bits)
    # The C++ backend's products read W's panels at every row count on AVX-512 BF16 (without
    # AMX), else the plain weights for a few rows and a oneDNN copy past them where that is
    # faster than the plain weight (gpu_workers.kernel_linear.packed_copy_for).
    routed = ops.name == "cpu" and dtype == torch.bfloat16
    packed = cfg.model.pack_weights and (keeps_packed_copy(device, dtype) if routed
                                         else can_pack(device, dtype))
    prepare = (partial(route_linears, ops=ops, packed=packed) if routed
               else pack_model if packed else None)
    if cfg.model.deterministic:
        prepare = partial(_fixed_rows, prepare=prepare)
    if prepare is not None:
        prepare(model)
    draft = _load_draft(cfg.speculative, model, device, dtype, prepare)
    if prepare is not None:
        host_memory.return_freed_memory()
    block_size = cfg.scheduler.block_size
    budget = parse_memory(cfg.scheduler.kv_cache_memory, free_memory(device))
    if device.type == "cpu":
        # The ranks share one memory; on GPUs the budget is per device.
        budget //= tp.size * stage.size
    own_cache = draft is not None and not shares_layers(draft, model)
    num_blocks = budget // (kv_block_bytes(model, block_size, dtype)
                            + (kv_block_bytes(draft, block_size, dtype) if own_cache else 0))
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={cfg.scheduler.kv_cache_memory} holds no KV block "
                         f"of {block_size} tokens; raise it")
    cuda = device.type == "cuda"
    if cuda and cfg.model.deterministic:
        # cuBLAS picks its reduction order by the batch's shape; only the CPU path is invariant.
        raise ValueError("--deterministic runs on the CPU only; drop it or use --device cpu")
    model.ops = ops
    fused = fuse_layers(model)
    if draft is not None:
        draft.ops = ops
        fuse_layers(draft)
    # Not with pipeline stages: a step's forward there waits on its neighbours (not captured).
    graphs = (min(cfg.model.cuda_graph_max_batch, cfg.scheduler.max_num_seqs)
              if cuda and stage.size == 1 else 0)
    runner = ModelRunner(model, num_blocks, block_size, device, dtype,
                         graphs_max_batch=graphs, capture_graphs=cuda, draft=draft,
                         fixed_order=cfg.model.deterministic,
                         matchers=Matchers(runtime_dir, model.cfg.vocab_size)
                         if tp.rank == 0 and stage.last else None)
    # On the CPU oneDNN's first product at a new row count costs about a millisecond (its
    # primitive, measured), too little to warm each size for; a full budget's prefill would add
    # a fraction of a second to every start.
    runner.warm_up(cfg.scheduler.max_num_batched_tokens if cuda else 0)
    take_expert_load(expert_loads(model))  # the warm-up's routing is nobody's load
    for expert in range(model.cfg.num_experts if tp.rank == 0 else 0):
        metrics.moe_expert_tokens.labels(str(expert))  # every expert's series from the start
    split = f" (rank {tp.rank} of {tp.size})" if tp.size > 1 else ""
    if stage.size > 1:
        split += f", pipeline {stage.describe()} (split {describe_split(splits)})"
    if tp.size > 1 and model.cfg.num_experts:
        split += ", expert parallel" if tp.expert_parallel else ", experts sliced over ranks"
    if cuda:
        split += (f", CUDA graphs for decode batches up to {graphs}" if graphs
                  else ", no CUDA graphs (pipeline stages)" if stage.size > 1
                  else ", no CUDA graphs")
    description = (f"{files.path} on {device}{split} in {str(dtype).removeprefix('torch.')}"
                   f"{'' if quant == 'none' else f', {quant} weights'}"
                   f"{_activation_note(cfg.model, ops)}"
                   f"{' (oneDNN-packed weights)' if packed and not routed else ''}"
                   f"{f' ({matmul_cpu.describe_rows(packed)})' if routed else ''}"
                   f"{', one call a layer' if fused else ''}"
                   f"{', deterministic attention' if cfg.model.deterministic else ''}"
                   f"{'' if draft is None else f', draft of {draft.cfg.num_layers} layers'}, "
                   f"{torch.get_num_threads()} threads, {ops}, loaded in "
                   f"{time.monotonic() - started:.1f}s; KV cache {budget / 2**20:.0f} MiB"
                   f"{_huge_page_note(runner.kv_cache)}")
    # Blocks the window has passed in every layer are given back by the scheduler; not with a
    # draft model of its own, whose attention sees the whole context.
    window = 0 if own_cache else model.cfg.reach
    return runner, WorkerReady(rank=rank, num_blocks=num_blocks, block_size=block_size,
                               description=description, kernels=str(ops), window=window)


def _count_expert_load(loads: list[torch.Tensor]) -> None:
    """The tokens each expert was routed since the last step, into surge_moe_expert_tokens."""
    for expert, tokens in enumerate(take_expert_load(loads) or ()):
        if tokens:
            metrics.moe_expert_tokens.labels(str(expert)).inc(tokens)


def _load_draft(cfg: SpeculativeConfig, target: LlamaModel, device: torch.device,
                dtype: torch.dtype, prepare: Callable[[LlamaModel], None] | None
                ) -> LlamaModel | None:
    """Speculative decoding's draft: another model file, or the target itself (sharing its
    weights), cut to draft_layers."""
    if not cfg.has_draft:
        return None
    draft = target
    if cfg.draft_model is not None:
        draft = load_model(resolve_model(cfg.draft_model), device, dtype)
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) is "
                             f"not the target's ({target.cfg.vocab_size}); a draft must share "
                             f"the target's tokenizer")
        if prepare is not None:
            prepare(draft)  # as the target's linear layers were
    return truncated(draft, cfg.draft_layers) if cfg.draft_layers else draft
