"""Compute kernels. Each has a plain-PyTorch reference (the CPU path and the test oracle)."""

from kernels.attention import decode_attention, prefill_attention, store_kv
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, rotary_angles, rotary_cache

__all__ = [
    "add_rms_norm",
    "apply_rotary",
    "decode_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_angles",
    "rotary_cache",
    "store_kv",
]
