"""The Files + Batches API end to end, through the official openai client: output and error
files, bad lines and uploads, tenants, cancel, expiry, listing, signed webhooks with retries."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import openai
import pytest

from surge.keys import KeyStore
from tests.server import ServerProcess
from tests.webhook_receiver import Receiver

SECRET = "whsec_" + "c2VjcmV0LWZvci10aGUtYmF0Y2gtdGVzdHMtMTIzNDU2"  # base64 of 32 bytes
CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, text: str, **extra: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": text}], "max_tokens": 4,
                     "temperature": 0, **extra}}


def jsonl(lines: list[dict | str]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def receiver():
    receiver = Receiver(failures=2)
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory, receiver):
    root = tmp_path_factory.mktemp("batch")
    (root / "surge.toml").write_text(f"""
[tenants.alpha]
webhook_urls = "{receiver.url}"
webhook_secret = "{SECRET}"
webhook_from_metadata = true
""")
    keys = KeyStore(str(root / "keys.json"))
    return {"root": root, "keys": {name: keys.add(name)[1] for name in ("alpha", "beta",
                                                                         "admin")}}


@pytest.fixture(scope="module")
def server(env):
    root = env["root"]
    server = ServerProcess("--config", str(root / "surge.toml"), "--api-keys-file",
                           str(root / "keys.json"), "--state-dir", str(root / "state"),
                           "--batch-max-in-flight", "3", "--batch-max-file-bytes", "65536",
                           "--webhook-backoff-s", "0.2",
                           env={"XDG_RUNTIME_DIR": str(root)}).wait_ready()
    yield server
    server.stop()


def client(server: ServerProcess, env: dict, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=env["keys"][tenant],
                         max_retries=0)


def wait_done(c: openai.OpenAI, batch_id: str, timeout: float = 120) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} is still {batch.status}")


def lines_of(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in
                                       c.files.content(file_id).text.splitlines()]


def run_batch(c: openai.OpenAI, lines: list[dict | str], **kwargs: object
              ) -> openai.types.Batch:
    upload = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = c.batches.create(**{"input_file_id": upload.id, "endpoint": CHAT,
                                "completion_window": "24h", **kwargs})  # type: ignore[arg-type]
    assert batch.status == "validating" and batch.input_file_id == upload.id
    return batch


def test_batch_answers_each_line_as_the_endpoint_does(server, env, receiver):
    c = client(server, env, "alpha")
    good = [chat_line(f"q{i}", f"Count to {i}.") for i in range(5)]
    bad = ["{not json", {**chat_line("wrong-url", "hi"), "url": "/v1/embeddings"},
           chat_line("unknown-field", "hi", frobnicate=1),
           chat_line("refused", "hi", n=100000), chat_line("streamed", "hi", stream=True),
           chat_line("q0", "a second line with a used custom_id")]
    batch = wait_done(c, run_batch(c, good[:3] + bad + good[3:],
                                   metadata={"purpose": "test"}).id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 11
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 6)
    assert batch.metadata == {"purpose": "test"}
    out = lines_of(c, batch.output_file_id)
    assert sorted(x["custom_id"] for x in out) == [f"q{i}" for i in range(5)]
    for x in out:
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert x["response"]["body"]["object"] == "chat.completion"
    # The same body as a plain request gets the same (greedy) answer.
    direct = c.chat.completions.create(model=None, **{  # type: ignore[arg-type]
        k: v for k, v in good[2]["body"].items()})
    answered = next(x for x in out if x["custom_id"] == "q2")["response"]["body"]
    assert answered["choices"][0]["message"]["content"] == direct.choices[0].message.content
    errors = {x["custom_id"]: x for x in lines_of(c, batch.error_file_id)}
    assert set(errors) == {None, "wrong-url", "unknown-field", "refused", "streamed", "q0"}
    assert errors[None]["error"]["code"] == "invalid_json"
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    assert errors["q0"]["error"]["code"] == "duplicate_custom_id"
    for name, param in (("unknown-field", "frobnicate"), ("refused", "n"),
                        ("streamed", "stream")):
        response = errors[name]["response"]
        assert response["status_code"] == 400, response
        assert param in response["body"]["error"]["message"] or \
            response["body"]["error"]["param"] == param

    # The webhook: signed, answered 500 twice, then delivered; one stable event id.
    deliveries = receiver.wait_for(1)
    assert [d[2] for d in deliveries] == [500, 500, 200]
    assert len({d[1]["webhook-id"] for d in deliveries}) == 1
    event = c.webhooks.unwrap(deliveries[-1][0], deliveries[-1][1], secret=SECRET)
    assert event.type == "batch.completed" and event.data.id == batch.id
    with pytest.raises(openai.InvalidWebhookSignatureError):
        c.webhooks.unwrap(deliveries[-1][0], deliveries[-1][1], secret="whsec_" + "QUJD" * 8)


def test_bad_uploads_are_400(server, env):
    c = client(server, env, "alpha")
    for content, purpose, needle in (
            (jsonl([chat_line("a", "hi")]), "fine-tune", "purpose"),
            (b"just some text\nnot json at all\n", "batch", "JSONL"),
            (b"\xff\xfe\x00binary", "batch", "UTF-8"),
            (jsonl([chat_line("a", "x" * 70000)]), "batch", "larger than")):
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("in.jsonl", content), purpose=purpose)  # type: ignore[arg-type]
        assert needle in e.value.message
    upload = c.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"),
                          ({"completion_window": "tomorrow"}, "completion_window"),
                          ({"input_file_id": "file-nope"}, "input_file_id")):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            c.batches.create(**{"input_file_id": upload.id, "endpoint": CHAT,
                                "completion_window": "24h", **kwargs})  # type: ignore[arg-type]
        assert e.value.body["param"] == param  # type: ignore[index]


def test_tenants_see_only_their_own(server, env):
    alpha, beta = client(server, env, "alpha"), client(server, env, "beta")
    upload = alpha.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])),
                                purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                 completion_window="24h")
    for call in (lambda: beta.files.retrieve(upload.id),
                 lambda: beta.files.content(upload.id),
                 lambda: beta.files.delete(upload.id),
                 lambda: beta.batches.retrieve(batch.id),
                 lambda: beta.batches.cancel(batch.id),
                 lambda: beta.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                             completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in beta.batches.list()]
    assert alpha.files.retrieve(upload.id).id == upload.id
    # A receiver in metadata only where the tenant's config allows it.
    with pytest.raises(openai.BadRequestError) as e:
        beta_file = beta.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])),
                                      purpose="batch")
        beta.batches.create(input_file_id=beta_file.id, endpoint=CHAT, completion_window="24h",
                            metadata={"webhook_url": "http://127.0.0.1:9/x"})
    assert "webhook_from_metadata" in e.value.message
    assert wait_done(alpha, batch.id).status == "completed"


def test_cancel_and_expiry_split_lines_between_the_files(server, env):
    c = client(server, env, "alpha")
    lines = [chat_line(f"c{i}", f"Write a long story number {i}.", max_tokens=48)
             for i in range(24)]
    cancelled = run_batch(c, lines)
    expired = run_batch(c, lines, completion_window="3s")
    time.sleep(1.5)
    assert c.batches.cancel(cancelled.id).status == "cancelling"
    for batch_id, end, code in ((cancelled.id, "cancelled", "batch_cancelled"),
                                (expired.id, "expired", "batch_expired")):
        batch = wait_done(c, batch_id)
        assert batch.status == end
        out = [x["custom_id"] for x in lines_of(c, batch.output_file_id)]
        errors = lines_of(c, batch.error_file_id)
        assert sorted(out + [x["custom_id"] for x in errors]) == sorted(x["custom_id"]
                                                                        for x in lines)
        assert errors and all(x["error"]["code"] == code for x in errors)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(cancelled.id)


def test_list_pages_and_stats(server, env):
    c = client(server, env, "alpha")
    seen = [b.id for b in c.batches.list(limit=1)]  # the client follows the pages
    assert len(seen) == len(set(seen)) >= 4
    assert seen == [b.id for b in c.batches.list(limit=100)]
    files = [f.purpose for f in c.files.list()]
    assert "batch" in files and "batch_output" in files
    assert {f.purpose for f in c.files.list(purpose="batch_output")} == {"batch_output"}
    with pytest.raises(openai.BadRequestError, match="order"):
        c.files.list(order="asc")
    request = urllib.request.Request(f"{server.url}/stats", headers={
        "Authorization": f"Bearer {env['keys']['admin']}"})
    with urllib.request.urlopen(request) as r:
        stats = json.load(r)["batches"]
    assert stats["by_state"]["completed"] >= 2 and stats["lines_done"] >= 6
    with urllib.request.urlopen(urllib.request.Request(f"{server.url}/metrics", headers={
            "Authorization": f"Bearer {env['keys']['admin']}"})) as r:
        text = r.read().decode()
    assert 'surge_batches{state="completed"}' in text
    assert 'surge_batch_lines_total{outcome="done"}' in text
    assert os.path.exists(env["root"] / "state" / "batches.sqlite3")
