"""Compute kernels. Each has a plain-PyTorch reference (any device; the CPU path and the test
oracle) and a Triton implementation with the same signature beside it (CUDA). `for_device`
picks one backend as a value, a Kernels bundle, which the worker chooses once and the model
holds."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import (
    decode_attention,
    fixed_order_attention,
    plan_decode,
    prefill_attention,
    store_kv,
)
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_, rotary_angles, rotary_cache

BACKENDS = ("auto", "reference", "triton")


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

    def __str__(self) -> str:
        return f"{self.name} kernels ({self.reason})"


# kernel -> the module holding its reference; the Triton one is the same name + "_triton".
_MODULES = {"store_kv": "attention", "plan_decode": "attention", "decode_attention": "attention",
            "prefill_attention": "attention", "rms_norm": "rmsnorm", "add_rms_norm": "rmsnorm",
            "apply_rotary_": "rotary"}


def backend(name: str, reason: str) -> Kernels:
    """The named backend's bundle (reference or triton)."""
    suffix = "_triton" if name == "triton" else ""
    return Kernels(name, reason, **{
        kernel: getattr(importlib.import_module(f"kernels.{module}{suffix}"), kernel)
        for kernel, module in _MODULES.items()})


REFERENCE = backend("reference", "the default before a worker picks")


def for_device(device: torch.device, choice: str = "auto") -> Kernels:
    """The backend for a device: choice is one of BACKENDS (--kernel-backend)."""
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r}: use one of {', '.join(BACKENDS)}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if choice == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError("the triton kernel backend needs CUDA (or TRITON_INTERPRET=1 to run it "
                         "in Triton's slow interpreter); use --kernel-backend reference")
    why = "--kernel-backend" if choice != "auto" else f"auto on {device.type}"
    if choice == "reference" or (choice == "auto" and device.type != "cuda"):
        return backend("reference", why)
    return backend("triton", why)


__all__ = [
    "BACKENDS",
    "REFERENCE",
    "Kernels",
    "add_rms_norm",
    "apply_rotary_",
    "backend",
    "decode_attention",
    "fixed_order_attention",
    "for_device",
    "plan_decode",
    "prefill_attention",
    "rms_norm",
    "rotary_angles",
    "rotary_cache",
    "store_kv",
]
