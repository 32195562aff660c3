"""The grammar engine behind one small interface: llguidance.

Why llguidance rather than xgrammar: it has no dependencies (xgrammar's wheel requires torch,
triton and transformers, so installing it risks replacing the CPU torch), it builds a grammar
lazily (a schema costs about a millisecond to prepare, so a slow compile cannot stall anyone),
and its matchers roll back and mask draft tokens, which speculative decoding needs.

The frontend turns a constraint into the engine's grammar text (compile_grammar) and checks
it; rank 0's worker keeps one matcher per constrained sequence (Matchers), fills the token
bitmask of its rows for each step and advances the matchers with the tokens sampled.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("surge.grammar")
# Compact JSON with single spaces: with any whitespace allowed a small model may spend its
# whole budget on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "choice", "grammar", "lark")
TOKENIZER_FILE = "grammar-tokenizer.json"
# The longest a constraint's matcher may take to build and give its first mask, measured in
# the frontend: a worker builds one inside a step, which every sequence in it waits for (test
# schemas take 1-5 ms; 10,000 choices 0.2 s, 3,000 properties 1 s, 10,000 properties 11 s).
MATCHER_BUDGET_S = 0.5
# Built matchers a worker keeps, by grammar, to copy for each new sequence (a copy is free).
_BUILT = 64
# llguidance's terse stop reasons, in words.
_REASONS = {"NoExtensionBias": "no token can continue the output (the constraint admits no "
                               "text here, e.g. a schema that no value satisfies)"}


# Where a schema holds schemas: one, a map of them, a list of them (JSON Schema 2020-12).
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "additionalProperties", "unevaluatedItems", "unevaluatedProperties")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems", "items", "allOf")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SHARING = ("allOf", "anyOf", "oneOf", "$ref", "dependentSchemas")


def _each_subschema(schema: dict, fn: Callable[[Any, str], Any]) -> dict:
    """A copy of schema with fn(subschema, keyword) in place of each schema it holds (never
    a value that is data, such as a const's, whatever its keys)."""
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key], key)
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: fn(s, key) for name, s in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [fn(s, key) for s in out[key]]
    return out


def closed_objects(schema: Any, joined: bool = False) -> Any:
    """The schema with every object that lists its `properties` and says nothing of others
    closed to them, as vLLM's default engine (xgrammar) and OpenAI's strict mode generate;
    `additionalProperties: true` keeps one open. An object whose keys other schemas share
    stays open, since closed each would forbid the others' keys: allOf's members, an object
    beside allOf, anyOf, oneOf, $ref or dependentSchemas, and, next to `properties`, the
    members of its anyOf and oneOf (a tagged union's)."""
    if not isinstance(schema, dict):
        return schema
    union = "properties" in schema
    out = _each_subschema(schema, lambda s, key: closed_objects(
        s, joined=key == "allOf" or (union and key in ("anyOf", "oneOf"))))
    shared = any(k in out for k in _SHARING)
    if "properties" in out and not (joined or shared) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def rebased(schema: Any, root: str) -> Any:
    """A schema's own references ("#/$defs/Unit", "#") pointed at root, where it now sits
    inside a larger schema (a tool's parameters inside its call's: pydantic's tools refer to
    their $defs so)."""
    if not isinstance(schema, dict):
        return schema
    out = _each_subschema(schema, lambda s, _: rebased(s, root))
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


class GrammarError(ValueError):
    """A constraint the engine cannot compile or does not fully support; the message says why."""


class TooCostly(GrammarError):
    """A constraint whose matcher took longer to build than MATCHER_BUDGET_S (this time: a
    busy machine may take longer than an idle one)."""


def compile_grammar(kind: str, spec: Any) -> str:
    """The engine's grammar for a constraint: kind is one of KINDS; spec a JSON schema (dict),
    a regex, a list of choices, or a GBNF / Lark grammar text."""
    from llguidance import LLMatcher, grammar_from

    try:
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(closed_objects(spec),
                                                         overrides=_JSON_OPTIONS)
        elif kind == "lark":
            grammar = LLMatcher.grammar_from_lark(spec)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec))
        else:
            grammar = grammar_from("regex" if kind == "regex" else "grammar", spec)
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    # A warning means part of the constraint would not be enforced: refuse rather than ignore.
    if failed or messages:
        raise GrammarError("; ".join(messages))
    return grammar


