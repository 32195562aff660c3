"""`surge serve`: start the workers, scheduler and frontend, watch them, and stop them cleanly."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import setproctitle
import zmq

from shm.ring import RingBuffer
from surge.config import SurgeConfig
from surge.config_live import flatten, restart_only, with_live
from surge.config_load import load_config, overrides
from surge.log import announce, setup_logging
from surge.process import title
from surge.protocol import WorkerFailed, encode
from surge.runtime import Channels, record_reload
from surge.systemd_notify import notify, watchdog_interval

log = logging.getLogger("surge.supervisor")
_STOP_TIMEOUT_S = 10.0
_RESTART_WINDOW_S = 60.0


def _run_worker(*args: Any) -> None:
    """A worker's entry: torch is imported in the worker alone (the supervisor would spend 2 s
    of every start-up and 250 MB on it). A rank of a group ends through exit_process."""
    from gpu_workers.parallel import exit_process
    from gpu_workers.worker import run_worker

    try:
        run_worker(*args)
    except SystemExit as e:
        exit_process(e.code)
    exit_process(0)


class _Replica:
    """One data-parallel engine: its channels, plan ring, worker generation and restarts."""

    def __init__(self, channels: Channels, context: zmq.Context) -> None:
        self.channels = channels
        self.ring: RingBuffer | None = None
        self.generation = 0  # of workers: a group is replaced as a whole
        self.restarts: list[float] = []
        self.problem: str | None = None  # unhealthy (its scheduler says why)
        # To speak for a worker that died without a word (see _tell_scheduler).
        self.results = context.socket(zmq.PUSH)
        self.results.connect(channels.results)


class Supervisor:
    def __init__(self, cfg: SurgeConfig, flags: dict[str, Any] | None = None,
                 loaded: SurgeConfig | None = None) -> None:
        """cfg.model has its devices resolved (gpu_workers.devices.resolve); loaded: cfg as
        read, before that (what a reload's options needing a restart are compared with)."""
        self.cfg = cfg
        self.num_workers = cfg.model.group_size  # of one replica: P stages x T ranks
        self.flags = flags or {}  # to rebuild the config on reload
        self.started_with = loaded or cfg
        self.reload_requested = False
        self.ctx = mp.get_context("spawn")
        num_replicas = cfg.model.data_parallel_size
        self.channels = msgspec.structs.replace(Channels.create(), replicas=num_replicas)
        # Every child inherits this and writes its metrics there (see surge/metrics.py).
        metrics_dir = os.path.join(self.channels.runtime_dir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        # What `surge admin` needs to find this server and its config file.
        self.channels.describe(host=cfg.server.host, port=cfg.server.port,
                               config=self.flags.get("config") or os.environ.get("SURGE_CONFIG"),
                               api_keys_file=cfg.server.api_keys_file,
                               overrides={name: source for name, (source, _) in
                                          overrides(self.flags, os.environ).items()})
        self.status: Any = self.ctx.Queue()
        self.procs: list[BaseProcess] = []
        self.stopping = False
        self.zmq = zmq.Context()
        self.replicas = [_Replica(self.channels.for_replica(i, num_replicas), self.zmq)
                         for i in range(num_replicas)]
        self.replica_of: dict[str, _Replica] = {}  # by process name (workers, schedulers)

    @property
    def problem(self) -> str | None:
        """Why the engine is unhealthy: every replica is (with several, one is degraded)."""
        problems = [r.problem for r in self.replicas]
        return "; ".join(p for p in problems if p) if all(problems) else None

    def _start(self, name: str, target: Any, channels: Channels, *args: Any) -> None:
        proc = self.ctx.Process(target=target, name=name, args=(self.cfg, channels, *args),
                                daemon=False)
        proc.start()
        self.procs.append(proc)

    def start(self) -> None:
        from scheduler.loop import run_scheduler
        from server.main import run_frontend

        for replica in self.replicas:
            # The supervisor owns the shared-memory segments, so they are removed however
            # children end.
            replica.ring = RingBuffer.create(replica.channels.plan_ring,
                                             num_readers=self.num_workers)
            self._start_workers(replica)
            name = replica.channels.name("scheduler")
            self.replica_of[name] = replica
            self._start(name, run_scheduler, replica.channels, self.num_workers, self.status)
        self._start("frontend", run_frontend, self.channels, self.status)

    def _start_workers(self, replica: _Replica) -> None:
        for rank in range(self.num_workers):
            name = replica.channels.name("worker", rank)
            self.replica_of[name] = replica
            self._start(name, _run_worker, replica.channels, rank, self.status,
                        replica.generation)

    def _stop_workers(self, replica: _Replica) -> None:
        """The workers left of a broken group: they would wait on their dead peer for ever."""
        from prometheus_client import multiprocess

        for proc in [p for p in self.procs if p.name.startswith("worker")
                     and self.replica_of[p.name] is replica]:
            if proc.is_alive():
                proc.terminate()
                proc.join(_STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
            multiprocess.mark_process_dead(proc.pid)  # its live gauges no longer count
            self.procs.remove(proc)

    def wait_ready(self) -> bool:
        """Wait for every child's ready report; False if one died or a stop was asked first."""
        pending = {p.name for p in self.procs}
        while pending and not self.stopping:
            try:
                name, info = self.status.get(timeout=0.2)
            except queue.Empty:
                if dead := [p for p in self.procs if p.exitcode is not None]:
                    log.error("%s exited with code %s during start-up", dead[0].name,
                              dead[0].exitcode)
                    return False
                continue
            log.info("%s ready: %s", name, info)
            pending.discard(name)
        return not pending

    def watch(self) -> int:
        """Block until a stop signal or a child's death; the exit code for `surge serve`.
        A dead worker is replaced with the rest of its replica's group (that scheduler
        recomputes its requests; other replicas keep serving) unless the replica's workers died
        too often lately; any other death (a scheduler's too) stops surge."""
        interval = watchdog_interval()
        pinged = 0.0
        while not self.stopping:
            self._read_status()
            if interval and not self.problem and time.monotonic() - pinged >= interval:
                # Every child is alive (a dead one is handled below) and the engine is healthy:
                # while it is not, systemd's watchdog runs out and restarts surge.
                notify("WATCHDOG=1")
                pinged = time.monotonic()
            if self.reload_requested:
                self.reload_requested = False
                self.reload()
            ready = wait([p.sentinel for p in self.procs], timeout=0.2)
            if not ready:
                continue
            dead = next(p for p in self.procs if p.sentinel in ready)
            # Its sentinel closes a moment before the kernel can report its exit code.
            dead.join(_STOP_TIMEOUT_S)
            if not dead.name.startswith("worker"):
                log.error("%s exited unexpectedly (code %s); stopping surge", dead.name,
                          dead.exitcode)
                frontend = next((p for p in self.procs if p.name == "frontend"), None)
                if dead.name.startswith("scheduler") and frontend is not None and \
                        frontend.is_alive():
                    # Nothing in flight can finish now: the frontend answers it at once.
                    os.kill(frontend.pid, signal.SIGUSR1)
                return 1
            replica = self.replica_of[dead.name]
            now = time.monotonic()
            replica.restarts = [t for t in replica.restarts if now - t < _RESTART_WINDOW_S]
            if len(replica.restarts) >= self.cfg.supervisor.max_worker_restarts:
                log.error("%s exited (code %s) after %d restarts in %.0fs; giving up",
                          dead.name, dead.exitcode, len(replica.restarts), _RESTART_WINDOW_S)
                self._tell_scheduler(dead, fatal=True)
                self._wait_for_answers(replica)
                return 1
            replica.restarts.append(now)
            others = " and the rest of its group" if self.num_workers > 1 else ""
            log.warning("%s exited (code %s); starting new workers%s", dead.name,
                        dead.exitcode, others)
            notify(f"STATUS=replacing {dead.name} (exit code {dead.exitcode})")
            self._tell_scheduler(dead, fatal=False)
            self._stop_workers(replica)
            replica.generation += 1
            self._start_workers(replica)
        return 0

    def _read_status(self) -> None:
        """Reports since start-up: new workers ready, and the engine's health changing."""
        while True:
            try:
                name, info = self.status.get_nowait()
            except queue.Empty:
                return
            if not name.startswith("health"):
                continue  # a new worker's ready report: the scheduler logs it
            self.replicas[int(name.split()[-1]) if " " in name else 0].problem = info
            if self.problem:
                notify(f"STATUS=unhealthy: {self.problem}")
            elif ailing := [r.problem for r in self.replicas if r.problem]:
                notify(f"STATUS=degraded: {'; '.join(ailing)}")
            else:
                notify(f"STATUS=serving on http://{self.cfg.server.host}:{self.cfg.server.port}")

    def reload(self) -> None:
        """SIGHUP: read the config again and hand the live parameters to the scheduler."""
        from surge.admin import ask_all
        from surge.config import ConfigError

        try:
            new = load_config(self.flags)
        except ConfigError as e:
            self._reloaded(False, f"reload refused, nothing changed: {e}")
            return
        addresses = [r.channels.admin for r in self.replicas]
        before = ask_all(addresses, "get").values  # live edits included
        reply = ask_all(addresses, "reload", flatten(new))
        if reply.ok:
            self.cfg = with_live(self.cfg, new)
            # (a table entry the file no longer has is gone: its keys are dotted; get's
            # others, such as the kernel backend, are not parameters)
            changed = sorted({k for k, v in reply.values.items() if before.get(k) != v} |
                             {k for k in before if "." in k and k not in reply.values})
            message = f"reloaded: {', '.join(changed) or 'no live parameter'} changed"
            if restart := restart_only(self.started_with, new):
                message += f"; not applied, as only a restart does: {', '.join(restart)}"
            self._reloaded(True, message)
        elif reply.message.startswith("replica "):  # a replica after the first refused it
            self._reloaded(False, f"reload refused partway: {reply.message}")
        else:
            self._reloaded(False, f"reload refused, nothing changed: {reply.message}")

    def _reloaded(self, ok: bool, message: str) -> None:
        """A reload's outcome: in the log, and for `surge admin reload` to report."""
        log.log(logging.INFO if ok else logging.ERROR, "%s", message)
        record_reload(self.channels.runtime_dir, ok, message)

    def _tell_scheduler(self, dead: BaseProcess, fatal: bool) -> None:
        """A worker killed outright says nothing itself: say it for it."""
        rank = int(dead.name.split()[-1].split(".")[-1])
        error = f"exited with code {dead.exitcode}"
        replica = self.replica_of[dead.name]
        replica.results.send(encode(WorkerFailed(rank, error, fatal, replica.generation)))

    def _wait_for_answers(self, replica: _Replica) -> None:
        """Let the scheduler end every request and the frontend write the errors out."""
        name = replica.channels.name("scheduler")
        scheduler = next(p for p in self.procs if p.name == name)
        scheduler.join(_STOP_TIMEOUT_S / 2)
        time.sleep(0.5)

    def stop(self) -> None:
        """Stop the frontend first (no new work), then the scheduler, then the workers."""
        order = {"frontend": 0, "scheduler": 1}
        for proc in sorted(self.procs, key=lambda p: order.get(p.name.split()[0], 2)):
            if proc.is_alive():
                proc.terminate()
            # The frontend first lets requests in flight finish (the drain).
            patience = _STOP_TIMEOUT_S + (self.cfg.server.drain_timeout_s
                                          if proc.name == "frontend" else 0)
            proc.join(patience)
            if proc.is_alive():
                log.warning("%s did not stop in %.0fs; killing it", proc.name, patience)
                proc.kill()
                proc.join()
        self.status.close()
        self.status.join_thread()
        self.zmq.destroy(linger=0)
        for replica in self.replicas:
            if replica.ring is not None:
                replica.ring.close()
                replica.ring.unlink()
        self.channels.remove()


def serve(cfg: SurgeConfig, flags: dict[str, Any] | None = None,
          loaded: SurgeConfig | None = None) -> int:
    """Run the server until it stops; its exit code. cfg, flags, loaded: see Supervisor."""
    # Before the runtime dir records this pid: `surge admin` trusts it by this title.
    setproctitle.setproctitle(title("supervisor"))
    setup_logging(cfg.server.log_level, cfg.server.log_json, "supervisor")
    sup = Supervisor(cfg, flags, loaded)

    def request_stop(signum: int, frame: object) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        sup.stopping = True

    def request_reload(signum: int, frame: object) -> None:
        sup.reload_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGHUP, request_reload)
    started = time.monotonic()
    code = 1
    url = f"http://{cfg.server.host}:{cfg.server.port}"
    try:
        notify("STATUS=loading the model")
        sup.start()
        if sup.wait_ready():
            took = round(time.monotonic() - started, 1)
            announce(f"surge ready on {url} (started in {took:.1f}s)", event="ready", url=url,
                     startup_s=took)
            notify("READY=1", f"STATUS=serving on {url}")
            code = sup.watch()
        elif sup.stopping:
            code = 0
    finally:
        notify("STOPPING=1", "STATUS=draining and stopping")
        sup.stop()
    return code
