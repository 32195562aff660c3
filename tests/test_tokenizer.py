"""The served tokenizer: a GGUF file's, converted once and then read from the cache, is the
same tokenizer (ids, chat template, special tokens, decoding)."""

from __future__ import annotations

import os

from server.tokenizer import Tokenizer, cache_dir
from tests.prompts import CHAT, LONG_TEXT, RAW

TEXTS = [*RAW, LONG_TEXT, "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\n\n\ttab",
         "émigré naïve façade — «quotes» 東京 🚀🚀", "x = {'a': [1, 2.5e-3]}  # comment"]


def test_a_cached_gguf_tokenizer_is_the_converted_one(model_files, tmp_path, monkeypatch):
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = Tokenizer(model_files)  # converted from the file, then stored
    folder = cache_dir(model_files)
    assert folder.startswith(str(tmp_path)) and os.path.isfile(f"{folder}/tokenizer.json")
    cached = Tokenizer(model_files)
    assert cached.hf.name_or_path == folder  # read from the cache this time
    for text in TEXTS:
        assert cached.encode(text) == built.encode(text), text
        ids = built.encode(text)
        assert cached.hf.decode(ids) == built.hf.decode(ids)
    for messages in CHAT:
        assert cached.apply_chat_template(messages) == built.apply_chat_template(messages)
    assert cached.eos_token_ids == built.eos_token_ids == [2]
    assert cached.vocab_size == built.vocab_size
    assert cached.hf.all_special_ids == built.hf.all_special_ids
    sample = list(range(0, built.vocab_size, 97))
    assert cached.hf.convert_ids_to_tokens(sample) == built.hf.convert_ids_to_tokens(sample)


def test_a_cache_that_cannot_be_written_is_no_error(model_files, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")  # the cache root is a file: nothing can go below it
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert Tokenizer(model_files).encode("The capital of France is")
    assert os.listdir(tmp_path) == ["file"]
