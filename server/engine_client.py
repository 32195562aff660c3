"""The frontend's side of the ZeroMQ link to the scheduler: submit, abort, and route outputs."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from server.breaker import Breakers, Ticket
from server.fleet import Fleet, each
from surge.config import SurgeConfig
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
    LiveSettings,
    PrefixReport,
    RequestOutput,
    SchedulerMessage,
    encode,
)
from surge.runtime import Channels

log = logging.getLogger("surge.frontend")


class EngineClient:
    def __init__(self, channels: Channels, cfg: SurgeConfig) -> None:
        """channels: the base set (outputs); each data-parallel replica's are derived."""
        self.ctx = zmq.asyncio.Context()
        self.requests: list[zmq.asyncio.Socket] = []  # one per replica
        for replica in range(channels.replicas):
            self.requests.append(self.ctx.socket(zmq.PUSH))
            self.requests[-1].connect(channels.for_replica(replica, channels.replicas).requests)
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.bind(channels.outputs)
        self.streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.ready: asyncio.Future[EngineReady] = asyncio.get_running_loop().create_future()
        self._readies: dict[int, EngineReady] = {}
        self.replica_stats: list[EngineStats | None] = [None] * channels.replicas
        # Why each replica is unhealthy (see EngineHealth); None: it serves.
        self.problems: list[str | None] = [None] * channels.replicas
        # With several replicas: routing, and the limits that span them (one replica's
        # scheduler applies them itself).
        self.fleet = Fleet(cfg, time.time()) if channels.replicas > 1 else None
        self.tenants = cfg.tenants  # as surge admin set leaves them (LiveSettings)
        self.breakers = Breakers(cfg.overload, channels.replicas, self._report_breaker)
        # Each replica's breaker state its scheduler was last told, and when; and whether a
        # later report is scheduled.
        self._breaker_sent = [("closed", 0.0)] * channels.replicas
        self._breaker_flush = [False] * channels.replicas
        self._reader = asyncio.create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(SchedulerMessage)
        while True:
            msg = decoder.decode(await self.outputs.recv())
            if isinstance(msg, EngineOutputs):
                self._deliver(msg.outputs)
            else:
                self._note(msg)

    def _note(self, msg: object) -> None:
        """A message about a replica rather than about requests."""
        fleet = self.fleet
        if isinstance(msg, EngineReady):
            self._readies[msg.replica] = msg
            if len(self._readies) == len(self.requests):
                # The smallest KV cache bounds what a request may ask of any replica.
                self.ready.set_result(min(self._readies.values(), key=lambda r: r.num_blocks))
        elif isinstance(msg, EngineStats):
            self.replica_stats[msg.replica] = msg
            if fleet is not None:
                fleet.router.back(msg.replica)  # stats after a fault: its workers are back
        elif isinstance(msg, EngineHealth):
            self.problems[msg.replica] = msg.problem
        elif isinstance(msg, EngineFault):
            self.breakers.failure(msg.replica, msg.reason)
            if fleet is not None:
                fleet.router.fault(msg.replica)
        elif isinstance(msg, LiveSettings):
            self.tenants = msg.tenants
            self.breakers.configure(msg.overload)
            if fleet is not None:
                fleet.configure(msg, time.time())
        elif isinstance(msg, PrefixReport) and fleet is not None:
            fleet.router.report(msg.replica, msg.gained, msg.lost)

    @property
    def stats(self) -> EngineStats | None:
        """The only replica's latest stats (with several, see replica_stats)."""
        return self.replica_stats[0]

    def _problems(self) -> list[str | None]:
        """Why each replica cannot serve new requests: its breaker and its health."""
        return ["; ".join(filter(None, (b.problem, p))) or None
                for b, p in zip(self.breakers.each, self.problems, strict=True)]

    @property
    def problem(self) -> str | None:
        """Why the engine cannot serve: its only replica, or every one of several, is
        unhealthy."""
        problems = self._problems()
        return "; ".join(p for p in problems if p) if all(problems) else None

    @property
    def degraded(self) -> str | None:
        """Which replicas are unhealthy while others serve."""
        problems = self._problems()
        if all(problems):
            return None
        return "; ".join(f"replica {i}: {p}" for i, p in enumerate(problems) if p) or None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            if self.fleet is not None:
                self.fleet.output(out, now)
            stream = self.streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                if out.finish_reason is not None:
                    del self.streams[out.request_id]

    def _send(self, data: bytes, replica: int = 0) -> None:
        # Queued by ZeroMQ when the scheduler is slow to take it; a send that fails later
        # (only while shutting down) is logged here rather than lost in an unread future.
        sent = self.requests[replica].send(data)
        sent.add_done_callback(_report_send_failure)

    def submit(self, requests: list[EngineRequest], ticket: Ticket
               ) -> list[asyncio.Queue[RequestOutput]]:
        """Send one API request's engine requests in one message (admitted as a unit) to a
        replica whose circuit breaker takes them (or raise its 503); the stream of outputs of
        each. ticket: told the breaker whose probe they became, if they did."""
        taking = self.breakers.taking()
        replica = 0 if self.fleet is None else self.fleet.place(requests, time.time(), taking)
        if isinstance(replica, int):
            self.breakers.take(replica, ticket)
        data = encode(EngineRequests(requests))
        streams: list[asyncio.Queue[RequestOutput]] = []
        for request in requests:
            streams.append(asyncio.Queue())
            self.streams[request.request_id] = streams[-1]
        if isinstance(replica, RequestOutput):  # refused here, as a scheduler would
            self._deliver(each(replica, requests))
        else:
            self._send(data, replica)
        return streams

    def _report_breaker(self, replica: int) -> None:
        """Tell the replica's scheduler (for `surge admin stats`) of each move of its breaker,
        and of rejections at most once a second: while open, every request would otherwise
        send a message."""
        breaker = self.breakers.each[replica]
        state, now = breaker.state, time.monotonic()
        wait = 1.0 - (now - self._breaker_sent[replica][1])
        if state == self._breaker_sent[replica][0] and wait > 0:
            if not self._breaker_flush[replica]:  # the count since is sent when the second is up
                self._breaker_flush[replica] = True
                asyncio.get_running_loop().call_later(wait, self._flush_breaker, replica)
            return
        self._breaker_sent[replica] = (state, now)
        self._send(encode(BreakerState(state, breaker.rejected)), replica)

    def _flush_breaker(self, replica: int) -> None:
        self._breaker_flush[replica] = False
        self._report_breaker(replica)

    def abort(self, *request_ids: str) -> None:
        """Abort those of request_ids still running, in one message."""
        running = [rid for rid in request_ids if self.streams.pop(rid, None) is not None]
        if self.fleet is None:
            if running:
                self._send(encode(AbortRequest(running)))
            return
        by_replica: dict[int, list[str]] = {}
        for rid in running:
            replica = self.fleet.router.replica_of(rid)
            if replica is not None:  # else refused here: never sent
                by_replica.setdefault(replica, []).append(rid)
                self.fleet.ended(rid, time.time())  # its place is free at once
        for replica, ids in by_replica.items():
            self._send(encode(AbortRequest(ids)), replica)

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
