"""The scheduler process: a busy loop of take requests -> schedule -> run a step -> send outputs."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from scheduler import admin
from scheduler.scheduler import Scheduler
from scheduler.stats import StatsCollector
from shm.ring import RingBuffer, RingClosed
from surge.config import SurgeConfig
from surge.config_live import shown
from surge.model_files import served_name
from surge.process import child_setup
from surge.protocol import (
    AbortRequest,
    AdminReply,
    AdminRequest,
    BreakerState,
    EngineFault,
    EngineHealth,
    EngineOutputs,
    EngineReady,
    EngineRequests,
    FrontendMessage,
    LiveSettings,
    PrefixReport,
    RequestOutput,
    StepPlan,
    StepResult,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
    encode,
)
from surge.runtime import Channels

log = logging.getLogger("surge.scheduler")
_IDLE_POLL_MS = 200
_STATS_INTERVAL_S = 1.0


class WorkerError(RuntimeError):
    """The workers are gone for good."""


class WorkerLost(RuntimeError):
    """A worker died; the supervisor is starting another. blames: whether the plans in
    flight may have killed it (not when its replacement was already up as they were sent)."""

    def __init__(self, message: str, blames: bool = True) -> None:
        super().__init__(message)
        self.blames = blames


class SchedulerLoop:
    def __init__(self, cfg: SurgeConfig, channels: Channels, num_workers: int,
                 status: Any) -> None:
        """status: the supervisor's queue, told of health changes (for systemd)."""
        self.cfg = cfg
        self.status = status
        self.channels = channels
        self.replica = channels.replica  # of the data-parallel engines (0: the only one)
        self.zmq = zmq.Context()
        self.requests = self.zmq.socket(zmq.PULL)
        self.requests.bind(channels.requests)
        self.outputs = self.zmq.socket(zmq.PUSH)
        self.outputs.connect(channels.outputs)
        self.results = self.zmq.socket(zmq.PULL)
        self.results.bind(channels.results)
        self.admin = self.zmq.socket(zmq.REP)
        self.admin.bind(channels.admin)
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)
        self.poller.register(self.admin, zmq.POLLIN)
        # While idle too: a worker that dies with nothing to do is noticed at once (health, the
        # router, the breaker), not blamed on the first step planned after it.
        self.poller.register(self.results, zmq.POLLIN)
        self.ring = RingBuffer(channels.plan_ring, reader=None)
        self.num_workers = num_workers
        self.frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
        self.worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
        self.scheduler: Scheduler | None = None
        self.kernels = ""  # the workers' kernel backend (WorkerReady.kernels), for admin get
        self.stats = StatsCollector(served_name(cfg.model.served_model_name, cfg.model.model),
                                    cfg.autoscale, self.replica)
        self._stats_sent = 0.0
        self._early: deque[Any] = deque()  # worker messages read while writing a plan
        self._stalled = False  # work is queued but nothing could be planned
        self._continuous = False  # the engine had work when the last result came back
        # Health: the workers' generation (each replacement group is the next one), whether
        # it has served (the first one counts as serving: only a restart can fail), and what
        # is wrong (None: healthy).
        self.generation = 0
        self._served = True
        self.problem: str | None = None

    def _current(self, msg: Any) -> bool:
        """Whether msg is not a failure of a worker group already replaced (the worker and
        the supervisor may both report one death, and every rank of a broken group)."""
        return not isinstance(msg, WorkerFailed) or msg.generation >= self.generation

    def _worker_message(self) -> Any:
        while True:
            msg = self._early.popleft() if self._early else \
                self.worker_decoder.decode(self.results.recv())
            if not self._current(msg):
                continue
            if isinstance(msg, WorkerReady) and msg.generation != self.generation:
                if msg.generation < self.generation:
                    continue  # a group already replaced, up late
                # A newer group is up before the report of its predecessor's death reached
                # us (ZeroMQ takes its senders in turn, not in order): that death first.
                self._early.appendleft(msg)
                error = f"the workers were replaced (generation {msg.generation} is up)"
                self._lost(error, msg.generation - 1)
                raise WorkerLost(error, blames=False)
            if isinstance(msg, WorkerFailed):
                error = f"worker {msg.rank} failed: {msg.error}"
                if msg.fatal:
                    raise WorkerError(error)
                self._lost(error, msg.generation)
                raise WorkerLost(error)
            return msg

    def _worker_failed(self) -> bool:
        """Has a worker died (so nobody will read a plan)? Asked while a plan waits for ring
        space, and before planning with nothing in flight."""
        while self.results.poll(0):
            self._early.append(self.worker_decoder.decode(self.results.recv()))
        return any(isinstance(m, WorkerFailed) and self._current(m) or
                   isinstance(m, WorkerReady) and m.generation > self.generation
                   for m in self._early)

    def _lost(self, error: str, generation: int) -> None:
        """A worker of `generation` died; a new group is on its way. If this group had not
        served a step yet, its restart failed: the engine is unhealthy until one serves."""
        if not self._served:
            self._set_health(f"the model worker died again after a restart, before serving "
                             f"({error}); restarting it")
        self.generation = generation + 1
        self._served = False

    def _serving(self) -> None:
        self._served = True
        self._set_health(None)

    def _set_health(self, problem: str | None) -> None:
        """Tell the frontend (/health) and the supervisor (systemd) when health changes."""
        if problem == self.problem:
            return
        self.problem = problem
        if problem:
            log.error("engine unhealthy: %s", problem)
        else:
            log.info("engine healthy again: a restarted worker serves")
        self.outputs.send(encode(EngineHealth(problem, self.replica)))
        self.status.put((self.channels.name("health"), problem))

    def _recover(self, reason: WorkerLost, crashed: list[StepPlan]) -> None:
        """End the requests that crashed a worker twice (see Quarantine), wait for the
        replacement workers (a whole tensor-parallel group), then recompute every other
        request from its tokens: their clients see a pause, not an error."""
        assert self.scheduler is not None
        # The circuit breaker counts it; the router spares this replica until it is back.
        self.outputs.send(encode(EngineFault(str(reason), self.replica)))
        if poisoned := self.scheduler.crashed(crashed):
            self.outputs.send(encode(EngineOutputs(poisoned)))
        log.warning("%s; waiting for new workers, then recomputing %d requests", reason,
                    len(self.scheduler.requests))
        self.scheduler.restart()
        self._early = deque(m for m in self._early if not isinstance(m, StepResult))
        back: set[int] = set()
        while len(back) < self.num_workers:
            try:
                msg = self._worker_message()
            except WorkerLost as again:
                log.warning("%s", again)  # a new worker died in its start: another comes
                back.clear()
                continue
            if isinstance(msg, WorkerReady) and msg.generation == self.generation:
                log.info("worker %d is back: %s", msg.rank, msg.description)
                back.add(msg.rank)
        if not self.scheduler.has_work():
            self._serving()  # ready, with nothing to do

    def wait_for_workers(self) -> EngineReady:
        readies: list[WorkerReady] = []
        while len(readies) < self.num_workers:
            msg = self._worker_message()
            assert isinstance(msg, WorkerReady), msg
            readies.append(msg)
        num_blocks = min(r.num_blocks for r in readies)
        self.kernels = readies[0].kernels
        self.scheduler = Scheduler(self.cfg.scheduler, num_blocks, self.cfg.tenants,
                                   speculative=self.cfg.speculative,
                                   overload=self.cfg.overload, window=readies[0].window,
                                   stages=self.cfg.model.pipeline_parallel_size)
        self._report_depth()
        ready = EngineReady(num_blocks=num_blocks, block_size=self.cfg.scheduler.block_size,
                            description=readies[0].description, replica=self.replica)
        self.outputs.send(encode(ready))
        return ready

    def _take_requests(self, block_ms: int) -> None:
        """Handle every message from the frontend that has arrived (waiting up to block_ms)."""
        assert self.scheduler is not None
        ready = dict(self.poller.poll(block_ms))
        if self.admin in ready:
            self._answer_admin()
        if self.requests not in ready:
            return
        # An acknowledgement or a refusal for each new request, at once.
        replies: list[RequestOutput] = []
        while True:
            try:
                raw = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = self.frontend_decoder.decode(raw)
            except msgspec.DecodeError as e:
                log.error("skipped a malformed message from the frontend: %s", e)
                continue
            if isinstance(msg, EngineRequests):
                replies.extend(self.scheduler.add_all(msg.requests))
            elif isinstance(msg, AbortRequest):
                replies.extend(self.scheduler.abort(msg.request_ids))
            elif isinstance(msg, BreakerState):
                self.stats.breaker = msg
        if replies:
            self.outputs.send(encode(EngineOutputs(replies)))

    def run(self) -> None:
        """Keep up to two steps in flight (one computing, the next queued behind it), so the
        worker never waits for this loop; with P pipeline stages up to P (one micro-batch per
        stage); one at a time without async_scheduling."""
        inflight: deque[StepPlan] = deque()
        ahead = max(2, self.cfg.model.pipeline_parallel_size)
        while True:
            # Live (admin set); one step at a time while urgent arrivals must not wait for
            # a step planned ahead of them, and while proposals need the last tokens.
            # Suspects of a crash run one step at a time, so a crash names its step.
            sched = self.scheduler
            depth = ahead if self.cfg.scheduler.async_scheduling and not (sched and (
                sched.interactive() or sched.speculating() or sched.quarantine)) else 1
            if sched is not None:
                sched.in_flight = depth  # micro-batches only while they can overlap
            try:
                self._step(inflight, depth)
            except WorkerLost as e:
                crashed = list(inflight) if e.blames else []  # died with the worker
                inflight.clear()
                self._recover(e, crashed)
                self._stalled = self._continuous = False

    def _step(self, inflight: deque[StepPlan], depth: int) -> None:
        sched = self.scheduler
        assert sched is not None
        busy = bool(inflight) or (sched.has_work() and not self._stalled)
        self._take_requests(0 if busy else (5 if self._stalled else _IDLE_POLL_MS))
        if not inflight:
            while self._worker_failed():
                self._worker_message()  # up to the death, which raises: nothing to blame
            self._gather_batch()
        if expired := sched.expire():
            self.outputs.send(encode(EngineOutputs(expired)))
        plan = sched.schedule() if len(inflight) < depth else None
        if sched.failed:
            self.outputs.send(encode(EngineOutputs(sched.failed)))
            sched.failed = []
        if plan is not None:
            try:
                self.ring.put(encode(plan), should_stop=self._worker_failed)
            except RingClosed:  # no worker will read it: the plans before it died with one
                while True:
                    self._worker_message()  # up to the failure that stopped it, which raises
            inflight.append(plan)
        self._stalled = plan is None and not inflight and sched.has_work()
        if inflight and (plan is None or len(inflight) == depth):
            result = self._worker_message()
            while result.step_id < inflight[0].step_id:
                result = self._worker_message()  # a step planned before a worker was replaced
            assert isinstance(result, StepResult) and result.step_id == inflight[0].step_id
            if not self._served:
                self._serving()
            done = inflight.popleft()
            sched.cost.record(sum(len(s.token_ids) for s in done.seqs), result.compute_s)
            outputs = sched.update(done, result)
            self.stats.record_step(done, result, outputs, self._continuous)
            self._continuous = sched.has_work()
            if outputs:
                self.outputs.send(encode(EngineOutputs(outputs)))
        self._send_stats()

    def _answer_admin(self) -> None:
        """Between two steps, so a change applies atomically to the next step on."""
        assert self.scheduler is not None
        # Every frame: a REP socket can answer only once the whole request is read.
        raw = b"".join(self.admin.recv_multipart())
        try:
            request = msgspec.msgpack.decode(raw, type=AdminRequest)
        except msgspec.DecodeError as e:
            log.warning("malformed admin request: %s", e)
            self.admin.send(encode(AdminReply(False, f"malformed admin request: {e}")))
            return
        reply, new = admin.handle(request, self.cfg, self.stats.snapshot(self.scheduler),
                                  {"kernel_backend": self.kernels})
        if new is not self.cfg:
            log.info("live parameters changed: %s", shown(request.values))
            if _frontend_settings(new) != _frontend_settings(self.cfg):
                self.outputs.send(encode(LiveSettings(**_frontend_settings(new))))
            self.cfg = new
            self.scheduler.configure(new.scheduler, new.tenants, new.speculative, new.overload)
            self._report_depth()
        self.admin.send(encode(reply))

    def _report_depth(self) -> None:
        """With several replicas, the prefix cache tracks what the router wants to know."""
        assert self.scheduler is not None
        if self.channels.replicas > 1:
            self.scheduler.blocks.report_depth = self.cfg.routing.route_prefix_blocks

    def _gather_batch(self) -> None:
        """With batch_wait_ms, an idle engine waits a moment after the first arrival so that
        requests arriving together start in one step."""
        sched = self.scheduler
        assert sched is not None
        wait_s = self.cfg.scheduler.batch_wait_ms / 1000
        if not wait_s or sched.running or not sched.waiting:
            return
        deadline = min(s.arrival_time for s in sched.waiting) + wait_s
        budget = self.cfg.scheduler.max_num_batched_tokens
        while (remaining := deadline - time.time()) > 0 and len(sched.waiting) < \
                self.cfg.scheduler.max_num_seqs and \
                sched.waiting.num_tokens < budget:
            self._take_requests(max(1, int(remaining * 1000)))

    def _send_stats(self) -> None:
        now = time.time()
        if now - self._stats_sent < _STATS_INTERVAL_S:
            return
        self._stats_sent = now
        assert self.scheduler is not None
        snapshot = self.stats.snapshot(self.scheduler)
        self.stats.export(snapshot, self.scheduler, self.cfg)
        gained, lost = self.scheduler.blocks.report()
        if gained or lost:
            self.outputs.send(encode(PrefixReport(self.replica, gained, lost)))
        self.outputs.send(encode(snapshot))

    def fail_all(self, reason: str) -> None:
        """Give every request a terminal error, those still queued in the socket too: nothing
        is silently lost."""
        if self.scheduler is None:
            return
        ids = list(self.scheduler.requests)
        self.scheduler.abort(ids)
        while self.requests.poll(0):
            msg = self.frontend_decoder.decode(self.requests.recv())
            if isinstance(msg, EngineRequests):
                ids += [r.request_id for r in msg.requests]
        self.outputs.send(encode(EngineOutputs([RequestOutput(i, [], "error", reason)
                                                for i in ids])))

    def close(self) -> None:
        self.ring.close()
        self.zmq.destroy(linger=200)


def _frontend_settings(cfg: SurgeConfig) -> dict[str, Any]:
    """The live sections the frontend applies as well (see LiveSettings)."""
    return {"overload": cfg.overload, "routing": cfg.routing, "pools": cfg.pools,
            "tenants": cfg.tenants, "scheduler": cfg.scheduler}


def capacity_report(num_blocks: int, block_size: int) -> str:
    fits = ", ".join(f"{num_blocks // -(-n // block_size)} of {n}" for n in (512, 2048, 8192))
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens = "
            f"{num_blocks * block_size} tokens; concurrent sequences at full length: {fits}")


def run_scheduler(cfg: SurgeConfig, channels: Channels, num_workers: int, status: Any) -> None:
    child_setup(channels.name("scheduler"), cfg)
    loop = SchedulerLoop(cfg, channels, num_workers, status)
    try:
        ready = loop.wait_for_workers()
        status.put((channels.name("scheduler"),
                    capacity_report(ready.num_blocks, ready.block_size)))
        loop.run()
    except WorkerError as e:
        log.error("%s", e)
        loop.fail_all(f"the model worker failed: {e}")
        raise SystemExit(1) from e
    finally:
        loop.close()
