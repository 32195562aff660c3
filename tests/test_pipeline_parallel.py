"""Pipeline parallelism on the CPU (gloo): a model split into stages (with or without tensor
parallelism inside each) gives the greedy tokens of one rank, with P steps in flight."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import subprocess
import sys
import time
from collections import deque
from typing import Any

import pytest
import torch

from gpu_workers.pipeline import PipelineStage, stage_layers
from scheduler.pipeline import micro_batch_seats
from tests.test_tensor_parallel import leave
from tests.tiny_model import save_tiny_llama

N_TOKENS = 10
LAYERS = 6


def _prompts(n: int, seed: int = 5, shared: int = 0) -> dict[str, list[int]]:
    """n random prompts; shared > 0: each starts with the same `shared` tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(1, 250) for _ in range(shared)]
    return {f"p{i}": head + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 30))]
            for i in range(n)}


def _long(n: int) -> dict[str, list[int]]:
    """Prompts holding much of the vocabulary: the n-gram proposer (from one token on) finds
    each new token in them."""
    rng = random.Random(13)
    return {f"r{i}": [rng.randrange(1, 250) for _ in range(100)] for i in range(n)}


# name -> (prompts, scheduler options, KV blocks); "ngram" speculates.
SCENARIOS: dict[str, tuple[dict[str, list[int]], dict[str, Any], int]] = {
    "concurrent": (_prompts(16), {}, 512),
    "chunked": (_prompts(6, seed=7), {"max_num_batched_tokens": 8}, 512),
    "preempted": (_prompts(12, seed=9), {}, 40),
    "prefix": (_prompts(6, seed=11, shared=24), {}, 512),
    "ngram": (_long(4), {}, 512),
}


def _serve(runner: Any, prompts: dict[str, list[int]], options: dict[str, Any], stages: int,
           num_blocks: int, share: Any, ngram: bool = False
           ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The scheduler driven as the scheduler loop drives it, `stages` steps in flight; the
    sampling rank's results reach every rank's (identical) scheduler through `share`."""
    from scheduler.scheduler import Scheduler
    from surge.config import SchedulerConfig, SpeculativeConfig
    from surge.protocol import EngineRequest, SamplingParams

    spec = SpeculativeConfig(speculative_method="ngram", ngram_min=1) if ngram else None
    sched = Scheduler(SchedulerConfig(block_size=4, **options), num_blocks, stages=stages,
                      speculative=spec)
    for name, ids in prompts.items():
        assert sched.add(EngineRequest(request_id=name, prompt_token_ids=ids, arrival_time=0.0,
                                       sampling=SamplingParams(max_tokens=N_TOKENS,
                                                               temperature=0.0))) is None
    tokens: dict[str, list[int]] = {}
    inflight: deque = deque()
    most = 0
    while sched.has_work() or inflight:
        depth = 1 if sched.speculating() else stages  # as the scheduler loop does
        sched.in_flight = depth
        plan = sched.schedule() if len(inflight) < depth else None
        if plan is not None:
            inflight.append((plan, runner.launch(runner.prepare(plan))))
            most = max(most, len(inflight))
        assert plan is not None or inflight, "work is queued but nothing could be scheduled"
        if plan is None or len(inflight) >= depth:
            done, launched = inflight.popleft()
            for out in sched.update(done, share(runner.finish(launched))):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, {"preemptions": sched.num_preemptions, "in_flight": most,
                    "hits": sched.blocks.hit_tokens, "proposed": sched.spec.proposed_tokens}


def _rank_main(rank: int, tp_size: int, split: str | None, stages: int, folder: str,
               store: str, out: mp.Queue) -> None:
    """One worker of the group: join it, load its stage's shard, serve every scenario."""
    import torch.distributed as dist

    from gpu_workers.families import read_family
    from gpu_workers.loader import load_model
    from gpu_workers.model_runner import ModelRunner
    from gpu_workers.parallel import init_groups
    from surge.model_files import resolve_model

    torch.set_num_threads(1)
    files = resolve_model(folder)
    splits = stage_layers(read_family(files)[0].num_layers, stages, split)
    tp, stage = init_groups(rank, tp_size, splits, torch.device("cpu"), store)
    model = load_model(files, torch.device("cpu"), torch.float32, tp, stage=stage)
    sampler = (stages - 1) * tp_size  # the last stage's rank 0
    world = dist.new_group(list(range(stages * tp_size))) if dist.is_initialized() else None

    def share(result: Any) -> Any:
        if world is None:
            return result
        box = [result]
        dist.broadcast_object_list(box, src=sampler, group=world)
        return box[0]

    answers = {}
    for name, (prompts, options, num_blocks) in SCENARIOS.items():
        runner = ModelRunner(model, num_blocks, 4, torch.device("cpu"), torch.float32)
        runner.warm_up()
        answers[name] = _serve(runner, prompts, options, stages, num_blocks, share,
                               ngram=name == "ngram")
    info = {"layers": [layer.attn.num_heads for layer in model.layers],
            "kv_layers": ModelRunner(model, 1, 4, torch.device("cpu"),
                                     torch.float32).kv_cache.shape[0],
            "embed": model.embed is not None, "head": model.norm is not None}
    out.put((rank, answers, info))
    leave(out)


def _run_group(folder: str, tmp_path, stages: int, tp_size: int = 1,
               split: str | None = None) -> dict[int, tuple[dict, dict]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / f"store-{stages}-{tp_size}-{split}")
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, split, stages, folder, store, out))
             for r in range(stages * tp_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[dict, dict]] = {}
    deadline = time.monotonic() + 600
    while len(results) < len(procs):
        # A rank that died leaves its neighbours waiting on it for ever: fail at once.
        if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
            for p in procs:
                p.kill()
            raise AssertionError(f"a rank exited with {dead[0]}")
        assert time.monotonic() < deadline, "the group did not answer in 10 minutes"
        try:
            rank, answers, info = out.get(timeout=1)
        except queue.Empty:
            continue
        results[rank] = (answers, info)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-untied")
    save_tiny_llama(str(folder), heads=4, kv_heads=2, layers=LAYERS, vocab=256)
    return str(folder)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-tied")
    save_tiny_llama(str(folder), heads=4, kv_heads=2, layers=LAYERS, vocab=256, tie=True,
                    seed=1)
    return str(folder)


