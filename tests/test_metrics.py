"""GET /metrics: Prometheus text from every process, moving as traffic flows."""

from __future__ import annotations

import json
import time
import urllib.request

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


@pytest.mark.slow
def test_metrics_parse_and_move_with_traffic():
    server = ServerProcess().wait_ready()
    try:
        before = _samples(server.url)
        prompt = "The same long system prompt for everyone. " * 8
        for _ in range(3):
            body = json.dumps({"prompt": prompt, "max_tokens": 5, "temperature": 0}).encode()
            req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req).read()
        time.sleep(2.5)  # the scheduler exports its figures about once a second
        after = _samples(server.url)
    finally:
        assert server.stop() == 0
    ok = {"endpoint": "/v1/completions", "status": "200"}
    assert _value(after, "surge_requests_total", **ok) - \
        _value(before, "surge_requests_total", **ok) == 3
    assert _value(after, "surge_time_to_first_token_seconds_count") == 3
    assert _value(after, "surge_request_latency_seconds_count") == 3
    assert _value(after, "surge_generated_tokens_total") == 15
    assert _value(after, "surge_queue_wait_seconds_count") == 3
    # From the scheduler and the worker processes:
    assert _value(after, "surge_kv_cache_blocks") == 364
    assert _value(after, "surge_kv_cache_blocks_used") == 0
    assert _value(after, "surge_prefix_cache_hit_tokens_total") > 0
    assert _value(after, "surge_worker_step_seconds_count", rank="0") > \
        _value(before, "surge_worker_step_seconds_count", rank="0")
    assert _value(after, "surge_batch_size_count") > 0
    assert _value(after, "surge_inter_token_latency_seconds_count") > 0


def test_dashboard_names_only_metrics_that_exist():
    import re
    from pathlib import Path

    import surge.metrics as m

    root = Path(__file__).parent.parent
    dashboard = json.loads((root / "ops" / "grafana-dashboard.json").read_text())
    used = set(re.findall(r"surge_[a-z_]+", json.dumps(dashboard)))
    defined = {c._name for c in vars(m).values() if hasattr(c, "_name")}
    for name in used:
        base = re.sub(r"_(total|bucket|count|sum)$", "", name)
        assert base in defined or name in defined, name
