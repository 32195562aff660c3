"""The grammar engine's interface (surge.grammar), its masks in the batched sampler, how the
scheduler hands grammars to the worker, and how a request's fields become one constraint."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch

from gpu_workers.sampler import SamplingBatch, sample
from scheduler.scheduler import Scheduler
from server.errors import ApiError
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.structured import constraint_of
from surge.config import SchedulerConfig
from surge.grammar import GrammarError, Matchers, closed_objects, compile_grammar, write_tokenizer
from surge.protocol import EngineRequest, SamplingParams, ScheduledSeq, SeqResult, StepResult

VOCAB = 49152


@pytest.mark.parametrize(("kind", "spec", "says"), [
    ("regex", "a(", "unclosed group"),
    ("json_schema", {"type": "object", "if": {}}, "Unimplemented keys"),
    ("json_schema", {"type": "string", "format": "weird"}, "Unknown format"),
    ("grammar", "root ::= missing", "missing"),
])
def test_compile_errors_say_what_is_wrong(kind, spec, says):
    with pytest.raises(GrammarError, match=says):
        compile_grammar(kind, spec)


def test_objects_are_closed_unless_they_say_otherwise():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "properties": point,  # a property so named is a property, not a keyword
        "free": {**point, "additionalProperties": True},
        "list": {"type": "array", "items": point},
        "either": {"anyOf": [point, {"type": "null"}]},
        "both": {"allOf": [point, {"properties": {"y": {"type": "integer"}}}]}},
        "$defs": {"p": point}}
    shut = {**point, "additionalProperties": False}
    assert closed_objects(schema) == {**schema, "additionalProperties": False, "properties": {
        "properties": shut,
        "free": {**point, "additionalProperties": True},
        "list": {"type": "array", "items": shut},
        "either": {"anyOf": [shut, {"type": "null"}]},
        "both": schema["properties"]["both"]},  # allOf's members: closed, they would clash
        "$defs": {"p": shut}}
    assert point == {"type": "object", "properties": {"x": {"type": "integer"}}}  # not changed
    # Objects whose keys other schemas share stay open: beside allOf, and a tagged union's
    # members next to its `properties` (closed, each would forbid the others' keys).
    beside = {**point, "allOf": [{"properties": {"name": {"type": "string"}}}]}
    assert closed_objects(beside) == beside
    tagged = {**point, "oneOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(tagged) == tagged
    union = {"anyOf": [point, {"type": "null"}]}  # alternatives, each a whole object: closed
    assert closed_objects(union)["anyOf"][0] == shut


@pytest.fixture(scope="module")
def matchers(tokenizer, tmp_path_factory) -> Matchers:
    folder = str(tmp_path_factory.mktemp("runtime"))
    write_tokenizer(tokenizer.hf, tokenizer.eos_token_ids, folder)
    return Matchers(folder, VOCAB)


def _greedy(n: int) -> list[ScheduledSeq]:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return [ScheduledSeq(i, [5], 0, [0], True, params, 0) for i in range(n)]


@pytest.mark.slow
def test_masked_rows_follow_the_grammar_and_the_others_do_not_move(matchers, tokenizer):
    """Rows 0 and 2 constrained (row 2 verifying a draft token), rows 1 and 3 free: the free
    rows' argmax is untouched; the constrained rows only pick allowed tokens."""
    matchers.start(10, compile_grammar("choice", ["yes", "no"]), [])
    matchers.start(11, compile_grammar("regex", "[0-9]{2}"), [])
    yes = tokenizer.encode("yes")
    assert len(yes) == 1
    rows, mask = matchers.bitmask([(10, 0, []), (11, 2, [tokenizer.encode("4")[0]])])
    assert rows == [0, 2, 3]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.build(_greedy(5), [9] * 5, VOCAB, torch.device("cpu"))
    batch.grammar_rows, batch.grammar_mask = torch.tensor(rows), torch.from_numpy(mask)
    tokens, _, _ = sample(logits, batch)
    free = logits.argmax(dim=-1)
    assert tokens[1] == free[1] and tokens[4] == free[4]
    assert tokenizer.hf.decode([int(tokens[0])]) in ("y", "ye", "yes", "n", "no")
    assert tokenizer.hf.decode([int(tokens[2])]).isdigit()
    assert tokenizer.hf.decode([int(tokens[3])]).isdigit()
    # After the whole choice only the end of the answer is allowed.
    matchers.advance(10, yes)
    rows, mask = matchers.bitmask([(10, 0, [])])
    allowed = [t for t in range(VOCAB) if mask[0, t // 32] >> (t % 32) & 1]
    assert allowed == tokenizer.eos_token_ids
    # A new matcher for a recomputed sequence starts past its output so far.
    matchers.start(10, compile_grammar("choice", ["yes", "no"]), yes)
    assert np.array_equal(matchers.bitmask([(10, 0, [])])[1], mask)
    matchers.release([10, 11])
    assert 10 not in matchers and 11 not in matchers


@pytest.mark.slow
def test_a_grammar_is_built_once_and_copied_for_each_sequence(matchers, tokenizer):
    """n choices (or a schema sent again) cost one build in the step, not one each: the copies
    advance on their own."""
    grammar = compile_grammar("choice", ["yes", "no", "perhaps"])  # not built before here
    built = len(matchers._built)
    matchers.start(20, grammar, [])
    matchers.start(21, grammar, [])
    assert len(matchers._built) == built + 1
    matchers.advance(20, tokenizer.encode("yes"))
    _, mask = matchers.bitmask([(20, 0, []), (21, 1, [])])
    assert not np.array_equal(mask[0], mask[1])  # 21 may still start either word
    matchers.release([20, 21])


def test_a_constraint_too_costly_to_start_matching_is_refused(tokenizer):
    """A worker would build its matcher inside a step that everyone waits for: the frontend
    measures the build and refuses one over the budget, naming the field (5,000 properties
    take 5x the budget on the 2-core EPYC: a faster CPU still refuses them)."""
    from server.structured import Constraint, Grammars

    async def compile_both() -> None:
        grammars = Grammars(tokenizer)
        small = Constraint("choice", ["yes", "no"], "guided_choice")
        assert "yes" in await grammars.compile(small)
        huge = Constraint("json_schema", {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(5_000)}}, "guided_json")  # 2.5 s here
        with pytest.raises(ApiError, match=r"guided_json: .*too large to enforce") as e:
            await grammars.compile(huge)
        assert e.value.param == "guided_json"
        assert len(grammars._cache) == 1  # measured again next time, not remembered

    asyncio.run(compile_both())


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_token_the_grammar_forbids_is_rejected(matchers, tokenizer, temperature):
    """A proposal is checked against the grammar: the row that verifies it cannot pick it,
    so it is rejected however much the model likes it, and the row after it allows
    nothing; an allowed proposal the model likes is accepted."""
    digit, letter = tokenizer.encode("4")[0], tokenizer.encode("x")[0]
    matchers.start(30, compile_grammar("regex", "[0-9]{2}"), [])
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=1)
    seqs = [ScheduledSeq(0, [5], 0, [0], True, params, 0)] * 2
    for draft, accepted in ((letter, False), (digit, True)):
        rows, mask = matchers.bitmask([(30, 0, [draft])])
        assert rows == [0, 1]
        allowed = [t for t in range(VOCAB) if mask[1, t // 32] >> (t % 32) & 1]
        assert (allowed == []) != accepted  # past a forbidden proposal: nothing
        logits = torch.zeros(2, VOCAB)
        logits[0, draft] = 100.0  # the model is sure of its proposal
        batch = SamplingBatch.build(seqs, [9, 10], VOCAB, torch.device("cpu"),
                                    drafts=[draft, -1])
        batch.grammar_rows, batch.grammar_mask = torch.tensor(rows), torch.from_numpy(mask)
        tokens, took, _ = sample(logits, batch)
        assert bool(took[0]) == accepted
        assert tokenizer.hf.decode([int(tokens[0])]).isdigit()
    matchers.release([30])


def test_the_scheduler_sends_a_grammar_once_per_computation_and_releases_it():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), 64)
    params = SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[2])
    sched.add(EngineRequest(request_id="g", prompt_token_ids=[5, 6, 7], sampling=params,
                            arrival_time=0.0, grammar="G"))
    sched.add(EngineRequest(request_id="f", prompt_token_ids=[5, 6], arrival_time=0.0,
                            sampling=msgspec.structs.replace(params, max_tokens=8)))

    def step(token: int) -> list[ScheduledSeq]:
        plan = sched.schedule()
        assert plan is not None
        sched.update(plan, StepResult(plan.step_id, {s.seq_id: SeqResult([token])
                                                     for s in plan.seqs if s.sample}))
        return plan

    first = step(9)
    assert [(s.grammar, s.grammar_tokens) for s in first.seqs] == [("G", []), (None, [])]
    assert all(s.grammar is None for s in step(9).seqs)
    seq = sched.requests["g"]
    sched._preempt(seq)  # what the batch policy does under memory pressure
    again = step(9)
    assert [(s.grammar, s.grammar_tokens) for s in again.seqs if s.seq_id == seq.seq_id] \
        == [("G", [9, 9])]
    assert sched.schedule().released == [seq.seq_id]  # it reached max_tokens


