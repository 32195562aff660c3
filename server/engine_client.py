"""The frontend's side of the ZeroMQ link to the scheduler: submit, abort, and route outputs."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from server.breaker import Breaker
from surge.config import OverloadConfig
from surge.protocol import (
    AbortRequest,
    BreakerState,
    EngineFault,
    EngineHealth,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    EngineRequests,
    EngineStats,
    OverloadSettings,
    RequestOutput,
    SchedulerMessage,
    encode,
)
from surge.runtime import Channels

log = logging.getLogger("surge.frontend")


class EngineClient:
    def __init__(self, channels: Channels, overload: OverloadConfig) -> None:
        self.ctx = zmq.asyncio.Context()
        self.requests = self.ctx.socket(zmq.PUSH)
        self.requests.connect(channels.requests)
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.bind(channels.outputs)
        self.streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.ready: asyncio.Future[EngineReady] = asyncio.get_running_loop().create_future()
        self.stats: EngineStats | None = None
        self.problem: str | None = None  # why the engine is unhealthy (see EngineHealth)
        self.breaker = Breaker(overload, on_change=self._report_breaker)
        self._breaker_sent = ("closed", 0.0)  # the state the scheduler was last told, and when
        self._breaker_flush = False  # a later report is scheduled
        self._reader = asyncio.create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(SchedulerMessage)
        while True:
            msg = decoder.decode(await self.outputs.recv())
            if isinstance(msg, EngineReady):
                self.ready.set_result(msg)
                continue
            if isinstance(msg, EngineStats):
                self.stats = msg
                continue
            if isinstance(msg, EngineHealth):
                self.problem = msg.problem
                continue
            if isinstance(msg, EngineFault):
                self.breaker.failure(msg.reason)
                continue
            if isinstance(msg, OverloadSettings):
                self.breaker.configure(msg.cfg)
                continue
            assert isinstance(msg, EngineOutputs)
            for out in msg.outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
                    if out.finish_reason is not None:
                        del self.streams[out.request_id]

    def _send(self, data: bytes) -> None:
        # Queued by ZeroMQ when the scheduler is slow to take it; a send that fails later
        # (only while shutting down) is logged here rather than lost in an unread future.
        sent = self.requests.send(data)
        sent.add_done_callback(_report_send_failure)

    def submit(self, requests: list[EngineRequest]) -> list[asyncio.Queue[RequestOutput]]:
        """Send one API request's engine requests in one message (admitted as a unit); the
        stream of outputs of each."""
        data = encode(EngineRequests(requests))
        streams: list[asyncio.Queue[RequestOutput]] = []
        for request in requests:
            streams.append(asyncio.Queue())
            self.streams[request.request_id] = streams[-1]
        self._send(data)
        return streams

    def _report_breaker(self) -> None:
        """Tell the scheduler (for `surge admin stats`) of each move, and of rejections at
        most once a second: while open, every request would otherwise send a message."""
        state, now = self.breaker.state, time.monotonic()
        wait = 1.0 - (now - self._breaker_sent[1])
        if state == self._breaker_sent[0] and wait > 0:
            if not self._breaker_flush:  # the count since is sent when the second is up
                self._breaker_flush = True
                asyncio.get_running_loop().call_later(wait, self._flush_breaker)
            return
        self._breaker_sent = (state, now)
        self._send(encode(BreakerState(state, self.breaker.rejected)))

    def _flush_breaker(self) -> None:
        self._breaker_flush = False
        self._report_breaker()

    def abort(self, *request_ids: str) -> None:
        """Abort those of request_ids still running, in one message."""
        running = [rid for rid in request_ids if self.streams.pop(rid, None) is not None]
        if running:
            self._send(encode(AbortRequest(running)))

    def fail_all(self, reason: str) -> None:
        """End every request this frontend is waiting on with an error, and abort it."""
        for request_id, stream in self.streams.items():
            stream.put_nowait(RequestOutput(request_id, [], "error", reason))
        self.abort(*self.streams)

    def close(self) -> None:
        self._reader.cancel()
        self.ctx.destroy(linger=0)


def _report_send_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.debug("a message to the scheduler was dropped: %s", sent.exception())
