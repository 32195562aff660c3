"""Tool calling: each format's call parser on fixed strings (whole, streamed in every
two-piece split and one character at a time), which format a chat template gets, the prompt
for a template without tools support, and the tool_choice grammars (what each accepts, the
same format's parser reads back)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.openai_types import ChatCompletionRequest
from server.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, format_of, parser_for
from server.tools import chat_messages, tool_grammar, tool_parsers
from surge.grammar import compile_grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = ["get_weather", "get_time"]
TEXTS = [
    # (format, model output, content, [(name, arguments text)])
    (HERMES, "Paris is sunny.", "Paris is sunny.", []),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "", [("get_weather", '{"city": "Paris"}')]),
    (HERMES, 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": '
     '"Oslo"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me check.\n", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (HERMES, "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    # cut short by max_tokens once the name is known: the call keeps what it has
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"ci', "",
     [("get_weather", '{"ci')]),
    (HERMES, '<tool_call>{"name": "get_wea', '<tool_call>{"name": "get_wea', []),
    (HERMES, "a < b <tool", "a < b <tool", []),
    (HERMES, '\n <tool_call>{"name": "get_time", "arguments": {}}</tool_call> \n', "",
     [("get_time", "{}")]),  # whitespace around calls is not content
    (HERMES, '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call> no',
     '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call> no', []),
    # a brace, a quote and an escape inside a string do not end the arguments
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "a}\\"b]"}}'
     '</tool_call>', "", [("get_weather", '{"city": "a}\\"b]"}')]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "get_time", "parameters": {}}', "",
     [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (LLAMA3_JSON, ' {"name": "get_time", "arguments": {}}', "", [("get_time", "{}")]),
    (LLAMA3_JSON, '{"type": "function", "name": "get_time"}', "", [("get_time", "{}")]),
    # arguments before the name: the call comes whole once the object is complete
    (LLAMA3_JSON, '{"parameters": {"city": "Rome"}, "name": "get_weather"}', "",
     [("get_weather", '{"city": "Rome"}')]),
    (LLAMA3_JSON, "It is sunny {really}.", "It is sunny {really}.", []),
    (LLAMA3_JSON, '{"name": "launch_rocket", "parameters": {}}',  # not an offered tool
     '{"name": "launch_rocket", "parameters": {}}', []),
    (LLAMA3_JSON, '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {}} and more', "and more",
     [("get_time", "{}")]),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": '
     '"get_time", "arguments": {}}]', "", [("get_weather", '{"city": "Paris"}'),
                                          ("get_time", "{}")]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "", [("get_time", "{}")]),
    (MISTRAL, "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    (MISTRAL, '[{"name": "get_time", "arguments": {', "", [("get_time", "{")]),  # cut short
    (MISTRAL, "Sure.", "Sure.", []),
]


def _raw(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _assembled(deltas: list[dict]) -> list[tuple[str, str]]:
    """The deltas put together as the openai client does: by index, strings appended."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:  # a call's first delta: id, type, name, arguments ""
            assert d["id"] and d["type"] == "function" and d["function"]["name"], d
            calls[d["index"]] = {"name": "", "arguments": ""}
        calls[d["index"]]["name"] += d["function"].get("name", "")
        calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    assert list(calls) == list(range(len(calls)))
    return [(c["name"], c["arguments"]) for c in calls.values()]


def _fed(fmt: ToolFormat, pieces: list[str], limit: int | None = None
         ) -> tuple[str, list[dict], list[dict]]:
    """(content, deltas, calls) of an answer fed in these pieces."""
    parser = parser_for(fmt, NAMES, limit)
    shown, deltas = "", []
    for i, piece in enumerate(pieces):
        more, found = parser.feed(piece, final=i == len(pieces) - 1)
        shown, deltas = shown + more, deltas + found
    assert shown == parser.content
    return shown, deltas, parser.calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), TEXTS,
                         ids=[f"{t[0].name}-{i}" for i, t in enumerate(TEXTS)])
