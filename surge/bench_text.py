"""`surge bench` against servers that take text: random prompts as text whose token count the
tokenizer confirms, and chat bodies."""

from __future__ import annotations

from typing import Any

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def text_prompt(tokenizer: Any, ids: list[int]) -> str:
    """Text the tokenizer reads back as exactly len(ids) tokens (decoded ids re-tokenize a
    little differently; trimming or topping up converges in a step or two)."""
    text = tokenizer.hf.decode(ids)
    for _ in range(10):
        again = tokenizer.encode(text)
        if len(again) == len(ids):
            return text
        text = tokenizer.hf.decode((again + ids)[: len(ids)])
    raise ValueError(f"no text of exactly {len(ids)} tokens found from these ids")


def convert(bodies: list[dict], tokenizer: Any | None, endpoint: str) -> list[dict]:
    """Token-id prompts as text (when a tokenizer is given) and as chat messages for chat."""
    out = []
    for body in bodies:
        prompt = body["prompt"]
        if tokenizer is not None and isinstance(prompt, list):
            prompt = text_prompt(tokenizer, prompt)
        rest = {k: v for k, v in body.items() if k != "prompt"}
        out.append({**rest, "messages": [{"role": "user", "content": prompt}]}
                   if endpoint == "chat" else {**rest, "prompt": prompt})
    return out
