"""Staging buffers: a step's inputs packed into one buffer, and two buffers alternating so the
previous step's inputs stay intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_workers.draft import truncated
from gpu_workers.loader import load_model
from gpu_workers.model_runner import ModelRunner
from shm.staging import Staging, StagingOverflow
from surge.model_files import resolve_model
from surge.protocol import PREVIOUS_TOKEN, SamplingParams, ScheduledSeq, StepPlan
from surge.step_size import step_words
from tests.tiny_model import save_tiny_llama

_BLOCKS, _BLOCK_SIZE = 64, 4


def test_staging_packs_ints_floats_and_tables():
    stage = Staging(torch.device("cpu"), capacity=64)
    stage.begin(12)
    ids = stage.add([5, 6, 7])
    temps = stage.add([0.5, 1.25, 2.0], torch.float32)
    table = stage.add(np.arange(6).reshape(2, 3))
    empty = stage.add(np.zeros((0, 4), dtype=np.int64))
    stage.send()
    assert ids.tolist() == [5, 6, 7] and ids.dtype == torch.int64
    assert temps.tolist() == [0.5, 1.25, 2.0] and temps.dtype == torch.float32
    assert table.tolist() == [[0, 1, 2], [3, 4, 5]] and empty.shape == (0, 4)
    # Three floats take two words; three ints four, as each array starts on 16 bytes (Triton
    # compiles a kernel variant per pointer alignment).
    assert stage.used == 4 + 2 + 6
    assert all(t.data_ptr() % 16 == 0 for t in (ids, temps, table))


def test_staging_alternates_so_the_previous_step_stays_intact():
    stage = Staging(torch.device("cpu"), capacity=16)
    first = stage.begin(3)
    a = stage.add([1, 2, 3])
    second = stage.begin(3)
    b = stage.add([7, 8, 9])
    assert first != second and a.tolist() == [1, 2, 3] and b.tolist() == [7, 8, 9]
    with pytest.raises(StagingOverflow, match="need 17 staging words, more than the 16"):
        stage.begin(17)  # refused before anything is packed
    stage.begin(16)
    with pytest.raises(StagingOverflow, match="more than 16 staging words"):
        stage.add(list(range(17)))


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    """A tiny model with a draft of its first layer, so proposers are packed too."""
    folder = str(tmp_path_factory.mktemp("tiny"))
    save_tiny_llama(folder)
    model = load_model(resolve_model(folder), torch.device("cpu"), torch.float32)
    return ModelRunner(model, _BLOCKS, _BLOCK_SIZE, torch.device("cpu"), torch.float32,
                       draft=truncated(model, 1))


@st.composite
def _seq(draw: st.DrawFn, seq_id: int) -> ScheduledSeq:
    start = draw(st.integers(0, 40))
    decode = draw(st.booleans())
    sample = decode or draw(st.booleans())
    num_draft = draw(st.integers(0, 3)) if sample and not decode else 0
    fed = 1 if decode else draw(st.integers(2 + num_draft, 12))
    tokens = [draw(st.integers(1, 200)) for _ in range(fed)]
    if draw(st.booleans()):
        tokens[0] = PREVIOUS_TOKEN
    context = start + fed
    width = -(-context // _BLOCK_SIZE) + draw(st.integers(0, 3))
    table = [(seq_id * 7 + i) % _BLOCKS for i in range(width)]
    params = SamplingParams(
        max_tokens=8, temperature=draw(st.sampled_from([0.0, 0.7])),
        logit_bias={t: 1.0 for t in draw(st.sets(st.integers(0, 255), max_size=5))},
        stop_token_ids=draw(st.lists(st.integers(0, 255), max_size=4)))
    return ScheduledSeq(seq_id, tokens, start, table, sample, params, seed=seq_id,
                        ban_stop_tokens=sample and draw(st.booleans()), num_draft=num_draft,
                        propose=draw(st.integers(0, 2)) if sample else 0)


@st.composite
def _plan(draw: st.DrawFn) -> StepPlan:
    n = draw(st.integers(1, 6))
    return StepPlan(0, [draw(_seq(i)) for i in range(n)])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=_plan(), rank0=st.booleans())
def test_step_words_are_the_words_a_step_packs(runner, plan, rank0):
    """The one count the scheduler plans with is exactly what the worker packs, on the rank
    that samples and on the others."""
    samples = runner.samples
    runner.samples = rank0  # whether this rank samples for the group (see ModelRunner)
    runner.sampled_rows = {s.seq_id: 0 for s in plan.seqs}
    runner.sampled = torch.zeros(1, dtype=torch.int64)
    try:
        runner.prepare(plan)
    finally:
        runner.samples = samples
    assert runner.staging.used == step_words(plan, sampling=rank0)
