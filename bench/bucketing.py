"""Length bucketing's effect on decode-attention padding, by simulation (no model).

Decode attention gathers every sequence of a step up to the longest context in that step, so
its work is (decodes x longest context); the useful part is the sum of the contexts. This runs
the real Scheduler on 512 requests with long-tailed prompt lengths and a fake worker, and
reports padded/useful work and mean steps to first token, with bucketing off and on.

Usage: .venv/bin/python -m bench.bucketing
"""

from __future__ import annotations

import random

from scheduler.scheduler import Scheduler
from surge.config import SchedulerConfig
from surge.protocol import EngineRequest, SamplingParams, SeqResult, StepResult


def simulate(bucketing: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, block_size=16,
                          length_bucketing=bucketing)
    sched = Scheduler(cfg, num_blocks=4096)
    for i in range(512):
        length = int(16 * 2 ** rng.uniform(0, 7))  # 16 .. 2048 tokens, long-tailed
        sched.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=[5] * length,
                                arrival_time=0.0, sampling=SamplingParams(max_tokens=64)))
    padded = useful = steps = 0
    first_token: dict[str, int] = {}
    while sched.has_work():
        plan = sched.schedule()
        steps += 1
        decode_ctx = [s.start_pos + 1 for s in plan.seqs if len(s.token_ids) == 1]
        if decode_ctx:
            padded += len(decode_ctx) * max(decode_ctx)
            useful += sum(decode_ctx)
        sampled = {s.seq_id: SeqResult([7]) for s in plan.seqs if s.sample}
        for out in sched.update(plan, StepResult(plan.step_id, sampled)):
            first_token.setdefault(out.request_id, steps)
    return {"padding_overhead": padded / useful - 1, "steps": steps,
            "mean_steps_to_first_token": sum(first_token.values()) / len(first_token)}


def main() -> None:
    off, on = simulate(False), simulate(True)
    for label, r in (("bucketing off", off), ("bucketing on", on)):
        print(f"{label:14s} padded attention work +{r['padding_overhead']:.1%}, "
              f"{r['steps']} steps, mean steps to first token "
              f"{r['mean_steps_to_first_token']:.0f}")


if __name__ == "__main__":
    main()
