"""Our Llama, scheduler and sampler against transformers' implementation, token for token."""

from __future__ import annotations

import random

import pytest

from tests.inprocess import InProcessEngine
from tests.prompts import reference_prompts

N_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return reference_prompts(tokenizer)


@pytest.fixture(scope="module")
def expected(prompts, reference):
    return {name: reference.greedy(ids, N_TOKENS) for name, ids in prompts.items()}


def test_each_prompt_alone_matches_reference(engine_model, prompts, expected):
    for name, ids in prompts.items():
        engine = InProcessEngine(engine_model)
        engine.add(name, ids, N_TOKENS)
        assert engine.run()[name] == expected[name], name


def test_batch_invariance(engine_model, prompts, expected):
    """All prompts at once, mixed with random-length strangers, give the tokens they give alone."""
    rng = random.Random(0)
    engine = InProcessEngine(engine_model, max_num_batched_tokens=4096)
    for name, ids in prompts.items():
        engine.add(name, ids, N_TOKENS)
    for i in range(6):
        engine.add(f"other{i}", [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 300))],
                   rng.randrange(1, 40))
    got = engine.run()
    for name in prompts:
        assert got[name] == expected[name], name


@pytest.mark.parametrize(("label", "options"), [
    ("overlapped steps", dict(depth=2)),
    ("chunked prefill", dict(max_num_batched_tokens=37)),
    ("preemption", dict(num_blocks=140, max_num_batched_tokens=4096)),
])
def test_scheduling_variants_keep_reference_tokens(engine_model, prompts, expected, label,
                                                   options):
    """Tiny token budgets, a cache too small for everyone, and planning ahead change how the
    work is cut into steps, never the tokens."""
    engine = InProcessEngine(engine_model, **options)
    for name, ids in prompts.items():
        engine.add(name, ids, N_TOKENS)
    got = engine.run()
    for name in prompts:
        assert got[name] == expected[name], (label, name)
    if label == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if label == "chunked prefill":
        assert max(len(d) for _, d in engine.step_times) > 1


def test_prefix_cache_hits_keep_reference_tokens(engine_model, prompts, expected, tokenizer,
                                                 reference):
    engine = InProcessEngine(engine_model)
    long_ids = prompts["long"]
    engine.add("first", long_ids, N_TOKENS)
    assert engine.run()["first"] == expected["long"]
    # Same long prefix, different endings: all but the last partial block comes from the cache.
    variants = {f"v{i}": long_ids[: 900 + 37 * i] + tokenizer.encode(f" Question {i}:")
                for i in range(3)}
    for name, ids in variants.items():
        engine.add(name, ids, 16)
    # Decoding together over the same cached blocks: cascade attention reads them once.
    shared: list[int] = []
    prepare = engine.runner.prepare
    engine.runner.prepare = lambda plan: (step := prepare(plan),
                                          shared.append(step.meta.decode_shared_blocks))[0]
    got = engine.run()
    assert max(shared) >= 896 // 16, shared
    blocks = engine.scheduler.blocks
    assert blocks.hit_tokens >= 3 * 896, blocks.hit_tokens
    for name, ids in variants.items():
        assert got[name] == reference.greedy(ids, 16), name
