"""A small streaming load generator for the OpenAI completions API (closed loop)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import aiohttp
from msgspec import Struct


class Result(Struct):
    ttft: float = 0.0  # seconds to the first streamed token
    itl: list[float] = []  # seconds between streamed chunks
    latency: float = 0.0
    output_tokens: int = 0
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> Result:
    result = Result()
    started = time.perf_counter()
    last = started
    try:
        async with session.post(f"{url}/v1/completions",
                                json={**body, "stream": True,
                                      "stream_options": {"include_usage": True}}) as r:
            if r.status != 200:
                return Result(error=f"HTTP {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if not result.ttft:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last = now
    except (TimeoutError, aiohttp.ClientError) as e:
        return Result(error=f"{type(e).__name__}: {e}")
    result.latency = time.perf_counter() - started
    return result


async def run(url: str, bodies: list[dict], concurrency: int, headers: dict | None = None
              ) -> tuple[list[Result], float]:
    """Send every body with at most `concurrency` in flight; (results, wall seconds)."""
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=3600)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            results.append(await _one(session, url, queue.get_nowait()))

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
    return results, time.perf_counter() - started


def summary(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    itl = [x for r in ok for x in r.itl]

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (
            values[0] if values else float("nan"))

    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_p50_ms": pct([r.ttft for r in ok], 50) * 1000,
        "ttft_p90_ms": pct([r.ttft for r in ok], 90) * 1000,
        "itl_p50_ms": pct(itl, 50) * 1000,
        "itl_p95_ms": pct(itl, 95) * 1000,
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "wall_s": wall,
    }