def check_cost(grammar: str, tokenizer: Any) -> None:
    """Refuse (GrammarError) a grammar whose matcher takes over MATCHER_BUDGET_S to build and
    mask once, or fails doing it; tokenizer: an llguidance tokenizer (ll_tokenizer)."""
    from llguidance import LLMatcher

    # This thread's CPU time: the build's own cost, whatever else the machine is doing.
    started = time.thread_time()
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    matcher.compute_bitmask()
    took = time.thread_time() - started
    if matcher.is_error():
        raise GrammarError(matcher.get_error().strip().splitlines()[0])
    if took > MATCHER_BUDGET_S:
        raise TooCostly(f"it is too large to enforce without holding up every other request "
                        f"(its matcher took {took * 1000:.0f} ms to build, the limit is "
                        f"{MATCHER_BUDGET_S * 1000:.0f} ms); give fewer choices, properties "
                        f"or alternatives")


def ll_tokenizer(tokenizer_json: str, vocab: int, eos_token_ids: list[int]) -> Any:
    """llguidance's tokenizer from a Hugging Face tokenizer's JSON."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos_token_ids or None)


def write_tokenizer(hf_tokenizer: Any, eos_token_ids: list[int], runtime_dir: str) -> None:
    """The tokenizer the workers' matchers need, saved by the frontend (which has it loaded:
    building it again from a GGUF file costs the worker seconds)."""
    data = {"tokenizer": hf_tokenizer.backend_tokenizer.to_str(), "eos": eos_token_ids}
    path = os.path.join(runtime_dir, TOKENIZER_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


class Matchers:
    """Rank 0's matchers, one per constrained sequence, by seq_id."""

    def __init__(self, runtime_dir: str, vocab: int) -> None:
        self.path = os.path.join(runtime_dir, TOKENIZER_FILE)
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self.by_seq: dict[int, Any] = {}
        self.failed: dict[int, str] = {}  # seq_id -> why its matcher gave up, until reported
        self._tokenizer: Any = None
        self._executor: Any = None
        self._built: OrderedDict[str, Any] = OrderedDict()  # grammar -> a fresh matcher

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.by_seq

    def _load(self) -> None:
        """On the first constrained sequence (under a second), so unconstrained serving never
        pays for it."""
        from llguidance import LLExecutor

        with open(self.path) as f:
            data = json.load(f)
        self._tokenizer = ll_tokenizer(data["tokenizer"], self.vocab, data["eos"])
        self._executor = LLExecutor()

    def start(self, seq_id: int, grammar: str, tokens: list[int]) -> None:
        """A new matcher for seq_id (replacing any), past `tokens` (a recomputed sequence's
        output so far)."""
        from llguidance import LLMatcher

        if self._tokenizer is None:
            self._load()
        # Built once a grammar and copied: n choices, or a schema sent again, build no more.
        fresh = self._built.pop(grammar, None) or LLMatcher(self._tokenizer, grammar, log_level=0)
        self._built[grammar] = fresh
        while len(self._built) > _BUILT:
            self._built.popitem(last=False)
        matcher = fresh.deep_copy()
        if tokens:
            matcher.consume_tokens(tokens)
        self.by_seq[seq_id] = matcher
        self._check(seq_id)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.by_seq.pop(seq_id, None)
            self.failed.pop(seq_id, None)

    def advance(self, seq_id: int, tokens: list[int]) -> None:
        matcher = self.by_seq.get(seq_id)
        if matcher is None:
            return
        if not matcher.is_stopped():
            matcher.consume_tokens(tokens)
        self._check(seq_id)  # the mask computed for these tokens may have failed too

    def _check(self, seq_id: int) -> None:
        """A matcher in error (a limit of the engine met lazily, e.g. a regex too large to
        build, or a mask not honoured) leaves: its sequence must end, never go on unconstrained."""
        matcher = self.by_seq[seq_id]
        if matcher.is_error():
            # Its first line says why; the rest is the engine's state and the whole grammar.
            why = matcher.get_error().strip().splitlines()[0]
            why = _REASONS.get(why, why)
            log.warning("grammar of sequence %d failed: %s", seq_id, why)
            self.failed[seq_id] = why
            del self.by_seq[seq_id]

    def bitmask(self, rows: list[tuple[int, int, list[int]]]) -> tuple[list[int], np.ndarray]:
        """rows: (seq_id, first row, draft tokens) of the constrained sequences in a step.
        -> (the step's rows that are masked, their bitmasks [R, words] int32: bit t of a row
        set = token t allowed), one row per sampling position (after each draft token too)."""
        plain, drafted, out_rows = [], [], []
        for seq_id, first, drafts in rows:
            matcher = self.by_seq.get(seq_id)
            if matcher is None:
                continue
            if drafts:
                drafted.append((matcher, len(out_rows), list(drafts)))
            else:
                plain.append((matcher, len(out_rows)))
            out_rows += range(first, first + len(drafts) + 1)
        mask = np.zeros((len(out_rows), self.words), dtype=np.int32)
        size = (mask.ctypes.data, self.words * 4, len(out_rows))
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *size)
        if drafted:
            # Rows past an invalid draft token keep "nothing allowed": their tokens are dropped.
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *size)
        return out_rows, mask
