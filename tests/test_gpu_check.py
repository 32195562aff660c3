"""bench/gpu_check.py's kernel checks, without a GPU: the whole script in its interpreter smoke
mode, and its check on a kernel that is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (Linux x86_64 only)")

from bench import gpu_check
from kernels import rmsnorm

ROOT = Path(__file__).resolve().parent.parent


def test_interpret_smoke_passes_every_kernel(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--interpret-smoke", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert {row["status"] for row in report["kernels"]} == {"PASS"}
    assert {row["kernel"] for row in report["kernels"]} == set(gpu_check.KERNELS)
    assert report["failed"] == []


def _rms_norm_case() -> gpu_check.Case:
    return next(case for case in gpu_check.cases(gpu_check.SMOKE, torch.device("cpu"))
                if case.kernel == "rms_norm")


def test_a_wrong_kernel_fails() -> None:
    """Off by 1% (far over fp32's tolerance), or raising: FAIL with the reason, and a report
    whose failures name it."""
    def off(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm.rms_norm(x, weight, eps) * 1.01

    def raising(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        raise ValueError("no kernel")

    timer = gpu_check.cpu_timer(1)
    wrong = gpu_check.check(_rms_norm_case(), off, rmsnorm.rms_norm, timer, 1.0)
    assert wrong["status"] == "FAIL" and "over the tolerance" in wrong["error"]
    assert wrong["max_abs_error"] > 1e-3
    crashed = gpu_check.check(_rms_norm_case(), raising, rmsnorm.rms_norm, timer, 1.0)
    assert crashed["status"] == "FAIL" and crashed["error"] == "ValueError: no kernel"
    right = gpu_check.check(_rms_norm_case(), rmsnorm.rms_norm, rmsnorm.rms_norm, timer, 1.0)
    assert right["status"] == "PASS"
    failed = gpu_check.failures({"kernels": [wrong, crashed, right]})
    assert len(failed) == 2 and all(line.startswith("rms_norm float32") for line in failed)


def test_server_failures() -> None:
    """A server that did not start, a level that raised and a level with failed requests."""
    levels = [{"concurrency": 1, "error": "RuntimeError: surge bench exited with 2"},
              {"concurrency": 16, "requests": 32, "ok": 31, "errors": {"503": 1}},
              {"concurrency": 64, "requests": 128, "ok": 128, "errors": {}}]
    assert gpu_check.failures({"server": {"levels": levels}}) == [
        "concurrency 1: RuntimeError: surge bench exited with 2", "concurrency 16: {'503': 1}"]
    assert gpu_check.failures({"server": {"error": "TimeoutError: x"}}) == [
        "server: TimeoutError: x"]
    assert gpu_check.failures({"dp_server": {"levels": levels[1:]}}) == [
        "data parallel, concurrency 16: {'503': 1}"]


def test_kernels_compiled_while_serving_fail_the_check(tmp_path: Path) -> None:
    """Triton's cache folder read as the kernels in it (each variant a folder holding its
    <name>.json and a __grp__ file); a level during which the server compiled one fails."""
    for folder, name in (("a1", "_prefill_kernel"), ("b2", "_store_kv_kernel")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{name}.json").write_text("{}")
        (tmp_path / folder / f"__grp__{name}.json").write_text("{}")
    (tmp_path / "c3").mkdir()  # a variant still being written: no name yet
    assert gpu_check.compiled_kernels(tmp_path) == {
        "a1": "_prefill_kernel", "b2": "_store_kv_kernel", "c3": "?"}
    levels = [{"concurrency": 16, "requests": 32, "ok": 32, "errors": {},
               "compiled": ["_prefill_kernel"]},
              {"concurrency": 64, "requests": 128, "ok": 128, "errors": {}, "compiled": []}]
    assert gpu_check.failures({"server": {"levels": levels}}) == [
        "concurrency 16: Triton compiled _prefill_kernel while serving (the warm-up should have)"]