def test_parser_whole_in_every_two_piece_split_and_one_character_at_a_time(
        fmt, text, content, calls):
    whole, deltas, parsed = _fed(fmt, [text])
    assert (whole, _raw(parsed), _assembled(deltas)) == (content, calls, calls)
    splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    for pieces in [*splits, [*text, ""]]:
        shown, deltas, streamed = _fed(fmt, pieces)
        assert (shown, _assembled(deltas), _raw(streamed)) == (content, calls, calls), pieces
        assert len({d["id"] for d in deltas if "id" in d}) == len(calls)


@pytest.mark.parametrize(("text", "cut"), [
    ('<tool_call>{"name": "get_weather", "arguments": {"ci', True),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', False),
    ('<tool_call>{"name": "get_wea', False),  # no call yet: content
])
def test_the_parser_says_when_the_answer_ended_inside_a_calls_arguments(text, cut):
    parser = parser_for(HERMES, NAMES)
    parser.feed(text, final=True)
    assert parser.cut is cut


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text("ab{}[]\",:\\ \n<", max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text("ab{}\":\\ ", max_size=4), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from([HERMES, LLAMA3_JSON, MISTRAL]),
       calls=st.lists(st.tuples(st.sampled_from([*NAMES, "nope"]), _JSON, st.booleans()),
                      min_size=1, max_size=3),
       data=st.data())
