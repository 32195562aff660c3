"""transformers' own Llama on the same dequantized weights: the oracle for greedy tokens."""

from __future__ import annotations

import torch

from surge.model_files import ModelFiles


class Reference:
    def __init__(self, files: ModelFiles) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            files.folder, gguf_file=files.gguf_file, dtype=torch.float32).eval()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], n: int) -> list[int]:
        """The first n greedy tokens, EOS included like any other token."""
        key = (tuple(prompt_ids), n)
        if key not in self._cache:
            ids = torch.tensor([prompt_ids])
            out = self.model(ids, use_cache=True)
            tokens: list[int] = []
            for _ in range(n):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = self.model(torch.tensor([[token]]), cache=out.cache,
                                 use_cache=True)
            self._cache[key] = tokens
        return self._cache[key]

    @torch.inference_mode()
    def log_probs(self, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