@pytest.fixture(scope="module")
def untied_one(untied, tmp_path_factory) -> dict:
    return _run_group(untied, tmp_path_factory.mktemp("one"), 1)[0][0]


def _tokens(answers: dict) -> dict[str, dict[str, list[int]]]:
    return {name: tokens for name, (tokens, _) in answers.items()}


def _check(group: dict[int, tuple[dict, dict]], one: dict, stages: int) -> None:
    """The sampling rank's tokens are the one rank's in every scenario, with the scenario's
    circumstances really met and the pipeline really full."""
    sampler = max(group)
    answers = group[sampler][0]
    assert _tokens(answers) == _tokens(one)
    assert all(len(t) == N_TOKENS for t in answers["concurrent"][0].values())
    assert answers["preempted"][1]["preemptions"] > 0
    assert answers["prefix"][1]["hits"] > 0
    assert answers["ngram"][1]["proposed"] > 0  # n-gram proposals verified on the last stage
    assert answers["concurrent"][1]["in_flight"] == stages
    for rank, (other, _) in group.items():  # every rank's scheduler saw the same results
        assert _tokens(other) == _tokens(answers), rank


def test_two_stages_give_the_one_rank_tokens(untied, untied_one, tmp_path):
    group = _run_group(untied, tmp_path, 2)
    _check(group, untied_one, 2)
    (_, first), (_, last) = group[0], group[1]
    assert first["kv_layers"] == last["kv_layers"] == LAYERS // 2  # each its own layers' cache
    assert first["embed"] and not first["head"] and last["head"] and not last["embed"]


def test_two_stages_of_two_tensor_parallel_ranks(untied, untied_one, tmp_path):
    group = _run_group(untied, tmp_path, 2, tp_size=2)
    _check(group, untied_one, 2)
    assert all(info["layers"] == [2] * (LAYERS // 2) for _, info in group.values())  # 2 of 4


def test_three_stages_uneven_split_with_a_tied_head(tied, tmp_path):
    """Layers 1 | 3 | 2; the last stage holds the embedding matrix as its head."""
    one = _run_group(tied, tmp_path, 1)[0][0]
    group = _run_group(tied, tmp_path, 3, split="1,3,2")
    _check(group, one, 3)
    assert [group[r][1]["kv_layers"] for r in range(3)] == [1, 3, 2]
    assert [group[r][1]["embed"] for r in range(3)] == [True, False, True]


def test_layer_split():
    assert stage_layers(30, 3) == [range(0, 10), range(10, 20), range(20, 30)]
    assert stage_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_layers(6, 3, "1,3,2") == [range(0, 1), range(1, 4), range(4, 6)]
    assert stage_layers(6, 1) == [range(0, 6)]
    for spec in ("1,3", "3,3,1", "0,3,3", "a,b,c"):
        with pytest.raises(ValueError, match="--pipeline-layers"):
            stage_layers(6, 3, spec)
    with pytest.raises(ValueError, match="more stages than the model's 6 layers"):
        stage_layers(6, 7)


def test_a_stage_reads_only_its_own_weights():
    stage = PipelineStage(1, 3, range(10, 20))
    assert stage.holds("model.layers.10.mlp.down_proj.weight")
    assert not stage.holds("model.layers.20.mlp.down_proj.weight")
    assert not stage.holds("model.layers.9.self_attn.q_proj.weight")
    assert not stage.holds("model.embed_tokens.weight") and not stage.holds("lm_head.weight")
    last = PipelineStage(2, 3, range(20, 30))
    assert last.holds("lm_head.weight") and last.holds("model.norm.weight")
    assert last.holds("model.embed_tokens.weight")  # a tied head reads it


def test_micro_batches_share_the_sequences_out():
    assert micro_batch_seats(1, 16, 0, 128) == 128
    assert micro_batch_seats(2, 16, 0, 128) == 8
    assert micro_batch_seats(3, 16, 0, 128) == 6
    assert micro_batch_seats(2, 1, 0, 128) == 1
    assert micro_batch_seats(4, 100, 100, 16) == 16


def test_no_step_plans_a_token_still_in_flight():
    """With stages, the steps in flight hold disjoint sequences and never a placeholder."""
    from scheduler.scheduler import Scheduler
    from surge.config import SchedulerConfig
    from surge.protocol import PREVIOUS_TOKEN, EngineRequest, SamplingParams

    sched = Scheduler(SchedulerConfig(block_size=4), 256, stages=2)
    for i in range(8):
        sched.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3 + i],
                                arrival_time=0.0, sampling=SamplingParams(max_tokens=4)))
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None
    ids = [{s.seq_id for s in p.seqs} for p in (first, second)]
    assert len(ids[0]) == len(ids[1]) == 4 and not ids[0] & ids[1]
    assert sched.schedule() is None  # every sequence waits for its token
    for plan in (first, second):
        assert all(PREVIOUS_TOKEN not in s.token_ids for s in plan.seqs)


