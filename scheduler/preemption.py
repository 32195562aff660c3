"""Preemption: which running sequence gives way, to a more urgent waiting request or to a
suspect of a crash that must run alone. A part of Scheduler (its base class), kept apart
because it is one idea."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice

from scheduler.block_manager import BlockManager
from scheduler.queue import WaitingQueue, urgency
from scheduler.sequence import Sequence, Status
from surge.config import SchedulerConfig


class Preemption:
    # Scheduler's state and its _preempt, which these methods use.
    cfg: SchedulerConfig
    blocks: BlockManager
    waiting: WaitingQueue
    running: list[Sequence]
    clock: Callable[[], float]
    _preempt: Callable[[Sequence], None]

    def _hits(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence starts on: none for a prompt scored for its
        logprobs, which is computed whole."""
        if seq.sampling.prompt_logprobs is not None:
            return []
        return self.blocks.lookup(seq.token_ids)

    def _victim(self, candidates: list[Sequence]) -> Sequence:
        """The least urgent sequence, the latest arrival among equals."""
        now = self.clock()
        return max(reversed(candidates), key=lambda s: (urgency(s, self.cfg, now)[0],
                                                        s.arrival_time))

    def _preempt_for_urgent(self, max_seqs: int) -> None:
        """Waiting requests of a more urgent class than some running ones take their places
        when the batch or the KV cache has no room for them."""
        now = self.clock()
        # Aged like the waiting ones, so two requests never preempt each other in turn.
        classes = {s.seq_id: urgency(s, self.cfg, now)[0] for s in self.running}
        seats = max_seqs - len(self.running)
        reserved = 0  # free blocks the more urgent ones before seq will take
        for seq in islice(self.waiting.order(self.cfg, now), max_seqs):
            urgent = urgency(seq, self.cfg, now)[0]
            if urgent >= max(classes.values(), default=urgent):
                return  # the queue comes most urgent first: no one further on can preempt
            if seq.num_pending:
                continue
            hits = self._hits(seq)
            cached = len(hits) * self.cfg.block_size
            num_tokens = cached + min(seq.num_tokens - cached, self.cfg.max_num_batched_tokens)
            while True:
                # Counted again after each preemption: a victim returns only the blocks nobody
                # else holds, and may have held some of seq's cached prefix.
                need = self.blocks.blocks_to_allocate(seq, num_tokens, hits)
                if seats > 0 and need <= self.blocks.num_free - reserved:
                    break
                lax = [s for s in self.running if classes[s.seq_id] > urgent]
                if not lax:
                    return
                victim = self._victim(lax)
                seats += 1
                self._preempt(victim)
                del classes[victim.seq_id]
            seats -= 1
            reserved += need

    def _make_room(self, seq: Sequence, seats: int) -> Iterator[Sequence]:
        """A waiting suspect runs alone: running sequences are preempted to make room for it."""
        if seq.status is not Status.WAITING or seq.num_pending:
            return iter(())
        hits = self._hits(seq)
        num_tokens = min(seq.num_tokens, len(hits) * self.cfg.block_size
                         + self.cfg.max_num_batched_tokens)
        while self.running and (len(self.running) >= seats or self.blocks.blocks_to_allocate(
                seq, num_tokens, hits) > self.blocks.num_free):
            self._preempt(self._victim(self.running))
        return iter([seq])
