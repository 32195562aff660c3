"""Tensor parallelism on the CPU (gloo): a model split over N ranks gives the tokens of one rank."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import torch

from gpu_workers.families import LlamaConfig
from gpu_workers.loader import shard
from gpu_workers.parallel import TensorParallel
from tests.tiny_model import save_tiny_llama

N_TOKENS = 12


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(3)
    return {f"p{i}": [rng.randrange(1, 250) for _ in range(rng.randrange(1, 40))]
            for i in range(5)}


def _rank_main(rank: int, size: int, folder: str, store: str, out: mp.Queue,
               quantization: str, expert_parallel: bool, n_tokens: int,
               prompts: dict[str, list[int]]) -> None:
    """One rank: join the group, load its shard, serve every prompt with the in-process
    scheduler (each rank plans the same steps; rank 0 samples and broadcasts)."""
    from gpu_workers.loader import load_model
    from gpu_workers.parallel import init_group
    from surge.model_files import resolve_model
    from tests.inprocess import InProcessEngine

    torch.set_num_threads(1)
    tp = TensorParallel(rank, size, expert_parallel)
    init_group(tp, torch.device("cpu"), store)
    model = load_model(resolve_model(folder), torch.device("cpu"), torch.float32, tp)
    if quantization != "none":
        from gpu_workers.quant import quantize_model

        quantize_model(model, quantization, 32)
    engine = InProcessEngine(model, block_size=4, max_num_batched_tokens=32)
    for name, ids in prompts.items():
        engine.add(name, ids, n_tokens)
    out.put((rank, engine.run()))
    leave(out)


def leave(out: mp.Queue) -> None:
    """End a rank once its answer is sent, as the server's workers end (exit_process)."""
    from gpu_workers.parallel import exit_process

    out.close()
    out.join_thread()
    exit_process(0)


def _run_group(size: int, folder: str, tmp_path, quantization: str = "none",
               expert_parallel: bool = False, n_tokens: int = N_TOKENS,
               prompts: dict[str, list[int]] | None = None) -> dict[int, dict[str, list[int]]]:
    """Each rank's tokens for every prompt (by default _prompts())."""
    prompts = _prompts() if prompts is None else prompts
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / f"store-{size}-{quantization}")
    procs = [ctx.Process(target=_rank_main, args=(r, size, folder, store, out, quantization,
                                                  expert_parallel, n_tokens, prompts))
             for r in range(size)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def _busy_rank_main(rank: int, store: str, out: mp.Queue) -> None:
    """A rank that ends with its last collectives still in gloo's threads."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    works = [dist.all_reduce(torch.full((20000,), float(i)), async_op=True) for i in range(200)]
    works[0].wait()
    del works
    out.put(rank)
    leave(out)


def test_a_rank_ends_cleanly_with_collectives_in_flight(tmp_path):
    """exit_process: the rank skips the interpreter's finalization, which a gloo thread freeing
    its tensors' Python objects would abort (SIGABRT in every run of this test with sys.exit)."""
    ctx = mp.get_context("spawn")
    for attempt in range(3):
        out = ctx.Queue()
        procs = [ctx.Process(target=_busy_rank_main, args=(r, str(tmp_path / f"s{attempt}"), out))
                 for r in range(2)]
        for p in procs:
            p.start()
        assert sorted(out.get(timeout=60) for _ in procs) == [0, 1]
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0]


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny8")
    save_tiny_llama(str(folder), heads=8, kv_heads=2, vocab=256)
    return str(folder)


@pytest.mark.parametrize("size", [2, 4])
def test_split_model_gives_the_one_rank_tokens(eight_heads, tmp_path, size):
    """8 query heads over 2 KV heads: at size 2 each rank holds one KV head, at 4 each KV head
    is replicated on two ranks."""
    one = _run_group(1, eight_heads, tmp_path)[0]
    split = _run_group(size, eight_heads, tmp_path)
    assert split[0] == one
    assert all(split[r] == one for r in split)  # every rank fed the same tokens back


