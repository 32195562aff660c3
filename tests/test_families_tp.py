"""Every dense family split over 2 ranks (gloo on the CPU): each rank holds half the heads
(with their biases and q/k norms) and half the MLP columns, and the group gives the greedy
tokens of transformers' generate."""

from __future__ import annotations

import pytest
import torch

from tests.test_families import N_TOKENS, _prompts
from tests.test_tensor_parallel import _run_group
from tests.tiny_families import FAMILIES, MOE_FAMILIES, save_tiny

pytestmark = pytest.mark.slow

DENSE = [f for f in FAMILIES if f not in MOE_FAMILIES]


@pytest.mark.parametrize("family", DENSE)
def test_two_ranks_match_generate(family, tmp_path):
    """Two prompts (13 and 40 tokens), 32 tokens each: past the window of 8 and, for the
    stretched ropes, past the original context of 48."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / family)
    save_tiny(folder, family)
    prompts = {k: v for k, v in _prompts().items() if k in ("p13", "p40")}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = {name: hf.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS,
                                      do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
                    for name, ids in prompts.items()}
    ranks = _run_group(2, folder, tmp_path, n_tokens=N_TOKENS, prompts=prompts)
    assert ranks[0] == expected
    assert ranks[1] == expected  # rank 0's tokens reached rank 1 too
