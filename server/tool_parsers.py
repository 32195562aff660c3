"""The model's tool calls out of its text, whole or as it streams, in each chat-template
family's own format:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text
  (Hermes, Qwen 2.5/3, and surge's own description for a template without tools support);
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}`, several joined by
  `;`, after an optional `<|python_tag|>` (Llama 3.1-3.3);
- mistral: the whole answer is `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

The markers `<|python_tag|>` and `[TOOL_CALLS]` are special tokens the detokenizer drops, so
the JSON alone is enough; a JSON answer counts as calls only when it names offered tools.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str  # what a call's arguments are called in the model's output
    markers: tuple[str, ...]  # how an answer that is calls begins (llama3_json, mistral)

    def call_id(self) -> str:
        # Mistral's templates refuse any tool call id but 9 letters and digits.
        if self.name == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


HERMES = ToolFormat("hermes", "arguments", ())
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", ("<|python_tag|>", "{"))
MISTRAL = ToolFormat("mistral", "arguments", ("[TOOL_CALLS]", "["))
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


class ToolParser(Protocol):
    calls: list[dict[str, Any]]  # as OpenAI's message.tool_calls
    content: str  # all the content given out so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to emit now, stream deltas for the calls completed now)."""
        ...


def parser_for(fmt: ToolFormat, names: list[str]) -> ToolParser:
    """A parser of one choice's text, for calls of the tools named."""
    return TaggedParser(fmt) if fmt is HERMES else LeadingJsonParser(fmt, names)


def _call(fmt: ToolFormat, value: Any, names: list[str] | None) -> dict[str, Any] | None:
    """OpenAI's form of one parsed call (None: not a call of an offered tool)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get(fmt.arguments_key, value.get("arguments", value.get("parameters", {})))
    return {"id": fmt.call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def _deltas(calls: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    return [{"index": first + i, **c} for i, c in enumerate(calls)]


class TaggedParser:
    """Calls between tags, anywhere in the text. Text that might begin a call is held back
    until it is known whether it does."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buffer = ""
        self.in_call = False
        self.content = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        out, deltas = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
                self.in_call = False
                try:
                    call = _call(self.fmt, json.loads(body), None)
                except ValueError:
                    call = None
                if call is None:  # not a well-formed call: it stays text
                    out += f"{OPEN}{body}{CLOSE}"
                    continue
                deltas += _deltas([call], len(self.calls))
                self.calls.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _held(self.buffer)
                out += self._text(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out += self._text(self.buffer[:start])
            self.buffer = self.buffer[start + len(OPEN):]
            self.in_call = True
        if final and self.in_call:  # a call the budget cut short: shown as the text it is
            out += OPEN + self.buffer
            self.buffer, self.in_call = "", False
        self.content += out
        return out, deltas

    def _text(self, text: str) -> str:
        """Content, except the whitespace between and after calls."""
        return "" if self.calls and not text.strip() else text


def _held(buffer: str) -> int:
    """How much of the buffer's end to hold back: trailing whitespace (it may precede a call)
    and any start of OPEN."""
    stripped = buffer.rstrip()
    for k in range(min(len(OPEN) - 1, len(stripped)), 0, -1):
        if OPEN.startswith(stripped[-k:]):
            return len(buffer) - len(stripped) + k
    return len(buffer) - len(stripped)


class LeadingJsonParser:
    """An answer that is calls and nothing else: held back from its first character while it
    may be calls, then given out as calls or, if it does not parse as them, as text."""

    def __init__(self, fmt: ToolFormat, names: list[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.buffer = ""
        self.is_text = False
        self.content = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        if not self.is_text:
            self.buffer += text
            head = self.buffer.lstrip()
            maybe = any(m.startswith(head) or head.startswith(m) for m in self.fmt.markers)
            if maybe and not final:
                return "", []
            calls = self._parse(head) if maybe else None
            if calls:
                self.calls = calls
                return "", _deltas(calls, 0)
            self.is_text, text, self.buffer = True, self.buffer, ""
        self.content += text
        return text, []

    def _parse(self, text: str) -> list[dict[str, Any]] | None:
        """The calls the whole text is, or None."""
        for marker in self.fmt.markers[:1]:
            text = text.removeprefix(marker).lstrip()
        decoder, values, at = json.JSONDecoder(), [], 0
        try:
            while at < len(text):
                value, at = decoder.raw_decode(text, at)
                values += value if isinstance(value, list) and self.fmt is MISTRAL else [value]
                rest = text[at:].lstrip()
                at = len(text) - len(rest.removeprefix(";").lstrip())
        except ValueError:
            return None
        calls = [_call(self.fmt, v, self.names) for v in values]
        return None if not calls or None in calls else calls
