"""Prompt logprobs (completions' echo with logprobs): every prompt token's logprob after the
first, scored by the worker chunk by chunk, against transformers' log-softmax."""

from __future__ import annotations

import pytest

from tests.inprocess import InProcessEngine


def _check(got, ids: list[int], expected, k: int) -> None:
    assert len(got) == len(ids) - 1
    for p, lp in enumerate(got, 1):
        assert lp.logprob == pytest.approx(float(expected[p - 1, ids[p]]), abs=2e-3), p
        top = expected[p - 1].topk(k)
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=2e-3), p


@pytest.mark.parametrize(("options", "others"), [
    ({}, 8),  # the prompt in one step
    ({"max_num_batched_tokens": 37}, 8),  # in chunks: a chunk's last row predicts the next's
    # Preempted mid-prompt by the others' growth, and scored again from its first token.
    ({"num_blocks": 14, "max_num_batched_tokens": 37}, 20),
], ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_are_the_models_own(engine_model, tokenizer, reference, options,
                                            others):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 18)
    expected = reference.log_probs(ids)
    engine = InProcessEngine(engine_model, **options)
    for i in range(3):  # strangers first, which take no scores
        engine.add(f"other{i}", ids[: 20 + 9 * i], others)
    engine.add("scored", ids, 4, prompt_logprobs=3)
    preempted: list[int] = []  # the scored prompt's tokens computed when it was preempted
    preempt = engine.scheduler._preempt

    def watched(seq) -> None:
        if seq.request_id == "scored":
            preempted.append(seq.num_computed_tokens)
        preempt(seq)

    engine.scheduler._preempt = watched
    engine.run()
    _check(engine.prompt_logprobs["scored"], ids, expected, 3)
    assert set(engine.prompt_logprobs) == {"scored"}
    if "num_blocks" in options:
        assert any(0 < n < len(ids) for n in preempted), preempted


def test_a_cached_prefix_is_scored_all_the_same(engine_model, tokenizer, reference):
    """The prefix cache holds the prompt's blocks, but their logprobs were never computed: a
    scored prompt is computed whole."""
    ids = tokenizer.encode("Once upon a time, in a land far away, there lived a king. " * 4)
    engine = InProcessEngine(engine_model)
    engine.add("first", ids, 2)
    engine.run()
    engine.add("again", ids, 2, prompt_logprobs=0)
    engine.run()
    got = engine.prompt_logprobs["again"]
    _check(got, ids, reference.log_probs(ids), 0)
    assert all(lp.top_ids == [] for lp in got)
