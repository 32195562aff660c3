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
