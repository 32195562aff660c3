"""Tensor parallelism: which heads and MLP columns a rank holds, and the one collective per
block (an all-reduce after each row-parallel projection)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from msgspec import Struct

if TYPE_CHECKING:
    from gpu_workers.llama import LlamaConfig


class TensorParallel(Struct, frozen=True):
    """This rank's place in a group of `size` ranks (size 1: no group, nothing to reduce)."""

    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` heads or columns, which must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) do not split evenly over "
                             f"--tensor-parallel-size {self.size}; pick a size that divides it")
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
            dist.all_reduce(summed)
            return summed.to(x.dtype)
        dist.all_reduce(x)
        return x

    def shard(self, name: str, w: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
        """The part of a full weight (`name` is its Hugging Face per-layer suffix) this rank
        holds: output rows of column-parallel layers, input columns of row-parallel ones."""
        if self.size == 1:
            return w
        d = cfg.head_dim
        h = self.split(cfg.num_heads, "attention heads")
        first_kv, kvl = self.kv_heads(cfg.num_kv_heads)
        ff = self.split(cfg.intermediate_size, "MLP columns (intermediate_size)")
        rank = self.rank
        if name == "self_attn.q_proj.weight":
            return w[rank * h * d : (rank + 1) * h * d]
        if name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            return w[first_kv * d : (first_kv + kvl) * d]
        if name == "self_attn.o_proj.weight":
            return w[:, rank * h * d : (rank + 1) * h * d]
        if name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return w[rank * ff : (rank + 1) * ff]
        if name == "mlp.down_proj.weight":
            return w[:, rank * ff : (rank + 1) * ff]
        return w  # embedding, norms, LM head: replicated

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's tensor to every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0)


def init_group(tp: TensorParallel, device: torch.device, store_path: str) -> None:
    """Join the group: NCCL between GPUs, gloo on the CPU; rendezvous through a file."""
    if tp.size == 1:
        return
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
        rank=tp.rank, world_size=tp.size, device_id=device if device.type == "cuda" else None)

