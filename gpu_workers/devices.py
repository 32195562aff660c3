"""Which device each worker runs on, how many workers there are, and which CPUs they use.
torch is imported where it is used: the supervisor settles the devices without it where no
NVIDIA driver is loaded (its import is 2 s of every start-up)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from surge.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch


def _cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where the kernel has no NVIDIA
    driver (no CUDA device can be used then)."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        return False
    import torch

    return torch.cuda.is_available()


def resolve(cfg: ModelConfig) -> ModelConfig:
    """The model config with `device`, `devices` and `tensor_parallel_size` made concrete: one
    device per worker, data_parallel_size x pipeline_parallel_size x tensor_parallel_size of
    them, replica by replica, stage by stage. Run in the supervisor: a worker must set
    CUDA_VISIBLE_DEVICES before it asks CUDA anything."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not _cuda_available()):
        return msgspec.structs.replace(cfg, device="cpu",
                                       tensor_parallel_size=cfg.tensor_parallel_size or 1)
    if listed := cfg.devices or os.environ.get("CUDA_VISIBLE_DEVICES"):
        devices = [d.strip() for d in listed.split(",") if d.strip()]
    else:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    if not devices:
        raise ConfigError("--device cuda: no GPU is visible here (check nvidia-smi and "
                          "CUDA_VISIBLE_DEVICES); use --device cpu, or auto")
    others = cfg.data_parallel_size * cfg.pipeline_parallel_size
    size = cfg.tensor_parallel_size or max(1, len(devices) // others)
    if size * others > len(devices):
        layout = f"--tensor-parallel-size {size}" + "".join(
            f" x {flag} {n}" for flag, n in (("--pipeline-parallel-size",
                                               cfg.pipeline_parallel_size),
                                              ("--data-parallel-size", cfg.data_parallel_size))
            if n > 1)
        raise ConfigError(f"{layout} needs {size * others} GPUs but "
                          f"{len(devices)} are visible ({','.join(devices) or 'none'}); "
                          "lower it or list more with --devices")
    return msgspec.structs.replace(cfg, device="cuda",
                                   devices=",".join(devices[: size * others]),
                                   tensor_parallel_size=size)


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's cpulist format) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def _gpu_local_cpus(device: torch.device) -> list[int]:
    """The CPUs of the GPU's NUMA node, from sysfs (empty where unknown)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return []
    address = (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
               f"{getattr(props, 'pci_device_id', 0):02x}.0")
    try:
        with open(f"/sys/bus/pci/devices/{address}/local_cpulist") as f:
            return parse_cpulist(f.read())
    except OSError:
        return []


def cpu_share(cpus: list[int], rank: int, size: int) -> list[int]:
    """Rank's contiguous slice of cpus when `size` CPU workers share them (at least one each)."""
    per = max(1, len(cpus) // size)
    share = cpus[rank * per : (rank + 1) * per]
    return share or [cpus[rank % len(cpus)]]


def place(cfg: ModelConfig, rank: int, replica: int = 0) -> torch.device:
    """Put worker `rank` of data-parallel `replica` on its device and CPUs (cfg from
    resolve()); call before anything touches CUDA."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    index = replica * cfg.group_size + rank  # workers are laid out replica by replica
    if cfg.device == "cuda":
        # Each worker sees its own GPU only, so it is cuda:0 and NCCL pairs ranks to GPUs.
        assert cfg.devices is not None
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.devices.split(",")[index]
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        cpus = [c for c in _gpu_local_cpus(device) if c in allowed] or allowed
    else:
        device = torch.device("cpu")
        cpus = cpu_share(allowed, index, cfg.data_parallel_size * cfg.group_size)
        torch.set_num_threads(len(cpus))
    os.sched_setaffinity(0, cpus)
    return device
