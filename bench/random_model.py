"""A Hugging Face folder with a model's config and tokenizer and random weights of its shapes:
the device check's model where the real weights cannot travel (a device call carries 64 MiB).
The work per token is the model's; the answers are noise.

Usage: python -m bench.random_model export GGUF FOLDER   (config and tokenizer, no weights)
       python -m bench.random_model fill FOLDER          (adds model.safetensors, bf16)"""

from __future__ import annotations

import os
import sys

import torch


def export(gguf_path: str, folder: str) -> None:
    from transformers import AutoConfig

    from server.tokenizer import Tokenizer
    from surge.model_files import resolve_model

    where, name = os.path.split(os.path.abspath(gguf_path))
    AutoConfig.from_pretrained(where, gguf_file=name).save_pretrained(folder)
    # The tokenizer surge serves the file with (its conversion, cached across starts).
    Tokenizer(resolve_model(gguf_path)).hf.save_pretrained(folder)


def fill(folder: str, seed: int = 0) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "export":
        export(argv[1], argv[2])
    elif len(argv) == 2 and argv[0] == "fill":
        fill(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
