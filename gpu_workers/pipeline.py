"""Pipeline parallelism: which contiguous layers a stage holds, and the hidden states (with the
residual stream) a stage hands to the next one, point to point."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from msgspec import Struct

# Sends a stage keeps outstanding before it waits for the oldest one (each holds a step's
# hidden states): enough for every stage to work on its own micro-batch.
_MAX_PENDING_SENDS = 8


def stage_layers(num_layers: int, stages: int, spec: str | None = None) -> list[range]:
    """The layers of each stage: `spec`'s comma-separated counts, or as even as possible (the
    first stages take the extra layers: the last one also runs the LM head)."""
    if spec:
        try:
            counts = [int(c) for c in spec.split(",")]
        except ValueError:
            raise ValueError(f"--pipeline-layers {spec!r}: give comma-separated layer counts, "
                             f"one per stage, e.g. 15,15") from None
        if len(counts) != stages or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(
                f"--pipeline-layers {spec!r}: give {stages} counts of at least 1 (one per "
                f"stage of --pipeline-parallel-size {stages}) that sum to the model's "
                f"{num_layers} layers")
    else:
        if stages > num_layers:
            raise ValueError(f"--pipeline-parallel-size {stages} is more stages than the "
                             f"model's {num_layers} layers; lower it")
        base, extra = divmod(num_layers, stages)
        counts = [base + (s < extra) for s in range(stages)]
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def describe_split(splits: list[range]) -> str:
    """'0-14 | 15-29', the split as printed at start."""
    return " | ".join(f"{r.start}-{r.stop - 1}" for r in splits)


class PipelineStage(Struct, frozen=True):
    """This worker's stage of `size` and its layers (global indices); prev/next: the global
    ranks it receives hidden states from and sends them to (-1: none)."""

    index: int = 0
    size: int = 1
    layers: range = range(0)
    prev: int = -1
    next: int = -1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def holds(self, name: str) -> bool:
        """Whether a Hugging Face weight name belongs on this stage, so the loader never reads
        the others' (the embedding: the first stage, and the last when it is the tied head)."""
        if self.size == 1:
            return True
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in self.layers
        if name == "model.embed_tokens.weight":
            return self.first or self.last  # the last drops it unless it is the tied head
        if name in ("model.norm.weight", "lm_head.weight"):
            return self.last
        return True

    def describe(self) -> str:
        return (f"stage {self.index + 1} of {self.size}, layers {self.layers.start}-"
                f"{self.layers.stop - 1}")


class StageLink:
    """The hidden states [2, tokens, hidden] (x and the residual) between stages: received
    whole from the previous stage, sent to the next without waiting (isend), so a stage moves
    on to its next micro-batch while the next stage reads this one."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.sends: deque[tuple[Any, torch.Tensor]] = deque()
        self.wait_s = 0.0  # time blocked on a neighbour since the last take_wait()

    def recv(self, num_tokens: int, hidden: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        buf = torch.empty((2, num_tokens, hidden), dtype=dtype, device=device)
        started = time.perf_counter()
        dist.recv(buf, src=self.stage.prev)
        self.wait_s += time.perf_counter() - started
        return buf

    def send(self, states: torch.Tensor) -> None:
        states = states.contiguous()
        # The tensor must outlive its send: kept with the work until that completes.
        self.sends.append((dist.isend(states, dst=self.stage.next), states))
        while self.sends and self.sends[0][0].is_completed():
            self.sends.popleft()
        if len(self.sends) > _MAX_PENDING_SENDS:
            started = time.perf_counter()
            self.sends.popleft()[0].wait()
            self.wait_s += time.perf_counter() - started

    def take_wait(self) -> float:
        wait, self.wait_s = self.wait_s, 0.0
        return wait
