"""Tool calling in the Llama 3 and Mistral formats against the real server: the bundled model
served with a tokenizer folder whose chat template is in that family's form; required calls
come out in the family's format, parse, stream the same, and go back through the template."""

from __future__ import annotations

import json

import openai
import pytest

from server.tokenizer import Tokenizer
from surge.model_files import resolve_model
from tests.chat_templates import LLAMA3, MISTRAL
from tests.server import ServerProcess
from tests.test_structured import (
    ASK_WEATHER,
    MODEL,
    TIME,
    WEATHER,
    _checked,
    streamed,
    well_formed,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llama3", "mistral"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = Tokenizer(resolve_model("default")).hf
    hf.chat_template = {"llama3": LLAMA3, "mistral": MISTRAL}[request.param]
    hf.save_pretrained(folder)
    srv = ServerProcess("--tokenizer", str(folder)).wait_ready()
    yield request.param, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none",
                                       max_retries=0)
    assert srv.stop() == 0, srv.output()


def test_required_calls_in_the_familys_format_parse_stream_and_go_back(family):
    name, client = family
    args = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                tool_choice="required", temperature=0, max_tokens=120)
    r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = _checked(choice.message.tool_calls)
    # Streamed, the calls come as they are written (several chunks each), text for text.
    assembled, content, reason, chunks = streamed(client, **args)
    assert calls and (assembled, content, reason) == (
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], "",
        "tool_calls")
    assert chunks > 2
    if name == "mistral":  # its template refuses other ids in the next turn
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    followup = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
                *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True})}
                  for c in choice.message.tool_calls)]
    answer = client.chat.completions.create(model=MODEL, messages=followup, tools=[WEATHER, TIME],
                                            temperature=0, max_tokens=30)
    final = answer.choices[0]
    well_formed(final)  # with tool_choice auto the model may answer (even with nothing) or call
    print(f"\n  {name}: {calls} -> {final.message.content!r} ({final.finish_reason})")


def test_a_named_function_is_the_only_call(family):
    _, client = family
    r = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=0,
        max_tokens=80, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [n for n, _ in _checked(r.choices[0].message.tool_calls)] == ["get_time"]
