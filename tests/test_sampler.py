"""Sampling: greedy is argmax; seeded sampling is reproducible and follows the distribution."""

from __future__ import annotations

import torch

from gpu_workers.sampler import sample, uniform_noise


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 100)
    out = sample(logits, torch.zeros(5), torch.arange(5), torch.zeros(5, dtype=torch.int64))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_noise_is_a_pure_function_of_seed_and_position():
    seeds = torch.tensor([1, 1, 2])
    positions = torch.tensor([5, 5, 5])
    u = uniform_noise(seeds, positions, 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert bool((u > 0).all() and (u < 1).all())
    assert torch.equal(u, uniform_noise(seeds, positions, 1000))
    # Roughly uniform: mean 1/2, variance 1/12.
    big = uniform_noise(torch.arange(50), torch.arange(50), 4000)
    assert abs(big.mean().item() - 0.5) < 0.01
    assert abs(big.var().item() - 1 / 12) < 0.005


def test_mixed_batch_greedy_rows_unaffected():
    logits = torch.randn(4, 50)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7])
    out = sample(logits, temps, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_sampled_frequencies_follow_softmax():
    """10,000 draws (one position each) against the target probabilities: chi-square, 6 dof."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 10_000
    temps = torch.full((n,), 0.8)
    out = sample(logits.expand(n, -1).clone(), temps, torch.full((n,), 1234),
                 torch.arange(n))
    observed = torch.bincount(out, minlength=7).double()
    expected = torch.softmax(logits / 0.8, -1).double() * n
    chi2 = (((observed - expected) ** 2) / expected).sum().item()
    assert chi2 < 22.46, chi2  # the 0.999 quantile of chi-square with 6 degrees of freedom
