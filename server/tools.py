"""Tool calling: OpenAI `tools` into the prompt, `tool_choice` into a grammar, and the model's
calls out of its text, whole or streamed.

The call format is Hermes-style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes, Qwen 2.5 and others). A chat template that takes `tools` gets them and the messages'
tool calls as they are; for one that does not (the bundled SmolLM2's), the tools are described
in the system message and past calls and results are written in that format.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.errors import ApiError
from server.openai_types import ChatCompletionRequest, ToolChoiceNamed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SYSTEM = (
    "You may call one or more functions to assist with the user query. You are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
# As the JSON constraints elsewhere: compact, so a small model cannot pad with whitespace.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tools_on(body: ChatCompletionRequest) -> bool:
    """Whether the model is offered the tools (tool_choice none: it is not)."""
    return bool(body.tools) and body.tool_choice != "none"


def check(body: ChatCompletionRequest) -> None:
    names = [t.function.name for t in body.tools or []]
    if body.tool_choice is not None and not body.tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(body.tool_choice, ToolChoiceNamed) \
            and body.tool_choice.function.name not in names:
        raise ApiError(400, f"tool_choice names {body.tool_choice.function.name!r}, which is "
                            f"not among the tools", param="tool_choice")
    if len(set(names)) != len(names):
        raise ApiError(400, "two tools have the same name", param="tools")
    for i, m in enumerate(body.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise ApiError(400, f"messages[{i}] ({m.role}) cannot carry tool_calls; only an "
                                f"assistant turn does", param="messages")
        if m.tool_call_id is not None and m.role != "tool":
            raise ApiError(400, f"messages[{i}] ({m.role}) cannot carry tool_call_id; only a "
                                f"tool turn does", param="messages")
        if m.role == "tool" and not m.tool_call_id:
            raise ApiError(400, f"messages[{i}] (tool) needs a tool_call_id", param="messages")


def _tool_json(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": t.function.name, "description": t.function.description or "",
        "parameters": t.function.parameters or {"type": "object", "properties": {}}}}
        for t in body.tools or []]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_messages(body: ChatCompletionRequest, template_takes_tools: bool
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template, and the tools to pass it (None: not passed)."""
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None \
            else "".join(p.text for p in m.content)
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": content}
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                 for c in m.tool_calls or []]
        if template_takes_tools:
            if calls:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": f}
                                       for c, f in zip(m.tool_calls or [], calls, strict=True)]
            if m.tool_call_id:
                entry["tool_call_id"] = m.tool_call_id
        elif calls:
            entry["content"] = "\n".join([content or "", *(
                f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls)]).strip()
        elif role == "tool":
            entry = {"role": "user",
                     "content": f"<tool_response>\n{content}\n</tool_response>"}
        entry["content"] = entry["content"] or ""
        messages.append(entry)
    if not tools_on(body):
        return messages, None
    if template_takes_tools:
        return messages, _tool_json(body)
    described = _SYSTEM.format(tools="\n".join(json.dumps(t) for t in _tool_json(body)))
    if messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}
    else:
        messages.insert(0, {"role": "system", "content": described})
    return messages, None


def tool_grammar(body: ChatCompletionRequest) -> str | None:
    """A Lark grammar (llguidance's dialect) for tool_choice required or a named function:
    only calls of the allowed functions, with arguments valid for their schemas."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "none", "auto"):
        return None
    tools = body.tools
    if isinstance(choice, ToolChoiceNamed):
        tools = [t for t in tools if t.function.name == choice.function.name]
    rules = []
    for i, t in enumerate(tools):
        schema = {"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": _COMPACT}
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    many = body.parallel_tool_calls and not isinstance(choice, ToolChoiceNamed)
    call = f'"{OPEN}\\n" ({" | ".join(f"fn{i}" for i in range(len(tools)))}) "\\n{CLOSE}"'
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return "\n".join([start, f"call: {call}", *rules])


class ToolCallParser:
    """One choice's text, fed as it streams: the content to show and the tool calls found.
    Text that might begin a call is held back until it is known whether it does."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.content = ""  # all the content given out so far
        self.calls: list[dict[str, Any]] = []  # as OpenAI's message.tool_calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to emit now, stream deltas for the calls completed now)."""
        self.buffer += text
        out, deltas = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
                self.in_call = False
                call = self._call(body)
                if call is None:  # not a well-formed call: it stays text
                    out += f"{OPEN}{body}{CLOSE}"
                    continue
                self.calls.append(call)
                deltas.append({"index": len(self.calls) - 1, **call})
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

    @staticmethod
    def _call(body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def _held(buffer: str) -> int:
    """How much of the buffer's end to hold back: trailing whitespace (it may precede a call)
    and any start of OPEN."""
    stripped = buffer.rstrip()
    for k in range(min(len(OPEN) - 1, len(stripped)), 0, -1):
        if OPEN.startswith(stripped[-k:]):
            return len(buffer) - len(stripped) + k
    return len(buffer) - len(stripped)
