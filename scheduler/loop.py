"""The scheduler process: a busy loop of take requests -> schedule -> run a step -> send outputs."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from scheduler.scheduler import Scheduler
from shm.ring import RingBuffer
from surge.config import SurgeConfig
from surge.process import child_setup
from surge.protocol import (
    AbortRequest,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    FrontendMessage,
    RequestOutput,
    StepResult,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
    encode,
)
from surge.runtime import Channels

log = logging.getLogger("surge.scheduler")
_IDLE_POLL_MS = 200


class WorkerError(RuntimeError):
    pass


class SchedulerLoop:
    def __init__(self, cfg: SurgeConfig, channels: Channels, num_workers: int) -> None:
        self.cfg = cfg
        self.zmq = zmq.Context()
        self.requests = self.zmq.socket(zmq.PULL)
        self.requests.bind(channels.requests)
        self.outputs = self.zmq.socket(zmq.PUSH)
        self.outputs.connect(channels.outputs)
        self.results = self.zmq.socket(zmq.PULL)
        self.results.bind(channels.results)
        self.ring = RingBuffer(channels.plan_ring, reader=None)
        self.num_workers = num_workers
        self.frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self.worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
        self.scheduler: Scheduler | None = None

    def _worker_message(self) -> Any:
        msg = self.worker_decoder.decode(self.results.recv())
        if isinstance(msg, WorkerFailed):
            raise WorkerError(f"worker {msg.rank} failed: {msg.error}")
        return msg

    def wait_for_workers(self) -> EngineReady:
        readies: list[WorkerReady] = []
        while len(readies) < self.num_workers:
            msg = self._worker_message()
            assert isinstance(msg, WorkerReady), msg
            readies.append(msg)
        num_blocks = min(r.num_blocks for r in readies)
        self.scheduler = Scheduler(self.cfg.scheduler, num_blocks)
        ready = EngineReady(num_blocks=num_blocks, block_size=self.cfg.scheduler.block_size,
                            description=readies[0].description)
        self.outputs.send(encode(ready))
        return ready

    def _take_requests(self, block_ms: int) -> None:
        """Handle every message from the frontend that has arrived (waiting up to block_ms)."""
        assert self.scheduler is not None
        if not self.requests.poll(block_ms):
            return
        errors: list[RequestOutput] = []
        while True:
            try:
                raw = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.frontend_decoder.decode(raw)
            if isinstance(msg, EngineRequest):
                if (error := self.scheduler.add(msg)) is not None:
                    errors.append(error)
            elif isinstance(msg, AbortRequest):
                errors.extend(self.scheduler.abort(msg.request_ids))
        if errors:
            self.outputs.send(encode(EngineOutputs(errors)))

    def run(self) -> None:
        sched = self.scheduler
        assert sched is not None
        while True:
            self._take_requests(0 if sched.has_work() else _IDLE_POLL_MS)
            plan = sched.schedule()
            if plan is None:
                continue
            self.ring.put(encode(plan))
            result = self._worker_message()
            assert isinstance(result, StepResult), result
            if outputs := sched.update(plan, result):
                self.outputs.send(encode(EngineOutputs(outputs)))

    def fail_all(self, reason: str) -> None:
        """Give every request in the scheduler a terminal error: nothing is silently lost."""
        if self.scheduler is None:
            return
        ids = list(self.scheduler.requests)
        self.scheduler.abort(ids)
        self.outputs.send(encode(EngineOutputs([RequestOutput(i, [], "error", reason)
                                                for i in ids])))

    def close(self) -> None:
        self.ring.close()
        self.zmq.destroy(linger=200)


def run_scheduler(cfg: SurgeConfig, channels: Channels, status: Any) -> None:
    child_setup("scheduler", cfg)
    loop = SchedulerLoop(cfg, channels, num_workers=1)
    try:
        ready = loop.wait_for_workers()
        status.put(("scheduler", f"{ready.num_blocks} KV blocks of {ready.block_size} tokens "
                                 f"({ready.num_blocks * ready.block_size} tokens)"))
        loop.run()
    except WorkerError as e:
        log.error("%s", e)
        loop.fail_all(f"the model worker failed: {e}")
        raise SystemExit(1) from e
    finally:
        loop.close()
