"""Single-writer, multi-reader broadcast ring buffer in POSIX shared memory (/dev/shm).

Every reader sees every message in order. A message larger than a slot spans consecutive slots,
so any size fits; the writer waits while the slowest reader is a full ring behind.

Layout: a header line (slot count, slot size, reader count), the writer's counter, one counter
per reader (each on its own 64-byte line), then the slots. A slot is [length u32][more u32][data].
Counters only grow and each has one writer, so no locks are needed: data is written before the
counter that publishes it (x86 keeps stores in order).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable

_LINE = 64
_HEADER = struct.Struct("<III")
_COUNTER = struct.Struct("<Q")
_SLOT_HEADER = struct.Struct("<II")
SHM_DIR = "/dev/shm"


class RingClosed(Exception):
    """The wait was abandoned because should_stop() said so."""


def _wait_until(ready: Callable[[], bool], should_stop: Callable[[], bool]) -> None:
    # Spin briefly (the other side is usually mid-step), then back off to at most 1 ms so an
    # idle process costs almost no CPU.
    for _ in range(2000):
        if ready():
            return
    delay = 20e-6
    while not ready():
        if should_stop():
            raise RingClosed
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class RingBuffer:
    """Attach to (or create) a ring; `reader` is this process's reader index (None: writer)."""

    def __init__(self, name: str, reader: int | None, *, create: bool = False,
                 num_slots: int = 64, slot_size: int = 1 << 16, num_readers: int = 1) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                size = _LINE * (2 + num_readers) + num_slots * slot_size
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        if create:
            _HEADER.pack_into(self._mm, 0, num_slots, slot_size, num_readers)
        self.num_slots, self.slot_size, self.num_readers = _HEADER.unpack_from(self._mm, 0)
        self.reader = reader
        self._slots_at = _LINE * (2 + self.num_readers)
        self._payload = self.slot_size - _SLOT_HEADER.size

    @classmethod
    def create(cls, name: str, **kwargs: int) -> RingBuffer:
        return cls(name, None, create=True, **kwargs)

    def _counter(self, index: int) -> int:
        return _COUNTER.unpack_from(self._mm, _LINE * (1 + index))[0]

    def _set_counter(self, index: int, value: int) -> None:
        _COUNTER.pack_into(self._mm, _LINE * (1 + index), value)

    def _slowest_reader(self) -> int:
        return min(self._counter(1 + r) for r in range(self.num_readers))

    def put(self, data: bytes, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Publish one message to every reader."""
        view = memoryview(data)
        written = self._counter(0)
        offset = 0
        while True:
            chunk = view[offset:offset + self._payload]
            offset += len(chunk)
            more = offset < len(view)
            _wait_until(lambda w=written: w - self._slowest_reader() < self.num_slots, should_stop)
            at = self._slots_at + (written % self.num_slots) * self.slot_size
            _SLOT_HEADER.pack_into(self._mm, at, len(chunk), int(more))
            start = at + _SLOT_HEADER.size
            self._mm[start:start + len(chunk)] = chunk
            written += 1
            self._set_counter(0, written)
            if not more:
                return

    def get(self, should_stop: Callable[[], bool] = lambda: False) -> bytes:
        """Next message for this reader, waiting for it; RingClosed if should_stop() turns true."""
        assert self.reader is not None, "the writer cannot read"
        me = 1 + self.reader
        read = self._counter(me)
        parts: list[bytes] = []
        while True:
            _wait_until(lambda r=read: self._counter(0) > r, should_stop)
            at = self._slots_at + (read % self.num_slots) * self.slot_size
            length, more = _SLOT_HEADER.unpack_from(self._mm, at)
            start = at + _SLOT_HEADER.size
            parts.append(self._mm[start:start + length])
            read += 1
            self._set_counter(me, read)
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def poll(self) -> bool:
        """Whether a message is waiting for this reader (get() would not wait)."""
        assert self.reader is not None, "the writer cannot read"
        return self._counter(0) > self._counter(1 + self.reader)

    def skip_to_end(self) -> None:
        """A reader replacing a dead one: ignore everything written before it attached (the
        writer re-sends what still matters, and writes nothing until this reader is ready)."""
        assert self.reader is not None
        self._set_counter(1 + self.reader, self._counter(0))

    def close(self) -> None:
        self._mm.close()

    def unlink(self) -> None:
        """Remove the segment's name; attached processes keep their mapping until they close."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
