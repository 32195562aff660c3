"""Logprobs bodies for tokens that hold part of a character (emoji, CJK): their own bytes,
distinct strings, and completion offsets that point into the text."""

from __future__ import annotations

import pytest

from server.generate import Piece
from server.responses import TokenText, _raw_bytes, chat_logprobs, completion_logprobs
from surge.protocol import TokenLogprobs

TEXT = "Emoji party: 🎉🎉 日本語のテキスト ñ, done"


@pytest.fixture(scope="module")
def token_text(tokenizer) -> TokenText:
    return TokenText(tokenizer.hf)


def _piece(tokenizer, text: str, top: list[int]) -> Piece:
    ids = tokenizer.encode(text)
    lps = [TokenLogprobs(-0.5, top, [-0.5 - i for i in range(len(top))]) for _ in ids]
    return Piece(0, text, len(ids), None, ids, lps)


def _partial(tokenizer) -> list[int]:
    """The ids of TEXT's tokens that hold part of a character."""
    return [t for t in tokenizer.encode(TEXT) if "\ufffd" in tokenizer.hf.decode([t])]


def test_a_token_is_its_own_bytes(tokenizer, token_text):
    ids = tokenizer.encode(TEXT)
    pairs = [token_text(t) for t in ids]
    assert b"".join(raw for _, raw in pairs) == TEXT.encode()
    assert all("\ufffd" not in text for text, _ in pairs)
    partial = _partial(tokenizer)
    assert len(partial) >= 4  # the emoji and the CJK split into byte pieces
    for t in partial:  # shown as OpenAI shows them: the bytes escaped, "\xf0\x9f"
        text, raw = token_text(t)
        assert "\\x" in text and text == raw.decode("utf-8", "backslashreplace")


def test_vocabulary_spellings_give_their_bytes():
    assert _raw_bytes("<0xE6>") == b"\xe6"  # SentencePiece byte fallback
    assert _raw_bytes("Ġhello") == b" hello"  # byte-level BPE: Ġ is the space
    assert _raw_bytes("ðŁİ") == b"\xf0\x9f\x8e"
    assert _raw_bytes("▁hello") is None  # neither: the caller keeps the decoded text


def test_completion_offsets_point_at_the_characters_completed(tokenizer, token_text):
    partial = _partial(tokenizer)
    piece = _piece(tokenizer, TEXT, partial[:3])
    start = 7  # where the piece begins in the choice's text
    body = completion_logprobs(piece, token_text, start)
    offsets = body["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == start
    raw = b""
    for t, offset in zip(piece.token_ids, offsets, strict=True):
        done = TEXT[: offset - start].encode()
        # The characters before the offset are the whole of the bytes before the token, but
        # for a character still incomplete.
        assert raw.startswith(done) and len(raw) - len(done) < 4, (raw, offset)
        raw += token_text(t)[1]
    # Three distinct byte pieces are three entries (they all decode alone to U+FFFD), plus
    # the sampled token where it is not among them.
    for t, top in zip(piece.token_ids, body["top_logprobs"], strict=True):
        assert len(top) == 3 + (t not in partial[:3]), top


def test_chat_bytes_rebuild_the_text(tokenizer, token_text):
    partial = _partial(tokenizer)
    body = chat_logprobs(_piece(tokenizer, TEXT, partial[:2]), token_text)
    content = body["content"]
    assert bytes(b for c in content for b in c["bytes"]) == TEXT.encode()
    tops = content[0]["top_logprobs"]
    assert len({e["token"] for e in tops}) == 2
    assert all(bytes(e["bytes"]).decode("utf-8", "backslashreplace") == e["token"] for e in tops)


def test_a_stop_string_inside_a_speculative_step_ends_usage_and_logprobs_there(tokenizer):
    """A speculative step brings several tokens at once: the text, the tokens counted and the
    logprobs all end at the token that completes the stop string (the text did; the counts
    and logprobs went on to the step's end)."""
    import asyncio

    from server.generate import generate
    from surge.protocol import RequestOutput, SamplingParams

    ids = tokenizer.encode(" apple, banana, apple, cherry")
    stop_at = next(i for i in range(len(ids))
                   if "banana" in tokenizer.hf.decode(ids[:i + 1]))
    lps = [TokenLogprobs(-float(i), [], []) for i in range(len(ids))]
    aborted: list[str] = []

    async def main() -> list[Piece]:
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        stream.put_nowait(RequestOutput("r", ids, None, logprobs=lps))  # one step, all of it
        engine = type("Engine", (), {"abort": lambda self, rid: aborted.append(rid)})()
        return [p async for p in generate(engine, stream, tokenizer.hf, "r", 0, [1],
                                          SamplingParams(max_tokens=64, logprobs=0),
                                          ["ana"])]

    pieces = asyncio.run(main())
    assert "".join(p.text for p in pieces) == " apple, b"
    assert pieces[-1].finish_reason == "stop" and aborted == ["r"]
    assert sum(p.num_tokens for p in pieces) == stop_at + 1
    assert [lp.logprob for p in pieces for lp in p.logprobs] == [-float(i)
                                                                for i in range(stop_at + 1)]
