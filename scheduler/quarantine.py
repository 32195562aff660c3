"""Poison requests: a request whose steps crash the worker must not crash it for ever.

Every sequence in a step that was in flight when a worker died becomes a suspect. Suspects are
recomputed one at a time, each alone in its steps (and one step in flight), up to the tokens it
had reached when its step crashed; then it is cleared and rejoins the batch. A suspect whose
step of its own crashes a worker again crashed it twice: it ends with an error, and the others
carry on. A crash costs one slow recovery (the suspects' steps run one by one), never a loop.
"""

from __future__ import annotations

from scheduler.sequence import Sequence
from surge.protocol import StepPlan

POISON_ERROR = ("this request crashed the engine twice (each time its step killed the model "
                "worker), so it was ended to let the other requests run; please report it")


class Quarantine:
    def __init__(self) -> None:
        # Suspect seq id -> the tokens it had been planned up to when its step crashed.
        self.crash_points: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.crash_points)

    def crashed(self, plans: list[StepPlan], seqs: dict[int, Sequence]) -> list[Sequence]:
        """The steps in plans died with their worker (one crash): the suspects of an earlier
        crash that were alone in one of them (returned: the caller ends them); everyone else
        in them is a suspect now. A sequence alone in two overlapped steps crashed once."""
        earlier = set(self.crash_points)
        poisoned: dict[int, Sequence] = {}
        for plan in plans:
            for item in plan.seqs:
                seq = seqs.get(item.seq_id)
                if seq is None or seq.seq_id in poisoned:
                    continue  # finished or aborted while the step ran, or judged already
                if len(plan.seqs) == 1 and seq.seq_id in earlier:
                    poisoned[seq.seq_id] = seq
                    del self.crash_points[seq.seq_id]
                else:
                    self.crash_points[seq.seq_id] = max(self.crash_points.get(seq.seq_id, 0),
                                                        seq.num_computed_tokens)
        return list(poisoned.values())

    def next(self, seqs: dict[int, Sequence]) -> Sequence | None:
        """The suspect to run alone next: the newest, most likely the culprit (the older ones
        had run in steps that did not crash before it came)."""
        return seqs[max(self.crash_points)] if self.crash_points else None

    def served(self, plan: StepPlan, seqs: dict[int, Sequence]) -> None:
        """plan's step finished: a suspect in it that has got past its crash point is cleared."""
        for item in plan.seqs:
            seq = seqs.get(item.seq_id)
            point = self.crash_points.get(item.seq_id)
            if seq is not None and point is not None and seq.num_computed_tokens >= point:
                del self.crash_points[item.seq_id]

    def forget(self, seq_id: int) -> None:
        self.crash_points.pop(seq_id, None)
