"""Each model family against transformers' own implementation of it: greedy tokens alone, batched,
with chunked prefill, from the prefix cache and after preemption, and log-probabilities, in
float32."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_workers.llama import AttentionMetadata
from tests.inprocess import InProcessEngine
from tests.tiny_families import FAMILIES, ORIGINAL, WINDOW, save_tiny

pytestmark = pytest.mark.slow

N_TOKENS = 32


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1)
    return {f"p{n}": [rng.randrange(1, 255) for _ in range(n)] for n in (1, 5, 13, 40)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, our model, transformers' model, each prompt's greedy tokens by `generate`)."""
    from transformers import AutoModelForCausalLM

    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model

    folder = str(tmp_path_factory.mktemp(request.param))
    save_tiny(folder, request.param)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = {}
    with torch.inference_mode():
        for name, ids in _prompts().items():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            expected[name] = out[0, len(ids):].tolist()
    model = load_model(resolve_model(folder), torch.device("cpu"), torch.float32)
    return request.param, model, hf, expected


def test_switches_follow_the_family(family):
    name, model, _, _ = family
    cfg = model.cfg
    assert cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.qk_norm == (name in ("qwen3", "gemma3", "qwen3_moe"))
    assert cfg.sandwich_norms == name.startswith("gemma")
    assert (cfg.sliding_window == WINDOW) == (name in ("mistral", "gemma2", "gemma3"))
    if name.startswith("gemma"):  # alternating windowed and global layers
        assert cfg.window_layers == [True, False]
    scaling = {"llama3": "llama3", "llama-dynamic": "dynamic", "qwen2-yarn": "yarn",
               "phi3-longrope": "longrope"}.get(name)
    assert (cfg.rope_scaling or {}).get("rope_type") == scaling
    # dynamic and yarn serve past the original context, as vLLM counts it
    assert cfg.max_position_embeddings == {"llama-dynamic": 2 * ORIGINAL,
                                           "qwen2-yarn": 4 * ORIGINAL}.get(name, 512)
    assert cfg.num_experts == {"qwen3_moe": 8, "mixtral": 4}.get(name, 0)
    assert cfg.moe_renormalize == (name == "mixtral")
    assert cfg.dense_layers == ([1] if name == "qwen3_moe" else [])


def test_each_prompt_alone_matches_generate(family):
    _, model, _, expected = family
    for name, ids in _prompts().items():
        engine = InProcessEngine(model)
        engine.add(name, ids, N_TOKENS)
        assert engine.run()[name] == expected[name], name


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=4096),
                                     dict(max_num_batched_tokens=7, block_size=4)],
                         ids=["batched", "chunked"])
def test_batched_chunked_and_cached_match_generate(family, options):
    """All prompts with strangers of random lengths, then all again from the prefix cache."""
    _, model, _, expected = family
    rng = random.Random(2)
    engine = InProcessEngine(model, **options)
    for rnd in range(2):
        for name, ids in _prompts().items():
            engine.add(f"{name}-{rnd}", ids, N_TOKENS)
        for i in range(3):
            engine.add(f"other{i}-{rnd}", [rng.randrange(1, 255) for _ in range(rng.randrange(
                1, 60))], rng.randrange(1, 40))
        got = engine.run()
        for name in expected:
            assert got[f"{name}-{rnd}"] == expected[name], (name, rnd)
    assert engine.scheduler.blocks.hit_tokens > 0
    if "block_size" in options:
        assert max(len(d) for _, d in engine.step_times) > 1


def test_preempted_sequences_match_generate(family):
    """A cache too small for every prompt at once: sequences are preempted and recomputed."""
    _, model, _, expected = family
    engine = InProcessEngine(model, num_blocks=24, block_size=4)
    # Each prompt twice: a sliding window gives blocks back as it passes them, and one copy of
    # each fits a windowed model's cache without preemption.
    for copy in "ab":
        for name, ids in _prompts().items():
            engine.add(name + copy, ids, N_TOKENS)
    assert engine.run() == {name + copy: want for name, want in expected.items() for copy in "ab"}
    assert engine.scheduler.num_preemptions > 0


@torch.inference_mode()
def test_logprobs_match_transformers(family):
    """Every position of a prompt and its answer, prefilled in one step."""
    name, model, hf, expected = family
    ids = _prompts()["p40"] + expected["p40"]
    if name == "llama-dynamic":
        # Hugging Face rotates a whole prompt by its length's frequencies, surge each position
        # by its own (the same in generation): they agree on prompts in the original context
        # (shorter than it: only then does Hugging Face drop the frequencies its generation
        # stretched).
        ids = ids[: ORIGINAL - 1]
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    cache = torch.zeros(model.cfg.num_layers, 2, model.layers[0].attn.num_kv_heads, blocks, bs,
                        model.cfg.head_dim)
    table = torch.arange(blocks)[None]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode=0, decode_block_tables=table[:0],
        decode_context_lens=torch.zeros(0, dtype=torch.long), prefill_block_tables=table,
        prefill_query_start=torch.tensor([0, n]), prefill_context_lens=torch.tensor([n]),
        prefill_max_query_len=n)
    ours = model.logits(model(torch.tensor(ids), torch.arange(n), meta, cache))
    want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.log_softmax(-1), want.log_softmax(-1), rtol=0, atol=1e-4)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_window_gives_back_the_blocks_it_has_passed(tmp_path, prefix_cache):
    """Mistral (every layer windowed): a long answer holds about a window's worth of blocks,
    not its whole length, and still gives transformers' tokens; Llama holds them all."""
    from transformers import AutoModelForCausalLM

    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model

    ids, n = _prompts()["p13"], 96
    peaks = {}
    for family in ("mistral", "llama3"):
        folder = str(tmp_path / family)
        save_tiny(folder, family)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        model = load_model(resolve_model(folder), torch.device("cpu"), torch.float32)
        engine = InProcessEngine(model, block_size=4, prefix_cache=prefix_cache)
        engine.add("long", ids, n)
        assert engine.run()["long"] == expected, family
        peaks[family] = engine.peak_blocks
    # Every token but the last one sampled has K/V: 108, in 27 blocks.
    assert peaks["llama3"] == -(-(len(ids) + n - 1) // 4)
    assert peaks["mistral"] <= 8, peaks  # a window of 8 and the proposals' margin
