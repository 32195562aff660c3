"""Incremental detokenization gives the same text as decoding everything at once."""

from __future__ import annotations

import pytest

from server.detokenizer import Detokenizer

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "北京是中国的首都，上海是最大的城市。",
    "Emoji: 🎉🚀👩‍👩‍👧 and accents: café naïve façade",
    "  leading spaces\nnew lines\ttabs  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer.hf, prompt)
    pieces = [detok.step([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert "".join(pieces) == tokenizer.hf.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces), pieces


def test_multibyte_character_waits_for_its_last_token(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = Detokenizer(tokenizer.hf, [])
    assert [detok.step([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step([ids[-1]]) == "🚀"


def test_a_character_cut_by_the_last_token_is_dropped(tokenizer):
    """max_tokens may end an answer inside a character: its first bytes never show as U+FFFD."""
    ids = tokenizer.encode("ok 🚀")
    detok = Detokenizer(tokenizer.hf, [])
    pieces = [detok.step([t]) for t in ids[:-2]] + [detok.step([ids[-2]], final=True)]
    assert "".join(pieces) == "ok "
    whole = Detokenizer(tokenizer.hf, [])
    assert whole.step(ids[:-1], final=True) == "ok "


def test_special_tokens_are_not_shown(tokenizer):
    detok = Detokenizer(tokenizer.hf, [])
    text = detok.step(tokenizer.encode("Paris.") + tokenizer.eos_token_ids, final=True)
    assert text == "Paris."
