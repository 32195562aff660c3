"""Start-up mistakes through the real `surge serve`: found before the model loads, one line
with the fix, exit code 2, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.server import free_port

pytestmark = pytest.mark.slow


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surge.cli", "serve", "--device", "cpu",
                           *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "loading weights" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("surge: "), out.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["--kv-cache-memory", "1KiB"], "holds no KV block: one block of 16 tokens takes"),
    (["--kv-cache-memory", "1.5"], "read as a fraction of free memory, which must be in (0, 1]"),
    (["--kv-cache-memory", "4096"], "for a size add a unit (e.g. 4096MiB)"),
    (["--model", "/no/such/model.gguf"], "no such file or folder"),
    (["--tokenizer", "/no/such/folder"], "--tokenizer"),
    # These were found only by the workers, as a traceback and exit code 1.
    (["--kv-cache-memory", "10TiB"], "is more than this machine's memory"),
    (["--deterministic", "--kernel-backend", "cpu"], "drop --kernel-backend cpu"),
    (["--speculative-method", "draft", "--draft-layers", "999"],
     "--draft-layers 999: the model has 30 layers"),
    (["--tensor-parallel-size", "2"], "attention heads (9) do not split evenly"),
    (["--speculative-method", "draft", "--draft-model", "/no/draft.gguf"],
     "--draft-model '/no/draft.gguf': no such file"),
])
def test_mistake_is_one_line_with_exit_code_2(args, expected):
    assert expected in _one_line_error(_serve("--port", str(free_port()), *args))


def test_triton_kernels_on_the_cpu_are_refused_outside_the_interpreter():
    out = _serve("--port", str(free_port()), "--kernel-backend", "triton",
                 env={"TRITON_INTERPRET": "0"})  # the tests' own Triton runs interpreted
    assert "the triton kernel backend needs CUDA" in _one_line_error(out)


def test_cuda_without_a_gpu_names_the_device_flag():
    out = _serve("--port", str(free_port()), "--device", "cuda",
                 env={"CUDA_VISIBLE_DEVICES": ""})  # none, on any machine
    assert "--device cuda: no GPU is visible here" in _one_line_error(out)


def test_port_in_use():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = _one_line_error(_serve("--port", str(port)))
    assert f"port {port} on 127.0.0.1 is not free" in line and "--port" in line


def test_hugging_face_repo_id(tmp_path):
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    line = _one_line_error(_serve("--model", repo, env={"HF_HOME": str(tmp_path)}))
    assert "Hugging Face repo id" in line and "does not download" in line
    assert f"huggingface-cli download {repo}" in line
    # Already in the Hugging Face cache: the message names the folder to pass.
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / \
        "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    line = _one_line_error(_serve("--model", repo, env={"HF_HOME": str(tmp_path)}))
    assert line.endswith(f"--model {snapshot}")


def test_help_shows_defaults_and_choices():
    out = subprocess.run([sys.executable, "-m", "surge.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0
    assert "--device {auto,cpu,cuda}" in out.stdout
    assert "--policy {fcfs,priority,sjf}" in out.stdout
    assert "HTTP port (default: 8000)" in out.stdout
    assert "(default: 1GiB)" in out.stdout and "(default: true)" in out.stdout
