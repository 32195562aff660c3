"""A streaming load generator for OpenAI-compatible completions servers: closed loop (a fixed
number of clients) or open loop (arrivals at given times), with per-request timings."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
from msgspec import Struct


class Result(Struct):
    ttft: float = 0.0  # seconds to the first streamed token
    itl: list[float] = []  # seconds between streamed chunks
    latency: float = 0.0
    output_tokens: int = 0
    status: int = 200
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def send(session: aiohttp.ClientSession, url: str, body: dict,
               path: str = "/v1/completions") -> Result:
    """One streamed completion (or chat completion, by path); its timings, or its error."""
    result = Result()
    started = time.perf_counter()
    last = started
    chunks = 0
    try:
        async with session.post(f"{url}{path}",
                                json={**body, "stream": True,
                                      "stream_options": {"include_usage": True}}) as r:
            if r.status != 200:
                return Result(status=r.status, error=(await r.text())[:300])
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    return Result(status=500, error=json.dumps(chunk["error"])[:300])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not _text(chunk["choices"][0]):
                    continue  # usage, a chat's opening role, an empty closing chunk
                chunks += 1
                if not result.ttft:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last = now
    except (TimeoutError, aiohttp.ClientError) as e:
        return Result(status=0, error=f"{type(e).__name__}: {e}")
    result.latency = time.perf_counter() - started
    result.output_tokens = result.output_tokens or chunks  # a server without usage
    return result


def _text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def client_session(headers: dict | None) -> aiohttp.ClientSession:
    """For many concurrent streams: no connection limit, an hour before a timeout."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), headers=headers,
                                 connector=aiohttp.TCPConnector(limit=0))


async def closed_loop(url: str, bodies: list[dict], concurrency: int,
                      headers: dict | None = None, deadline_s: float | None = None,
                      done: Callable[[], None] = lambda: None,
                      path: str = "/v1/completions") -> tuple[list[Result], float]:
    """Every body, at most `concurrency` in flight, none started after deadline_s;
    (results, wall seconds)."""
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[Result] = []
    started = time.perf_counter()

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            if deadline_s is not None and time.perf_counter() - started > deadline_s:
                return
            results.append(await send(session, url, queue.get_nowait(), path))
            done()

    async with client_session(headers) as session:
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
    return results, time.perf_counter() - started


async def open_loop(url: str, arrivals: list[tuple[float, dict]], headers: dict | None = None,
                    deadline_s: float | None = None, done: Callable[[], None] = lambda: None,
                    path: str = "/v1/completions") -> tuple[list[Result], float]:
    """Each body sent at its arrival time (seconds from the start) whatever is in flight."""
    results: list[Result] = []
    started = time.perf_counter()

    async def one(session: aiohttp.ClientSession, body: dict) -> None:
        results.append(await send(session, url, body, path))
        done()

    async with client_session(headers) as session:
        tasks = []
        for at, body in arrivals:
            if deadline_s is not None and at > deadline_s:
                break
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - started)))
            tasks.append(asyncio.create_task(one(session, body)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p95/p99 (in ms by default); NaN without data."""
    if not values:
        return {f"p{q}": math.nan for q in (50, 90, 95, 99)}
    if len(values) == 1:
        return {f"p{q}": values[0] * scale for q in (50, 90, 95, 99)}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{q}": cuts[q - 1] * scale for q in (50, 90, 95, 99)}


def summarize(results: list[Result], wall: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """Latency percentiles (ms), throughput, errors by status (and the first body of each),
    and goodput under the SLO when one is given."""
    ok = [r for r in results if r.error is None]
    tpots = [t for r in ok if (t := r.tpot) is not None]

    def meets(r: Result) -> bool:
        tpot = r.tpot
        return (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms) and \
            (slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms)

    good = sum(1 for r in ok if meets(r))
    first_errors: dict[str, str] = {}
    for r in results:
        if r.error is not None:
            first_errors.setdefault(str(r.status), r.error)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    return {
        "requests": len(results), "ok": len(ok),
        "errors": dict(Counter(str(r.status) for r in results if r.error is not None)),
        "first_errors": first_errors,  # the first body of each status, to tell why
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(tpots),
        "e2e_ms": percentiles([r.latency for r in ok]),
        "output_tok_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        # Only against an SLO: without one every request would count as good.
        "goodput": {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
                    "share": good / len(results) if results else 0.0,
                    "requests_per_s": good / wall if wall else 0.0} if has_slo else None,
        "wall_s": wall,
    }
