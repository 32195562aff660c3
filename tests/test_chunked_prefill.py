"""A 4,000-token prompt arriving while 16 requests decode is read in chunks: the decodes keep
going every step. The chunking is asserted; the step times are reported, not asserted."""

from __future__ import annotations

import statistics

import pytest

from tests.inprocess import InProcessEngine
from tests.prompts import LONG_TEXT

pytestmark = pytest.mark.slow
BUDGET = 256


def test_long_prompt_does_not_stall_decodes(engine_model, tokenizer, capsys):
    engine = InProcessEngine(engine_model, num_blocks=600, max_num_batched_tokens=BUDGET)
    for i in range(16):
        engine.add(f"d{i}", tokenizer.encode(f"Count slowly from {i} to one hundred:"), 60,
                   stop_token_ids=[])
    sched = engine.scheduler
    # Let the 16 settle into decoding, then the long prompt arrives.
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running) or sched.waiting:
        engine.step_times.clear()
        plan = sched.schedule()
        sched.update(plan, engine._run_plan(plan))
    long_ids = (tokenizer.encode(LONG_TEXT) * 3)[:4000]
    engine.add("long", long_ids, 4)
    plans = []
    while sched.requests["long"].num_computed_tokens < len(long_ids):
        plan = sched.schedule()
        plans.append(plan)
        sched.update(plan, engine._run_plan(plan))
    chunks = [sum(len(s.token_ids) for s in p.seqs if len(s.token_ids) > 1) for p in plans]
    decodes = [sum(1 for s in p.seqs if len(s.token_ids) == 1) for p in plans]
    assert len(plans) >= 4000 // BUDGET
    assert all(sum(len(s.token_ids) for s in p.seqs) <= BUDGET for p in plans)
    assert decodes == [16] * len(plans), "a decode was skipped while the prompt was read"
    assert sum(chunks) == len(long_ids) == 4000
    during = [t for t, _ in engine.step_times[-len(plans):]]
    engine.step_times.clear()
    engine.run()
    after = [t for t, d in engine.step_times if len(d) >= 15]
    with capsys.disabled():
        print(f"\n  16 decodes + 4000-token prompt in {len(plans)} chunks of <= {BUDGET}: "
              f"step p50 {statistics.median(during) * 1000:.0f} ms, "
              f"max {max(during) * 1000:.0f} ms; decode-only step p50 "
              f"{statistics.median(after) * 1000:.0f} ms "
              f"({statistics.median(during) / statistics.median(after):.1f}x)")
