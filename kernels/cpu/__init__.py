"""The C++ CPU kernels (ATen + OpenMP), compiled on first use for this machine's CPU and cached
in the virtual environment (`make` builds them ahead: see kernels.cpu.build)."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

_SOURCES = ("bindings.cpp", "attention.cpp", "norm.cpp", "gemv.cpp", "amx.cpp", "panels.cpp",
            "int4.cpp", "quant_panels.cpp", "int8.cpp", "activation.cpp", "rotary.cpp",
            "layer.cpp", "sampling.cpp")


def build_dir() -> Path:
    """Inside the virtual environment, never in the source tree: one build per CPU (a build for
    another CPU's instructions could crash on this one) and per checkout using the environment
    (a build names its sources' paths: a shared one would be rebuilt at each switch, under the
    other checkout's running processes)."""
    try:  # x86's "flags", ARM's "Features"
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        cpu = platform.processor()
    tag = hashlib.sha256(f"{Path(__file__).resolve().parent}\n{cpu}".encode()).hexdigest()[:12]
    return Path(os.environ.get("SURGE_KERNEL_BUILD_DIR",
                               Path(sys.prefix) / f"surge-cpu-kernels-{tag}"))


@cache
def extension() -> ModuleType | None:
    """The compiled module, or None (with one warning naming why) where it cannot be built."""
    from torch.utils import cpp_extension

    here = Path(__file__).parent
    build_dir().mkdir(parents=True, exist_ok=True)
    # The ninja that pip installed beside this interpreter, when the caller's PATH lacks it.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        return cpp_extension.load(
            name="surge_cpu_kernels", sources=[str(here / s) for s in _SOURCES],
            build_directory=str(build_dir()),
            # -march=native: the build is per machine, so it uses what this CPU has (AVX-512,
            # AVX2, ...) without a dispatch table of our own. SURGE_KERNEL_MARCH (with a
            # SURGE_KERNEL_BUILD_DIR of its own) builds another CPU's paths to test them here,
            # e.g. haswell: AVX2 without AVX-512.
            extra_cflags=["-O3", f"-march={os.environ.get('SURGE_KERNEL_MARCH', 'native')}",
                          "-fopenmp"], extra_ldflags=["-fopenmp"],
            verbose=False)
    except (OSError, RuntimeError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"the C++ CPU kernels did not build ({first}); using the PyTorch "
                      "reference kernels", stacklevel=2)
        return None
