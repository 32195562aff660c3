"""Compute kernels. Each has a plain-PyTorch reference (the CPU path and the test oracle) and a
Triton implementation with the same signature beside it; `use_triton` picks one set for the
whole process (the worker picks Triton on CUDA)."""

from __future__ import annotations

import importlib

from kernels.attention import (
    decode_attention,
    fixed_order_attention,
    plan_decode,
    prefill_attention,
    store_kv,
)
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_, rotary_angles, rotary_cache

# name -> the module holding its reference; the Triton one is the same name + "_triton".
_SWITCHED = {
    "store_kv": "attention",
    "plan_decode": "attention",
    "decode_attention": "attention",
    "prefill_attention": "attention",
    "rms_norm": "rmsnorm",
    "add_rms_norm": "rmsnorm",
    "apply_rotary_": "rotary",
}


def use_triton(enabled: bool) -> None:
    """Point every switched kernel name at its Triton implementation, or back at the reference.
    Callers look the names up on this module (kernels.store_kv(...)) so they follow the switch."""
    for name, module in _SWITCHED.items():
        impl = importlib.import_module(f"kernels.{module}{'_triton' if enabled else ''}")
        globals()[name] = getattr(impl, name)


__all__ = [
    "add_rms_norm",
    "apply_rotary_",
    "decode_attention",
    "fixed_order_attention",
    "plan_decode",
    "prefill_attention",
    "rms_norm",
    "rotary_angles",
    "rotary_cache",
    "store_kv",
    "use_triton",
]
