"""Staging of per-step inputs: every array of a step is packed into one host buffer (pinned when
a GPU reads it), reused every other step, and sent to the device in one copy on a side stream.

Two buffers alternate, so step N+1 is packed and copied while step N computes. Events keep the
order: a host buffer is rewritten only after its copy finished, a device buffer only after the
step that read it finished, and a step computes only after its copy arrived. On the CPU the
device buffer is the host buffer and no copy, stream or event exists.
"""

from __future__ import annotations

import numpy as np
import torch

from shm import STAGING_WORDS


class StagingOverflow(ValueError):
    """A step needs more staging words than a buffer holds."""


class Staging:
    def __init__(self, device: torch.device, capacity: int = STAGING_WORDS) -> None:
        self.cuda = device.type == "cuda"
        self.capacity = capacity
        # int64 words; float32 arrays take half a word each (see add()).
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda)
                     for _ in range(2)]
        self.dev = ([torch.empty(capacity, dtype=torch.int64, device=device) for _ in range(2)]
                    if self.cuda else self.host)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.read: list[torch.cuda.Event | None] = [None, None]
        self.slot = 1
        self.used = 0
        self._words = self.host[0].numpy()

    def begin(self, words: int) -> int:
        """Start packing the next step, of `words` words, into the other buffer; its slot, for
        wait/release."""
        if words > self.capacity:
            raise StagingOverflow(f"a step's inputs need {words} staging words, more than the "
                                  f"{self.capacity} a buffer holds")
        self.slot ^= 1
        self.used = 0
        if (copied := self.copied[self.slot]) is not None:
            copied.synchronize()  # two steps ago: long done
        self._words = self.host[self.slot].numpy()
        return self.slot

    def add(self, values: np.ndarray | list, dtype: torch.dtype = torch.int64,
            shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Pack values (int64, or float32) at the next 16-byte boundary and return their view in
        the device buffer; it holds them once send() has been called and the compute stream has
        waited on it."""
        floats = dtype == torch.float32
        array = np.asarray(values, dtype=np.float32 if floats else np.int64)
        n = array.size
        words = (n + 1) // 2 if floats else n
        start, end = self.used, self.used + words
        if end > len(self._words):
            raise StagingOverflow(f"a step's inputs need more than {len(self._words)} staging "
                                  "words: more than begin() was told")
        # The next array starts on an even word (16 bytes): Triton compiles a kernel variant
        # for each alignment of a pointer, and unaligned offsets would come and go with the batch.
        self.used = end + (end & 1)
        dest = self._words[start:end]
        view = self.dev[self.slot][start:end]
        if floats:
            dest.view(np.float32)[:n] = array.reshape(-1)
            view = view.view(torch.float32)[:n]
        else:
            dest[:] = array.reshape(-1)
        return view.view(shape if shape is not None else array.shape)

    def send(self) -> None:
        """Copy the packed words to the device on the side stream."""
        if not self.cuda:
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            if (read := self.read[self.slot]) is not None:
                self.stream.wait_event(read)  # the step that last read this buffer is done
            self.dev[self.slot][: self.used].copy_(self.host[self.slot][: self.used],
                                                   non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[self.slot] = event

    def wait(self, slot: int) -> None:
        """Make the compute stream wait for the copy of the step packed in slot."""
        if self.cuda and (event := self.copied[slot]) is not None:
            torch.cuda.current_stream().wait_event(event)

    def release(self, slot: int) -> None:
        """Everything that reads slot's buffer has been queued on the compute stream."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self.read[slot] = event
