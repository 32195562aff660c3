"""OpenAI response bodies and stream chunks, for completions and chat, with logprobs."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from server.generate import Piece


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) spell each byte as one
    printable character: the printable Latin-1 bytes as themselves, the rest from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + len(chars) - len(printable))
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def _raw_bytes(piece: str) -> bytes | None:
    """A vocabulary entry's own bytes: a SentencePiece byte-fallback token (<0xE6>) or a
    byte-level BPE spelling; None for anything else."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


class TokenText:
    """Token ids to the strings and bytes OpenAI's logprobs show (a cache: the same ids recur).
    A token holding part of a character (emoji, CJK) is its own bytes, shown as OpenAI shows
    them ("\\xf0\\x9f"), not the replacement character every such token decodes to alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self.cache.get(token_id)
        if found is None:
            text = self.tokenizer.decode([token_id])
            raw = text.encode()
            if "\ufffd" in text:
                own = _raw_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
                if own is not None:
                    raw, text = own, own.decode("utf-8", "backslashreplace")
            found = self.cache[token_id] = (text, raw)
        return found


def completion_logprobs(piece: Piece, token_text: TokenText, offset: int) -> dict:
    """The legacy completions format; offset is where this piece starts in the choice's text.
    A token's offset counts the characters its piece's tokens before it complete, so the
    offsets never go back and never pass the piece's text."""
    tokens, offsets, complete = [], [], 0
    characters = codecs.getincrementaldecoder("utf-8")("ignore")
    for t in piece.token_ids:
        text, own = token_text(t)
        tokens.append(text)
        offsets.append(offset + min(complete, len(piece.text)))
        complete += len(characters.decode(own))
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for lp in piece.logprobs],
        # As OpenAI: the top k and the sampled token, whether or not it is among them.
        "top_logprobs": [None if lp is None else
                         {token_text(t)[0]: lp.logprob,
                          **{token_text(i)[0]: v for i, v in zip(lp.top_ids, lp.top_logprobs,
                                                                 strict=True)}}
                         for t, lp in zip(piece.token_ids, piece.logprobs, strict=True)],
        "text_offset": offsets,
    }


async def echoed(pieces: AsyncIterator[Piece], echo: list[str], prompts: list[list[int]],
                 scored: bool, shown: bool) -> AsyncIterator[Piece]:
    """Completions' echo past the plain case. scored (echo with logprobs): each choice's first
    piece gets its prompt in front, with the prompt's logprobs (its first token has none).
    Not shown (max_tokens 0): the one token computed for the prompt's sake is left out."""
    async for piece in pieces:
        if not shown:
            piece = msgspec.structs.replace(piece, text="", num_tokens=0, token_ids=[],
                                            logprobs=[], finish_reason=piece.finish_reason
                                            and "length")
        if scored and piece.prompt_logprobs is not None:
            piece = msgspec.structs.replace(
                piece, text=echo[piece.index] + piece.text,
                token_ids=prompts[piece.index] + piece.token_ids,
                logprobs=[None, *piece.prompt_logprobs, *piece.logprobs], prompt_logprobs=None)
        yield piece


def chat_logprobs(piece: Piece, token_text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text, own = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(own)}

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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens the prefix cache held (None: not
    known here, left out)."""
    out: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def cached_of(piece: Piece, n: int) -> int:
    """The prompt tokens the prefix cache held, from a choice's piece that says so: once a
    prompt (its first choice's), as usage counts each prompt's tokens once."""
    return piece.timing[1] if piece.timing is not None and piece.index % n == 0 else 0
