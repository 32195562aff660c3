"""GET /metrics: Prometheus text from every process, moving as traffic flows."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ServerProcess


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{url}/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_for(url: str, check, timeout: float = 30.0) -> dict:
    """Samples once check(samples) holds (the scheduler exports about once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = _samples(url)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def _complete(url: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()


def _stream_and_leave(url: str, chunks: int) -> None:
    """A streamed request whose client goes away after `chunks` pieces."""
    body = json.dumps({"prompt": "Count to one hundred:", "max_tokens": 200, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        seen = 0
        for line in r:
            seen += line.startswith(b"data: {")
            if seen == chunks:
                break


M = {"model_name": "SmolLM2-135M-Instruct"}
E = {**M, "replica": "0"}  # a scheduler's series of its own engine name its replica


@pytest.mark.slow
def test_metrics_parse_and_move_with_traffic():
    server = ServerProcess("--metrics-compat", "vllm").wait_ready()
    try:
        # Before any request every series is there, at 0 (no "No data" panels).
        default_queue = {**E, "priority": "0", "tenant": "default"}
        before = _wait_for(server.url, lambda s: ("surge_waiting_requests",
                                                   tuple(sorted(default_queue.items()))) in s)
        zero = [("surge_running_requests", E),
                ("surge_waiting_requests", default_queue),
                ("surge_rejected_requests_total", {"tenant": "default",
                                                   "limit": "max_queued_requests"}),
                ("surge_kv_cache_usage_ratio", E), ("surge_generated_tokens_total", E),
                ("surge_prompt_tokens_total", M), ("surge_preemptions_total", E),
                ("surge_time_to_first_token_seconds_count", M),
                *(("surge_request_success_total", {**M, "finished_reason": reason})
                  for reason in ("stop", "length", "abort", "error")),
                ("vllm:num_requests_waiting", M), ("vllm:kv_cache_usage_perc", M)]
        for name, labels in zero:
            assert before.get((name, tuple(sorted(labels.items())))) == 0.0, (name, labels)
        prompt = "The same long system prompt for everyone. " * 8
        for _ in range(3):
            _complete(server.url, prompt, 5)
        _stream_and_leave(server.url, chunks=3)
        after = _wait_for(server.url, lambda s: (
            _value(s, "surge_request_success_total", **M, finished_reason="abort") == 1
            and _value(s, "surge_generated_tokens_total", **E) >= 15 + 3
            and _value(s, "surge_running_requests", **E) == 0
            and _value(s, "surge_queue_wait_seconds_count", **E) == 4))
    finally:
        assert server.stop() == 0
    ok = {"endpoint": "/v1/completions", "status": "200"}
    # (The stream whose client left is counted once aiohttp notices.)
    assert _value(after, "surge_requests_total", **ok) - \
        _value(before, "surge_requests_total", **ok) >= 3
    assert _value(after, "surge_time_to_first_token_seconds_count", **M) == 4
    assert _value(after, "surge_request_latency_seconds_count", **M) == 3
    assert _value(after, "surge_request_success_total", **M, finished_reason="length") == 3
    assert _value(after, "surge_request_success_total", **M, finished_reason="abort") == 1
    # The cancelled request's tokens count too: at least the 3 pieces its client read.
    assert _value(after, "surge_generated_tokens_total", **E) >= 15 + 3
    assert _value(after, "surge_queue_wait_seconds_count", **E) == 4
    # From the scheduler and the worker processes:
    assert _value(after, "surge_kv_cache_blocks", **E) == 364
    assert _value(after, "surge_kv_cache_blocks_used", **E) == 0
    assert _value(after, "surge_kv_cache_usage_ratio", **E) == 0
    assert _value(after, "surge_prefix_cache_hit_tokens_total", **E) > 0
    assert _value(after, "surge_worker_step_seconds_count", rank="0") > \
        _value(before, "surge_worker_step_seconds_count", rank="0")
    assert _value(after, "surge_batch_size_count") > 0
    assert _value(after, "surge_inter_token_latency_seconds_count", **M) > 0
    # --metrics-compat vllm: the same figures under vLLM's names, its labels only.
    from surge.metrics import VLLM_NAMES

    for ours, theirs in [("surge_request_success_total", "vllm:request_success_total"),
                         ("surge_generated_tokens_total", "vllm:generation_tokens_total"),
                         ("surge_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
                         ("surge_time_to_first_token_seconds_count",
                          "vllm:time_to_first_token_seconds_count")]:
        assert {tuple(p for p in k[1] if p[0] != "replica"): v
                for k, v in after.items() if k[0] == ours} == \
            {k[1]: v for k, v in after.items() if k[0] == theirs}, theirs
    assert _value(after, "vllm:num_requests_waiting", **M) == 0
    exported = {name.split("_total")[0] for name, _ in after if name.startswith("vllm:")}
    assert set(VLLM_NAMES.values()) <= {re.sub(r"_(bucket|count|sum)$", "", n)
                                        for n in exported}


def test_readme_maps_every_vllm_name():
    from surge.metrics import VLLM_NAMES

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(surge_[a-z_]+)` \| `(vllm:[a-z0-9_]+)` \|", readme, re.M))
    assert rows == VLLM_NAMES


def test_dashboard_names_only_metrics_that_exist():
    import surge.metrics as m

    root = Path(__file__).parent.parent
    dashboard = json.loads((root / "ops" / "grafana-dashboard.json").read_text())
    used = set(re.findall(r"surge_[a-z_]+", json.dumps(dashboard)))
    defined = {c._name for c in vars(m).values() if hasattr(c, "_name")}
    for name in used:
        base = re.sub(r"_(total|bucket|count|sum)$", "", name)
        assert base in defined or name in defined, name
    # Every query is narrowed by the job and instance variables (several servers, one board),
    # and prompt and output tokens have panels of their own (their scales differ).
    assert {"job", "instance", "model_name"} <= {v["name"] for v in
                                                 dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert all('job=~"$job"' in e and 'instance=~"$instance"' in e for e in exprs), exprs
        assert not ({"surge_prompt_tokens_total", "surge_generated_tokens_total"}
                    <= set(re.findall(r"surge_[a-z_]+", " ".join(exprs)))), panel["title"]
