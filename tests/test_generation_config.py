"""What a checkpoint says about generation: its list of EOS ids and its sampling defaults
(generation_config.json), and the one clear error for a model surge does not serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

from tests.server import ServerProcess
from tests.tiny_families import save_tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, model_files) -> tuple[str, list[int], list[int]]:
    """A tiny Qwen2 folder with a tokenizer, whose generation_config.json ends a turn with two
    ids (the third and fifth of a prompt's greedy answer), samples greedily by default, and keeps
    only the most likely token by its top_p (0.001 < 1 / vocab_size):
    (folder, prompt, the greedy answer by transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(tmp_path_factory.mktemp("qwen"))
    save_tiny(folder, "qwen2")
    AutoTokenizer.from_pretrained(model_files.folder, gguf_file=model_files.gguf_file
                                  ).save_pretrained(folder)
    prompt = [11, 22, 33, 44, 55, 66, 77]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    answer = out[0, len(prompt):].tolist()
    first_eos = next(i for i, t in enumerate(answer) if t in (answer[2], answer[4]))
    answer = answer[: first_eos + 1]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [answer[-1], 255], "temperature": 0.0, "top_p": 0.001,
                   "top_k": 5}, f)
    return folder, prompt, answer


def test_tokenizer_reads_generation_config(qwen):
    from server.tokenizer import Tokenizer
    from surge.model_files import resolve_model

    folder, _, answer = qwen
    tok = Tokenizer(resolve_model(folder))
    assert {answer[-1], 255} <= set(tok.eos_token_ids)
    assert tok.sampling_defaults == {"temperature": 0.0, "top_p": 0.001, "top_k": 5}


def test_every_eos_id_stops_and_defaults_apply(qwen):
    """No temperature in the request: generation_config's 0 makes it greedy; the answer stops at
    the first token of the EOS list, the one the server learned from generation_config.json.
    Sampled at temperature 1 with no top_p given, generation_config's top_p leaves only the
    greedy token at each step (its top_k alone leaves 5: 3 seeds would part from it)."""
    folder, prompt, answer = qwen
    srv = ServerProcess("--model", folder).wait_ready()
    try:
        choices = [_complete(srv.url, {"prompt": prompt, "max_tokens": 8, "logprobs": 0})]
        choices += [_complete(srv.url, {"prompt": prompt, "max_tokens": 8, "logprobs": 0,
                                        "temperature": 1.0, "seed": seed}) for seed in (1, 2, 3)]
    finally:
        srv.stop()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        assert choice["logprobs"]["tokens"] == [tok.decode([t]) for t in answer]


def _complete(url: str, body: dict) -> dict:
    """The one choice of a /v1/completions answer."""
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_unsupported_model_is_one_clear_error(tmp_path, kind):
    if kind == "hf":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
        model, named = str(tmp_path), "model_type 'mamba'"
    else:
        import gguf

        model, named = str(tmp_path / "m.gguf"), "GGUF architecture 'rwkv6'"
        writer = gguf.GGUFWriter(model, "rwkv6")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    done = subprocess.run([sys.executable, "-m", "surge.cli", "serve", "--model", model],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert named in done.stderr and "surge serves llama" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
