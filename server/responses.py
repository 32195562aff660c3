"""OpenAI response bodies and stream chunks, for completions and chat, with logprobs."""

from __future__ import annotations

from typing import Any

from server.generate import Piece


class TokenText:
    """Token ids to the strings OpenAI's logprobs show (a cache: the same ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(piece: Piece, token_text: TokenText, offset: int) -> dict:
    """The legacy completions format; offset is where this piece starts in the choice's text."""
    tokens = [token_text(t) for t in piece.token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in piece.logprobs],
        # As OpenAI: the top k and the sampled token, whether or not it is among them.
        "top_logprobs": [{token_text(t): lp.logprob,
                          **{token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs,
                                                              strict=True)}}
                         for t, lp in zip(piece.token_ids, piece.logprobs, strict=True)],
        "text_offset": offsets,
    }


def chat_logprobs(piece: Piece, token_text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(t, lp.logprob),
         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]}
        for t, lp in zip(piece.token_ids, piece.logprobs, strict=True)]}


def merge_logprobs(parts: list[dict]) -> dict | None:
    """One choice's logprobs from its pieces' (non-streaming answers)."""
    if not parts:
        return None
    merged: dict[str, list] = {}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
