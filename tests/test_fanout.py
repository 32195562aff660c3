"""One request's fan-out (prompts x n): bounded by max_choices, sent to the scheduler in one
message and admitted as a unit, against `surge serve`."""

from __future__ import annotations

import time

import pytest

from tests.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # 140 requests a minute: one request of 128 choices leaves 12 (refilling 2.3 a second).
    config = tmp_path_factory.mktemp("fanout") / "surge.toml"
    config.write_text("[tenants.default]\nrequests_per_min = 140\n")
    server = ServerProcess("--config", str(config)).wait_ready()
    yield server
    assert server.stop() == 0, server.output()


@pytest.mark.slow
def test_fanout_is_bounded_sent_as_one_message_and_admitted_as_a_unit(server):
    # The 40 KB body of the issue: 5,000 one-token prompts, n=16 (80,000 engine requests).
    flood = {"prompt": [[t] for t in range(1, 5001)], "n": 16, "max_tokens": 1}
    started = time.monotonic()
    status, body = server.post("/v1/completions", flood)
    print(f"\n  5,000 prompts x n=16 answered {status} in {time.monotonic() - started:.3f}s")
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "80000 choices" in body["error"]["message"]
    assert "max_choices" in body["error"]["message"]
    # Many prompts, admitted whole: 32 prompts x n=4.
    status, body = server.post("/v1/completions", {
        "prompt": [[t, t + 1] for t in range(5, 37)], "n": 4, "max_tokens": 1, "temperature": 0})
    assert status == 200 and len(body["choices"]) == 128
    assert sorted(c["index"] for c in body["choices"]) == list(range(128))
    # 128 more than the quota's 12 left: refused whole, taking none of it...
    status, body = server.post("/v1/completions",
                               {"prompt": [[5, 6]] * 32, "n": 4, "max_tokens": 1})
    assert status == 429 and "requests_per_min" in body["error"]["message"], body
    assert body["error"]["code"] == "rate_limit_exceeded"  # as OpenAI's: clients read it
    # ...so 12 choices still fit.
    status, body = server.post("/v1/completions", {"prompt": [[5, 6]] * 6, "n": 2, "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == 12, body
