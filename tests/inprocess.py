"""The scheduler and the model runner driven in one process (no transport): for tests only."""

from __future__ import annotations

import time

import torch

from gpu_workers.model_runner import ModelRunner
from scheduler.scheduler import Scheduler
from surge.config import SchedulerConfig
from surge.protocol import EngineRequest, SamplingParams, StepResult


class InProcessEngine:
    def __init__(self, model, num_blocks: int = 512, **scheduler_options) -> None:
        cfg = SchedulerConfig(**scheduler_options)
        self.scheduler = Scheduler(cfg, num_blocks)
        self.runner = ModelRunner(model, num_blocks, cfg.block_size, torch.device("cpu"),
                                  model.embed.weight.dtype)
        self.steps = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, *,
            temperature: float = 0.0, seed: int | None = None,
            stop_token_ids: list[int] | None = None) -> None:
        error = self.scheduler.add(EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, arrival_time=time.time(),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                    stop_token_ids=stop_token_ids or [])))
        assert error is None, error

    def run(self) -> dict[str, list[int]]:
        """Step until every request is finished; the generated tokens of each."""
        tokens: dict[str, list[int]] = {}
        while self.scheduler.has_work():
            plan = self.scheduler.schedule()
            assert plan is not None, "work is queued but nothing could be scheduled"
            result = StepResult(plan.step_id, self.runner.run(plan))
            self.steps += 1
            for out in self.scheduler.update(plan, result):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens
