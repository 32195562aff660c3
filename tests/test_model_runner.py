"""The model runner on the CPU: the padded decode-graph path and its batch sizes, a step
prepared while the previous one is still in flight, and the KV cache's pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from gpu_workers import host_memory
from gpu_workers.graphs import graph_sizes
from gpu_workers.loader import load_model
from gpu_workers.model_runner import ModelRunner
from surge.model_files import resolve_model
from surge.protocol import PREVIOUS_TOKEN, SamplingParams, ScheduledSeq, StepPlan
from tests.inprocess import InProcessEngine
from tests.tiny_model import hf_greedy, save_tiny_llama


def test_graph_sizes_cover_every_batch():
    sizes = graph_sizes(100)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 100
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:], strict=False))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny"))
    save_tiny_llama(folder, heads=4, kv_heads=2, vocab=256)
    return folder, load_model(resolve_model(folder), torch.device("cpu"), torch.float32)


def test_padded_decode_graph_path_keeps_the_reference_tokens(tiny):
    """Five sequences decode as a padded batch of 8 (three padding rows on the scratch block)."""
    folder, model = tiny
    prompts = {f"p{i}": [(7 * i + j) % 250 + 1 for j in range(3 + 4 * i)] for i in range(5)}
    engine = InProcessEngine(model, num_blocks=64, graphs_max_batch=8, block_size=4)
    replays = []
    real_run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda *a: replays.append(len(a[0])) or real_run(*a)
    for name, ids in prompts.items():
        engine.add(name, ids, 10)
    got = engine.run()
    assert 5 in replays  # the whole batch took the padded path at least once
    for name, ids in prompts.items():
        assert got[name] == hf_greedy(folder, ids, 10), name


def test_next_step_prepared_while_the_previous_one_is_in_flight(tiny):
    """prepare(N+1) before finish(N): the token N samples reaches N+1 on the device."""
    _, model = tiny
    params = SamplingParams(max_tokens=3, temperature=0.0)
    prompts = [[3, 4, 5, 6, 7], [9, 10, 11]]

    def plans() -> list[StepPlan]:
        prefill = [ScheduledSeq(i, p, 0, [2 * i, 2 * i + 1], True, params, 0)
                   for i, p in enumerate(prompts)]
        decode = [ScheduledSeq(i, [PREVIOUS_TOKEN], len(p), [2 * i, 2 * i + 1], True, params, 0)
                  for i, p in enumerate(prompts)]
        return [StepPlan(0, prefill), StepPlan(1, decode)]

    def runner() -> ModelRunner:
        return ModelRunner(model, 8, 4, torch.device("cpu"), torch.float32)

    one_by_one = runner()
    expected = [one_by_one.run(p).seqs for p in plans()]
    overlapped = runner()
    first, second = plans()
    launched = overlapped.launch(overlapped.prepare(first))
    step = overlapped.prepare(second)
    got = [overlapped.finish(launched).seqs]
    got.append(overlapped.finish(overlapped.launch(step)).seqs)
    assert got == expected


def _huge_pages_mode() -> str:
    """The kernel's transparent huge page setting: always, madvise or never (also where the
    kernel has none)."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists():
        return "never"
    text = setting.read_text()
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_huge_pages_mode() == "never",
                    reason="this kernel gives no transparent huge pages")
def test_cpu_kv_cache_is_asked_into_huge_pages(tiny):
    """The CPU KV cache is zeroed and asked into 2 MiB pages before its first touch (scattered
    2 KB block reads then miss the TLB far less); a tensor not asked is not. How many the
    kernel grants depends on the machine's free memory runs (CI once got 26 of 128 MiB), so
    the test holds the asking, and under the usual "madvise" setting that nothing unasked got.
    The unasked tensor lies in a fresh mapping: a heap allocation may reuse memory that an
    earlier test's cache asked (seen: 27 MiB of a torch.zeros "asked")."""
    _, model = tiny
    engine = InProcessEngine(model, num_blocks=16384, block_size=16)
    cache = engine.runner.kv_cache
    assert cache.nbytes > 8 << 20 and not cache.any()
    asked, _ = host_memory.huge_pages(cache)
    assert asked >= cache.nbytes - (4 << 20)
    fresh = mmap.mmap(-1, cache.nbytes)
    plain = torch.frombuffer(fresh, dtype=torch.uint8).fill_(0)
    asked, got = host_memory.huge_pages(plain)
    assert asked == 0
    if _huge_pages_mode() == "madvise":
        assert got == 0
