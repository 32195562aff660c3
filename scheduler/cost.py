"""The measured cost of a step: time = fixed + per_token * tokens, fitted on recent steps."""

from __future__ import annotations

from collections import deque

_WINDOW = 256  # steps the fit looks back over


class StepCost:
    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=_WINDOW)  # (tokens, seconds)

    def record(self, num_tokens: int, seconds: float) -> None:
        self.steps.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) by least squares; None until steps of different
        sizes have been seen."""
        n = len(self.steps)
        if n < 8:
            return None
        mean_x = sum(x for x, _ in self.steps) / n
        mean_y = sum(y for _, y in self.steps) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.steps)
        if var == 0:
            return None
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self.steps) / var
        if slope <= 0:
            return None
        return max(0.0, mean_y - slope * mean_x), slope

    def tokens_within(self, seconds: float) -> int | None:
        """How many tokens a step can carry and still take at most this long (at least 1)."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(1, int((seconds - fixed) / per_token))