@pytest.mark.slow
def test_a_grammar_that_fails_while_decoding_is_reported_not_dropped(matchers, tokenizer):
    """llguidance builds a regex lazily: one too large fails only after some tokens. The
    sequence's matcher leaves and the failure waits to be reported, so the request ends
    rather than going on unconstrained."""
    matchers.start(20, compile_grammar("regex", "(a|aa)*b{1000000}"), [])
    bb = tokenizer.hf.encode("bb", add_special_tokens=False)
    assert len(bb) == 1
    for _ in range(8):
        if 20 not in matchers:
            break
        matchers.bitmask([(20, 0, [])])  # as each step does before sampling
        matchers.advance(20, bb)
    assert 20 not in matchers
    assert matchers.failed[20] == "lexer error: too many expressions constructed"
    matchers.release([20])
    assert 20 not in matchers.failed
    # A schema no value satisfies compiles, and fails at its first mask.
    looped = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    matchers.start(21, compile_grammar("json_schema", looped), [])
    matchers.bitmask([(21, 0, [])])
    matchers.advance(21, tokenizer.eos_token_ids[:1])
    assert matchers.failed.pop(21).startswith("no token can continue the output")


def test_a_failed_grammar_ends_its_request_with_a_400():
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_batched_tokens=64), 64)
    sched.add(EngineRequest(request_id="g", prompt_token_ids=[5, 6, 7], grammar="G",
                            sampling=SamplingParams(max_tokens=8), arrival_time=0.0))
    sched.add(EngineRequest(request_id="f", prompt_token_ids=[5, 6], arrival_time=0.0,
                            sampling=SamplingParams(max_tokens=8)))
    plan = sched.schedule()
    seq_id, free_id = [s.seq_id for s in plan.seqs]
    out, free = sched.update(plan, StepResult(plan.step_id, {
        seq_id: SeqResult([9], grammar_error="lexer error: too many expressions"),
        free_id: SeqResult([9])}))
    assert free.finish_reason is None and free.new_token_ids == [9]
    assert (out.finish_reason, out.status, out.new_token_ids) == ("error", 400, [])
    assert "too many expressions" in out.error and "response_format" in out.error
    assert "g" not in sched.requests
    assert sched.schedule().released == [seq_id]  # the worker drops its matcher

