"""Structured output's cost to everyone else: concurrency 16, none constrained vs half the
requests constrained by a JSON schema, on one server in one run (--rounds pairs, A-B-B-A).

Every request is a chat asking for JSON and decodes 64 tokens (the unconstrained ones ignore
EOS; the constrained ones follow a schema that needs more than 64). Reported per run: output
tokens/s, and the TPOT p50 of the unconstrained requests (the target: within 10% of the
all-unconstrained run) and of the constrained ones. Then the grammar's cost per test schema
(tests/test_structured.py): the frontend's compile_grammar, and a matcher's first token mask
with the model's vocabulary (where llguidance does its lazy work).

Usage: .venv/bin/python -m bench.structured_bench [--rounds 2] [-- server args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from surge.loadgen import Result, closed_loop, percentiles
from tests.server import ServerProcess
from tests.test_structured import SCHEMAS

# Constrained requests that cannot finish inside 64 tokens, so that both runs keep the same
# number of sequences decoding (the test schemas close in ~20 tokens, which would shrink the
# batch and flatter the constrained run).
_LONG = {"type": "object", "properties": {"readings": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 60}}, "required": ["readings"], "additionalProperties": False}


def _bodies(constrained: bool, count: int) -> list[dict]:
    """count chat bodies asking for JSON, each decoding 64 tokens; constrained ones carry a
    json_schema."""
    out = []
    for _ in range(count):
        body: dict = {"messages": [{"role": "user", "content": "List sensor readings as "
                                    "JSON."}], "max_tokens": 64, "temperature": 0}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "readings", "schema": _LONG, "strict": True}}
        else:
            body["ignore_eos"] = True
        out.append(body)
    return out


def _run(url: str, constrained: bool, count: int, concurrency: int) -> dict:
    """Half the clients send unconstrained requests; the other half constrained ones (or
    unconstrained too, for the baseline)."""
    async def both() -> tuple[tuple[list[Result], float], tuple[list[Result], float]]:
        half = concurrency // 2
        return await asyncio.gather(
            closed_loop(url, _bodies(False, count // 2), half, path="/v1/chat/completions"),
            closed_loop(url, _bodies(constrained, count // 2), concurrency - half,
                        path="/v1/chat/completions"))

    (plain, wall_a), (other, wall_b) = asyncio.run(both())
    ok = [r for r in plain + other if r.error is None]
    plain_ok = [r for r in (plain if constrained else plain + other) if r.error is None]

    def tpot(rs: list[Result]) -> float:
        return round(percentiles([t for r in rs if (t := r.tpot) is not None])["p50"], 1)

    return {"constrained": "half" if constrained else "none", "errors": 2 * (count // 2) - len(ok),
            "tok_s": round(sum(r.output_tokens for r in ok) / max(wall_a, wall_b), 1),
            "plain_tpot_p50_ms": tpot(plain_ok),
            "constrained_tpot_p50_ms": tpot([r for r in other if r.error is None])
            if constrained else None}


def _compile_costs() -> dict[str, dict[str, float]]:
    from llguidance import LLMatcher, LLTokenizer

    from server.tokenizer import Tokenizer
    from surge.grammar import compile_grammar
    from surge.model_files import resolve_model

    hf = Tokenizer(resolve_model("default"))
    tokenizer = LLTokenizer(hf.hf.backend_tokenizer.to_str(), n_vocab=hf.vocab_size,
                            eos_token=hf.eos_token_ids)
    costs = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = compile_grammar("json_schema", schema)
        t1 = time.perf_counter()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()
        t2 = time.perf_counter()
        costs[name] = {"compile_ms": round((t1 - t0) * 1000, 2),
                       "first_mask_ms": round((t2 - t1) * 1000, 2)}
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    opts, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    server = ServerProcess(*extra, dtype=opts.dtype, kv_cache_memory="1GiB").wait_ready()
    rows: list[dict] = []
    try:
        _run(server.url, True, opts.concurrency, opts.concurrency)  # warm-up, matchers too
        # A-B-B-A: a drift in the machine's speed over the run falls on both sides alike.
        for i in range(opts.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            pair = {}
            for constrained in order:
                pair[constrained] = _run(server.url, constrained, opts.requests,
                                         opts.concurrency)
                print(json.dumps(pair[constrained]), flush=True)
            rows += [pair[False], pair[True]]
    finally:
        server.stop()
    base = [r["plain_tpot_p50_ms"] for r in rows if r["constrained"] == "none"]
    half = [r["plain_tpot_p50_ms"] for r in rows if r["constrained"] == "half"]
    ratios = sorted(h / b for h, b in zip(half, base, strict=True))
    print(f"unconstrained TPOT p50, half constrained / none: mean of runs "
          f"{sum(half) / len(half) / (sum(base) / len(base)):.3f}, median of the "
          f"{len(ratios)} pairs' ratios {statistics.median(ratios):.3f} "
          f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(json.dumps({"grammar_cost": _compile_costs()}))
    print(f"server args: {' '.join(extra) or '(defaults)'}; load average "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
