"""Tool calling: the call parser on fixed strings (whole and streamed in every split), the
prompt for a template without tools support, and the tool_choice grammar."""

from __future__ import annotations

import json

import msgspec
import pytest

from server.openai_types import ChatCompletionRequest
from server.tools import ToolCallParser, chat_messages, tool_grammar
from surge.grammar import compile_grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TEXTS = [
    # (model output, content, [(name, arguments)])
    ("Paris is sunny.", "Paris is sunny.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"ci', '<tool_call>{"name": '
     '"get_weather", "arguments": {"ci', []),  # cut short by max_tokens
    ("a < b <tool", "a < b <tool", []),
]


def _calls(parser: ToolCallParser) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parser.calls]


@pytest.mark.parametrize(("text", "content", "calls"), TEXTS)
def test_parser_whole_and_in_every_two_piece_split(text, content, calls):
    whole = ToolCallParser()
    whole.feed(text, final=True)
    assert (whole.content, _calls(whole)) == (content, calls)
    for cut in range(len(text) + 1):
        parser = ToolCallParser()
        shown, deltas = parser.feed(text[:cut])
        more, later = parser.feed(text[cut:], final=True)
        assert shown + more == content and _calls(parser) == calls
        assert [d["index"] for d in deltas + later] == list(range(len(calls)))


def _body(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "tools": [WEATHER, TIME], **fields}, ChatCompletionRequest)


def test_a_template_without_tools_gets_them_in_the_system_message():
    body = _body(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    messages, tools = chat_messages(body, template_takes_tools=False)
    assert tools is None and messages[0]["role"] == "system"
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": '
                           '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    messages, tools = chat_messages(body, template_takes_tools=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["tool_call_id"] == "c1"
    none = _body(tool_choice="none")
    assert chat_messages(none, template_takes_tools=False)[0][0]["role"] == "user"


def test_tool_choice_grammars_compile():
    assert tool_grammar(_body()) is None and tool_grammar(_body(tool_choice="auto")) is None
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        grammar = tool_grammar(_body(tool_choice=choice, parallel_tool_calls=False))
        compile_grammar("lark", grammar)
    named = tool_grammar(_body(tool_choice={"type": "function",
                                            "function": {"name": "get_time"}}))
    assert "get_time" in named and "get_weather" not in named
