"""The Files + Batches API end to end, through the official openai client: output and error
files, bad lines and uploads, files that fail the batch, tenants, cancel, expiry, listing,
metrics against /stats, signed webhooks (each delivery verified) with retries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
import urllib.request

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.batch_runner import OUTCOMES
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
    receiver = Receiver(SECRET, failures=2)
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
[tenants.metered]
tokens_per_min = 80
""")
    keys = KeyStore(str(root / "keys.json"))
    return {"root": root, "keys": {name: keys.add(name)[1] for name in ("alpha", "beta",
                                                                         "metered", "admin")}}


@pytest.fixture(scope="module")
def server(env):
    root = env["root"]
    server = ServerProcess("--config", str(root / "surge.toml"), "--api-keys-file",
                           str(root / "keys.json"), "--state-dir", str(root / "state"),
                           "--batch-max-in-flight", "3", "--batch-max-file-bytes", "65536",
                           "--batch-max-lines", "30", "--max-body-bytes", "32768",
                           "--webhook-backoff-s", "0.2",
                           env={"XDG_RUNTIME_DIR": str(root)}).wait_ready()
    yield server
    server.stop()


def client(server: ServerProcess, env: dict, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=env["keys"][tenant],
                         max_retries=0)


def admin_get(server: ServerProcess, env: dict, path: str) -> str:
    request = urllib.request.Request(f"{server.url}{path}", headers={
        "Authorization": f"Bearer {env['keys']['admin']}"})
    with urllib.request.urlopen(request) as r:
        return r.read().decode()


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
           chat_line("refused", "hi", n=100000), chat_line("streamed", "hi", stream=True)]
    batch = wait_done(c, run_batch(c, good[:3] + bad + good[3:],
                                   metadata={"purpose": "test"}).id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 10
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 5)
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
    # usage: the answered lines' usages summed, as OpenAI's batch object has it.
    usages = [x["response"]["body"]["usage"] for x in out]
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    # The lines share the chat template's opening: the prefix cache holds it after the first.
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert batch.usage.input_tokens_details.cached_tokens == cached > 0
    assert batch.usage.output_tokens_details.reasoning_tokens == 0
    errors = {x["custom_id"]: x for x in lines_of(c, batch.error_file_id)}
    assert set(errors) == {None, "wrong-url", "unknown-field", "refused", "streamed"}
    assert errors[None]["error"]["code"] == "invalid_json"
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    for name, param in (("unknown-field", "frobnicate"), ("refused", "n"),
                        ("streamed", "stream")):
        response = errors[name]["response"]
        assert response["status_code"] == 400, response
        assert param in response["body"]["error"]["message"] or \
            response["body"]["error"]["param"] == param

    # The webhook: each attempt signed (the receiver verifies it), answered 500 twice, then
    # delivered; one stable event id.
    deliveries = receiver.wait_for(1)
    assert [d[2] for d in deliveries] == [500, 500, 200]
    assert len({d[1]["webhook-id"] for d in deliveries}) == 1
    assert receiver.events == [("batch.completed", batch.id, s) for s in (500, 500, 200)]
    with pytest.raises(openai.InvalidWebhookSignatureError):
        c.webhooks.unwrap(deliveries[-1][0], deliveries[-1][1], secret="whsec_" + "QUJD" * 8)


def test_files_and_a_batchs_output_take_openais_expiry(server, env):
    c = client(server, env, "alpha")
    retention = 30 * 86400  # the default --batch-retention-s
    kept = c.files.create(file=("in.jsonl", jsonl([chat_line("e", "Hi.")])), purpose="batch")
    assert kept.expires_at == kept.created_at + retention  # as OpenAI's batch files
    short = c.files.create(file=("in.jsonl", jsonl([chat_line("e", "Hi.")])), purpose="batch",
                           expires_after={"anchor": "created_at", "seconds": 3600})
    assert short.expires_at == short.created_at + 3600
    assert c.files.retrieve(short.id).expires_at == short.expires_at
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_used", "seconds": 3600},
                {"anchor": "created_at"}):
        with pytest.raises(openai.BadRequestError, match="expires_after") as e:
            c.files.create(file=("in.jsonl", jsonl([chat_line("e", "Hi.")])), purpose="batch",
                           expires_after=bad)  # type: ignore[arg-type]
        assert e.value.body["param"] == "expires_after"
    batch = wait_done(c, c.batches.create(
        input_file_id=short.id, endpoint=CHAT, completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200}).id)
    output = c.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    with pytest.raises(openai.BadRequestError, match="output_expires_after"):
        c.batches.create(input_file_id=short.id, endpoint=CHAT, completion_window="24h",
                         output_expires_after={"anchor": "created_at", "seconds": 10**8})


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
    with pytest.raises(openai.BadRequestError, match="at most 255"):
        c.files.create(file=("x" * 300 + ".jsonl", jsonl([chat_line("a", "hi")])),
                       purpose="batch")
    # Two files in one form: refused, not the first silently replaced by the second.
    two = httpx.post(f"{server.url}/v1/files", data={"purpose": "batch"},
                     headers={"Authorization": f"Bearer {env['keys']['alpha']}"},
                     files=[("file", ("a.jsonl", jsonl([chat_line("a", "hi")]))),
                            ("file", ("b.jsonl", jsonl([chat_line("b", "hi")])))])
    assert two.status_code == 400 and two.json()["error"]["param"] == "file", two.text
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's bound on metadata keys
        c.batches.create(input_file_id=c.files.create(
            file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch").id,
            endpoint=CHAT, completion_window="24h", metadata={"k" * 65: "v"})
    assert e.value.body["param"] == "metadata"  # type: ignore[index]
    upload = c.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    for kwargs, param in (({"endpoint": "/v1/embeddings"}, "endpoint"),
                          ({"completion_window": "tomorrow"}, "completion_window"),
                          ({"input_file_id": "file-nope"}, "input_file_id")):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            c.batches.create(**{"input_file_id": upload.id, "endpoint": CHAT,
                                "completion_window": "24h", **kwargs})  # type: ignore[arg-type]
        assert e.value.body["param"] == param  # type: ignore[index]


def test_a_file_that_begins_with_a_byte_order_mark_runs(server, env):
    c = client(server, env, "alpha")
    upload = c.files.create(file=("in.jsonl", b"\xef\xbb\xbf" + jsonl([chat_line("a", "hi")])),
                            purpose="batch")
    batch = wait_done(c, c.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                          completion_window="24h").id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 0), batch
    assert lines_of(c, batch.output_file_id)[0]["custom_id"] == "a"


