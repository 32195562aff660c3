"""Structured output against the real server: JSON schemas, regexes, choices and grammars hold
for every answer, greedy and sampled, streamed or not, mixed with free requests in one batch."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.prompts import RAW
from tests.server import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"}},
        "required": ["colour", "bright"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "primes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 2, "maxItems": 4}},
        "required": ["primes"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "code", "age"], "additionalProperties": False},
}
ASK = {"nested": "Describe Paris as JSON with its coordinates.",
       "enum": "Pick a colour and say whether it is bright, as JSON.",
       "array": "List a few prime numbers as JSON.",
       "pattern": "Invent a person with a name, a product code and an age, as JSON."}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _schema_format(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def _chat(aclient, name: str, sampled: bool, stream: bool) -> tuple[str, str]:
    args = dict(model=MODEL, messages=[{"role": "user", "content": ASK[name]}],
                max_tokens=120, response_format=_schema_format(name),
                temperature=0.8 if sampled else 0, seed=7)
    if not stream:
        r = await aclient.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = [], None
    async for chunk in await aclient.chat.completions.create(**args, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


async def _free(aclient, prompt: str) -> str:
    r = await aclient.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                         max_tokens=16, extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_sixteen_at_once_schemas_hold_and_free_requests_keep_their_tokens(
        server, tokenizer, reference):
    """8 constrained (4 schemas x greedy/sampled, half streamed) beside 8 free greedy
    requests in the same steps: every answer validates; the free ones are the reference's."""
    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                                     max_retries=0, timeout=600)
        constrained = [_chat(aclient, name, sampled, stream=sampled != (i % 2 == 0))
                       for i, name in enumerate(SCHEMAS) for sampled in (False, True)]
        free = [_free(aclient, RAW[i % len(RAW)]) for i in range(8)]
        return await asyncio.gather(asyncio.gather(*constrained), asyncio.gather(*free))

    answers, texts = asyncio.run(run())
    names = [name for name in SCHEMAS for _ in (False, True)]
    for name, (text, reason) in zip(names, answers, strict=True):
        assert reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    for i, text in enumerate(texts):
        ids = tokenizer.encode(RAW[i % len(RAW)])
        assert text == tokenizer.hf.decode(reference.greedy(ids, 16), skip_special_tokens=True)


def test_json_object_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:",
                                  max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # the budget ran out inside a string: still a JSON object's beginning
        assert r.choices[0].text.startswith("{")
    text = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text


