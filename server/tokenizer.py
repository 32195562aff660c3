"""The model's tokenizer and chat template (loaded from the GGUF file or the HF folder)."""

from __future__ import annotations

from typing import Any

from surge.model_files import ModelFiles, generation_config

# generation_config.json's sampling defaults a request without its own takes, as vLLM does.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


class Tokenizer:
    def __init__(self, files: ModelFiles) -> None:
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": files.gguf_file} if files.gguf_file else {}
        self.hf: Any = AutoTokenizer.from_pretrained(files.folder, **kwargs)
        generation = generation_config(files)
        # Llama 3 and Qwen end a turn with one of several ids: each of them stops a request.
        self.eos_token_ids = sorted(set(_ids(self.hf.eos_token_id))
                                    | set(_ids(generation.get("eos_token_id"))))
        self.sampling_defaults: dict[str, float] = {
            k: generation[k] for k in SAMPLING_DEFAULTS if generation.get(k) is not None}
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Raw prompts get exactly the tokens of their text (no BOS), as the model card expects.
        return self.hf(text, add_special_tokens=add_special_tokens).input_ids

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` argument (else tools.py describes them)."""
        return "tools" in (self.hf.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        text = self.hf.apply_chat_template(messages, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        return self.encode(text)
