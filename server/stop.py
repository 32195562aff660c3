"""Stop strings found in streamed text, across token boundaries, without ever emitting past one."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""  # text held back because it could be the start of a stop string

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found). After a hit, the text ends
        right before the stop string."""
        buf = self.pending + text
        hits = [i for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        keep = 0 if final else self._partial_suffix(buf)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(len(buf), longest), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                return k
        return 0
