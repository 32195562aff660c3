"""Tool calling: OpenAI `tools` into the prompt and `tool_choice` into a grammar (the calls
come back out of the text in server/tool_parsers.py).

A chat template that takes `tools` gets them and the messages' tool calls as they are, and
the model answers in its family's format; for one that does not (the bundled SmolLM2's), the
tools are described in the system message in the Hermes format, and past calls and results
are written in it.
"""

from __future__ import annotations

import json
from typing import Any

from server.errors import ApiError
from server.openai_types import ChatCompletionRequest, TextPart, ToolChoiceNamed
from server.tool_parsers import CLOSE, OPEN, ToolFormat, ToolParser, parser_for
from surge.grammar import closed_objects, rebased

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
    if body.parallel_tool_calls is not None and not body.tools:
        raise ApiError(400, "parallel_tool_calls needs tools", param="parallel_tool_calls")
    for i, t in enumerate(body.tools or []):
        kind = (t.function.parameters or {}).get("type", "object")
        if kind != "object":  # the calls' arguments are a JSON object, as clients decode them
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema of type "
                                f"object (a call's arguments are an object), not {kind!r}",
                           param="tools")
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


# A function without `parameters` takes none, as OpenAI reads it: its arguments are {}.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _tool_json(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": t.function.name, "description": t.function.description or "",
        "parameters": t.function.parameters or _NO_PARAMETERS}}
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
            else "".join(p.text for p in m.content if isinstance(p, TextPart))
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:  # a template may render it (who spoke, which tool answered)
            entry["name"] = m.name
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


def calls_forced(body: ChatCompletionRequest) -> bool:
    """tool_choice required or a named function: the answer is calls only (tool_grammar)."""
    return bool(body.tools) and body.tool_choice not in (None, "none", "auto")


def tool_grammar(body: ChatCompletionRequest, fmt: ToolFormat) -> str | None:
    """A Lark grammar (llguidance's dialect) for tool_choice required or a named function:
    only calls of the allowed functions in the format's own form, with arguments valid for
    their schemas."""
    if not calls_forced(body):
        return None
    choice, tools = body.tool_choice, body.tools or []
    if isinstance(choice, ToolChoiceNamed):
        tools = [t for t in tools if t.function.name == choice.function.name]
    rules = []
    for i, t in enumerate(tools):
        arguments = closed_objects(t.function.parameters or _NO_PARAMETERS)
        schema = {"type": "object", "properties": {
            "name": {"const": t.function.name},
            fmt.arguments_key: rebased(arguments, f"#/properties/{fmt.arguments_key}")},
            "required": ["name", fmt.arguments_key], "additionalProperties": False,
            "x-guidance": _COMPACT}
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    many = body.many_tool_calls and not isinstance(choice, ToolChoiceNamed)
    fn = f'({" | ".join(f"fn{i}" for i in range(len(tools)))})'
    # (opening, call, separator, closing) of each format's answer
    opening, call, sep, closing = {
        "hermes": ("", f'"{OPEN}\\n" {fn} "\\n{CLOSE}"', '"\\n"', ""),
        "llama3_json": ("", fn, '"; "', ""),
        "mistral": ('"["', fn, '", "', '"]"')}[fmt.name]
    calls = f"call ({sep} call)*" if many else "call"
    start = " ".join(p for p in (opening, calls, closing) if p)
    return "\n".join([f"start: {start}", f"call: {call}", *rules])


def tool_parsers(body: ChatCompletionRequest, fmt: ToolFormat, n: int) -> list[ToolParser] | None:
    """One parser per choice when the model is offered tools (None: it is not); without
    parallel_tool_calls each keeps only the answer's first call."""
    if not tools_on(body):
        return None
    names = [t.function.name for t in body.tools or []]
    limit = None if body.many_tool_calls else 1
    return [parser_for(fmt, names, limit, calls_forced(body)) for _ in range(n)]
