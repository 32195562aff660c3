"""Result cache hit latency, memory and Redis, against the same request computed by the engine,
in one run.

Two servers: one with `--result-cache memory`, one with `--result-cache redis://...` on a
redis-server started here. One deterministic chat request; per round, the engine computes it
once (`"cache": false`, on the memory server), then the memory server and the Redis server
each answer it --hits times from their caches, one request at a time over a kept-alive
connection, so the three are measured under the same load. Every hit's answer must equal the
engine's. Reported: p50/p99 in ms for each, the ratios, the load average before and after.

Usage: flock /tmp/bench.lock .venv/bin/python -m bench.result_cache_bench [--rounds 30]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import time

from surge.loadgen import percentiles
from tests.redis_server import RedisServer
from tests.server import ServerProcess

_BODY = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
         "temperature": 0, "max_tokens": 16}


class Client:
    """One kept-alive connection: what a client that repeats itself sees."""

    def __init__(self, server: ServerProcess) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)

    def ask(self, body: dict, expect: str) -> tuple[float, list]:
        started = time.perf_counter()
        self.connection.request("POST", "/v1/chat/completions", json.dumps(body),
                                {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        seconds = time.perf_counter() - started
        assert response.status == 200, answer
        assert response.getheader("x-surge-cache") == expect, response.getheader("x-surge-cache")
        return seconds, [answer["choices"], answer["usage"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="engine computations")
    parser.add_argument("--hits", type=int, default=10, help="hits per backend and round")
    parser.add_argument("--dtype", default="bfloat16")
    opts = parser.parse_args()
    load_before = os.getloadavg()
    store = RedisServer(tempfile.mkdtemp(prefix="surge-redis-"))
    servers = [ServerProcess("--result-cache", "memory", dtype=opts.dtype),
               ServerProcess("--result-cache", store.url, dtype=opts.dtype)]
    try:
        for server in servers:
            server.wait_ready()
        memory, redis = Client(servers[0]), Client(servers[1])
        _, expected = memory.ask(_BODY, "miss")
        assert redis.ask(_BODY, "miss")[1] == expected
        times: dict[str, list[float]] = {"engine": [], "memory": [], "redis": []}
        for _ in range(opts.rounds):
            seconds, answer = memory.ask({**_BODY, "cache": False}, "bypass")
            assert answer == expected, (answer, expected)
            times["engine"].append(seconds)
            for name, client in (("memory", memory), ("redis", redis)):
                for _ in range(opts.hits):
                    seconds, answer = client.ask(_BODY, "hit")
                    assert answer == expected
                    times[name].append(seconds)
        figures = {name: {k: round(v, 2) for k, v in percentiles(values).items()
                          if k in ("p50", "p99")} | {"n": len(values)}
                   for name, values in times.items()}
        engine = figures["engine"]["p50"]
        print(json.dumps({
            "request": _BODY, "dtype": opts.dtype, "latency_ms": figures,
            "engine_p50_over_hit_p50": {name: round(engine / figures[name]["p50"], 1)
                                        for name in ("memory", "redis")},
            "completion_tokens": expected[1]["completion_tokens"],
            "load_average_before": load_before, "load_average_after": os.getloadavg()},
            indent=2))
    finally:
        for server in servers:
            server.stop()
        store.stop()


if __name__ == "__main__":
    main()