def _body(kind: type, **fields) -> CompletionRequest | ChatCompletionRequest:
    base = {"prompt": "hi"} if kind is CompletionRequest else \
        {"messages": [{"role": "user", "content": "hi"}]}
    return msgspec.convert({**base, **fields}, kind)


def test_request_fields_to_one_constraint():
    c = constraint_of(_body(CompletionRequest, guided_json='{"type": "integer"}'))
    assert (c.kind, c.spec, c.param) == ("json_schema", {"type": "integer"}, "guided_json")
    c = constraint_of(_body(ChatCompletionRequest, structured_outputs={"choice": ["a", "b"]}))
    assert (c.kind, c.spec) == ("choice", ["a", "b"])
    c = constraint_of(_body(CompletionRequest, response_format={"type": "json_object"}))
    assert (c.kind, c.spec) == ("json_schema", {"type": "object"})
    assert constraint_of(_body(CompletionRequest, response_format={"type": "text"})) is None
    with pytest.raises(ApiError) as e:
        constraint_of(_body(CompletionRequest, guided_regex="a",
                            response_format={"type": "json_object"}))
    assert e.value.param == "guided_regex"
    with pytest.raises(ApiError, match="structured_outputs.json and structured_outputs.regex"):
        constraint_of(_body(CompletionRequest, structured_outputs={"json": {"type": "object"},
                                                                   "regex": "a"}))
