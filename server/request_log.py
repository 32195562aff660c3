"""A request's account as it ends: its log line, its metrics and its trace, whether it finished,
failed or its client left."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from server.errors import ApiError
from server.generate import Piece
from server.tracing import RequestTrace
from surge import metrics

log = logging.getLogger("surge.frontend")


async def logged(pieces: AsyncIterator[Piece], rid: str, prompt_tokens: int, tenant: str,
                 model: str, choices: int, ended: Callable[[bool | None], None] | None = None,
                 trace: RequestTrace | None = None) -> AsyncIterator[Piece]:
    """One log line per finished request: id, outcome, token counts, timings (no text); its
    metrics and its trace, a cancelled or failed request's too. ended: told whether it
    finished (True), the engine failed it (False), or neither (None), as Breaker.finished
    takes it."""
    started = time.monotonic()
    first: float | None = None
    last = started
    generated = 0
    reasons: list[str] = []
    outcome = "cancelled"
    engine_failed = False
    try:
        async with aclosing(pieces) as stream:
            async for piece in stream:
                now = time.monotonic()
                if first is None:
                    first = now
                    metrics.ttft.labels(model).observe(now - started)
                else:
                    metrics.itl.labels(model).observe(now - last)
                last = now
                if trace is not None:
                    trace.piece(piece.timing)
                generated += piece.num_tokens
                if piece.finish_reason:
                    reasons.append(piece.finish_reason)
                yield piece
        outcome = "ok"
        metrics.e2e.labels(model).observe(time.monotonic() - started)
    except ApiError as e:
        outcome = f"error {e.status}"
        engine_failed = e.status >= 500
        raise
    finally:
        if ended is not None:
            ended(True if outcome == "ok" else False if engine_failed else None)
        if trace is not None:
            trace.end(outcome, reasons, prompt_tokens, generated)
        metrics.prompt_tokens.labels(model).inc(prompt_tokens)
        for reason in reasons:
            metrics.request_success.labels(model, reason).inc()
        # Choices that did not finish: the client left (or cancelled), or an error ended them.
        unfinished = "error" if outcome.startswith("error") else "abort"
        metrics.request_success.labels(model, unfinished).inc(choices - len(reasons))
        log.info("request %s", outcome, extra={
            "request_id": rid, "tenant": tenant, "finish_reason": ",".join(reasons) or None,
            "prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "ttft_ms": round((first - started) * 1000, 1) if first else None,
            "duration_ms": round((time.monotonic() - started) * 1000, 1)})