def _refused(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surge.cli", "serve", "--device", "cpu",
                           *args], capture_output=True, text=True, timeout=120)


def test_bad_splits_and_a_draft_are_refused_at_start():
    out = _refused("--pipeline-parallel-size", "31")
    assert out.returncode == 2 and "more stages than the model's 30 layers" in out.stderr
    out = _refused("--pipeline-parallel-size", "2", "--pipeline-layers", "10,10")
    assert out.returncode == 2 and "sum to the model's 30 layers" in out.stderr
    out = _refused("--pipeline-parallel-size", "2", "--draft-layers", "4")
    assert out.returncode == 2 and "one rank" in out.stderr


def _total(url: str, name: str) -> float:
    """A metric summed over its labels (the scheduler exports about once a second)."""
    from tests.test_metrics import _samples

    return sum(v for (n, _), v in _samples(url).items() if n == name)


@pytest.fixture(scope="module")
def one_rank_answers() -> tuple[list[str], list[str]]:
    """The default model on one rank: greedy chat answers, and 16 greedy streams at once."""
    from tests.server import ServerProcess
    from tests.test_shutdown import _streams
    from tests.test_tensor_parallel import _PROMPTS, _greedy_over_http

    one = ServerProcess("--device", "cpu")
    try:
        one.wait_ready(300)
        return _greedy_over_http(one.url, _PROMPTS), [t for t, _ in _streams(one, 16, 24)]
    finally:
        assert one.stop() == 0, one.output()


@pytest.fixture(scope="module")
def three_stages(tmp_path_factory):
    """SmolLM2's 30 layers over 3 CPU stages, in float32, with prompts prefilled in chunks of
    16 tokens and a KV cache small enough for 16 streams to preempt each other."""
    from tests.server import ServerProcess

    server = ServerProcess("--device", "cpu", "--pipeline-parallel-size", "3",
                           "--max-num-batched-tokens", "16", kv_cache_memory="12MiB",
                           env={"XDG_RUNTIME_DIR": str(tmp_path_factory.mktemp("runtime"))})
    try:
        yield server.wait_ready(300)
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.slow
def test_three_served_stages_give_the_one_rank_answers(three_stages, one_rank_answers):
    from tests.test_shutdown import _streams
    from tests.test_tensor_parallel import _PROMPTS, _greedy_over_http

    chat, streams = one_rank_answers
    assert "stage 3 of 3, layers 20-29" in three_stages.output()
    assert _greedy_over_http(three_stages.url, _PROMPTS) == chat
    assert _total(three_stages.url, "surge_prefix_cache_hit_tokens_total") > 0  # system prompt
    assert [t for t, _ in _streams(three_stages, 16, 24)] == streams
    time.sleep(1.5)  # the scheduler's next export
    assert _total(three_stages.url, "surge_preemptions_total") > 0
    assert _total(three_stages.url, "surge_worker_busy_seconds_total") > 0


@pytest.mark.slow
def test_killed_stage_replaces_the_group_and_streams_finish_identically(three_stages):
    """kill -9 the middle stage mid-stream: a new group of three starts and every stream ends
    with the text of an undisturbed run."""
    from tests.test_shutdown import assert_killed_worker_replaces_its_group

    assert_killed_worker_replaces_its_group(three_stages, "surge: worker 1", 3)