def test_chat_json_object_and_text(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                max_tokens=60, temperature=0)
    r = client.chat.completions.create(**args, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the budget ran out inside a string: still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")
    # "text" is no constraint: the answer is the unconstrained one, token for token.
    free = client.chat.completions.create(**args).choices[0].message.content
    text = client.chat.completions.create(**args, response_format={"type": "text"})
    assert text.choices[0].message.content == free and not free.startswith("{")


def test_an_object_that_does_not_open_itself_gets_only_its_properties(client):
    """No additionalProperties: no keys beyond `properties` (vLLM's default engine and OpenAI's
    strict mode); `true` leaves room for more, which this model then writes."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 6,
                                                     "maximum": 999}}, "required": ["n"]}
    answers = []
    for extra in ({}, {"additionalProperties": True}):
        answers.append(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give me numbers as JSON."}],
            max_tokens=40, temperature=0, response_format={"type": "json_schema", "json_schema": {
                "name": "numbers", "schema": {**schema, **extra}}}).choices[0])
    shut, free = answers
    assert shut.finish_reason == "stop" and list(json.loads(shut.message.content)) == ["n"]
    assert len(re.findall(r'"\w+": ', free.message.content)) > 1, free.message.content


@pytest.mark.parametrize("field", ["response_format", "guided_json"])
def test_completions_json_schema_and_guided_json(client, field):
    schema = SCHEMAS["enum"]
    extra = {"guided_json": schema} if field == "guided_json" else \
        {"response_format": _schema_format("enum")}
    for seed in (1, 2):
        r = client.completions.create(model=MODEL, prompt="A colour, as JSON:", max_tokens=40,
                                      temperature=1.0, seed=seed, extra_body=extra)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_guided_grammar_on_chat_and_completions(client):
    gbnf = 'root ::= ("yes" | "no") ", " [a-z]{2,8} "!"'
    r = client.completions.create(model=MODEL, prompt="Do cats fly?", max_tokens=20,
                                  temperature=1.0, seed=3, extra_body={"guided_grammar": gbnf})
    assert re.fullmatch(r"(yes|no), [a-z]{2,8}!", r.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Do cats fly?"}], max_tokens=20,
        temperature=1.0, seed=3, extra_body={"guided_grammar": gbnf})
    assert re.fullmatch(r"(yes|no), [a-z]{2,8}!", chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", [1, 2])
def test_guided_regex_choice_and_grammar(client, seed):
    regex = client.completions.create(
        model=MODEL, prompt="My phone number is", max_tokens=20, temperature=1.0, seed=seed,
        extra_body={"guided_regex": r"\+44 [0-9]{4} [0-9]{6}"})
    assert re.fullmatch(r"\+44 [0-9]{4} [0-9]{6}", regex.choices[0].text)
    assert regex.choices[0].finish_reason == "stop"
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10, temperature=1.0, seed=seed,
        extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    gbnf = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\n' \
           'reason ::= [a-z ]{1,30}'
    grammar = client.completions.create(
        model=MODEL, prompt="Do cats fly?", max_tokens=40, temperature=1.0, seed=seed,
        extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,30}\.", grammar.choices[0].text)


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "a("}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}}}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {  # OpenAI's name pattern
        "name": "a b/c", "schema": {"type": "object"}}}}, "response_format"),
])
def test_constraints_the_engine_cannot_honour_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_fails_while_decoding_ends_the_request(client, stream):
    """llguidance builds this regex lazily and gives up after a few tokens: the request ends
    with an error naming the constraint, never goes on unconstrained."""
    with pytest.raises(openai.APIError, match="output constraint .* failed while decoding"):
        out = client.completions.create(model=MODEL, prompt="hi", max_tokens=16, temperature=0,
                                        stream=stream, extra_body={"guided_regex": "b{1000000}"})
        if stream:
            list(out)


# ---- tool calling through the official client ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


def _checked(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, tool["function"]["parameters"])
        assert call.id and call.type == "function"
        out.append((call.function.name, arguments))
    return out


def well_formed(final) -> None:
    """An answer under tool_choice auto: text, or calls of offered tools with valid
    arguments, except a last call that max_tokens cut short (it keeps what was written)."""
    calls = final.message.tool_calls or []
    if final.finish_reason == "length" and calls:
        assert calls[-1].function.name in ("get_weather", "get_time")
        calls = calls[:-1]
    elif calls:
        assert final.finish_reason == "tool_calls"
    else:
        assert isinstance(final.message.content, str)
        assert final.finish_reason in ("stop", "length")
    _checked(calls)


def streamed(client, **args) -> tuple[list[tuple[str, str]], str, str | None, int]:
    """A streamed chat answer assembled by index as the client's users do: (calls as
    (name, arguments text), content, finish_reason, most chunks any one call came in)."""
    assembled: dict[int, dict] = {}
    content, reason = [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            if d.index not in assembled:  # its first delta: id, type, name, arguments ""
                assert d.id and d.type == "function" and d.function.name, d
                assert d.function.arguments == "", d
                assembled[d.index] = {"name": "", "arguments": "", "chunks": set()}
            entry = assembled[d.index]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
            entry["chunks"].add(id(chunk))
        reason = chunk.choices[0].finish_reason or reason
    calls = [(e["name"], e["arguments"]) for e in assembled.values()]
    return calls, "".join(content), reason, max((len(e["chunks"]) for e in assembled.values()),
                                                default=0)


def _raw(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_parse_and_stream_the_same(client, choice):
    args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=choice,
                temperature=0, max_tokens=80, parallel_tool_calls=False)
    r = client.chat.completions.create(**args)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = _checked(r.choices[0].message.tool_calls)
    assert len(calls) == 1
    if isinstance(choice, dict):
        assert calls[0][0] == "get_time"
    # Streamed: the deltas give the same call, its arguments' text exactly, in several chunks
    # (the name first, then the arguments as they are written).
    assembled, content, reason, chunks = streamed(client, **args)
    assert (assembled, content, reason) == (_raw(r.choices[0].message.tool_calls), "",
                                            "tool_calls")
    assert chunks > 2
    # Calls only: content null from the first chunk on, as OpenAI's stream and the message.
    with client.chat.completions.create(**args, stream=True) as stream:
        opening = next(iter(stream)).choices[0].delta
    assert opening.role == "assistant" and opening.content is None


def test_a_stop_string_inside_the_arguments_is_no_tool_calls_finish(client):
    """A call whose arguments a stop string cut is unfinished: finish_reason stop, not
    tool_calls, whose clients would run it (streamed or not, it keeps what was written)."""
    args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=80)
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    city = json.loads(whole.function.arguments)["city"]
    cut = client.chat.completions.create(**args, stop=[city]).choices[0]
    written = whole.function.arguments[:whole.function.arguments.index(city)]
    assert cut.finish_reason == "stop"
    assert _raw(cut.message.tool_calls) == [("get_weather", written)]
    assembled, content, reason, _ = streamed(client, **args, stop=[city])
    assert (assembled, content, reason) == ([("get_weather", written)], "", "stop")


def _literal(text: str) -> str:
    """A regex matching exactly this text (llguidance's syntax)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.+*?()|[]{}^$" else c
                   for c in text)


