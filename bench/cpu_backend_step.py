"""The C++ kernel backend against the serving default on this CPU: runner decode-step time,
the models stepped alternately in one process so both see the same load. bf16: the default
(reference kernels, oneDNN-packed weights) vs `--kernel-backend cpu` (C++ paged attention,
norms and bf16 products: AMX tiles where the CPU has them); int4 / int8: PyTorch's low-bit
operators vs the C++ int4 / int8 products; fp32 (the default dtype on CPUs without bf16
instructions): the reference kernels vs the C++ ones, both on MKL's fp32 products.

With --against layers the baseline is the cpu backend itself, its layers called one by one
from Python, against one decoder_layer call a layer (gpu_workers/fused.py); with --against
onednn, the cpu backend on oneDNN's packed copies past the small-row product instead of W's
panels (kernels/cpu/panels.cpp, AVX-512 BF16 CPUs).

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.cpu_backend_step [--batches 1,4,64]
       [--steps 12] [--modes bf16,int4,int4a8,int8,int8a8,fp32]
       [--against reference|layers|onednn]
       (int4a8, int8a8: int4 and int8 with --quant-activation-bits 8)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import kernels
from bench import weight_mode
from bench.packed_weights import cpu_kind, decoding_engine, step_times
from gpu_workers.fused import fuse_layers
from gpu_workers.kernel_linear import keeps_packed_copy, route_linears
from gpu_workers.llama import LlamaModel
from gpu_workers.loader import load_model
from gpu_workers.packed import can_pack, pack_model
from gpu_workers.quant import quantize_model
from surge.model_files import resolve_model


def load(mode: str, backend: str, fused: bool = True, panels: bool = True) -> LlamaModel:
    """The bundled model as the worker prepares it for this mode and kernel backend (fused:
    one decoder_layer call a layer where the backend has it; panels: W's panels as the packed
    copies where the build has them, else oneDNN's)."""
    cpu, dtype = torch.device("cpu"), torch.float32 if mode == "fp32" else torch.bfloat16
    quantization, bits = weight_mode(mode)
    model = load_model(resolve_model("default"), cpu, dtype, keep_blocks=quantization == "int4")
    model.ops = kernels.for_device(cpu, backend)
    if quantization in ("int4", "int8"):
        quantize_model(model, quantization, 32, ops=model.ops, activation_bits=bits)
    if backend == "cpu":
        if dtype == torch.bfloat16:  # packed copies (W's panels or oneDNN's), as the worker
            route_linears(model, model.ops, keeps_packed_copy(cpu, dtype), panels)
        if fused:
            fuse_layers(model)
    elif can_pack(cpu, dtype):
        pack_model(model)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modes", default="bf16,int4")
    parser.add_argument("--against", default="reference",
                        choices=("reference", "layers", "onednn"),
                        help="the baseline: the reference kernels, the cpu backend's layers "
                             "called one by one from Python (no decoder_layer), or the cpu "
                             "backend on oneDNN's packed copies instead of W's panels")
    opts = parser.parse_args()
    print(f"{cpu_kind()}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}")
    for mode in opts.modes.split(","):
        baseline = (load(mode, "reference") if opts.against == "reference"
                    else load(mode, "cpu", fused=opts.against != "layers",
                              panels=opts.against != "onednn"))
        models = {"reference": baseline, "cpu": load(mode, "cpu")}
        for batch in (int(b) for b in opts.batches.split(",")):
            t = step_times({name: decoding_engine(m, batch, opts.context)
                            for name, m in models.items()}, opts.steps)
            print(f"{mode} batch {batch:3d} at context ~{opts.context}: step {opts.against} "
                  f"{t['reference'] * 1e3:.1f} ms, cpu {t['cpu'] * 1e3:.1f} ms "
                  f"(cpu {t['reference'] / t['cpu']:.2f}x)")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
