"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from typing import Any

# A few prompt tokens of left context make the first delta decode the way the full text would
# (word-initial spaces in SentencePiece vocabularies depend on what precedes them).
_CONTEXT_TOKENS = 4
_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Text added by new_token_ids; a character still incomplete waits for the next token,
        and is dropped at the final step (an answer cut by max_tokens mid-character)."""
        self.ids.extend(new_token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if final:
            full = full.rstrip(_INCOMPLETE)
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
