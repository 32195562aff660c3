"""How many staging words a step needs: counted once here, checked by the worker before it packs
a step (gpu_workers.model_runner) and by the scheduler while it plans one, so that no step is
planned that cannot be staged.

The count mirrors what ModelRunner.prepare packs (tests/test_staging.py holds it to the words
really used): int64 arrays take a word per value, float32 arrays half a word, and each array
starts on an even word (shm.staging), so each is counted rounded up to an even number.
"""

from __future__ import annotations

import copy

from surge.protocol import PREVIOUS_TOKEN, ScheduledSeq, StepPlan


def _ints(n: int) -> int:
    """Words of an array of n int64 values, with its alignment."""
    return n + (n & 1)


def _floats(n: int) -> int:
    """Words of an array of n float32 values, with its alignment."""
    return _ints((n + 1) // 2)


class StepSize:
    """A step's staging words, counted as its sequences join it."""

    __slots__ = ("tokens", "patched", "decodes", "decode_width", "prefills", "prefill_width",
                 "rows", "drafted", "bias", "proposers")

    def __init__(self) -> None:
        self.tokens = 0  # fed this step
        self.patched = 0  # PREVIOUS_TOKEN placeholders
        self.decodes = 0
        self.decode_width = 0  # widest block table among decodes
        self.prefills = 0
        self.prefill_width = 0
        self.rows = 0  # sampling rows: one per sampling sequence, plus one per proposal
        self.drafted = False  # some sequence verifies proposals
        self.bias = 0  # logit_bias entries (and banned stop tokens) over the sampling rows
        self.proposers = 0  # sequences the draft model proposes for after the step

    def plus(self, seq: ScheduledSeq) -> StepSize:
        """This step with seq in it too (self is unchanged)."""
        size = copy.copy(self)
        size.add(seq)
        return size

    def add(self, seq: ScheduledSeq) -> None:
        n = len(seq.token_ids)
        self.tokens += n
        self.patched += seq.token_ids.count(PREVIOUS_TOKEN)
        width = len(seq.block_table)
        if n == 1:
            self.decodes += 1
            self.decode_width = max(self.decode_width, width)
        else:
            self.prefills += 1
            self.prefill_width = max(self.prefill_width, width)
        if seq.sample:
            rows = seq.num_draft + 1
            self.rows += rows
            self.drafted = self.drafted or bool(seq.num_draft)
            banned = len(seq.sampling.stop_token_ids) if seq.ban_stop_tokens else 0
            self.bias += rows * (len(seq.sampling.logit_bias) + banned)
        self.proposers += bool(seq.propose)

    def words(self, sampling: bool = True) -> int:
        """Staging words of the step; sampling: the rank that samples (rank 0) packs the
        sampling parameters too."""
        words = (3 * _ints(self.tokens) + 2 * _ints(self.patched)  # slots, ids, positions;
                 # patch indices; block tables and context lengths of decodes, of prefills
                 + _ints(self.decodes * self.decode_width) + _ints(self.decodes)
                 + _ints(self.prefills * self.prefill_width) + _ints(self.prefills)
                 + _ints(self.prefills + 1)  # query starts
                 + _ints(self.rows))  # logit rows
        if sampling and self.rows:
            # temperature, top_p and min_p (float32); top_k, seeds, positions (int64)
            words += 3 * _floats(self.rows) + 3 * _ints(self.rows)
            words += _ints(self.rows) * self.drafted
            if self.bias:
                words += 2 * _ints(self.bias) + _floats(self.bias)  # rows, ids; values
        if self.proposers:  # first row, proposals, context, block table each
            width = max(self.decode_width, self.prefill_width)
            words += 3 * _ints(self.proposers) + _ints(self.proposers * width)
        return words


def step_words(plan: StepPlan, sampling: bool = True) -> int:
    """The staging words of a whole plan (see StepSize.words)."""
    size = StepSize()
    for seq in plan.seqs:
        size.add(seq)
    return size.words(sampling)
