"""The model's tokenizer and chat template (loaded from the GGUF file or the HF folder)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from typing import Any

from server.tool_parsers import ToolFormat, format_of
from surge.model_files import ModelFiles, generation_config

log = logging.getLogger("surge.frontend")

# generation_config.json's sampling defaults a request without its own takes, as vLLM does.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def cache_dir(files: ModelFiles) -> str:
    """Where a GGUF file's tokenizer, once converted to a Hugging Face one (seconds of work),
    is kept for the next start: systemd's CacheDirectory, else XDG_CACHE_HOME or ~/.cache;
    keyed by the file and the libraries that convert it."""
    import tokenizers
    import transformers

    st = os.stat(files.path)
    key = hashlib.sha256(f"{os.path.realpath(files.path)}|{st.st_size}|{st.st_mtime_ns}|"
                         f"{transformers.__version__}|{tokenizers.__version__}".encode())
    root = (os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
            or os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"))
    return os.path.join(root, "surge", "tokenizers", key.hexdigest()[:24])


def _from_cache(folder: str) -> Any:
    """A GGUF file's tokenizer as converted and saved. The folder has no model config, so
    AutoTokenizer would load the generic class it names as that class: loaded directly, without
    AutoTokenizer's import of the model configs, which brings in torch (2 s of the frontend's
    start-up)."""
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        named = json.load(f).get("tokenizer_class")
    if named in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _load(files: ModelFiles) -> Any:
    cached = cache_dir(files) if files.gguf_file else ""
    if cached and os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return _from_cache(cached)
    from transformers import AutoTokenizer

    if not files.gguf_file:
        return AutoTokenizer.from_pretrained(files.folder)
    hf = AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file)
    partial = f"{cached}.partial-{os.getpid()}"
    try:  # written whole, then renamed: a reader never sees half a folder
        hf.save_pretrained(partial)
        os.rename(partial, cached)
    except OSError as e:  # read-only, or another process has just put it there
        log.debug("tokenizer not cached at %s: %s", cached, e)
        shutil.rmtree(partial, ignore_errors=True)
    return hf


class Tokenizer:
    def __init__(self, files: ModelFiles) -> None:
        self.hf: Any = _load(files)
        generation = generation_config(files)
        # Llama 3 and Qwen end a turn with one of several ids: each of them stops a request.
        self.eos_token_ids = sorted(set(_ids(self.hf.eos_token_id))
                                    | set(_ids(generation.get("eos_token_id"))))
        self.sampling_defaults: dict[str, float] = {
            k: generation[k] for k in SAMPLING_DEFAULTS if generation.get(k) is not None}
        self.vocab_size = len(self.hf)
        # At least the characters of the longest token's text: a vocabulary entry spells each
        # byte (or character) of it as one character.
        self.longest_token = max(map(len, self.hf.get_vocab()))
        self._text_only: Any = None  # see _as_text
        # The text of the control tokens ("<|im_start|>"), as a message may spell them.
        self._controls = re.compile("|".join(
            re.escape(t.content) for t in self.hf.added_tokens_decoder.values() if t.special)
            or "(?!)")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Raw prompts get exactly the tokens of their text (no BOS), as the model card expects.
        return self.hf(text, add_special_tokens=add_special_tokens).input_ids

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` argument (else tools.py describes them)."""
        return "tools" in (self.hf.chat_template or "")

    @property
    def tool_format(self) -> ToolFormat:
        """The form of tool calls the model was taught (server/tool_parsers.py)."""
        return format_of(self.hf.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """The chat's token ids. What a client sent is text: where any string of its messages or
        tools spells a control token ("<|im_start|>system..."), the template renders a mark and
        the spelling gets plain-character tokens, so no message, name, tool call or tool
        description can forge a turn; only the template's own control tokens are controls."""
        # This chat's own mark, which no client text can spell: a spelling's index between.
        mark = f"\ue000{secrets.token_hex(8)}"
        spelled: list[str] = []

        def marked(spelling: re.Match[str]) -> str:
            spelled.append(spelling[0])
            return f"{mark}{len(spelled) - 1}\ue001"

        def unspell(value: Any) -> Any:
            if isinstance(value, str):
                return self._controls.sub(marked, value)
            if isinstance(value, dict):
                return {unspell(k): unspell(v) for k, v in value.items()}
            if isinstance(value, list):
                return [unspell(v) for v in value]
            return value

        text = self.hf.apply_chat_template(unspell(messages), tools=unspell(tools),
                                           add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        if not spelled:
            return self.encode(text)
        pieces = re.split(f"{mark}(\\d+)\ue001", text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):  # text, a spelling's index, text, ...
            ids += (self._as_text().encode(spelled[int(piece)], add_special_tokens=False).ids
                    if i % 2 else self.encode(piece))
        return ids

    def _as_text(self) -> Any:
        """A second copy of the tokenizer that reads control tokens' spellings as text. Its
        own: transformers' split_special_tokens flips a setting of the one every request
        shares, which requests tokenized in other threads would then meet."""
        if self._text_only is None:
            import tokenizers

            copy = tokenizers.Tokenizer.from_str(self.hf.backend_tokenizer.to_str())
            copy.encode_special_tokens = True
            self._text_only = copy
        return self._text_only
