"""The shared-memory broadcast ring: order, wrap-around, large messages, several readers."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm.ring import SHM_DIR, RingBuffer, RingClosed


@pytest.fixture
def name():
    name = f"surge-test-{uuid.uuid4().hex[:8]}"
    yield name
    if os.path.exists(os.path.join(SHM_DIR, name)):
        os.unlink(os.path.join(SHM_DIR, name))


def test_order_and_wraparound(name):
    writer = RingBuffer.create(name, num_slots=4, slot_size=64)
    reader = RingBuffer(name, reader=0)
    for i in range(50):  # many laps around a 4-slot ring
        writer.put(f"message {i}".encode())
        assert reader.get() == f"message {i}".encode()


def test_message_larger_than_slot_and_ring(name):
    writer = RingBuffer.create(name, num_slots=4, slot_size=64)
    reader = RingBuffer(name, reader=0)
    small = b"x" * 10
    big = os.urandom(1000)  # spans 18 slots of 56 bytes: more than the whole ring
    writer.put(small)
    ctx = mp.get_context("spawn")
    # The writer blocks until the reader frees slots, so write from another process.
    proc = ctx.Process(target=_put, args=(name, [big, small]))
    proc.start()
    assert reader.get() == small
    assert reader.get() == big
    assert reader.get() == small
    proc.join(10)
    assert proc.exitcode == 0


def _put(name: str, messages: list[bytes]) -> None:
    # A second writer handle on the same ring continues from the shared counter.
    ring = RingBuffer(name, reader=None)
    for m in messages:
        ring.put(m)
    ring.close()


def test_broadcast_to_every_reader_in_other_processes(name):
    writer = RingBuffer.create(name, num_slots=8, slot_size=128, num_readers=3)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    readers = [ctx.Process(target=_read, args=(name, r, 40, out)) for r in range(3)]
    for p in readers:
        p.start()
    messages = [os.urandom(i * 37 % 500 + 1) for i in range(40)]
    for m in messages:
        writer.put(m)
    results = sorted(out.get(timeout=30) for _ in readers)
    for p in readers:
        p.join(10)
    assert [r for r, _ in results] == [0, 1, 2]
    assert all(got == messages for _, got in results)


def _read(name: str, reader: int, n: int, out) -> None:
    ring = RingBuffer(name, reader=reader)
    out.put((reader, [ring.get() for _ in range(n)]))


def test_get_gives_up_when_told(name):
    RingBuffer.create(name, num_slots=2, slot_size=64)
    reader = RingBuffer(name, reader=0)
    with pytest.raises(RingClosed):
        reader.get(should_stop=lambda: True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=30), st.integers(2, 6),
       st.integers(24, 100))
def test_any_sequence_round_trips(messages, num_slots, slot_size):
    name = f"surge-test-{uuid.uuid4().hex[:8]}"
    writer = RingBuffer.create(name, num_slots=num_slots, slot_size=slot_size)
    reader = RingBuffer(name, reader=0)
    try:
        for m in messages:
            # Interleave so the writer never waits on itself: each message read before the next.
            if len(m) <= (slot_size - 8) * num_slots:
                writer.put(m)
                assert reader.get() == m
    finally:
        writer.unlink()
