"""`surge admin top`: a running server at a glance, refreshed every second, as `top` does."""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any

from msgspec import Struct

from surge.admin import ask_all, histograms, quantile
from surge.runtime import admin_addresses, recorded

_WINDOW_S = 60.0
_LATENCIES = (("TTFT", "surge_time_to_first_token_seconds"),
              ("inter-token", "surge_inter_token_latency_seconds"),
              ("request", "surge_request_latency_seconds"),
              ("queue wait", "surge_queue_wait_seconds"))
_CLEAR = "\x1b[H\x1b[2J"
_W = 34  # the latency table's first column


class Sample(Struct):
    time: float
    stats: dict[str, Any]
    hist: dict[str, list[tuple[float, float]]]


def _since(new: list[tuple[float, float]], old: list[tuple[float, float]]
           ) -> list[tuple[float, float]]:
    """Cumulative buckets of what was observed between two scrapes."""
    before = dict(old)
    return [(le, count - before.get(le, 0.0)) for le, count in new]


def _rate(key: str, last: Sample, prev: Sample | None) -> str:
    if prev is None:
        return "-"
    return f"{(last.stats[key] - prev.stats[key]) / max(last.time - prev.time, 1e-6):.1f}"


def frame(url: str, window: deque[Sample]) -> str:
    """One screen from the samples of the last minute (the newest last)."""
    last, first = window[-1], window[0]
    prev = window[-2] if len(window) > 1 else None
    s, span = last.stats, last.time - first.time
    queried = s["prefix_queried_tokens"] - first.stats["prefix_queried_tokens"]
    hits = s["prefix_hit_tokens"] - first.stats["prefix_hit_tokens"]
    if not queried:  # nothing looked up within the window yet: since start
        queried, hits = s["prefix_queried_tokens"], s["prefix_hit_tokens"]
    used, total = s["kv_blocks_used"], s["kv_blocks_total"]
    title = "latency since the server started" if prev is None else \
        f"latency, last {span:.0f}s"
    lines = [
        f"surge top  {url}  {time.strftime('%Y-%m-%d %H:%M:%S')}  (Ctrl-C quits)",
        f"requests   {s['running']} running   {s['waiting']} waiting   "
        f"{s['queued_tokens']} queued prompt tokens",
        f"tokens/s   {_rate('generated_tokens', last, prev)} generated   "
        f"{_rate('steps', last, prev)} steps/s",
        f"KV cache   {used} / {total} blocks ({used / max(total, 1):.0%})   prefix hit rate "
        f"{hits / queried if queried else 0.0:.1%}   preemptions {s['preemptions']}",
        # Until a second scrape, all there is: what the server saw since it started.
        f"{title:<{_W}}"
        + "  ".join(f"{q:>10}" for q in ("p50", "p95", "p99")),
    ]
    for label, name in _LATENCIES:
        buckets = last.hist.get(name, [])
        if prev is not None:
            buckets = _since(buckets, first.hist.get(name, []))
        values = [quantile(buckets, q) for q in (0.5, 0.95, 0.99)]
        cells = "no requests" if values[0] is None else "  ".join(
            f"{v:>8.3f} s" for v in values if v is not None)
        lines.append(f"{'  ' + label:<{_W}}{cells}")
    return "\n".join(lines)


def run_top(runtime_dir: str, iterations: int | None) -> int:
    url = recorded(runtime_dir, "url")
    assert url is not None  # written before the scheduler starts, so before it answers
    window: deque[Sample] = deque()
    tty = sys.stdout.isatty()
    shown = 0
    try:
        while True:
            reply = ask_all(admin_addresses(runtime_dir), "stats")
            if not reply.ok:
                print(f"surge admin: {reply.message}", file=sys.stderr)
                return 1
            window.append(Sample(time.monotonic(), reply.values, histograms(runtime_dir)))
            while window[-1].time - window[0].time > _WINDOW_S:
                window.popleft()
            # On a terminal, redraw in place; into a pipe, one screen after another.
            print((_CLEAR if tty else "") + frame(url, window) + ("" if tty else "\n"),
                  flush=True)
            shown += 1
            if iterations is not None and shown >= iterations:
                return 0
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
