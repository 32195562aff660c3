"""An incremental scanner of one JSON object as a model writes it: where each top-level key's
value lies in the text, known as soon as the text shows it (string- and escape-aware bracket
depth, no parsing), so a tool call's arguments can stream while they are written."""

from __future__ import annotations

import json

_SPACE = " \t\r\n"


class ObjectScanner:
    """Feed it the text from an object's `{` on; it records each top-level key's value span
    (start, end) in that text. A value still being written has end None."""

    def __init__(self) -> None:
        self.text = ""
        self.spans: dict[str, tuple[int, int | None]] = {}
        self.keys: list[str] = []  # top-level keys in the order written
        self.end: int | None = None  # just past the object's closing `}`
        self._at = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # at depth 1: key, colon, value, scalar (in one), after
        self._start = 0  # where the current top-level key or value began

    def feed(self, text: str) -> None:
        self.text += text
        while self._at < len(self.text) and self.end is None:
            self._step(self._at, self.text[self._at])
            self._at += 1

    @property
    def scanned(self) -> int:
        """How much of the text has been read (the rest lies past the object's end)."""
        return self._at

    def value(self, key: str) -> str | None:
        """The key's whole value text (None: not written, or not finished)."""
        span = self.spans.get(key)
        return None if span is None or span[1] is None else self.text[span[0]:span[1]]

    def partial(self, key: str) -> str:
        """As much of the key's value as is certainly its text: all of an object or array
        written so far, a string or a number only once it is complete."""
        span = self.spans.get(key)
        if span is None:
            return ""
        if span[1] is not None:
            return self.text[span[0]:span[1]]
        container = self.text[span[0]] in "{["
        return self.text[span[0]:self._at] if container else ""

    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_ended(i)
            return
        if c == '"':
            self._in_string = True
            if self._depth == 1 and self._expect in ("key", "value"):
                self._begin(i)
        elif c in "{[":
            self._depth += 1
            if self._depth == 2 and self._expect == "value":
                self._begin(i)
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._close(i + 1)
            elif self._depth == 0:
                if self._expect == "scalar":
                    self._close(len(self.text[:i].rstrip(_SPACE)))
                self.end = i + 1
        elif self._depth == 1:
            if c == ":" and self._expect == "colon":
                self._expect = "value"
            elif c == "," and self._expect in ("scalar", "after"):
                if self._expect == "scalar":
                    self._close(len(self.text[:i].rstrip(_SPACE)))
                self._expect = "key"
            elif c not in _SPACE and self._expect == "value":
                self._begin(i)
                self._expect = "scalar"

    def _begin(self, i: int) -> None:
        self._start = i
        if self._expect == "value" and self.keys:
            self.spans.setdefault(self.keys[-1], (i, None))

    def _string_ended(self, i: int) -> None:
        if self._expect == "key":
            try:
                key = json.loads(self.text[self._start:i + 1])
            except ValueError:
                key = self.text[self._start + 1:i]
            self.keys.append(key)
            self._expect = "colon"
        elif self._expect == "value":
            self._close(i + 1)

    def _close(self, end: int) -> None:
        """The current top-level value ends at `end`."""
        if self.keys:
            start, done = self.spans.get(self.keys[-1], (self._start, None))
            if done is None and start == self._start:
                self.spans[self.keys[-1]] = (start, end)
        self._expect = "after"
