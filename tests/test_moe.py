"""Mixture-of-experts models split over ranks (gloo on the CPU): a slice of every expert on each
rank, or whole experts (expert parallelism), give transformers' greedy tokens; the shards tile
the full weights."""

from __future__ import annotations

import pytest
import torch

from gpu_workers.moe import held_experts, shard_expert
from gpu_workers.parallel import TensorParallel
from tests.test_tensor_parallel import _prompts, _run_group
from tests.tiny_families import save_tiny

N_TOKENS = 32


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request, tmp_path_factory) -> tuple[str, dict[str, list[int]]]:
    """(folder, each prompt's greedy tokens by transformers' generate)."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp(request.param))
    save_tiny(folder, request.param)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = {name: hf.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS,
                                      do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
                    for name, ids in _prompts().items()}
    return folder, expected


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
def test_two_ranks_match_generate(moe_model, tmp_path, expert_parallel):
    folder, expected = moe_model
    ranks = _run_group(2, folder, tmp_path, expert_parallel=expert_parallel, n_tokens=N_TOKENS)
    assert ranks[0] == expected
    assert ranks[1] == expected  # rank 0's tokens reached rank 1 too


def test_expert_shards_tile_the_full_weights():
    ranks = [TensorParallel(r, 2) for r in range(2)]
    gate, down = torch.randn(32, 64), torch.randn(64, 32)
    assert torch.equal(torch.cat([shard_expert("mlp.experts.3.gate_proj.weight", gate, tp)
                                  for tp in ranks]), gate)
    assert torch.equal(torch.cat([shard_expert("mlp.experts.3.down_proj.weight", down, tp)
                                  for tp in ranks], dim=1), down)
    ep = [TensorParallel(r, 2, expert_parallel=True) for r in range(2)]
    assert shard_expert("mlp.experts.3.down_proj.weight", down, ep[1]) is down
    assert [held_experts(8, tp) for tp in ep] == [range(0, 4), range(4, 8)]
    assert held_experts(8, ranks[1]) == range(8)


def test_uneven_expert_split_names_the_problem():
    with pytest.raises(ValueError, match=r"experts \(--enable-expert-parallel\) \(6\) do not "
                                         r"split evenly"):
        held_experts(6, TensorParallel(0, 4, expert_parallel=True))


def _routed(url: str) -> dict[str, float]:
    """surge_moe_expert_tokens_total by expert, from /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("surge_moe_expert_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('expert="')[1].split('"')[0]] = float(value)
    return found


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """surge serve with a tiny Qwen3-MoE (8 experts, 2 of its 3 layers sparse) over two CPU
    ranks with whole experts on each."""
    from tests.server import ServerProcess
    from tests.tiny_families import save_tiny_served

    folder = str(tmp_path_factory.mktemp("served-moe"))
    save_tiny_served(folder, "qwen3_moe")
    runtime = tmp_path_factory.mktemp("runtime")
    server = ServerProcess("--model", folder, "--device", "cpu", "--tensor-parallel-size", "2",
                           "--enable-expert-parallel", env={"XDG_RUNTIME_DIR": str(runtime)})
    try:
        yield server.wait_ready(300)
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.slow
def test_served_expert_load_counts_every_routed_token(moe_server):
    """Through the openai client: every token the model computed went to top-2 experts in each
    of the 2 sparse layers, and /metrics counts exactly that."""
    import time

    from openai import OpenAI

    assert "expert parallel" in moe_server.output()
    routed = _routed(moe_server.url)
    assert sorted(routed, key=int) == [str(e) for e in range(8)]
    assert sum(routed.values()) == 0
    client = OpenAI(base_url=f"{moe_server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt="Mixtures of experts route tokens",
                                       max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16
    # The last token is sampled, never fed back.
    computed = answer.usage.prompt_tokens + answer.usage.completion_tokens - 1
    deadline = time.monotonic() + 10
    while sum(_routed(moe_server.url).values()) < 2 * 2 * computed and time.monotonic() < deadline:
        time.sleep(0.2)
    routed = _routed(moe_server.url)
    assert sum(routed.values()) == 2 * 2 * computed, routed
    assert sum(1 for v in routed.values() if v) >= 2
