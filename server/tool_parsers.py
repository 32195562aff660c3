"""The model's tool calls out of its text, whole or as it streams, in each chat-template
family's own format:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text
  (Hermes, Qwen 2.5/3, and surge's own description for a template without tools support);
- llama3_json: the answer opens with `{"name": ..., "parameters": {...}}`, several joined by
  `;`, after an optional `<|python_tag|>` (Llama 3.1-3.3);
- mistral: the answer opens with `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

In those two, what follows the calls (or an object that is not one) is content.

The markers `<|python_tag|>` and `[TOOL_CALLS]` are special tokens the detokenizer drops, so
the JSON alone is enough. In every format an object counts as a call only when it names an
offered tool; it is known to be one as soon as its name is written (its arguments then stream
as they come), or, when its arguments come before its name, once the object is complete.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from server.json_scan import ObjectScanner

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # either is taken in every format
_SPACE = " \t\r\n"
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str  # what a call's arguments are called in the model's output
    markers: tuple[str, ...]  # how an answer that is calls begins (llama3_json, mistral)
    separator: str = ""  # between two calls (llama3_json, mistral)

    def call_id(self) -> str:
        # Mistral's templates refuse any tool call id but 9 letters and digits.
        if self.name == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


HERMES = ToolFormat("hermes", "arguments", ())
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", ("<|python_tag|>", "{"), ";")
MISTRAL = ToolFormat("mistral", "arguments", ("[TOOL_CALLS]", "["), ",")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def format_of(template: str | None) -> ToolFormat:
    """The call format a chat template teaches its model (Hermes when it renders no tools:
    surge then describes them in that format itself)."""
    template = template or ""
    if "tools" not in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return LLAMA3_JSON
    return HERMES



def _name(text: str | None) -> str | None:
    try:
        value = None if text is None else json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _Call:
    """One object that may be a call, as it is written. Its deltas are OpenAI's: the first
    with id, type and name (arguments ""), then the arguments' text in fragments."""

    def __init__(self, fmt: ToolFormat, names: list[str], index: int, start: int) -> None:
        self.fmt, self.names, self.index = fmt, names, index
        self.start = start  # where its `{` is in the answer
        self.scan = ObjectScanner()
        self.call: dict[str, Any] | None = None  # OpenAI's form, once known to be a call
        self.sent = 0  # characters of the arguments given out

    def feed(self, text: str) -> list[dict[str, Any]] | None:
        """The deltas the new text makes known (None: the object is not a call)."""
        scan = self.scan
        scan.feed(text)
        keys = [k for k in scan.keys if k in _ARGUMENT_KEYS]
        key = keys[0] if keys else None
        deltas: list[dict[str, Any]] = []
        if self.call is None:
            name = scan.value("name")
            named_first = name is not None and (
                key is None or scan.keys.index(key) > scan.keys.index("name"))
            if not named_first and scan.end is None:
                return deltas  # not known yet
            if _name(name) not in self.names:
                return None
            whole = "{}" if key is None else scan.value(key) or ""
            self.call = {"id": self.fmt.call_id(), "type": "function",
                         "function": {"name": _name(name),
                                      "arguments": "" if named_first else whole}}
            self.sent = 0 if named_first else len(whole)
            deltas.append({"index": self.index, **self.call,
                           "function": dict(self.call["function"])})
        done = scan.end is not None
        arguments = scan.partial(key) if key is not None else "{}" if done else ""
        if len(arguments) > self.sent:
            piece = arguments[self.sent:]
            self.sent = len(arguments)
            self.call["function"]["arguments"] += piece
            deltas.append({"index": self.index, "function": {"arguments": piece}})
        return deltas