def test_any_calls_in_any_pieces_parse_as_a_whole(fmt, calls, data):
    """Arguments with brackets, quotes and escapes in their strings, written before or
    after the name: fed in random pieces, the same content and calls as whole; whole, the
    offered calls (in the JSON formats, those before the first one that is not a call)."""
    objects = []
    for name, arguments, name_first in calls:
        items = [("name", name), (fmt.arguments_key, arguments)]
        objects.append(json.dumps(dict(items if name_first else items[::-1])))
    if fmt is HERMES:
        text = "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objects)
        offered = [(n, json.dumps(a)) for n, a, _ in calls if n != "nope"]
    else:
        text = f"{fmt.separator} ".join(objects)
        text = f"[{text}]" if fmt is MISTRAL else text
        names = [n for n, _, _ in calls]
        first = names.index("nope") if "nope" in names else len(calls)
        offered = [(n, json.dumps(a)) for n, a, _ in calls[:first]]
    whole = _fed(fmt, [text])
    assert _raw(whole[2]) == _assembled(whole[1]) == offered
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, deltas, streamed = _fed(fmt, pieces)
    assert (content, _assembled(deltas), _raw(streamed)) == (whole[0], offered, offered)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_arguments_stream_as_written_and_never_past_their_end(fmt):
    """One character at a time, a call's arguments come in many fragments, each sent as soon
    as it is certainly part of them; written before the name, they come whole."""
    text = {"hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                      '</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'}[fmt.name]
    parser = parser_for(fmt, NAMES)
    fragments = []
    for i, c in enumerate(text):
        _, deltas = parser.feed(c)
        fragments += [d["function"]["arguments"] for d in deltas if "id" not in d]
        sent = "".join(fragments)
        # what has been sent is exactly what has been written of the arguments so far
        written = text[:i + 1].partition('s": ')[2]
        assert sent == written[:len('{"city": "Paris"}')], (text[:i + 1], sent)
    assert len(fragments) == len('{"city": "Paris"}')
    reversed_order = text.replace('"name": "get_weather", ', "").replace(
        '{"city": "Paris"}}', '{"city": "Paris"}, "name": "get_weather"}')
    _, deltas, _ = _fed(fmt, list(reversed_order) + [""])
    assert [d["function"]["arguments"] for d in deltas] == ['{"city": "Paris"}']


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_without_parallel_calls_only_the_first_call_is_kept(fmt):
    one, more = SAMPLES[fmt.name]
    text = one + more + ("]" if fmt is MISTRAL else "")
    for pieces in ([text], [*text, ""]):
        content, deltas, calls = _fed(fmt, pieces, limit=1)
        assert _raw(calls) == _assembled(deltas) == [("get_weather", '{"city": "Paris"}')]
        assert content == ""


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


def test_a_message_name_reaches_the_chat_template(tokenizer):
    body = _body(messages=[{"role": "user", "name": "ada", "content": "hi"},
                           {"role": "user", "content": "and me"}], tool_choice="none")
    messages, _ = chat_messages(body, template_takes_tools=False)
    assert [m.get("name") for m in messages] == ["ada", None]
    template = "{% for m in messages %}{{ m.name or '?' }}: {{ m.content }}\n{% endfor %}"
    text = tokenizer.hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert text == "ada: hi\n?: and me\n"


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
    _, _, calls = _fed(fmt, [one + more + end])
    assert _raw(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


@pytest.mark.parametrize("cut", ["\n<", "\n<tool_call>\n{\"name\": \"get_we"])
def test_forced_calls_leave_no_content_when_cut_short(cut):
    """tool_choice required or named: the grammar allows only calls, so what a max_tokens cut
    leaves of a second call is not content (offered freely, it is: it may be text)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for forced in (False, True):
        parser = parser_for(HERMES, NAMES, None, forced)
        shown, _ = parser.feed(call + cut, final=True)
        assert [c["function"]["name"] for c in parser.calls] == ["get_weather"]
        assert (shown == parser.content == "") == forced, (forced, shown)


def test_parsers_drop_content_where_the_grammar_allows_only_calls():
    named = {"type": "function", "function": {"name": "get_time"}}
    for fields, forced in (({}, False), ({"tool_choice": "auto"}, False),
                           ({"tool_choice": "required"}, True), ({"tool_choice": named}, True)):
        parsers = tool_parsers(_body(**fields), HERMES, 2)
        assert parsers is not None and [p.forced for p in parsers] == [forced, forced], fields
        assert (tool_grammar(_body(**fields), HERMES) is not None) == forced, fields
    assert tool_parsers(_body(tool_choice="none"), HERMES, 2) is None


def test_a_function_without_parameters_takes_empty_arguments(tokenizer):
    """OpenAI reads a missing `parameters` as none: forced, its arguments can only be {}."""
    named = tool_grammar(_body(tool_choice={"type": "function",
                                            "function": {"name": "get_time"}}), HERMES)
    call = '<tool_call>\n{"name": "get_time", "arguments": %s}\n</tool_call>'
    assert _accepts(named, call % "{}", tokenizer)
    assert not _accepts(named, call % '{"type": "object"}', tokenizer)



def test_forced_calls_keep_a_tools_own_references(tokenizer):
    """pydantic's tools (openai.pydantic_function_tool) keep enums and nested models in $defs
    and refer to them from the parameters' root; inside the call's schema they still resolve."""
    parameters = {"type": "object", "$defs": {
        "Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"},
        "Leg": {"type": "object", "properties": {"to": {"type": "string"},
                                                 "next": {"anyOf": [{"$ref": "#/$defs/Leg"},
                                                                    {"type": "null"}]}},
                "required": ["to", "next"]}},
        "properties": {"unit": {"$ref": "#/$defs/Unit"}, "leg": {"$ref": "#/$defs/Leg"},
                       "note": {"const": {"$ref": "#/data"}},
                       # properties named as keywords whose values are data elsewhere
                       "examples": {"type": "array", "items": {"$ref": "#/$defs/Unit"}},
                       "default": {"$ref": "#/$defs/Unit"}},
        "required": ["unit", "leg", "note", "examples", "default"]}
    body = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "trip", "parameters": parameters}}],
        "tool_choice": "required"}, ChatCompletionRequest)
    grammar = tool_grammar(body, HERMES)
    compile_grammar("lark", grammar)
    call = ('<tool_call>\n{"name": "trip", "arguments": {"unit": "%s", "leg": {"to": "Oslo", '
            '"next": {"to": "Rome", "next": null}}, "note": {"$ref": "#/data"}, '
            '"examples": ["celsius"], "default": "fahrenheit"}}\n</tool_call>')
    assert _accepts(grammar, call % "celsius", tokenizer)
    assert not _accepts(grammar, call % "kelvin", tokenizer)
