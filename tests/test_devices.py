"""Device selection: ranks per GPU, --devices (indices or MIG UUIDs), CPU shares."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_workers import devices
from surge.config import ConfigError, ModelConfig


def test_cpulist_parsing():
    assert devices.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert devices.parse_cpulist("5") == [5]


def test_cpu_ranks_share_the_cores():
    cpus = list(range(8))
    assert [devices.cpu_share(cpus, r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # More ranks than cores: each still gets one.
    assert [devices.cpu_share([0, 1], r, 3) for r in range(3)] == [[0], [1], [0]]


def test_cpu_resolves_to_one_rank_unless_asked():
    cfg = devices.resolve(ModelConfig(device="cpu"))
    assert (cfg.device, cfg.tensor_parallel_size) == ("cpu", 1)
    assert devices.resolve(ModelConfig(device="cpu", tensor_parallel_size=3)
                           ).tensor_parallel_size == 3


def test_cuda_is_asked_of_torch_only_where_a_driver_is_loaded():
    assert devices._cuda_available() == torch.cuda.is_available()


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(devices, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_one_rank_per_visible_gpu_by_default(four_gpus):
    cfg = devices.resolve(ModelConfig())
    assert (cfg.device, cfg.devices, cfg.tensor_parallel_size) == ("cuda", "0,1,2,3", 4)


def test_devices_by_index_or_mig_uuid(four_gpus, monkeypatch):
    cfg = devices.resolve(ModelConfig(devices="2, 3", tensor_parallel_size=1))
    assert (cfg.devices, cfg.tensor_parallel_size) == ("2", 1)
    mig = "MIG-4f7c2a1e-0000-5b6c-9d8e-123456789abc,MIG-4f7c2a1e-0001-5b6c-9d8e-123456789abc"
    assert devices.resolve(ModelConfig(devices=mig)).devices == mig
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert devices.resolve(ModelConfig()).devices == "1,3"


def test_more_ranks_than_gpus_is_refused_with_the_fix(four_gpus):
    with pytest.raises(ConfigError, match="needs 8 GPUs but 4 are visible"):
        devices.resolve(ModelConfig(tensor_parallel_size=8))


def test_serve_refuses_more_ranks_than_gpus_with_exit_code_2():
    import subprocess
    import sys

    # Two listed (none need exist here: the count is checked before any is used).
    proc = subprocess.run([sys.executable, "-m", "surge.cli", "serve", "--device", "cuda",
                           "--tensor-parallel-size", "512"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert proc.returncode == 2, proc.stderr
    assert "needs 512 GPUs but 2 are visible" in proc.stderr and "lower it" in proc.stderr
