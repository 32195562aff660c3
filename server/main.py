"""The frontend process: load the tokenizer, serve HTTP on uvloop, stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
from typing import Any

import uvloop
from aiohttp import web

from server.app import Frontend, build_app
from server.batch_api import BatchApi, add_off_routes
from server.batch_runner import BatchRunner
from server.batch_store import BatchStore, StateDirBusy, default_state_dir
from server.engine_client import EngineClient
from server.result_cache import ResultCache, model_scope
from server.tokenizer import Tokenizer
from server.webhooks import Webhooks
from surge.config import SurgeConfig
from surge.grammar import write_tokenizer
from surge.model_files import (
    max_model_len,
    resolve_model,
    served_name,
    tokenizer_files,
    weights_fingerprint,
)
from surge.process import child_setup
from surge.runtime import Channels

log = logging.getLogger("surge.frontend")


async def _serve(cfg: SurgeConfig, channels: Channels, status: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    files = resolve_model(cfg.model.model)
    tokenizer = Tokenizer(tokenizer_files(cfg.model.model, cfg.model.tokenizer))
    write_tokenizer(tokenizer.hf, tokenizer.eos_token_ids, channels.runtime_dir)
    engine = EngineClient(channels, cfg)
    # From the supervisor: the scheduler is gone, so no request in flight can finish.
    loop.add_signal_handler(signal.SIGUSR1, engine.fail_all,
                            "the scheduler stopped unexpectedly; retry the request")
    name = served_name(cfg.model.served_model_name, cfg.model.model)
    cache = ResultCache.of(cfg.cache, model_scope(name, weights_fingerprint(files), cfg.model),
                           tokenizer.sampling_defaults)
    frontend = Frontend(tokenizer, engine, name, max_model_len(files), cfg.server,
                        root=files.path, cache=cache)
    app = build_app(frontend)
    background: list[asyncio.Task] = []
    try:
        store: BatchStore | None = BatchStore(cfg.batch.state_dir or default_state_dir(),
                                            cfg.batch.batch_retention_s)
    except (StateDirBusy, OSError, sqlite3.Error) as e:  # busy, unwritable, not a database
        log.error("the Batch API is off: %s", e)
        store = None
        add_off_routes(app, str(e))
    if store is not None:
        webhooks = Webhooks(store, lambda: engine.tenants, cfg.batch)
        batches = BatchRunner(store, frontend, webhooks, cfg.batch)
        frontend.batch_stats = batches.stats
        BatchApi(store, batches, webhooks, frontend, cfg.batch).add_routes(app)
    # Open streams get a few seconds to finish on SIGTERM, inside the supervisor's patience.
    runner = web.AppRunner(app, handler_cancellation=True,
                           access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=cfg.server.keepalive_timeout_s)
    await runner.setup()
    assert runner.server is not None  # set up just above
    listener = await frontend.connections.listen(runner.server, cfg.server.host,
                                                 cfg.server.port)
    log.info("connections: at most %d, request headers within %gs, keep-alive %gs",
             frontend.connections.max_connections, cfg.server.header_timeout_s,
             cfg.server.keepalive_timeout_s)
    try:
        ready_wait = asyncio.ensure_future(engine.ready)
        stop_wait = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ready_wait, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if ready_wait.done():
            status.put(("frontend", f"serving {frontend.translator.model_name!r} on "
                                    f"http://{cfg.server.host}:{cfg.server.port}"))
            if store is not None:
                log.info("batch state in %s", store.root)
                background += [asyncio.create_task(batches.run()),
                               asyncio.create_task(webhooks.run())]
            await stop_wait
            await _drain(frontend, cfg.server.drain_timeout_s)
        else:
            ready_wait.cancel()
    finally:
        listener.close()  # no new connections; runner.cleanup() ends the open ones
        for task in background:  # lines in flight stay pending: they run after a restart
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await runner.cleanup()
        if store is not None:
            store.close()
        engine.close()
        if frontend.tracing is not None:
            frontend.tracing.shutdown()  # the last spans go out


async def _drain(frontend: Frontend, timeout_s: float) -> None:
    """Stop taking work (/health says so), let what is in flight finish, then end the rest
    with an error they can read."""
    frontend.draining = True
    await frontend.sockets.close_idle()
    log.info("draining %d requests (up to %.0fs)", frontend.in_flight, timeout_s)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while frontend.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if frontend.in_flight:
        log.warning("drain timeout: ending %d requests", frontend.in_flight)
        frontend.engine.fail_all(f"surge shut down before this request finished (drain "
                                 f"timeout {timeout_s:g}s); retry it")
        for _ in range(40):  # let the handlers write their errors out
            if not frontend.in_flight:
                break
            await asyncio.sleep(0.05)


def run_frontend(cfg: SurgeConfig, channels: Channels, status: Any) -> None:
    child_setup("frontend", cfg, raise_on_sigterm=False, own_group=False)
    uvloop.run(_serve(cfg, channels, status))
