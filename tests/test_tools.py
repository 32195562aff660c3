"""Tool calling: each format's call parser on fixed strings (whole and streamed in every
split), which format a chat template gets, the prompt for a template without tools support,
and the tool_choice grammars (what each accepts, the same format's parser reads back)."""

from __future__ import annotations

import json

import msgspec
import pytest

from server.openai_types import ChatCompletionRequest
from server.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, format_of, parser_for
from server.tools import chat_messages, tool_grammar
from surge.grammar import compile_grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = ["get_weather", "get_time"]
TEXTS = [
    # (format, model output, content, [(name, arguments)])
    (HERMES, "Paris is sunny.", "Paris is sunny.", []),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "", [("get_weather", {"city": "Paris"})]),
    (HERMES, 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": '
     '"Oslo"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (HERMES, "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"ci', '<tool_call>{"name": '
     '"get_weather", "arguments": {"ci', []),  # cut short by max_tokens
    (HERMES, "a < b <tool", "a < b <tool", []),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "get_time", "parameters": {}}', "",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (LLAMA3_JSON, ' {"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    (LLAMA3_JSON, "It is sunny {really}.", "It is sunny {really}.", []),
    (LLAMA3_JSON, '{"name": "launch_rocket", "parameters": {}}',  # not an offered tool
     '{"name": "launch_rocket", "parameters": {}}', []),
    (LLAMA3_JSON, '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {}} and more',
     '{"name": "get_time", "parameters": {}} and more', []),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": '
     '"get_time", "arguments": {}}]', "", [("get_weather", {"city": "Paris"}),
                                          ("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),
    (MISTRAL, "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    (MISTRAL, '[{"name": "get_time", "arguments": {', '[{"name": "get_time", "arguments": {',
     []),  # cut short
    (MISTRAL, "Sure.", "Sure.", []),
]


def _calls(parser) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parser.calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), TEXTS,
                         ids=[f"{t[0].name}-{i}" for i, t in enumerate(TEXTS)])
def test_parser_whole_and_in_every_two_piece_split(fmt, text, content, calls):
    whole = parser_for(fmt, NAMES)
    whole.feed(text, final=True)
    assert (whole.content, _calls(whole)) == (content, calls)
    for cut in range(len(text) + 1):
        parser = parser_for(fmt, NAMES)
        shown, deltas = parser.feed(text[:cut])
        more, later = parser.feed(text[cut:], final=True)
        assert shown + more == content and _calls(parser) == calls
        assert [d["index"] for d in deltas + later] == list(range(len(calls)))
        assert len({d["id"] for d in deltas + later}) == len(calls)


def test_each_template_family_gets_its_format_and_mistral_its_nine_character_ids():
    assert format_of(None) is HERMES and format_of("{{ messages }}") is HERMES
    assert format_of("{% if tools %}<tool_call>{% endif %}") is HERMES  # Qwen 2.5
    assert format_of("{% if tools %}<|python_tag|>{% endif %}") is LLAMA3_JSON  # Llama 3.1
    assert format_of('{% if tools %}Respond in the format {"name": function name, '
                     '"parameters": dictionary of argument name and its value}'
                     '{% endif %}') is LLAMA3_JSON  # Llama 3.2
    assert format_of("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is MISTRAL
    assert format_of("<|python_tag|> alone") is HERMES
    ids = {MISTRAL.call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)


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


# What each format's constrained answer looks like: one call, then two.
SAMPLES = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>', '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
               '</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '; {"name": "get_time", "parameters": {}}'),
    "mistral": ('[{"name": "get_weather", "arguments": {"city": "Paris"}}',
                ', {"name": "get_time", "arguments": {}}'),
}


def _accepts(grammar: str, text: str, tokenizer) -> bool:
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.hf.backend_tokenizer.to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=tokenizer.eos_token_ids)
    matcher = LLMatcher(ll, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_tool_choice_grammars_take_the_formats_calls_and_its_parser_reads_them(
        fmt: ToolFormat, tokenizer):
    assert tool_grammar(_body(), fmt) is None
    assert tool_grammar(_body(tool_choice="auto"), fmt) is None
    one, more = SAMPLES[fmt.name]
    end = "]" if fmt is MISTRAL else ""
    grammar = tool_grammar(_body(tool_choice="required"), fmt)
    compile_grammar("lark", grammar)
    assert _accepts(grammar, one + end, tokenizer)
    assert _accepts(grammar, one + more + end, tokenizer)
    assert not _accepts(grammar, one.replace("get_weather", "get_wether") + end, tokenizer)
    single = tool_grammar(_body(tool_choice="required", parallel_tool_calls=False), fmt)
    assert _accepts(single, one + end, tokenizer)
    assert not _accepts(single, one + more + end, tokenizer)
    named = tool_grammar(_body(tool_choice={"type": "function",
                                            "function": {"name": "get_time"}}), fmt)
    assert "get_time" in named and "get_weather" not in named
    assert not _accepts(named, one + end, tokenizer)
    parser = parser_for(fmt, NAMES)
    parser.feed(one + more + end, final=True)
    assert _calls(parser) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
