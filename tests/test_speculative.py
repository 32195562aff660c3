"""Speculative decoding: the n-gram proposer, exact verification (greedy and sampled), KV
rollback, the back-off rule, and greedy outputs identical to decoding without it."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_workers.draft import truncated
from gpu_workers.model_runner import ModelRunner
from gpu_workers.sampler import SamplingBatch, sample
from kernels.sampling import filter_logits
from scheduler import admin
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence
from scheduler.speculation import Speculation, ngram_propose
from scheduler.tenants import Tenant
from surge.config import ConfigError, SpeculativeConfig, SurgeConfig, TenantConfig
from surge.config_load import load_config
from surge.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.inprocess import InProcessEngine
from tests.prompts import reference_prompts

# ---- the n-gram proposer ----


def test_ngram_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    # "1 2 3" occurred twice before the end: the latest one (followed by 8 7 ...) wins.
    assert ngram_propose(tokens, 3, n_max=3, n_min=1) == [8, 7, 1]
    assert ngram_propose(tokens, 1, n_max=3, n_min=1) == [8]
    # The longest suffix that occurs is used: "9 4" never occurred, "4" did.
    assert ngram_propose([4, 5, 6, 9, 4], 2, n_max=2, n_min=1) == [5, 6]
    assert ngram_propose([4, 5, 6, 9, 4], 2, n_max=2, n_min=2) == []
    assert ngram_propose([1, 2, 3], 4, n_max=2, n_min=1) == []
    assert ngram_propose([5, 5], 3, n_max=3, n_min=1) == [5]  # a match right before the end


def test_ngram_matches_whole_tokens_only():
    # 256 and 1 share bytes with 1 and 0 in a little-endian int array; no token-straddling match.
    tokens = [256, 1, 0, 0, 7, 1, 0]
    assert ngram_propose(tokens, 2, n_max=2, n_min=2) == [0, 7]
    assert ngram_propose([0x0100, 0x0200, 3, 1, 2], 2, n_max=2, n_min=2) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=60), st.integers(1, 4),
       st.integers(1, 3), st.integers(1, 5))
def test_ngram_proposal_follows_a_real_earlier_occurrence(tokens, n_max, n_min, k):
    n_min = min(n_min, n_max)
    got = ngram_propose(tokens, k, n_max, n_min)
    found = [(n, i) for n in range(n_max, n_min - 1, -1) for i in range(len(tokens) - n)
             if tokens[i : i + n] == tokens[len(tokens) - n :]]
    if not found:
        assert got == []
        return
    n = found[0][0]
    latest = max(i for m, i in found if m == n)
    assert got == tokens[latest + n : latest + n + k]


# ---- verification keeps the target distribution ----


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the observed counts under probs (cells expecting under 5 merged)."""
    assert counts[probs == 0].sum() == 0, "a token with probability 0 was produced"
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    nonzero = expected > 0
    stat = ((observed - expected)[nonzero] ** 2 / expected[nonzero]).sum()
    df = int(nonzero.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _rows(params: SamplingParams, n: int) -> list[ScheduledSeq]:
    return [ScheduledSeq(seq_id=i, token_ids=[1], start_pos=0, block_table=[], sample=True,
                         sampling=params, seed=1000 + i) for i in range(n)]


ALPHA = 1e-3  # the significance every chi-square test here is held to


@pytest.mark.parametrize(("draft", "top_k"), [(0, 0), (2, 0), (5, 4), (5, 0)])
def test_rejection_sampling_keeps_the_distribution(draft, top_k):
    """Half the rows verify `draft`, half sample plainly; both must follow softmax(logits / T)
    after top-k, and the draft is accepted about p(draft) of the time."""
    n, logits = 20_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    params = SamplingParams(max_tokens=1, temperature=0.8, top_k=top_k)
    rows = _rows(params, n)
    drafts = [draft] * (n // 2) + [-1] * (n // 2)
    batch = SamplingBatch.build(rows, [7] * n, len(logits), torch.device("cpu"), drafts=drafts)
    tokens, accepted, _ = sample(logits.expand(n, -1).clone(), batch)
    one = SamplingBatch.build(rows[:1], [7], len(logits), torch.device("cpu"))
    probs = filter_logits(logits[None].clone(), one)[0].softmax(-1)
    for half in (tokens[: n // 2], tokens[n // 2 :]):
        counts = torch.bincount(half, minlength=len(logits))
        assert _chi_square_p(counts, probs) > ALPHA, (counts, probs)
    rate = accepted[: n // 2].double().mean().item()
    p = probs[draft].item()
    assert abs(rate - p) < 4 * (p * (1 - p) / (n // 2)) ** 0.5 + 1e-9
    assert not accepted[n // 2 :].any()
    assert torch.equal(tokens[: n // 2][accepted[: n // 2]],
                       torch.full((int(accepted[: n // 2].sum()),), draft))


def test_greedy_verification_accepts_exactly_the_argmax():
    logits = torch.randn(64, 20)
    rows = _rows(SamplingParams(max_tokens=1, temperature=0.0), 64)
    drafts = torch.where(torch.arange(64) % 2 == 0, logits.argmax(-1),
                         (logits.argmax(-1) + 1) % 20).tolist()
    drafts[5] = -1
    batch = SamplingBatch.build(rows, [3] * 64, 20, torch.device("cpu"), drafts=drafts)
    tokens, accepted, _ = sample(logits, batch)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    want = [i % 2 == 0 and i != 5 for i in range(64)]
    assert accepted.tolist() == want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gpu_workers.loader import load_model
    from surge.model_files import resolve_model
    from tests.tiny_model import save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-spec")
    save_tiny_llama(str(folder), vocab=12, layers=2, seed=3)
    return load_model(resolve_model(str(folder)), torch.device("cpu"), torch.float32)


def test_verified_steps_keep_the_model_distribution(tiny):
    """Many sequences (one seed each) verify the same two proposals in one step: their first
    new token follows the model's distribution after the prompt, and their second, among
    those that accepted the first proposal, its distribution after prompt + proposal."""
    n, prompt, drafts = 3000, [1, 4, 7, 4, 7], [4, 9]
    runner = ModelRunner(tiny, num_blocks=n + 1, block_size=16, device=torch.device("cpu"),
                         dtype=torch.float32)
    params = SamplingParams(max_tokens=8, temperature=1.3)
    seqs = [ScheduledSeq(seq_id=i, token_ids=prompt + drafts, start_pos=0, block_table=[i],
                         sample=True, sampling=params, seed=i, num_draft=2) for i in range(n)]
    result = runner.run(StepPlan(0, seqs))
    firsts, seconds = [], []
    for new in result.seqs.values():
        firsts.append(new.token_ids[0])
        if len(new.token_ids) > 1:  # the first proposal was accepted
            seconds.append(new.token_ids[1])
    plain = ModelRunner(tiny, num_blocks=2, block_size=16, device=torch.device("cpu"),
                        dtype=torch.float32)

    def distribution(tokens: list[int]) -> torch.Tensor:
        logits = []
        real = plain.model.logits
        plain.model.logits = lambda h: logits.append(real(h)) or real(h)
        plain.run(StepPlan(0, [ScheduledSeq(0, tokens, 0, [0], True, params, 0)]))
        plain.model.logits = real
        return (logits[0][0] / params.temperature).softmax(-1)

    p_first = distribution(prompt)
    assert _chi_square_p(torch.bincount(torch.tensor(firsts), minlength=12), p_first) > ALPHA
    assert len(seconds) > 200, "too few acceptances to test the second position"
    p_second = distribution(prompt + drafts[:1])
    assert _chi_square_p(torch.bincount(torch.tensor(seconds), minlength=12), p_second) > ALPHA


# ---- rollback and back-off ----


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 40)),
                max_size=40))
def test_trimming_returns_exactly_the_tail_blocks(ops):
    """Grow a sequence, take back a rejected tail, free it: counts and holders stay exact."""
    bm = BlockManager(num_blocks=48, block_size=4)
    tenant = Tenant("t", TenantConfig(), 0.0)
    seqs = [Sequence(i, str(i), [1], SamplingParams(max_tokens=1), 0, 0.0, tenant)
            for i in range(4)]
    for which, grow, keep in ops:
        seq = seqs[which]
        want = len(seq.block_table) * 4 + grow
        bm.allocate(seq, want)
        before = list(seq.block_table)
        bm.trim(seq, keep)
        assert seq.block_table == before[: bm.blocks_for(keep)]
        held = [b for s in seqs for b in s.block_table]
        assert len(held) == len(set(held))
        assert bm.num_free + len(held) == bm.num_blocks
        assert all(bm.ref_count[b] == (b in held) for b in range(bm.num_blocks))
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free == bm.num_blocks


def _seq(seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, str(seq_id), [1, 2, 3], SamplingParams(max_tokens=50), 0, 0.0,
                    Tenant("t", TenantConfig(), 0.0))


def test_low_acceptance_pauses_a_sequence_and_large_batches_stop_speculation():
    spec = Speculation(SpeculativeConfig(speculative_method="ngram", speculative_max_batch=2,
                                         speculative_min_acceptance=0.3))
    seq = _seq()
    assert spec.active([seq], step=0) and spec.eligible(seq, step=0)
    spec.record(seq, proposed=4, accepted=4, step=0, batch=1)
    spec.record(seq, proposed=4, accepted=0, step=1, batch=1)
    assert spec.eligible(seq, step=2)  # one bad step is not enough
    spec.record(seq, proposed=4, accepted=0, step=2, batch=1)
    assert not spec.eligible(seq, step=3) and not spec.active([seq], step=3)
    assert spec.eligible(seq, step=3 + 16)  # the pause ends
    spec.record(seq, proposed=4, accepted=0, step=19, batch=1)
    spec.record(seq, proposed=4, accepted=0, step=20, batch=1)
    assert not spec.eligible(seq, step=20 + 31) and spec.eligible(seq, step=20 + 32)  # twice
    spec.record(seq, proposed=4, accepted=4, step=52, batch=1)
    assert seq.spec_pauses == 0  # a good step ends the streak
    assert spec.proposed_tokens == 24 and spec.accepted_tokens == 8 and spec.verifications == 6
    # Half accepted: enough alone (bar 0.3 x 1.5), not in a full batch (bar 0.6).
    alone, crowded = _seq(1), _seq(2)
    for step in range(6):
        spec.record(alone, proposed=4, accepted=2, step=step, batch=1)
        spec.record(crowded, proposed=4, accepted=2, step=step, batch=2)
    assert spec.eligible(alone, step=6) and not spec.eligible(crowded, step=6)
    assert not spec.active([_seq(i) for i in range(3)], step=0)
    spec.cfg = msgspec.structs.replace(spec.cfg, speculative_method="off")
    assert not spec.active([seq], step=100)


def test_draft_needs_a_draft_model_at_start_and_live():
    with pytest.raises(ConfigError, match="draft-layers"):
        load_config({"speculative_method": "draft"}, env={})
    assert load_config({"speculative_method": "draft", "draft_layers": "4"}, env={})
    cfg = SurgeConfig()
    assert "draft-layers" in admin.updated(cfg, {"speculative_method": "draft"})
    new = admin.updated(cfg, {"speculative_method": "ngram", "num_speculative_tokens": "6"})
    assert new.speculative.speculative_method == "ngram"
    assert new.speculative.num_speculative_tokens == 6
    assert "restart" in admin.updated(cfg, {"draft_layers": "2"})


# ---- greedy outputs are those of plain decoding (SmolLM2, float32) ----

N_TOKENS = 32
COPY = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
        "All that glitters is not gold. Where there is smoke there is fire. ")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    prompts = reference_prompts(tokenizer)
    del prompts["len15"], prompts["len17"]
    # Copying tasks: the n-gram proposer finds most of the continuation in the prompt.
    prompts["copy"] = tokenizer.encode(f"{COPY}\n\nThe same again:\n{COPY[:60]}")
    prompts["copy_chat"] = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat exactly: {COPY}"}])
    return prompts


@pytest.fixture(scope="module")
def plain(engine_model, prompts):
    engine = InProcessEngine(engine_model, max_num_batched_tokens=4096)
    for name, ids in prompts.items():
        engine.add(name, ids, N_TOKENS)
    return engine.run()


def _spec_run(model, prompts, names, spec, draft=None, **options):
    engine = InProcessEngine(model, speculative=spec, draft=draft, **options)
    for name in names:
        engine.add(name, prompts[name], N_TOKENS)
    return engine.run(), engine


NGRAM = SpeculativeConfig(speculative_method="ngram", speculative_max_batch=64)


@pytest.mark.slow
def test_ngram_greedy_is_identical_singly_and_batched(engine_model, prompts, plain):
    for name in ("copy", "raw2"):
        got, _ = _spec_run(engine_model, prompts, [name], NGRAM)
        assert got[name] == plain[name], name
    got, engine = _spec_run(engine_model, prompts, list(prompts), NGRAM,
                            max_num_batched_tokens=4096)
    assert got == plain
    spec = engine.scheduler.spec
    assert 0 < spec.accepted_tokens < spec.proposed_tokens  # both outcomes exercised


@pytest.mark.slow
def test_ngram_greedy_is_identical_with_prefix_hits_and_preemption(engine_model, prompts, plain):
    names = ["copy", "copy_chat", "long", "raw2", "chat0"]
    # "long" takes most of the cache: the others get preempted and recompute, and a second
    # "long" finds its blocks in the prefix cache.
    got, engine = _spec_run(engine_model, prompts, names, NGRAM, num_blocks=140,
                            max_num_batched_tokens=512)
    assert {n: got[n] for n in names} == {n: plain[n] for n in names}
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.spec.accepted_tokens > 0
    engine.add("long again", prompts["long"], N_TOKENS)
    assert engine.run()["long again"] == plain["long"]
    assert engine.scheduler.blocks.hit_tokens > 0


@pytest.mark.slow
def test_ngram_under_a_json_schema_keeps_the_constrained_answer(engine_model, tokenizer,
                                                                tmp_path):
    """A constrained sequence's proposals are checked against its grammar: with n-gram
    speculation the greedy answer is the one without, valid for the schema, and proposals
    were both taken and turned down."""
    import json

    import jsonschema

    from surge.grammar import Matchers, compile_grammar, write_tokenizer

    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "maxItems": 4, "items": {
            "enum": ["red", "blue", "green"]}}},
        "required": ["name", "tags"], "additionalProperties": False}
    doc = '{"name": "Ada", "tags": ["red", "blue", "green", "red"]}'
    prompt = tokenizer.encode(f"Copy this JSON exactly.\n{doc}\n{doc}\n{doc}\n")
    grammar = compile_grammar("json_schema", schema)
    write_tokenizer(tokenizer.hf, tokenizer.eos_token_ids, str(tmp_path))

    def run(spec: SpeculativeConfig | None) -> tuple[list[int], InProcessEngine]:
        engine = InProcessEngine(engine_model, speculative=spec, matchers=Matchers(
            str(tmp_path), engine_model.cfg.vocab_size))
        engine.add("json", prompt, 48, grammar=grammar, stop_token_ids=tokenizer.eos_token_ids)
        return engine.run()["json"], engine

    plain, _ = run(None)
    got, engine = run(NGRAM)
    assert got == plain
    jsonschema.validate(json.loads(tokenizer.hf.decode(got, skip_special_tokens=True)), schema)
    spec = engine.scheduler.spec
    assert 0 < spec.accepted_tokens < spec.proposed_tokens


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "separate"), [(30, False), (6, False), (6, True)])
def test_draft_model_greedy_is_identical(engine_model, model_files, prompts, plain, layers,
                                         separate):
    """The whole model as its own draft (every proposal accepted) and its first 6 layers
    (mostly rejected), working in the target's KV cache or, loaded separately, in a cache of
    its own fed every step: the same tokens every way."""
    from gpu_workers.loader import load_model

    names = ["copy", "chat0", "raw0", "len16"]
    spec = SpeculativeConfig(speculative_method="draft", draft_layers=layers)
    source = load_model(model_files, torch.device("cpu"), torch.float32) if separate \
        else engine_model
    got, engine = _spec_run(engine_model, prompts, names, spec,
                            draft=truncated(source, layers))
    assert engine.runner.draft.mirrors == separate
    assert {n: got[n] for n in names} == {n: plain[n] for n in names}
    stats = engine.scheduler.spec
    assert stats.proposed_tokens > 0
    if layers == 30:
        assert stats.accepted_tokens == stats.proposed_tokens
    else:
        assert stats.accepted_tokens < stats.proposed_tokens


# ---- the real server ----

MODEL = "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_server_speculates_reports_and_switches_off_live(tmp_path):
    import os
    import subprocess
    import sys

    import openai

    from tests.server import ServerProcess
    from tests.test_metrics import _samples, _value

    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    server = ServerProcess("--speculative-method", "ngram", env=env).wait_ready()

    def admin_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "surge.cli", "admin", "--port",
                               str(server.port), *args], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=60)

    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        prompt = f"{COPY}\n\nThe same again:\n{COPY[:60]}"

        def complete(**extra) -> str:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                              temperature=0, **extra).choices[0].text

        spoken = complete()
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True))
        assert streamed == spoken
        with_logprobs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                  temperature=0, logprobs=2).choices[0]
        assert with_logprobs.text == spoken
        assert len(with_logprobs.logprobs.tokens) == len(with_logprobs.logprobs.top_logprobs)
        sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                            temperature=0.8, seed=7,
                                            extra_body={"ignore_eos": True}).choices[0]
        assert sampled.finish_reason == "length" and sampled.text
        time.sleep(2.5)  # the scheduler exports its figures about once a second
        on = _samples(server.url)
        assert _value(on, "surge_spec_accepted_tokens_total") > 0
        assert 0 < _value(on, "surge_spec_acceptance_rate") <= 1
        assert _value(on, "surge_spec_mean_accepted_length") > 1

        refused = admin_cli("set", "speculative_method=draft")
        assert refused.returncode != 0 and "draft-layers" in refused.stdout + refused.stderr
        assert admin_cli("set", "speculative_method=off").returncode == 0
        assert complete() == spoken
        time.sleep(2.5)
        off = _samples(server.url)
        assert _value(off, "surge_spec_proposed_tokens_total") == \
            _value(on, "surge_spec_proposed_tokens_total")
    finally:
        assert server.stop() == 0, server.output()


def test_draft_model_with_tensor_parallel_is_refused_at_start():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "surge.cli", "serve", "--device", "cpu",
                          "--tensor-parallel-size", "2", "--draft-layers", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "one rank" in out.stderr
