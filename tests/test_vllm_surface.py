"""What scripts written for vLLM call first: /tokenize, /detokenize, /version, the model's root
in /v1/models, --api-key, --tokenizer and `surge export-tokenizer`; and --log-json output that
is JSON lines only, against the real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

import surge
from tests.server import ServerProcess

pytestmark = pytest.mark.slow
KEY = "vllm-style-single-key"
# A chat template of our own in the --tokenizer folder, so a test can tell it is the one used.
TEMPLATE = ("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}ANSWER:{% endif %}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`surge export-tokenizer DIR`: the bundled model's tokenizer as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("exported")
    out = subprocess.run([sys.executable, "-m", "surge.cli", "export-tokenizer", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    return folder


def test_exported_tokenizer_counts_as_surge_does(exported, tokenizer):
    """What guidellm or `vllm bench serve --tokenizer DIR` load: the same ids, the same chat
    text, the same end-of-sequence token."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(exported)
    for text in ["Hello world, again", "北京 🐱 naïve café", "  spaces\n\ttabs"]:
        assert theirs(text, add_special_tokens=False).input_ids == tokenizer.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        tokenizer.hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert theirs.eos_token_id == tokenizer.hf.eos_token_id == 2


@pytest.fixture(scope="module")
def server(tmp_path_factory, exported):
    folder = tmp_path_factory.mktemp("tokenizer")
    for path in exported.iterdir():
        shutil.copy(path, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    srv = ServerProcess("--api-key", KEY, "--tokenizer", str(folder), "--log-json").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


def _call(server, path: str, body: dict | None = None, key: str | None = KEY
          ) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_tokenize_a_prompt_and_a_chat(server, tokenizer):
    status, out = _call(server, "/tokenize", {"prompt": "Hello world, again"})
    assert status == 200
    assert out["tokens"] == tokenizer.encode("Hello world, again")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 8192
    assert out["token_strs"] is None
    _, strs = _call(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert "".join(strs["token_strs"]).replace("Ġ", " ") == "Hello world"
    chat = [{"role": "user", "content": "hi"}]
    _, opened = _call(server, "/tokenize", {"messages": chat})
    # --tokenizer's own template, with and without the generation prompt:
    assert opened["tokens"] == tokenizer.encode("<<hi>>ANSWER:")
    _, closed = _call(server, "/tokenize", {"messages": chat, "add_generation_prompt": False})
    assert closed["tokens"] == tokenizer.encode("<<hi>>")


def test_detokenize_round_trip(server, tokenizer):
    text = "Paris is the capital of France. 北京 🐱"
    status, out = _call(server, "/detokenize", {"tokens": tokenizer.encode(text),
                                                "model": "SmolLM2-135M-Instruct"})
    assert status == 200 and out == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400,
     "prompt"),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_bodies_get_openai_errors(server, path, body, status, param):
    code, out = _call(server, path, body)
    assert code == status, out
    assert out["error"]["param"] == param and out["error"]["message"], out


def test_version_and_model_root(server, model_files):
    assert _call(server, "/version", key=None) == (200, {"version": surge.__version__})
    status, models = _call(server, "/v1/models")
    assert status == 200
    assert models["data"][0]["root"] == model_files.path


def test_single_api_key(server):
    assert _call(server, "/v1/models", key=None)[0] == 401
    assert _call(server, "/v1/models", key=KEY + "x")[0] == 401
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is",
                                       max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3


def test_json_log_is_json_lines_only(server):
    """Last in this file: it stops the server to read everything it wrote."""
    _call(server, "/v1/models", key=None)  # a 401, logged too
    assert server.stop() == 0
    records = [json.loads(line) for line in server.output().splitlines()]
    ready = [r for r in records if r.get("event") == "ready"]
    assert len(ready) == 1 and ready[0]["url"] == server.url
    assert ready[0]["msg"].startswith("surge ready on") and ready[0]["level"] == "info"
    assert {"supervisor", "frontend"} <= {r["process"] for r in records}
    assert any(r["logger"] == "surge.access" and r.get("status") == 401 for r in records)
