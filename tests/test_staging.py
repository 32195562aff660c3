"""Staging buffers: a step's inputs packed into one buffer, and two buffers alternating so the
previous step's inputs stay intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shm.staging import Staging


def test_staging_packs_ints_floats_and_tables():
    stage = Staging(torch.device("cpu"), capacity=64)
    stage.begin()
    ids = stage.add([5, 6, 7])
    temps = stage.add([0.5, 1.25, 2.0], torch.float32)
    table = stage.add(np.arange(6).reshape(2, 3))
    empty = stage.add(np.zeros((0, 4), dtype=np.int64))
    stage.send()
    assert ids.tolist() == [5, 6, 7] and ids.dtype == torch.int64
    assert temps.tolist() == [0.5, 1.25, 2.0] and temps.dtype == torch.float32
    assert table.tolist() == [[0, 1, 2], [3, 4, 5]] and empty.shape == (0, 4)
    assert stage.used == 3 + 2 + 6  # three floats take two words


def test_staging_alternates_so_the_previous_step_stays_intact():
    stage = Staging(torch.device("cpu"), capacity=16)
    first = stage.begin()
    a = stage.add([1, 2, 3])
    second = stage.begin()
    b = stage.add([7, 8, 9])
    assert first != second and a.tolist() == [1, 2, 3] and b.tolist() == [7, 8, 9]
    stage.begin()
    with pytest.raises(ValueError, match="more than 16 staging words"):
        stage.add(list(range(17)))
