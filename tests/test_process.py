"""Scheduler and worker processes through the real ZeroMQ + shared-memory transport."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import msgspec
import pytest
import zmq

from gpu_workers.devices import resolve as resolve_devices
from gpu_workers.worker import run_worker
from scheduler.loop import run_scheduler
from shm.ring import RingBuffer
from surge.config_load import load_config
from surge.protocol import (
    AbortRequest,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    EngineRequests,
    EngineStats,
    FrontendMessage,
    SamplingParams,
    SchedulerMessage,
    encode,
)
from surge.runtime import Channels
from tests.tiny_model import hf_greedy, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    save_tiny_llama(folder)
    return folder


class Engine:
    """The scheduler + one worker, with this test in the frontend's seat."""

    def __init__(self, model: str, **scheduler: object) -> None:
        env = {"SURGE_MODEL": model, "SURGE_DTYPE": "float32", "SURGE_KV_CACHE_MEMORY": "8MiB"}
        env.update({f"SURGE_{k.upper()}": str(v) for k, v in scheduler.items()})
        cfg = load_config({}, env)
        self.cfg = msgspec.structs.replace(cfg, model=resolve_devices(cfg.model))
        self.channels = Channels.create()
        self.ring = RingBuffer.create(self.channels.plan_ring)
        self.zmq = zmq.Context()
        self.outputs = self.zmq.socket(zmq.PULL)
        self.outputs.bind(self.channels.outputs)
        self.requests = self.zmq.socket(zmq.PUSH)
        self.requests.connect(self.channels.requests)
        ctx = mp.get_context("spawn")
        status = ctx.Queue()
        self.procs = [ctx.Process(target=run_worker, args=(self.cfg, self.channels, 0, status)),
                      ctx.Process(target=run_scheduler, args=(self.cfg, self.channels, 1, status))]
        for p in self.procs:
            p.start()
        self.decoder = msgspec.msgpack.Decoder(SchedulerMessage)
        ready = self._recv(120)
        assert isinstance(ready, EngineReady), ready
        self.ready = ready

    def _recv(self, timeout: float):
        assert self.outputs.poll(int(timeout * 1000)), "no message from the scheduler"
        return self.decoder.decode(self.outputs.recv())

    def submit(self, rid: str, prompt: list[int], max_tokens: int, **sampling: object) -> None:
        self.submit_all([_request(rid, prompt, max_tokens, **sampling)])

    def submit_all(self, requests: list[EngineRequest]) -> None:
        """One message, as the frontend sends one API request's choices."""
        self.requests.send(encode(EngineRequests(requests)))

    def collect(self, n: int, timeout: float = 60) -> dict[str, tuple[list[int], str]]:
        done: dict[str, tuple[list[int], str]] = {}
        tokens: dict[str, list[int]] = {}
        while len(done) < n:
            msg = self._recv(timeout)
            if isinstance(msg, EngineStats):
                continue
            assert isinstance(msg, EngineOutputs)
            for out in msg.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason:
                    done[out.request_id] = (tokens[out.request_id], out.finish_reason)
        return done

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            p.join(10)
        codes = [p.exitcode for p in self.procs]
        self.zmq.destroy(linger=0)
        self.ring.unlink()
        self.channels.remove()
        assert codes == [0, 0], codes


def _request(rid: str, prompt: list[int], max_tokens: int, **sampling: object
             ) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, arrival_time=time.time(),
                         sampling=SamplingParams(max_tokens=max_tokens, **sampling))


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, block_size=4, max_num_batched_tokens=24)
    yield eng
    eng.close()


def test_greedy_through_the_transport_matches_reference(engine, tiny_model):
    prompts = {f"r{i}": [(7 * i + j) % 250 + 1 for j in range(3 + 9 * i)] for i in range(5)}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, 12, temperature=0.0)
    done = engine.collect(len(prompts))
    for rid, prompt in prompts.items():
        tokens, reason = done[rid]
        assert reason == "length"
        assert tokens == hf_greedy(tiny_model, prompt, 12), rid