class ToolParser:
    """One choice's text to content and calls, whole or as it streams. What might still turn
    out to be part of a call is held back until it is known; nothing is taken back."""

    def __init__(self, fmt: ToolFormat, names: list[str], limit: int | None = None,
                 forced: bool = False) -> None:
        self.fmt, self.names, self.limit = fmt, names, limit
        # tool_choice required or named: the grammar allows only calls, so text outside them
        # is a call cut short (max_tokens), never content.
        self.forced = forced
        self.text = ""  # all of it so far
        self.at = 0  # where the unread text begins
        self.state = "text" if fmt is HERMES else "start"
        self.marked = False  # the answer's marker (<|python_tag|>, [TOOL_CALLS]) read
        self.current: _Call | None = None
        self.call_from = 0  # where the text begins that is content if the call is not one
        self.shown = False  # this stretch of content between calls has shown some text
        self.content = ""  # all the content given out so far
        self.calls: list[dict[str, Any]] = []  # as OpenAI's message.tool_calls
        self.cut = False  # the answer ended inside a call's arguments

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to give out now, the calls' stream deltas)."""
        self.text += text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while getattr(self, f"_{self.state}")(out, deltas, final):
            pass
        if final:
            self._flush(out)
        shown = "" if self.forced else "".join(out)
        self.content += shown
        return shown, deltas

    def _peek(self) -> str | None:
        """The next character that is not whitespace (None: none yet), skipping to it."""
        while self.at < len(self.text) and self.text[self.at] in _SPACE:
            self.at += 1
        return self.text[self.at] if self.at < len(self.text) else None

    def _plain(self, out: list[str], text: str, ends_stretch: bool) -> None:
        """Content, except a stretch of only whitespace next to calls."""
        if not text.strip() and not self.shown and (self.calls or ends_stretch):
            return
        self.shown = self.shown or bool(text.strip())
        out.append(text)

    def _begin_call(self, call_from: int) -> bool:
        self.call_from = call_from
        self.current = _Call(self.fmt, self.names, len(self.calls), self.at)
        self.state = "call"
        return True

    def _to_text(self, start: int) -> bool:
        """From `start` on, the answer is content (llama3_json, mistral)."""
        self.at, self.state = start, "text"
        return True

    # ---- states: each reads what it can and says whether to go on ----

    def _text(self, out: list[str], deltas: list, final: bool) -> bool:
        if self.fmt is not HERMES:
            if self.at < len(self.text):
                self._plain(out, self.text[self.at:], False)
            self.at = len(self.text)
            return False
        start = self.text.find(OPEN, self.at)
        if start < 0:
            keep = 0 if final else _held(self.text[self.at:])
            end = len(self.text) - keep
            if end > self.at:
                self._plain(out, self.text[self.at:end], False)
            self.at = end
            return False
        self._plain(out, self.text[self.at:start], True)
        self.call_from, self.at, self.state = start, start + len(OPEN), "open"
        return True

    def _open(self, out: list[str], deltas: list, final: bool) -> bool:
        """Hermes, after <tool_call>: an object, or text."""
        c = self._peek()
        if c is None:
            return False
        if c == "{":
            return self._begin_call(self.call_from)
        self.state = "raw"
        return True

    def _raw(self, out: list[str], deltas: list, final: bool) -> bool:
        """Hermes: a tagged stretch that is not a call is content, tags and all."""
        end = self.text.find(CLOSE, self.call_from + len(OPEN))
        if end < 0:
            return False
        self.at = end + len(CLOSE)
        self._plain(out, self.text[self.call_from:self.at], False)
        self.state = "text"
        return True

    def _call(self, out: list[str], deltas: list, final: bool) -> bool:
        call = self.current
        assert call is not None
        found = call.feed(self.text[call.start + len(call.scan.text):])
        self.at = call.start + call.scan.scanned
        if found is None:  # not a call after all
            if self.fmt is HERMES:
                self.state = "raw"
                return True
            return self._to_text(self.call_from)
        if self.limit is None or call.index < self.limit:  # else dropped unseen
            deltas += found
            if call.call is not None and (not self.calls or self.calls[-1] is not call.call):
                self.calls.append(call.call)
        if call.scan.end is None:
            return False
        self.shown = False
        self.state = "close" if self.fmt is HERMES else "between"
        return True

    def _close(self, out: list[str], deltas: list, final: bool) -> bool:
        """Hermes: what lies between a call's object and </tool_call> is dropped."""
        end = self.text.find(CLOSE, self.at)
        if end < 0:
            return False
        self.at, self.state = end + len(CLOSE), "text"
        return True

    def _start(self, out: list[str], deltas: list, final: bool) -> bool:
        """llama3_json, mistral: an answer that is calls opens with its marker or bracket."""
        c = self._peek()
        if c is None:
            return False
        rest, marker = self.text[self.at:], self.fmt.markers[0]
        if not self.marked and rest.startswith(marker):
            self.at += len(marker)
            self.marked = True
            return True
        if not self.marked and marker.startswith(rest):
            return False  # may yet be the marker
        if c != self.fmt.markers[1]:
            return self._to_text(0)
        if self.fmt is MISTRAL:
            self.at += 1
            self.state = "list"
            return True
        return self._begin_call(0)

    def _list(self, out: list[str], deltas: list, final: bool) -> bool:
        """mistral, after `[`: a call, or text."""
        c = self._peek()
        if c is None:
            return False
        return self._begin_call(0) if c == "{" else self._to_text(0)

    def _between(self, out: list[str], deltas: list, final: bool) -> bool:
        """After a call: a separator, Mistral's closing `]`, or text."""
        c = self._peek()
        if c is None:
            return False
        if c == self.fmt.separator:
            self.call_from = self.at
            self.at += 1
            self.state = "separated"
            return True
        if c == "]" and self.fmt is MISTRAL:
            self.at += 1
            self.state = "after"
            return True
        return self._to_text(self.at)

    def _separated(self, out: list[str], deltas: list, final: bool) -> bool:
        c = self._peek()
        if c is None:
            return False
        return self._begin_call(self.call_from) if c == "{" else self._to_text(self.call_from)

    def _after(self, out: list[str], deltas: list, final: bool) -> bool:
        return False if self._peek() is None else self._to_text(self.at)

    def _flush(self, out: list[str]) -> None:
        """At the end of the answer: what was held back for being undecided is content; a
        call cut short keeps the arguments it has (its finish_reason says length)."""
        committed = self.current is not None and self.current.call is not None
        self.cut = self.state == "call" and committed
        if self.state in ("open", "raw") or (self.state == "call" and not committed):
            self._plain(out, self.text[self.call_from:], False)
        elif self.state == "start" or self.state == "list":
            self._plain(out, self.text, False)
        elif self.state == "close" and self.text[self.at:].strip():
            self._plain(out, self.text[self.at:].strip(), False)
        self.at, self.state = len(self.text), "done"

    def _done(self, out: list[str], deltas: list, final: bool) -> bool:
        return False


def _held(buffer: str) -> int:
    """How much of the buffer's end to hold back: trailing whitespace (it may precede a call),
    and any start of OPEN with the whitespace before it."""
    stripped = buffer.rstrip()
    for k in range(min(len(OPEN) - 1, len(stripped)), 0, -1):
        if OPEN.startswith(stripped[-k:]):
            return len(buffer) - len(stripped[:-k].rstrip())
    return len(buffer) - len(stripped)


def parser_for(fmt: ToolFormat, names: list[str], limit: int | None = None,
               forced: bool = False) -> ToolParser:
    """A parser of one choice's text, for calls of the tools named (the first `limit` of
    them kept; forced: the answer can only be calls, see ToolParser)."""
    return ToolParser(fmt, names, limit, forced)
