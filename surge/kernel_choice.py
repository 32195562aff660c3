"""Which --kernel-backend choices a device refuses, without torch: the supervisor checks them
before any process starts (surge.preflight), each worker again as it picks its kernels
(kernels.for_device)."""

from __future__ import annotations

import os

BACKENDS = ("auto", "reference", "cpu", "triton")


def refused(choice: str, device: str, deterministic: bool) -> str | None:
    """Why `choice` cannot run on a `device` ("cpu" or "cuda") with or without --deterministic,
    whose batch-invariant steps the C++ products would break (one row and several sum in
    different orders); None: it can."""
    if choice not in BACKENDS:
        return f"kernel backend {choice!r}: use one of {', '.join(BACKENDS)}"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if choice == "triton" and device != "cuda" and not interpreted:
        return ("the triton kernel backend needs CUDA (or TRITON_INTERPRET=1 to run it in "
                "Triton's slow interpreter); use --kernel-backend reference")
    if choice == "cpu" and deterministic and device == "cpu":
        return ("--deterministic needs products whose result does not depend on the batch, "
                "which the cpu kernel backend's do; drop --kernel-backend cpu (auto then takes "
                "the reference)")
    if choice == "cpu" and device == "cuda":
        return "the cpu kernel backend runs on the CPU; use --kernel-backend auto"
    return None
