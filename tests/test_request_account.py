"""A request's account (its log line, abort count and trace) and its engine requests' abort, on
every way it can end before its pieces are read: cancelled while the engine takes it, or taken
and then never read (the client gone before the answer's first byte)."""

from __future__ import annotations

import asyncio
import logging
import re
from types import SimpleNamespace

from server.app import Frontend
from server.openai_types import CompletionRequest
from surge import metrics
from surge.protocol import EngineRequest, RequestOutput, SamplingParams

MODEL = "m"


class Engine:
    """Takes requests (acknowledging them at once, or never: held), records aborts."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.aborted: list[str] = []
        self.breakers = SimpleNamespace(taking=lambda: [0])

    def submit(self, requests: list[EngineRequest], ticket: object
               ) -> list[asyncio.Queue[RequestOutput]]:
        queues: list[asyncio.Queue[RequestOutput]] = []
        for r in requests:
            queues.append(asyncio.Queue())
            if not self.hold:
                queues[-1].put_nowait(RequestOutput(r.request_id, []))
        return queues

    def abort(self, *request_ids: str) -> None:
        self.aborted += request_ids


def _frontend(engine: Engine) -> Frontend:
    async def grammar(body: object) -> None:
        return None

    def engine_requests(body, rid, prompts, max_tokens, logprobs, tenant, grammar):
        return [EngineRequest(request_id=f"{rid}-{i}", prompt_token_ids=p, arrival_time=0.0,
                              sampling=SamplingParams(max_tokens=4))
                for i, p in enumerate(prompts)]

    frontend = object.__new__(Frontend)  # only what run() reads
    frontend.engine = engine
    frontend.tracing = None
    frontend.tokenizer = SimpleNamespace(hf=None)
    frontend.translator = SimpleNamespace(grammar=grammar, engine_requests=engine_requests,
                                          model_name=MODEL)
    return frontend


def _aborts() -> float:
    return metrics.request_success.labels(MODEL, "abort")._value.get()


def _run(hold: bool, caplog) -> Engine:
    engine = Engine(hold)
    frontend = _frontend(engine)
    body = CompletionRequest(prompt=[1, 2])

    async def handler() -> None:
        await frontend.run(body, "cmpl-1", [[1, 2], [3]], 4, None, "t")
        await asyncio.sleep(10)  # as aiohttp's prepare() when the client has gone

    async def main() -> None:
        task = asyncio.create_task(handler())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, "surge.frontend"):
        asyncio.run(main())
    return engine


def test_a_request_cancelled_while_the_engine_takes_it_is_accounted(caplog):
    before = _aborts()
    engine = _run(True, caplog)
    assert [re.sub(r"-[0-9a-f]{8}-", "-", i) for i in sorted(engine.aborted)] == \
        ["cmpl-1-0", "cmpl-1-1"]  # (the engine's ids: the answer's, made unique)
    assert [r.getMessage() for r in caplog.records] == ["request cancelled"]
    assert _aborts() - before == 2  # each choice


def test_pieces_never_read_are_aborted_and_accounted_as_their_task_ends(caplog):
    before = _aborts()
    engine = _run(False, caplog)
    assert [re.sub(r"-[0-9a-f]{8}-", "-", i) for i in sorted(engine.aborted)] == \
        ["cmpl-1-0", "cmpl-1-1"]  # (the engine's ids: the answer's, made unique)
    assert [r.getMessage() for r in caplog.records] == ["request cancelled"]
    assert _aborts() - before == 2
