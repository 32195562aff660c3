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


class Account:
    """What one API request used, settled once as it ends, however it ends: its log line (id,
    outcome, token counts, timings; no text), its metrics, its trace, and its outcome for the
    circuit breaker. ended: told whether it finished (True), the engine failed it (False), or
    neither (None), as Breaker.finished takes it."""

    def __init__(self, rid: str, prompt_tokens: int, tenant: str, model: str, choices: int,
                 ended: Callable[[bool | None], None] | None = None) -> None:
        self.rid, self.prompt_tokens, self.tenant, self.model = rid, prompt_tokens, tenant, model
        self.choices, self.ended = choices, ended
        self.trace: RequestTrace | None = None
        self.started = time.monotonic()
        self.first: float | None = None
        self.generated = 0
        self.reasons: list[str] = []
        self.settled = False

    def settle(self, outcome: str, engine_failed: bool = False) -> None:
        if self.settled:
            return
        self.settled = True
        if self.ended is not None:
            self.ended(True if outcome == "ok" else False if engine_failed else None)
        if self.trace is not None:
            self.trace.end(outcome, self.reasons, self.prompt_tokens, self.generated)
        metrics.prompt_tokens.labels(self.model).inc(self.prompt_tokens)
        for reason in self.reasons:
            metrics.request_success.labels(self.model, reason).inc()
        # Choices that did not finish: the client left (or cancelled), or an error ended them.
        unfinished = "error" if outcome.startswith("error") else "abort"
        metrics.request_success.labels(self.model, unfinished).inc(
            self.choices - len(self.reasons))
        log.info("request %s", outcome, extra={
            "request_id": self.rid, "tenant": self.tenant,
            "finish_reason": ",".join(self.reasons) or None,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
            "ttft_ms": round((self.first - self.started) * 1000, 1) if self.first else None,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 1)})


async def logged(pieces: AsyncIterator[Piece], account: Account) -> AsyncIterator[Piece]:
    """The pieces, each counted into account, which is settled as they end."""
    model = account.model
    last = account.started
    outcome = "cancelled"
    engine_failed = False
    try:
        async with aclosing(pieces) as stream:
            async for piece in stream:
                now = time.monotonic()
                if account.first is None:
                    account.first = now
                    metrics.ttft.labels(model).observe(now - account.started)
                else:
                    metrics.itl.labels(model).observe(now - last)
                last = now
                if account.trace is not None:
                    account.trace.piece(piece.timing)
                account.generated += piece.num_tokens
                if piece.finish_reason:
                    account.reasons.append(piece.finish_reason)
                yield piece
        outcome = "ok"
        metrics.e2e.labels(model).observe(time.monotonic() - account.started)
    except ApiError as e:
        outcome = f"error {e.status}"
        engine_failed = e.status >= 500
        raise
    finally:
        account.settle(outcome, engine_failed)
