"""A mixture-of-experts block (Mixtral, Qwen3-MoE): the router's top-k experts per token, their
weights normalised as the family does, and the experts' gated MLPs (ops.fused_moe). Over
tensor-parallel ranks each rank holds a slice of every expert's intermediate columns, or, with
expert parallelism, whole experts; either way one all-reduce ends the block."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.parallel import TensorParallel
from kernels import Kernels

# An expert's weight by its Hugging Face per-layer suffix (Mixtral's w1/w3/w2 renamed so).
EXPERT_WEIGHT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def held_experts(num_experts: int, tp: TensorParallel) -> range:
    """The experts rank tp.rank holds: all, or its even share under expert parallelism."""
    if not tp.expert_parallel:
        return range(num_experts)
    n = tp.split(num_experts, "experts (--enable-expert-parallel)")
    return range(tp.rank * n, (tp.rank + 1) * n)


class MoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, act, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.top_k, self.renormalize, self.act = tp, top_k, renormalize, act
        self.experts = held_experts(num_experts, tp)
        ff = intermediate if tp.expert_parallel else tp.split(
            intermediate, "expert columns (moe_intermediate_size)")
        # The router is replicated and stays out of quantization and packing (not a Linear):
        # a rounded score can change which experts a token gets.
        self.router = nn.Parameter(torch.empty(num_experts, hidden))
        self.w13 = nn.Parameter(torch.empty(len(self.experts), 2 * ff, hidden))
        self.w2 = nn.Parameter(torch.empty(len(self.experts), hidden, ff))
        # Tokens routed to each expert since the worker last read it (surge_moe_expert_tokens).
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, ops: Kernels) -> torch.Tensor:
        probs = F.linear(x, self.router).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        self.load.scatter_add_(0, flat, torch.ones_like(flat))
        if self.tp.expert_parallel:
            first, held = self.experts.start, len(self.experts)
            experts = torch.where((experts >= first) & (experts < first + held),
                                  experts - first, -1)
        out = ops.fused_moe(x, self.w13, self.w2, weights.to(x.dtype), experts, self.act)
        return self.tp.all_reduce(out)

    def place(self, name: str) -> tuple[torch.Tensor, int] | None:
        """(our tensor, row offset) for a per-layer weight name under mlp.; None for an expert
        another rank holds."""
        if name == "mlp.gate.weight":
            return self.router, 0
        m = EXPERT_WEIGHT.fullmatch(name)
        if m is None or int(m.group(1)) not in self.experts:
            return None
        e = int(m.group(1)) - self.experts.start
        part = m.group(2)
        if part == "down":
            return self.w2[e], 0
        return self.w13[e], 0 if part == "gate" else self.w13.shape[1] // 2


def shard_expert(name: str, w: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of an expert's full weight: gate/up rows, down columns (all of it under
    expert parallelism, where whole experts are placed)."""
    if tp.expert_parallel or tp.size == 1:
        return w
    part = EXPERT_WEIGHT.fullmatch(name).group(2)
    ff = (w.shape[1] if part == "down" else w.shape[0]) // tp.size
    cut = slice(tp.rank * ff, (tp.rank + 1) * ff)
    return w[:, cut] if part == "down" else w[cut]


def expert_names(num_experts: int, tp: TensorParallel) -> list[str]:
    """The per-layer weight names an MoE layer of this rank is filled from."""
    return ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight"
                                  for e in held_experts(num_experts, tp)
                                  for p in ("gate", "up", "down")]


def expert_loads(model: nn.Module) -> list[torch.Tensor]:
    """Each MoE layer's tokens routed to each expert (zeroed in place by take_expert_load), found
    once: a walk of SmolLM2's 213 modules takes 180 µs, ~3% of its 64-stream step on an H200."""
    return [m.load for m in model.modules() if isinstance(m, MoE)]


def take_expert_load(loads: list[torch.Tensor]) -> list[int] | None:
    """Tokens routed to each expert, summed over the layers' loads, since the last call (which
    zeroes the counts); None for a model without experts."""
    if not loads:
        return None
    total = torch.stack(loads).sum(0).tolist()
    for load in loads:
        load.zero_()
    return total
