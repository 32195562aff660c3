"""The batched sampler: each parameter against a direct computation, rows independent."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_workers.sampler import SamplingBatch, sample
from kernels.sampling import uniform_noise
from surge.protocol import SamplingParams, ScheduledSeq

V = 50


def _batch(params: list[SamplingParams], histories=None, positions=None, seeds=None,
           ban=None) -> SamplingBatch:
    n = len(params)
    seqs = [ScheduledSeq(seq_id=i, token_ids=[1], start_pos=0, block_table=[], sample=True,
                         sampling=p, seed=(seeds or list(range(n)))[i],
                         ban_stop_tokens=bool(ban and ban[i]), num_prompt_tokens=2)
            for i, p in enumerate(params)]
    batch = SamplingBatch.build(seqs, positions or [0] * n, V, torch.device("cpu"))
    batch.add_penalties(seqs, histories or [None] * n, V, torch.device("cpu"))
    return batch


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, V)
    tokens, _, logprobs = sample(logits, _batch([SamplingParams(max_tokens=1, temperature=0)] * 5))
    assert tokens.tolist() == logits.argmax(-1).tolist() and logprobs == []


def test_noise_is_a_pure_function_of_seed_and_position():
    seeds = torch.tensor([1, 1, 2])
    positions = torch.tensor([5, 5, 5])
    u = uniform_noise(seeds, positions, 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert bool((u > 0).all() and (u < 1).all())
    assert torch.equal(u, uniform_noise(seeds, positions, 1000))
    big = uniform_noise(torch.arange(50), torch.arange(50), 4000)
    assert abs(big.mean().item() - 0.5) < 0.01
    assert abs(big.var().item() - 1 / 12) < 0.005


def _frequencies(logits: torch.Tensor, params: SamplingParams, n: int = 10_000) -> torch.Tensor:
    batch = _batch([params] * n, positions=list(range(n)), seeds=[1234] * n)
    tokens, _, _ = sample(logits.expand(n, -1).clone(), batch)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / n


def test_sampled_frequencies_follow_softmax():
    """10,000 draws against the target probabilities: chi-square with 6 dof at 0.999."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 10_000
    observed = _frequencies(logits, SamplingParams(max_tokens=1, temperature=0.8), n) * n
    expected = torch.softmax(logits / 0.8, -1).double() * n
    chi2 = (((observed - expected) ** 2) / expected).sum().item()
    assert chi2 < 22.46, chi2


def test_top_k_top_p_min_p_keep_only_their_sets():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    assert set(_frequencies(logits, SamplingParams(max_tokens=1, top_k=2)).nonzero()
               .flatten().tolist()) == {0, 1}
    probs = logits.softmax(-1)  # 0.46, 0.28, 0.17, ...: top_p 0.75 needs the first three
    kept = _frequencies(logits, SamplingParams(max_tokens=1, top_p=0.75)).nonzero().flatten()
    assert set(kept.tolist()) == {0, 1, 2}, probs
    kept = _frequencies(logits, SamplingParams(max_tokens=1, min_p=0.3)).nonzero().flatten()
    assert set(kept.tolist()) == {0, 1, 2}  # p >= 0.3 * 0.46


def test_penalties_bias_and_banned_stop_tokens():
    logits = torch.zeros(4, V)
    logits[:, 7] = 1.0
    logits[:, 8] = 0.9
    history = [3, 4, 7, 7]  # prompt [3, 4]; outputs 7, 7
    rows = [
        SamplingParams(max_tokens=1, temperature=0, frequency_penalty=0.1),  # 1 - .2 < .9
        SamplingParams(max_tokens=1, temperature=0, presence_penalty=0.05),  # .95 > .9
        SamplingParams(max_tokens=1, temperature=0, repetition_penalty=1.2),  # 1/1.2 < .9
        SamplingParams(max_tokens=1, temperature=0, logit_bias={9: 5.0}),
    ]
    tokens, _, _ = sample(logits, _batch(rows, histories=[history] * 3 + [None]))
    assert tokens.tolist() == [8, 7, 8, 9]
    banned = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[7], min_tokens=2)
    tokens, _, _ = sample(logits[:2], _batch([banned, banned], ban=[True, False]))
    assert tokens.tolist() == [8, 7]


def test_logprobs_are_the_models_own():
    logits = torch.randn(3, V)
    rows = [SamplingParams(max_tokens=1, temperature=0, logprobs=k) for k in (None, 0, 3)]
    rows[2].repetition_penalty = 2.0  # penalties change the choice, never the reported logprobs
    tokens, _, logprobs = sample(logits, _batch(rows, histories=[None, None, [1, 2, 3]]))
    assert logprobs[0] is None
    ref = torch.log_softmax(logits, -1)
    assert logprobs[1].logprob == pytest.approx(ref[1, tokens[1]].item(), abs=1e-5)
    assert logprobs[1].top_ids == []
    top = ref[2].topk(3)
    assert logprobs[2].top_ids == top.indices.tolist()
    assert logprobs[2].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


def test_degenerate_rows_fall_back_to_greedy():
    logits = torch.randn(3, V)
    logits[2] = float("-inf")
    logits[2, 4] = 0.0  # the row's only finite token... then banned below
    rows = [SamplingParams(max_tokens=1, temperature=1e-30),
            SamplingParams(max_tokens=1, temperature=1.0, top_k=1),
            SamplingParams(max_tokens=5, temperature=1.0, stop_token_ids=[4], min_tokens=1)]
    tokens, _, _ = sample(logits, _batch(rows, ban=[False, False, True]))
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()
    assert 0 <= int(tokens[2]) < V  # every token masked: no NaN, a valid id


def test_both_halves_of_the_seed_count():
    positions = torch.zeros(2, dtype=torch.int64)
    u = uniform_noise(torch.tensor([5, 5 + 2**32]), positions, 100)
    assert not torch.equal(u[0], u[1])


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 100), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_grammar_bitmask_bans_exactly_the_unset_bits(vocab, seed, data):
    """Bit t of a masked row's word t // 32 set = token t allowed; unmasked rows untouched;
    logprobs stay the model's own (the raw logits are not written to)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=g)
    raw = logits.clone()
    rows = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True))
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=g)
    params = [SamplingParams(max_tokens=1, temperature=0, logprobs=1)] * 4
    batch = _batch(params)
    batch.grammar_rows, batch.grammar_mask = torch.tensor(rows), mask
    tokens, _, logprobs = sample(logits, batch)
    expected = raw.clone()
    for j, r in enumerate(rows):
        for t in range(vocab):
            if not (int(mask[j, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    assert torch.equal(logits, raw)
    assert tokens.tolist() == expected.argmax(-1).tolist()
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        torch.log_softmax(raw, -1).gather(1, tokens[:, None])[:, 0].tolist())
