"""Speculative decoding, the scheduler's half: which sequences propose tokens this step, the
n-gram proposer, and the back-off that stops proposing where it does not pay.

The model verifies every proposal in the step's one forward (the worker's sampler), so a
proposal only costs the extra tokens in that forward. It pays while the forward is bound by
reading the weights (small batches) and the proposals are mostly accepted. Measured on the
2-core CPU (bench/speculative_bench.py): at one sequence, verifying 4 proposals costs about 14%
more than a plain step, so even half of them accepted gains; at 8 sequences the step's extra
tokens are real compute and proposals accepted 56% of the time lose 7%. Hence the rule:
- no speculation above speculative_max_batch running sequences;
- a sequence whose recent acceptance falls below a bar pauses for _PAUSE_STEPS steps, twice as
  long after each pause in a row (up to 16x), until a step reaches the bar again; the bar is
  speculative_min_acceptance at one sequence and rises linearly to twice that at
  speculative_max_batch (a useless draft then costs a few percent, not a third);
- finding nothing to propose (no n-gram match) costs nothing and does not count.
"""

from __future__ import annotations

from array import array

from scheduler.sequence import Sequence
from surge.config import SpeculativeConfig

_PAUSE_STEPS = 16
# Weight of the newest step in a sequence's acceptance score: two steps in a row with nothing
# accepted take a fresh score (1) below the default bar (0.3 to 0.6).
_SCORE_WEIGHT = 0.5


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    for the longest n in [n_min, n_max] that occurs (prompt lookup decoding)."""
    if k < 1 or len(tokens) < n_min + 1:
        return []
    packed = array("i", tokens)
    data, width = packed.tobytes(), packed.itemsize
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        pattern = data[-n * width:]
        end = len(data) - width  # an occurrence ending at least one token before the last
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % width == 0:  # on a token boundary, not inside two neighbours
                start = at // width + n
                return tokens[start : start + k]
            end = at + len(pattern) - 1
    return []


class Speculation:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.verifications = 0

    def active(self, running: list[Sequence], step: int) -> bool:
        """Whether this step speculates at all: on, a small batch, someone not paused."""
        cfg = self.cfg
        return (cfg.speculative_method != "off" and 0 < len(running) <= cfg.speculative_max_batch
                and any(seq.spec_paused_until <= step for seq in running))

    def eligible(self, seq: Sequence, step: int) -> bool:
        """Whether seq may propose now: its last token known, min_tokens reached (stop tokens
        banned row by row are not worth the bookkeeping), not paused."""
        return (seq.num_pending == 0 and seq.spec_paused_until <= step
                and seq.num_output_tokens >= seq.sampling.min_tokens)

    def proposal(self, seq: Sequence, limit: int) -> list[int]:
        """At most `limit` tokens to verify after seq's last one."""
        k = min(self.cfg.num_speculative_tokens, limit)
        if self.cfg.speculative_method == "ngram":
            return ngram_propose(seq.token_ids, k, self.cfg.ngram_max, self.cfg.ngram_min)
        return seq.draft[:k] if k > 0 else []

    def record(self, seq: Sequence, proposed: int, accepted: int, step: int,
               batch: int) -> None:
        """After a step that verified `proposed` tokens of seq, in a batch of `batch`."""
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verifications += 1
        rate = accepted / proposed
        seq.spec_score = (1 - _SCORE_WEIGHT) * seq.spec_score + _SCORE_WEIGHT * rate
        cfg = self.cfg
        bar = cfg.speculative_min_acceptance * (
            1 + min(1.0, batch / max(1, cfg.speculative_max_batch)))
        if rate >= bar:
            seq.spec_pauses = 0
        if seq.spec_score < bar:
            seq.spec_paused_until = step + (_PAUSE_STEPS << min(seq.spec_pauses, 4))
            seq.spec_pauses += 1
            seq.spec_score = 1.0  # a fresh chance once the pause is over
