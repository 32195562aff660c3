"""Tensor parallelism: which heads and MLP columns (or, with expert parallelism, which whole
experts) a rank holds, and the one collective per block (an all-reduce after each row-parallel
projection)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from msgspec import Struct

from gpu_workers.families import unsplit
from gpu_workers.pipeline import PipelineStage


class TensorParallel(Struct, frozen=True):
    """This rank's place in a group of `size` ranks (size 1: no group, nothing to reduce)."""

    rank: int = 0
    size: int = 1
    # Mixture-of-experts layers: whole experts on each rank instead of a slice of every one.
    expert_parallel: bool = False
    # With pipeline stages: this stage's subgroup and the global rank of its rank 0 (None:
    # the whole world is the group).
    group: Any = None
    root: int = 0

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` heads or columns, which must divide evenly."""
        if problem := unsplit(total, self.size, what):
            raise ValueError(problem)
        return total // self.size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: an even share, or (fewer KV heads than
        ranks) the one KV head its query heads are grouped on, replicated across ranks."""
        if total >= self.size:
            count = self.split(total, "KV heads")
            return self.rank * count, count
        if self.size % total:
            raise ValueError(f"{total} KV heads cannot be replicated over "
                             f"--tensor-parallel-size {self.size}; pick a multiple of {total}")
        return self.rank * total // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial outputs of a row-parallel projection over the group."""
        if self.size == 1:
            return x
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # gloo sums reduced-precision tensors slowly and not on every build; fp32 also keeps
            # the sum closer to the one-rank result.
            summed = x.float()
            dist.all_reduce(summed, group=self.group)
            return summed.to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's tensor to every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=self.root, group=self.group)


def init_group(tp: TensorParallel, device: torch.device, store_path: str) -> None:
    """Join the group: NCCL between GPUs, gloo on the CPU; rendezvous through a file."""
    if tp.size == 1:
        return
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
        rank=tp.rank, world_size=tp.size, device_id=device if device.type == "cuda" else None)



def init_groups(rank: int, tp_size: int, splits: list[range], device: torch.device,
                store_path: str, expert_parallel: bool = False
                ) -> tuple[TensorParallel, PipelineStage]:
    """Worker `rank` of a group of len(splits) stages x tp_size ranks (stage = rank // tp_size):
    one world over every rank (its stage's neighbours are reached point to point), and a
    tensor-parallel subgroup per stage, created in the same order on every rank."""
    stages = len(splits)
    index, tp_rank = divmod(rank, tp_size)
    stage = PipelineStage(index, stages, splits[index],
                          prev=rank - tp_size if index > 0 else -1,
                          next=rank + tp_size if index < stages - 1 else -1)
    if stages == 1:
        tp = TensorParallel(rank, tp_size, expert_parallel)
        init_group(tp, device, store_path)
        return tp, stage
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
        rank=rank, world_size=stages * tp_size,
        device_id=device if device.type == "cuda" else None)
    group = None
    for s in range(stages):  # every rank creates every subgroup (new_group is collective)
        members = list(range(s * tp_size, (s + 1) * tp_size))
        made = dist.new_group(members) if tp_size > 1 else None
        if s == index:
            group = made
    return TensorParallel(tp_rank, tp_size, expert_parallel, group=group,
                          root=index * tp_size), stage


def exit_process(code: int | str | None = 0) -> NoReturn:
    """End a process (its own cleanup done) as sys.exit(code) would, but without the
    interpreter's finalization where it joined a process group: CPython 3.11 ends a thread that
    asks for the GIL during finalization with pthread_exit, and a gloo thread still releasing
    its last collective's tensors (it frees their Python objects) unwinds through a noexcept C++
    frame: SIGABRT, "terminate called without an active exception", after the rank's work."""
    if not dist.is_initialized():
        sys.exit(code)
    logging.shutdown()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # as sys.exit prints a message
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)