def test_split_model_with_int8_weights(eight_heads, tmp_path):
    """Each rank quantizes its own shards; the 2-rank group serves every prompt and agrees with
    the 1-rank int8 model (per-channel scales of a row-parallel shard cover fewer columns, so
    a late token may differ; the first ones must not)."""
    one = _run_group(1, eight_heads, tmp_path, "int8")[0]
    split = _run_group(2, eight_heads, tmp_path, "int8")[0]
    assert split.keys() == one.keys()
    assert all(split[k][:4] == one[k][:4] for k in one), (split, one)


def _cfg(heads: int, kv: int, ff: int = 96) -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=heads * 4, intermediate_size=ff, num_layers=1,
                       num_heads=heads, num_kv_heads=kv, head_dim=4, rms_norm_eps=1e-6,
                       rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)


def test_shards_tile_the_full_weights():
    """The column-parallel shards stacked, and the row-parallel ones side by side, are the
    full weight again."""
    cfg = _cfg(heads=9, kv=3)
    q = torch.randn(9 * 4, 36)
    o = torch.randn(36, 9 * 4)
    down = torch.randn(36, 96)
    ranks = [TensorParallel(r, 3) for r in range(3)]
    assert torch.equal(torch.cat([shard("self_attn.q_proj.weight", q, cfg, tp) for tp in ranks]), q)
    assert torch.equal(torch.cat([shard("self_attn.o_proj.weight", o, cfg, tp) for tp in ranks],
                                 dim=1), o)
    assert torch.equal(torch.cat([shard("mlp.down_proj.weight", down, cfg, tp) for tp in ranks],
                                 dim=1), down)
    assert ranks[1].kv_heads(3) == (1, 1)
    # Fewer KV heads than ranks: each rank takes the head its query heads are grouped on.
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_uneven_split_names_the_problem():
    with pytest.raises(ValueError, match="attention heads .9. do not split evenly"):
        TensorParallel(0, 2).split(9, "attention heads")
    with pytest.raises(ValueError, match="cannot be replicated"):
        TensorParallel(0, 3).kv_heads(2)


def _greedy_over_http(url: str, prompts: list[str]) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    return [client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": p}], max_tokens=24,
        temperature=0).choices[0].message.content for p in prompts]


@pytest.fixture(scope="module")
def split_server(tmp_path_factory):
    """surge serve with the default model's 9 query and 3 KV heads over 3 CPU ranks (gloo)."""
    from tests.server import ServerProcess

    runtime = tmp_path_factory.mktemp("runtime")
    server = ServerProcess("--device", "cpu", "--tensor-parallel-size", "3",
                           env={"XDG_RUNTIME_DIR": str(runtime)})
    try:
        yield server.wait_ready(300)
    finally:
        assert server.stop() == 0, server.output()


_PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?",
            "List three primary colors.", "Explain TCP in one sentence."]


@pytest.mark.slow
def test_surge_serve_split_three_ways_matches_one_rank(split_server):
    """Through the real server and the openai client. float32: in bfloat16 the all-reduce rounds
    the partial sums differently from one matrix product, so long generations may part."""
    from tests.server import ServerProcess

    assert "rank 2 of 3" in split_server.output()
    one = ServerProcess("--device", "cpu", "--tensor-parallel-size", "1")
    try:
        expected = _greedy_over_http(one.wait_ready(300).url, _PROMPTS)
    finally:
        assert one.stop() == 0
    assert _greedy_over_http(split_server.url, _PROMPTS) == expected


@pytest.mark.slow
def test_killed_rank_replaces_the_group_and_streams_finish_identically(split_server):
    """kill -9 rank 1 mid-stream: the other ranks are stopped, a new group of three starts, and
    every stream ends with the text of an undisturbed run."""
    from tests.test_shutdown import assert_killed_worker_replaces_its_group

    assert_killed_worker_replaces_its_group(split_server, "surge: worker 1", 3, streams=6)