def test_a_line_over_the_body_limit_is_refused_as_its_endpoint_refuses_it(server, env):
    """A line whose body the endpoint would refuse for its size (413) is refused the same
    way, before it is decoded or tokenized; the other lines still run."""
    c = client(server, env, "alpha")
    batch = wait_done(c, run_batch(c, [chat_line("big", "x" * 40000), chat_line("ok", "hi")]).id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    big = lines_of(c, batch.error_file_id)[0]
    assert big["custom_id"] == "big" and big["response"]["status_code"] == 413
    assert "32768" in big["response"]["body"]["error"]["message"]


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


def test_request_counts_move_as_each_line_ends(server, env):
    """A short line's end shows in request_counts while the long ones still run (all three
    were handed out at once: --batch-max-in-flight 3)."""
    c = client(server, env, "beta")
    lines = [chat_line("short", "Hi.", max_tokens=1),
             *(chat_line(f"long{i}", "Tell a story.", max_tokens=120, ignore_eos=True)
               for i in range(2))]
    batch = run_batch(c, lines)
    seen = []
    while batch.status not in ("completed", "failed"):
        batch = c.batches.retrieve(batch.id)
        seen.append((batch.status, batch.request_counts.completed))
        time.sleep(0.05)
    assert ("in_progress", 1) in seen, seen
    assert batch.request_counts.completed == 3, batch


def test_cancel_and_expiry_split_lines_between_the_files(server, env, receiver):
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
        receiver.wait_event(f"batch.{end}", batch_id)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(cancelled.id)


def test_a_file_that_cannot_run_fails_the_batch(server, env, receiver):
    c = client(server, env, "alpha")
    duplicated = [chat_line("a", "hi"), chat_line("b", "hi"), chat_line("a", "again")]
    too_long = [chat_line(f"l{i}", "hi") for i in range(31)]  # --batch-max-lines 30
    for lines, code, line, needle in ((duplicated, "duplicate_custom_id", 3, "used by line 1"),
                                      (too_long, "too_many_lines", 31, "more than 30 lines")):
        batch = wait_done(c, run_batch(c, lines).id)
        assert batch.status == "failed" and batch.failed_at is not None, batch
        assert batch.errors is not None and batch.errors.data is not None
        [error] = batch.errors.data
        assert (error.code, error.line) == (code, line) and needle in error.message, error
        assert batch.output_file_id is None and batch.error_file_id is None
        receiver.wait_event("batch.failed", batch.id)
    assert all(status != 400 for _, _, status in receiver.deliveries)  # every one verified


def test_batch_lines_spend_the_tenants_quota(server, env):
    """Lines run as their tenant: three at once (--batch-max-in-flight 3) of about 31 prompt
    tokens each do not fit its tokens_per_min bucket of 80, so the third is refused with 429,
    waits its Retry-After and runs instead of failing."""
    c = client(server, env, "metered")
    lines = [chat_line(f"m{i}", "hi", max_tokens=1) for i in range(3)]
    batch = wait_done(c, run_batch(c, lines).id)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    assert batch.usage is not None and batch.usage.input_tokens > 80
    refused = ("surge_rejected_requests_total", (("limit", "tokens_per_min"),
                                                 ("tenant", "metered")))
    served = ("surge_tenant_served_tokens_total", (("tenant", "metered"),))
    deadline = time.monotonic() + 10
    while True:  # the scheduler exports its counters a moment later
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in
                   text_string_to_metric_families(admin_get(server, env, "/metrics"))
                   for s in family.samples}
        if samples.get(refused, 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # Nothing else ran as this tenant: the refusal and the tokens are its lines'.
    assert samples.get(refused, 0) >= 1, "no line was refused: the bucket was not spent"
    assert samples[served] > 0


def test_list_pages_and_stats(server, env):
    c = client(server, env, "alpha")
    seen = [b.id for b in c.batches.list(limit=1)]  # the client follows the pages
    assert len(seen) == len(set(seen)) >= 4
    assert seen == [b.id for b in c.batches.list(limit=100)]
    files = list(c.files.list())
    assert {"batch", "batch_output"} <= {f.purpose for f in files}
    assert [f.created_at for f in files] == sorted((f.created_at for f in files), reverse=True)
    assert [f.id for f in c.files.list(limit=1)] == [f.id for f in files]  # page by page
    assert [f.id for f in c.files.list(limit=2, order="asc")] == [f.id for f in files][::-1]
    outputs = [f.id for f in files if f.purpose == "batch_output"]
    assert [f.id for f in c.files.list(purpose="batch_output", limit=1)] == outputs
    page = c.files.list(limit=1, after=files[0].id)
    assert [f.id for f in page.data] == [files[1].id] and page.has_more
    for call, param in ((lambda: c.files.list(order="sideways"), "order"),
                        (lambda: c.files.list(limit=0), "limit"),
                        (lambda: c.files.list(after="file-nonesuch"), "after"),
                        (lambda: c.batches.list(after="batch_nonesuch"), "after"),
                        (lambda: c.batches.list(after=files[0].id), "after")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param  # type: ignore[index]
    stats = json.loads(admin_get(server, env, "/stats"))["batches"]
    assert stats["by_state"]["completed"] >= 2 and stats["by_state"]["failed"] == 2
    text = admin_get(server, env, "/metrics")
    assert 'surge_batches{state="completed"}' in text
    # Each delivery result's series from the start, never-seen ones at 0 (no receiver here
    # gives up).
    assert 'surge_webhook_deliveries_total{result="given_up"} 0.0' in text
    # The counter (lines ended here) and /stats (lines kept) agree outcome by outcome; every
    # outcome happened in this module's batches.
    counted = {s.labels["outcome"]: int(s.value) for family in
               text_string_to_metric_families(text) for s in family.samples
               if s.name == "surge_batch_lines_total"}
    assert set(counted) == set(OUTCOMES) and min(counted.values()) > 0, counted
    assert counted == {k: stats["lines_by_outcome"].get(k, 0) for k in OUTCOMES}
    assert stats["lines_done"] == counted["done"] and stats["lines_pending"] == 0
    assert stats["lines_failed"] == sum(counted.values()) - counted["done"]
    assert os.path.exists(env["root"] / "state" / "batches.sqlite3")


def test_webhook_settings_change_live_and_the_secret_is_never_shown(server, env):
    """`surge admin set` gives a tenant receivers and a secret that its next batch's event is
    signed with; get, set and the server's log show only that one is set, and --persist
    writes the secret itself."""
    secret = "whsec_" + "bGl2ZS1zZWNyZXQtZm9yLXRoZS1iYXRjaC10ZXN0cyE="  # 32 bytes
    receiver = Receiver(secret)

    def admin(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "surge.cli", "admin", "--port",
                               str(server.port), *args], capture_output=True, text=True,
                              env={**os.environ, "XDG_RUNTIME_DIR": str(env["root"])},
                              timeout=60)

    try:
        bad = admin("set", "tenants.beta.webhook_secret=whsec_%%")
        assert bad.returncode == 1 and "webhook_secret" in bad.stderr
        done = admin("set", f"tenants.beta.webhook_urls={receiver.url}",
                     f"tenants.beta.webhook_secret={secret}", "--persist")
        assert done.returncode == 0, done.stderr
        # --persist writes the secret itself, not what the reply shows of it.
        with open(env["root"] / "surge.toml", "rb") as f:
            assert tomllib.load(f)["tenants"]["beta"]["webhook_secret"] == secret
        got = admin("get", "--json")
        values = json.loads(got.stdout)["values"]
        assert values["tenants.beta.webhook_secret"] == "<redacted>"
        assert values["tenants.alpha.webhook_secret"] == "<redacted>"
        assert values["tenants.beta.webhook_urls"] == receiver.url
        beta = client(server, env, "beta")
        batch = wait_done(beta, run_batch(beta, [chat_line("b", "hi")]).id)
        assert batch.status == "completed"
        receiver.wait_event("batch.completed", batch.id)
        for text in (done.stdout, done.stderr, got.stdout, server.output()):
            assert secret not in text and SECRET not in text
        assert "<redacted>" in done.stdout
    finally:
        admin("set", "tenants.beta.webhook_urls=", "tenants.beta.webhook_secret=", "--persist")
        receiver.close()
