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