def _hermes(*calls: tuple[str, dict]) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                     for n, a in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_all_or_only_the_first_and_unoffered_names_stay_text(client, stream):
    """The answer's text forced (guided_regex) to two calls under tool_choice auto: both come
    back, or with parallel_tool_calls false only the first; a call of a tool not offered is
    text."""
    def answer(text: str, **more) -> tuple[list[tuple[str, str]], str, str | None]:
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Time in UTC and CET?"}],
                    tools=[WEATHER, TIME], temperature=0, max_tokens=80,
                    extra_body={"guided_regex": _literal(text)}, **more)
        if stream:
            return streamed(client, **args)[:3]
        choice = client.chat.completions.create(**args).choices[0]
        return _raw(choice.message.tool_calls), choice.message.content or "", \
            choice.finish_reason

    utc, cet = ("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})
    both = [(n, json.dumps(a)) for n, a in (utc, cet)]
    assert answer(_hermes(utc, cet)) == (both, "", "tool_calls")
    assert answer(_hermes(utc, cet), parallel_tool_calls=False) == (both[:1], "", "tool_calls")
    rocket = _hermes(("launch_rocket", {}))
    assert answer(rocket) == ([], rocket, "stop")


def test_two_turns_call_result_answer(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=60, parallel_tool_calls=False)
    message = first.choices[0].message
    (name, arguments), = _checked(message.tool_calls)
    followup = [*ASK_WEATHER, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                 "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=MODEL, messages=followup, tools=[WEATHER],
                                            temperature=0, max_tokens=40)
    final = answer.choices[0]
    well_formed(final)  # with tool_choice auto the model may answer or call again
    print(f"\n  call {name}({arguments}) -> answer {final.message.content!r}")


def test_tool_fields_that_do_not_fit_are_400(client):
    for extra, param in [({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": {
                             "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                         ({"functions": [WEATHER["function"]]}, "functions"),
                         ({"parallel_tool_calls": False}, "parallel_tool_calls"),
                         ({"tools": [{"type": "function", "function": {
                             "name": "count", "parameters": {"type": "integer"}}}]}, "tools")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5,
                                           extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": HI, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": HI, "functions": [TIME["function"]]}, "functions"),
    ("/v1/chat/completions", {"messages": HI, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "input_audio"),
])
def test_what_surge_does_not_implement_is_a_400_naming_it(server, path, body, field):
    code, payload = server.post(path, {**body, "max_tokens": 2})
    assert code == 400, payload
    assert field in payload["error"]["message"], payload


def test_best_of_equal_to_n_and_a_message_name_are_taken(server):
    for n in (1, 2):
        code, payload = server.post("/v1/completions", {"prompt": "hi", "n": n, "best_of": n,
                                                        "max_tokens": 2})
        assert code == 200 and len(payload["choices"]) == n, payload
    code, payload = server.post("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "name": "ada", "content": [{"type": "text", "text": "hi"}]}]})
    assert code == 200, payload
