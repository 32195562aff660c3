"""One prompt through the engine, as a stream of text pieces, and many prompts merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from msgspec import Struct

from server.breaker import Ticket
from server.detokenizer import Detokenizer
from server.engine_client import EngineClient
from server.errors import ApiError
from server.stop import StopMatcher
from surge.protocol import EngineRequest, RequestOutput, SamplingParams, TokenLogprobs


class Piece(Struct):
    index: int  # which choice this belongs to
    text: str
    num_tokens: int  # generated tokens this piece accounts for
    finish_reason: str | None = None
    token_ids: list[int] = []  # with logprobs: the tokens whose logprobs follow
    logprobs: list[TokenLogprobs | None] = []  # None: an echoed prompt's first token
    # On the piece after the first token, for traces: (seconds queued, prompt tokens cached).
    timing: tuple[float, int] | None = None
    # On the same piece, when asked for: the prompt's logprobs (its tokens after the first).
    prompt_logprobs: list[TokenLogprobs] | None = None


def refusal(out: RequestOutput) -> ApiError:
    """The error a request's terminal output stands for."""
    if out.finish_reason == "abort":
        return ApiError(503, "the request was aborted by the server")
    return ApiError(out.status, out.error or "the engine failed this request",
                    retry_after=out.retry_after)


async def submit(engine: EngineClient, requests: list[EngineRequest], ticket: Ticket
                 ) -> tuple[list[asyncio.Queue[RequestOutput]], str | None]:
    """Send one API request's engine requests (ticket: see EngineClient.submit) and wait until
    the scheduler takes them (all or none); a refusal raises its ApiError before anything has
    been sent to the client. The streams, and how the degradation ladder changed the request
    (None: not at all)."""
    streams = engine.submit(requests, ticket)
    ids = [r.request_id for r in requests]
    try:
        firsts = [await stream.get() for stream in streams]
    except BaseException:  # cancelled: the client left while the requests were on their way
        engine.abort(*ids)
        raise
    if refused := [out for out in firsts if out.finish_reason is not None]:
        engine.abort(*ids)  # none should be running: they are admitted as a unit
        raise refusal(refused[0])
    return streams, firsts[0].degraded


async def generate(engine: EngineClient, stream: asyncio.Queue[RequestOutput],
                   tokenizer: object, request_id: str, index: int, prompt_ids: list[int],
                   sampling: SamplingParams, stop: list[str]) -> AsyncIterator[Piece]:
    """Text pieces of one completion, from a submitted request; the request is aborted if the
    consumer stops early or a stop string is found."""
    detok = Detokenizer(tokenizer, prompt_ids)
    stops = StopMatcher(stop) if stop else None
    finished = False
    uncounted = 0  # tokens whose text is still held back (a character or stop string unsure)
    held_ids: list[int] = []
    held_logprobs: list[TokenLogprobs] = []
    generated = 0
    timing: tuple[float, int] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    try:
        while not finished:
            out = await stream.get()
            finished = out.finish_reason is not None
            if out.finish_reason in ("error", "abort"):
                raise refusal(out)
            if out.queued_s is not None:
                timing = (out.queued_s, out.cached_tokens or 0)
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            ids, lps = out.new_token_ids, out.logprobs or []
            # With stop strings, a speculative step's tokens one at a time: the text, its
            # usage and its logprobs end at the token that completes the stop string.
            steps = [(ids[i:i + 1], lps[i:i + 1]) for i in range(len(ids))] \
                if stops is not None and len(ids) > 1 else [(ids, lps)]
            for n, (step_ids, step_lps) in enumerate(steps):
                last = n == len(steps) - 1
                done = finished and last
                reason = out.finish_reason if last else None
                shown = step_ids
                if reason == "stop" and shown and shown[-1] in sampling.stop_token_ids:
                    shown = shown[:-1]  # the stop token itself is not part of the text
                text = detok.step(shown, final=done)
                generated += len(step_ids)
                # Like stop tokens, stop strings only count once min_tokens are out.
                if stops is not None and generated >= sampling.min_tokens:
                    text, hit = stops.feed(text, final=done)
                    if hit:
                        if not finished:
                            engine.abort(request_id)
                        done, reason = True, "stop"
                uncounted += len(step_ids)
                if step_lps:
                    held_ids += step_ids
                    held_logprobs += step_lps
                if text or done:
                    yield Piece(index, text, uncounted, reason, held_ids, held_logprobs,
                                timing, prompt_logprobs)
                    uncounted, held_ids, held_logprobs, timing = 0, [], [], None
                    prompt_logprobs = None
                if done:
                    finished = True
                    break
    finally:
        if not finished:
            engine.abort(request_id)


async def merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """Interleave several pieces streams as pieces arrive; an error in one ends them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for piece in stream:
                yield piece
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
            await queue.put(None)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
