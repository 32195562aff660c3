"""Structured output: a request's constraint (response_format, vLLM's guided_* fields or
structured_outputs) to the grammar engine's text, compiled off the event loop and cached per
distinct constraint."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import Any

from msgspec import Struct

from server.errors import ApiError
from server.openai_types import ChatCompletionRequest, CompletionRequest
from server.tokenizer import Tokenizer
from server.tool_parsers import HERMES, ToolFormat
from server.tools import tool_grammar
from surge.grammar import GrammarError, TooCostly, check_cost, compile_grammar, ll_tokenizer

# Distinct constraints whose compiled grammar is kept (a few KB each).
CACHE_SIZE = 256


class Constraint(Struct, frozen=True):
    kind: str  # one of surge.grammar.KINDS
    spec: Any  # a JSON schema (dict), a regex, a list of choices, a grammar text
    param: str  # the request field it came from, for error messages


def constraint_of(body: CompletionRequest | ChatCompletionRequest,
                  tool_format: ToolFormat = HERMES) -> Constraint | None:
    """The body's one constraint (None: free text); two at once are a 400. tool_format: the
    form tool_choice's calls take."""
    found: list[Constraint] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise ApiError(400, f"response_format json_schema is for type json_schema, not "
                            f"{fmt.type}", param="response_format.json_schema")
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint("json_schema", {"type": "object"}, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema",
                           param="response_format")
        found.append(Constraint("json_schema", fmt.json_schema.json_schema, "response_format"))
    so = body.structured_outputs
    fields = [("guided_json", "json_schema", body.guided_json),
              ("guided_regex", "regex", body.guided_regex),
              ("guided_choice", "choice", body.guided_choice),
              ("guided_grammar", "grammar", body.guided_grammar)]
    if so is not None:
        fields += [("structured_outputs.json", "json_schema", so.json),
                   ("structured_outputs.regex", "regex", so.regex),
                   ("structured_outputs.choice", "choice", so.choice),
                   ("structured_outputs.grammar", "grammar", so.grammar),
                   ("structured_outputs.json_object", "json_schema", {"type": "object"}
                    if so.json_object else None)]
    for param, kind, spec in fields:
        if spec is not None:
            found.append(Constraint(kind, _schema(spec, param) if kind == "json_schema"
                                    else spec, param))
    if isinstance(body, ChatCompletionRequest) and (calls := tool_grammar(body, tool_format)):
        found.append(Constraint("lark", calls, "tool_choice"))
    if len(found) > 1:
        raise ApiError(400, f"{found[0].param} and {found[1].param} both constrain the output; "
                            f"give one", param=found[1].param)
    if found and body.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with a constrained output (the "
                            "answer ends when its grammar completes)", param="ignore_eos")
    if found and body.min_tokens:
        raise ApiError(400, "min_tokens cannot be combined with a constrained output (the "
                            "grammar decides where the answer ends)", param="min_tokens")
    return found[0] if found else None


def _schema(spec: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(spec, dict):
        return spec
    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise ApiError(400, f"{param} is not a JSON schema: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} is not a JSON schema (an object)", param=param)
    return schema


class Grammars:
    """Compiled grammars by constraint: a bounded LRU cache of futures, so concurrent requests
    with one schema share its compile, and an error is remembered like a grammar."""

    def __init__(self, tokenizer: Tokenizer, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._cache: OrderedDict[str, asyncio.Future[str]] = OrderedDict()
        self.tokenizer = tokenizer
        self._ll_tokenizer: Any = None  # built on the first constraint (a third of a second)

    def _compiled(self, c: Constraint) -> str:
        """The constraint's grammar, refused when the engine cannot enforce it or a worker
        would take too long to start matching it (in a thread: llguidance lets go of the GIL)."""
        grammar = compile_grammar(c.kind, c.spec)
        if self._ll_tokenizer is None:
            hf = self.tokenizer.hf
            self._ll_tokenizer = ll_tokenizer(hf.backend_tokenizer.to_str(),
                                              self.tokenizer.vocab_size,
                                              self.tokenizer.eos_token_ids)
        check_cost(grammar, self._ll_tokenizer)
        return grammar

    async def compile(self, c: Constraint) -> str:
        key = f"{c.kind}\0{json.dumps(c.spec, sort_keys=True)}"
        future = self._cache.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(None, self._compiled, c)
            self._cache[key] = future
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        try:
            # Shielded: a client that leaves must not cancel the compile others wait for.
            return await asyncio.shield(future)
        except GrammarError as e:
            if isinstance(e, TooCostly):  # measured once: not remembered as the schema's fault
                self._cache.pop(key, None)
            raise ApiError(400, f"{c.param}: the constraint cannot be enforced: {e}",
                           param=c.param) from None
