"""The scheduler and the model runner driven in one process (no transport): for tests only."""

from __future__ import annotations

import time
from collections import deque

import torch

from gpu_workers.draft import shares_layers
from gpu_workers.model_runner import ModelRunner
from scheduler.scheduler import Scheduler
from surge.config import SchedulerConfig, SpeculativeConfig
from surge.grammar import Matchers
from surge.protocol import EngineRequest, SamplingParams, StepPlan, StepResult


class InProcessEngine:
    """depth=2 plans each step before the previous one's tokens are read back, as the
    scheduler loop does with async_scheduling."""

    def __init__(self, model, num_blocks: int = 512, depth: int = 1, graphs_max_batch: int = 0,
                 speculative: SpeculativeConfig | None = None, draft=None,
                 fixed_order: bool = False, matchers: Matchers | None = None,
                 **scheduler_options) -> None:
        cfg = SchedulerConfig(**scheduler_options)
        own_cache = draft is not None and not shares_layers(draft, model)
        self.scheduler = Scheduler(cfg, num_blocks, speculative=speculative,
                                   window=0 if own_cache else model.cfg.reach)
        self.runner = ModelRunner(model, num_blocks, cfg.block_size, torch.device("cpu"),
                                  model.embed.weight.dtype, graphs_max_batch=graphs_max_batch,
                                  draft=draft, fixed_order=fixed_order, matchers=matchers)
        self.depth = depth
        self.step_times: list[tuple[float, list[str]]] = []  # (seconds, requests decoding)
        self.peak_blocks = 0  # the most KV blocks held at once
        self.prompt_logprobs: dict[str, list] = {}  # by request, where asked for

    def add(self, request_id: str, prompt: list[int], max_tokens: int, *,
            temperature: float = 0.0, seed: int | None = None,
            stop_token_ids: list[int] | None = None, grammar: str | None = None,
            **sampling) -> None:
        error = self.scheduler.add(EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, arrival_time=time.time(),
            grammar=grammar,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                    stop_token_ids=stop_token_ids or [], **sampling)))
        assert error is None, error

    def _run_plan(self, plan: StepPlan) -> StepResult:
        names = {s.seq_id: s.request_id for s in self.scheduler.seqs.values()}
        started = time.perf_counter()
        result = self.runner.run(plan)
        blocks = self.scheduler.blocks
        self.peak_blocks = max(self.peak_blocks, blocks.num_blocks - blocks.num_free)
        decoding = [names[s.seq_id] for s in plan.seqs if len(s.token_ids) == 1]
        self.step_times.append((time.perf_counter() - started, decoding))
        return result

    def run(self) -> dict[str, list[int]]:
        """Step until every request is finished; the generated tokens of each."""
        tokens: dict[str, list[int]] = {}
        inflight: deque[tuple[StepPlan, StepResult]] = deque()
        while self.scheduler.has_work() or inflight:
            depth = 1 if self.scheduler.speculating() else self.depth  # as the loop does
            plan = self.scheduler.schedule() if len(inflight) < depth else None
            if plan is not None:
                inflight.append((plan, self._run_plan(plan)))
            elif not inflight:
                raise AssertionError("work is queued but nothing could be scheduled")
            if plan is None or len(inflight) >= depth:
                for out in self.scheduler.update(*inflight.popleft()):
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.prompt_logprobs is not None:
                        self.prompt_logprobs[out.request_id] = out.prompt_logprobs
        return tokens
