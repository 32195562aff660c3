"""Interactive TTFT and batch goodput through a 3x overload, with the degradation ladder off and
on (one server each, in the same run).

Tenants `batch` and `interactive` share one priority class. First the batch tenant's capacity
is measured (closed loop, --clients streams). Then, for each setting, batch requests arrive
open-loop at 3x that rate for --overload-s while `interactive` sends a short probe every --gap
seconds; whatever is still unanswered at the end is cancelled. Reported per setting: the
probes' TTFT p50/p95, batch goodput (output tokens a second of the batch requests that
finished, capped ones included), batch refusals (429), and the ladder's counters from
/metrics. The ladder's setting: batch may degrade cap-then-refuse (max_tokens 16); signals
TTFT p95 over --slo-ms and a queue drain over --drain-s.

Usage: .venv/bin/python -m bench.overload_bench [--overload-s 60] [-- server args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request

from surge.bench import engine_stats
from surge.keys import KeyStore
from surge.loadgen import Result, client_session, closed_loop, percentiles, send
from tests.server import ServerProcess

_PROBE = {"prompt": "Answer in one short sentence: what is the capital of France?",
          "max_tokens": 16, "temperature": 0, "ignore_eos": True}
_BATCH = {"prompt": "Write a long, detailed story about a lighthouse keeper who finds a message "
                    "in a bottle. " * 3, "max_tokens": 128, "ignore_eos": True}


def _config(root: str, ladder: bool, opts: argparse.Namespace) -> str:
    path = os.path.join(root, f"surge-{'on' if ladder else 'off'}.toml")
    text = ('[tenants.batch]\ndegrade = "cap-then-refuse"\ndegrade_max_tokens = 16\n'
            '[tenants.interactive]\nweight = 4\n')
    if ladder:
        text += (f"[overload]\nttft_slo_s = {opts.slo_ms / 1000}\n"
                 f"max_queue_drain_s = {opts.drain_s}\nladder_interval_s = 1.0\n")
    with open(path, "w") as f:
        f.write(text)
    return path


async def _overload(url: str, keys: dict[str, str], rate: float, opts: argparse.Namespace
                    ) -> tuple[list[Result], list[Result], float]:
    """Batch arrivals at `rate` a second and the probes, for overload_s; (batch results,
    probe results, seconds) counting only what finished in time."""
    batch: list[Result] = []
    probes: list[Result] = []

    async def one(session: object, body: dict, into: list[Result]) -> None:
        into.append(await send(session, url, body))

    started = time.perf_counter()
    async with client_session({"Authorization": f"Bearer {keys['batch']}"}) as bs, \
            client_session({"Authorization": f"Bearer {keys['interactive']}"}) as ps:
        tasks = []
        next_batch = next_probe = 0.0
        while (now := time.perf_counter() - started) < opts.overload_s:
            if now >= next_batch:
                tasks.append(asyncio.create_task(one(bs, _BATCH, batch)))
                next_batch += 1 / rate
            if now >= next_probe:
                tasks.append(asyncio.create_task(one(ps, _PROBE, probes)))
                next_probe += opts.gap
            await asyncio.sleep(max(0.0, min(next_batch, next_probe) - now))
        for task in tasks:
            task.cancel()  # unanswered: the client leaves, the server aborts them
        await asyncio.gather(*tasks, return_exceptions=True)
    return batch, probes, time.perf_counter() - started


def _metrics(url: str, key: str) -> dict[str, float]:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        lines = r.read().decode().splitlines()
    wanted = ("surge_degraded_requests_total", "surge_overload_level",
              "surge_degraded_responses_total")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith(wanted)}


def measure(ladder: bool, rate: float | None, opts: argparse.Namespace, extra: list[str]
            ) -> tuple[dict, float]:
    root = tempfile.mkdtemp(prefix="surge-overload-")
    store = KeyStore(os.path.join(root, "keys.json"))
    keys = {"batch": store.add("batch")[1], "interactive": store.add("interactive")[1],
            "admin": store.add("admin")[1]}
    server = ServerProcess("--config", _config(root, ladder, opts), "--api-keys-file",
                           store.path, *extra, dtype=opts.dtype,
                           kv_cache_memory="2GiB").wait_ready()
    try:
        if rate is None:  # the batch tenant's capacity, on this machine, now: the tokens
            # the server generated under a closed loop, in batch requests' worth a second
            admin = {"Authorization": f"Bearer {keys['admin']}"}
            before = engine_stats(server.url, headers=admin)
            asyncio.run(closed_loop(server.url, [_BATCH] * 1000, opts.clients,
                                    {"Authorization": f"Bearer {keys['batch']}"},
                                    deadline_s=opts.measure_s))
            after = engine_stats(server.url, after=before["time"] + opts.measure_s,
                                 headers=admin)
            rate = (after["generated_tokens"] - before["generated_tokens"]) / \
                (after["time"] - before["time"]) / _BATCH["max_tokens"]
        batch, probes, wall = asyncio.run(_overload(server.url, keys, 3 * rate, opts))
        counters = _metrics(server.url, keys["admin"])
    finally:
        server.stop()
    done = [r for r in batch if r.error is None]
    ttft = percentiles([r.ttft for r in probes if r.error is None])
    return {"ladder": "on" if ladder else "off", "batch_rate_per_s": round(3 * rate, 2),
            "probe_ttft_p50_ms": round(ttft["p50"]), "probe_ttft_p95_ms": round(ttft["p95"]),
            "probes_answered": f"{sum(r.error is None for r in probes)}/"
                               f"{int(opts.overload_s / opts.gap)}",
            "batch_finished": len(done),
            "batch_goodput_tok_s": round(sum(r.output_tokens for r in done) / wall, 1),
            "batch_refused_429": sum(1 for r in batch if r.status == 429),
            "ladder_counters": counters}, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overload-s", type=float, default=60.0)
    parser.add_argument("--measure-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument("--dtype", default="auto")
    opts, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    rate = None
    for ladder in (False, True):
        row, rate = measure(ladder, rate, opts, extra)
        print(json.dumps(row), flush=True)
    print(f"capacity {rate:.2f} batch requests/s; server args: {' '.join(extra) or '(defaults)'}"
          f"; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
