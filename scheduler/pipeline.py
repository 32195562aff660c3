"""Planning for pipeline stages: up to P steps in flight, each a different micro-batch.

A stage's hidden states go forward only, so the first stage never sees the tokens the last one
samples: a sequence whose token is still in flight is not planned again (no PREVIOUS_TOKEN),
and the steps in flight hold disjoint sequences. For every stage to have a micro-batch of its
own, a step takes at most 1/P of the sequences there are to run.
"""

from __future__ import annotations


def micro_batch_seats(stages: int, num_running: int, num_waiting: int, seats: int) -> int:
    """The most sequences one step may take: all `seats` without stages, else an even share
    of the running and waiting ones over the stages (at least one)."""
    if stages <= 1:
        return seats
    return max(1, min(seats, -(-(num_running + num_waiting) // stages)))
