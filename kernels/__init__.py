"""Compute kernels. Each has a plain-PyTorch reference (any device; the test oracle), and beside
it, with the same signature, a Triton implementation (CUDA; `*_triton.py`) and for some a C++
one (CPU; `*_cpu.py` over kernels/cpu/). `for_device` picks one backend as a value, a Kernels
bundle, which the worker chooses once and the model holds."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from kernels.activation import silu_mul
from kernels.attention import (
    decode_attention,
    fixed_order_attention,
    plan_decode,
    prefill_attention,
    store_kv,
)
from kernels.matmul import int4_linear, int8_linear, linear
from kernels.moe import fused_moe
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_, rotary_angles, rotary_cache
from surge.kernel_choice import refused


@dataclass(frozen=True)
class Kernels:
    """One backend's kernels, each with the reference's signature."""

    name: str
    reason: str  # why this backend was picked
    store_kv: Callable
    plan_decode: Callable
    decode_attention: Callable
    prefill_attention: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    apply_rotary_: Callable
    fused_moe: Callable
    linear: Callable
    silu_mul: Callable
    argmax: Callable  # the greedy pick of each row of logits
    random_pick: Callable  # the seeded random pick of each row (-1: none)
    # Rotary on queries and keys, then keys and values into the cache (see rotate_and_store).
    rotate_and_store: Callable
    # A whole Llama-shaped decoder layer in one call (gpu_workers/fused.py), where the backend
    # has one (cpu); None: the model calls the kernels above one by one.
    decoder_layer: Callable | None = None
    # The backend's own int4 and int8 products, over weights it repacked once (int4_linear(x,
    # pack_int4(packed, scales, mins), activation_bits) computes kernels.matmul.int4_linear's
    # product, and int8_linear(x, pack_int8(q, scales), activation_bits) its int8_linear's),
    # where it has them (cpu); None: gpu_workers/quant.py takes PyTorch's low-bit operators.
    pack_int4: Callable | None = None
    int4_linear: Callable | None = None
    pack_int8: Callable | None = None
    int8_linear: Callable | None = None

    def __str__(self) -> str:
        return f"{self.name} kernels ({self.reason})"


# kernel -> the module holding its reference; a backend's is the same name + "_triton" or
# "_cpu". The C++ backend has no store_kv or rotary of its own: it fuses them instead.
_MODULES = {"store_kv": "attention", "plan_decode": "attention", "decode_attention": "attention",
            "prefill_attention": "attention", "rms_norm": "rmsnorm", "add_rms_norm": "rmsnorm",
            "apply_rotary_": "rotary", "fused_moe": "moe", "linear": "matmul",
            "silu_mul": "activation", "argmax": "sampling", "random_pick": "sampling"}


def backend(name: str, reason: str) -> Kernels:
    """The named backend's bundle (reference, cpu or triton)."""
    def own(kernel: str, module: str) -> Callable | None:
        """The backend's own kernel, if it has one (the reference has no *_reference module)."""
        spec = importlib.util.find_spec(f"kernels.{module}_{name}")
        return spec and getattr(importlib.import_module(f"kernels.{module}_{name}"), kernel, None)

    found = {k: own(k, m) or getattr(importlib.import_module(f"kernels.{m}"), k)
             for k, m in _MODULES.items()}
    return Kernels(name, reason, **found,
                   rotate_and_store=own("rotate_and_store", "rotary") or partial(
                       rotate_and_store, found["apply_rotary_"], found["store_kv"]),
                   decoder_layer=own("decoder_layer", "layer"),
                   **{k: own(k, "matmul") for k in ("pack_int4", "int4_linear", "pack_int8",
                                                    "int8_linear")})


def rotate_and_store(rotate: Callable, store: Callable, qk: torch.Tensor, v: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate qk [T, H + KVH, D] in place (queries, then keys), then store its keys and v into
    the cache: a backend's own rotary and store, where it has no fused kernel."""
    rotate(qk, cos, sin)
    store(qk[:, qk.shape[1] - v.shape[1]:], v, k_cache, v_cache, slot_mapping)


REFERENCE = backend("reference", "the default before a worker picks")


def for_device(device: torch.device, choice: str = "auto", deterministic: bool = False
               ) -> Kernels:
    """The backend for a device: choice is --kernel-backend (surge.kernel_choice says which it
    refuses); deterministic: --deterministic."""
    if problem := refused(choice, device.type, deterministic):
        raise ValueError(problem)
    why = "--kernel-backend" if choice != "auto" else f"auto on {device.type}"
    if choice == "reference":
        return backend("reference", why)
    if deterministic and device.type == "cpu":
        return backend("reference", f"{why} with --deterministic: batch-invariant products")
    if device.type == "cuda":
        return backend("triton", why)
    if choice == "triton":  # Triton's interpreter on the CPU, for its tests
        return backend("triton", why)
    from kernels.cpu import extension

    # auto takes the C++ kernels wherever they built: faster per step at every batch size
    # measured (bench.cpu_backend_step). Where they did not, extension() has warned why.
    if extension() is not None:
        return backend("cpu", why)
    if choice == "cpu":
        raise ValueError("--kernel-backend cpu: the C++ kernels did not build (see the "
                         "warning above); use --kernel-backend reference")
    return backend("reference", f"{why}: the C++ kernels did not build")


__all__ = [
    "REFERENCE",
    "Kernels",
    "add_rms_norm",
    "apply_rotary_",
    "backend",
    "decode_attention",
    "fixed_order_attention",
    "for_device",
    "fused_moe",
    "int4_linear",
    "int8_linear",
    "linear",
    "plan_decode",
    "prefill_attention",
    "rms_norm",
    "rotary_angles",
    "rotary_cache",
    "silu_mul",
    "store_kv",
]