def test_stop_token_and_abort(engine, tiny_model):
    # A prompt whose greedy continuation brings a new token after a few steps: stop on that.
    for start in range(1, 200):
        prompt = [start, start + 1, start + 2, start + 3]
        greedy = hf_greedy(tiny_model, prompt, 8)
        k = next((k for k in range(2, 8) if greedy[k] not in greedy[:k]), None)
        if k is not None:
            break
    assert k is not None
    engine.submit("stops", prompt, 50, temperature=0.0, stop_token_ids=[greedy[k]])
    tokens, reason = engine.collect(1)["stops"]
    assert (tokens, reason) == (greedy[: k + 1], "stop")
    engine.submit("long", prompt, 400, temperature=0.0)
    engine.requests.send(encode(AbortRequest(["long"])))
    tokens, reason = engine.collect(1)["long"]
    assert reason == "abort" and len(tokens) < 400


def test_oversized_request_is_refused(engine):
    capacity = engine.ready.num_blocks * engine.ready.block_size
    engine.submit("huge", [1] * 10, capacity, temperature=0.0)
    tokens, reason = engine.collect(1)["huge"]
    assert reason == "error" and tokens == []


def test_one_message_of_requests_round_trips():
    message = EngineRequests([_request(f"cmpl-1-{i}", [5, i + 1], 3, seed=i) for i in range(3)])
    assert msgspec.msgpack.Decoder(FrontendMessage).decode(encode(message)) == message


def test_the_requests_of_one_message_are_admitted_all_or_none(engine, tiny_model):
    """Three choices in one message all run; three where one can never fit are all refused
    with its reason, and none of them runs."""
    engine.submit_all([_request(f"unit{i}", [3, 4, 5 + i], 4, temperature=0.0)
                       for i in range(3)])
    done = engine.collect(3)
    assert all(reason == "length" and len(tokens) == 4 for tokens, reason in done.values())
    capacity = engine.ready.num_blocks * engine.ready.block_size
    engine.submit_all([_request("fits0", [3, 4], 4), _request("never", [3, 4], capacity),
                       _request("fits1", [3, 4], 4)])
    refused = engine.collect(3)
    assert sorted(refused) == ["fits0", "fits1", "never"]
    assert all(out == ([], "error") for out in refused.values())
    stats = _stats(engine)
    assert (stats.running, stats.waiting) == (0, 0)


def test_nothing_left_behind(tiny_model):
    eng = Engine(tiny_model)
    ring_path, runtime = eng.ring.path, eng.channels.runtime_dir
    eng.close()
    assert not os.path.exists(ring_path) and not os.path.exists(runtime)


def _stats(engine: Engine, timeout: float = 10) -> EngineStats:
    while True:
        msg = engine._recv(timeout)
        if isinstance(msg, EngineStats):
            return msg


def test_abort_frees_blocks_at_once(engine):
    for i in range(4):
        engine.submit(f"gone{i}", list(range(1, 40)), 300, temperature=0.0)
    engine.requests.send(encode(AbortRequest([f"gone{i}" for i in range(4)])))
    assert {r for r, (_, reason) in engine.collect(4).items() if reason == "abort"} == \
        {f"gone{i}" for i in range(4)}
    stats = _stats(engine)
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)


def test_batch_wait_gathers_arrivals_into_one_first_step(tiny_model):
    eng = Engine(tiny_model, batch_wait_ms=400)
    try:
        eng.submit("a", [3, 4, 5], 2, temperature=0.0)
        time.sleep(0.1)
        eng.submit("b", [6, 7, 8], 2, temperature=0.0)
        while True:  # past the acknowledgements (outputs without tokens)
            msg = eng._recv(30)
            if isinstance(msg, EngineOutputs) and any(o.new_token_ids for o in msg.outputs):
                break
        # Both started in the same step, so their first tokens come back together.
        assert {o.request_id for o in msg.outputs if o.new_token_ids} == {"a", "b"}
    finally:
        eng.close()
