"""The device check's pipeline-parallel runs (bench/gpu_check.py), for a machine with several
GPUs: each layout's greedy answers against one GPU's, then one `surge bench` level.

Layouts by the GPUs visible: 2 -> PP=2; 4 -> PP=2, PP=4 and TP=2 x PP=2. With one GPU there is
nothing to run (each stage needs a GPU of its own) and the section says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.server import ServerProcess

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?",
           "List three primary colors.", "Explain TCP in one sentence."]
# bf16 on GPUs: reduction orders differ between layouts, so answers are compared on their
# first tokens, as the README judges bf16 elsewhere.
COMPARED_CHARS = 40
CONCURRENCY = 64


def layouts(gpus: int) -> list[tuple[int, int]]:
    """(pipeline stages, tensor-parallel ranks) worth running on this many GPUs."""
    found = [(2, 1)] if gpus >= 2 else []
    return found + ([(4, 1), (2, 2)] if gpus >= 4 else [])


def _greedy(url: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    return [client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": p}], max_tokens=32,
        temperature=0).choices[0].message.content or "" for p in PROMPTS]


def _bench(url: str, requests: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "surge.cli", "bench", "--url", url,
                        "--concurrency", str(CONCURRENCY), "--num-requests", str(requests),
                        "--input-len", "128", "--output-len", "128", "--duration", "40",
                        "--no-progress", "--output", str(out)], timeout=160)
        return json.loads(out.read_text())["results"][0]


def _serve(stages: int, tp: int, requests: int) -> dict[str, Any]:
    server = ServerProcess("--device", "cuda", "--pipeline-parallel-size", str(stages),
                           "--tensor-parallel-size", str(tp), dtype="auto",
                           kv_cache_memory="4GiB")
    try:
        server.wait_ready(timeout=240)
        split = [line for line in server.output().splitlines() if "stage " in line]
        answers = _greedy(server.url)
        level = _bench(server.url, requests) if stages > 1 else None
    finally:
        server.stop()
    return {"stages": stages, "tp": tp, "split": split, "answers": answers, "level": level}


def pipeline_runs(quick: bool) -> dict[str, Any]:
    """Every layout the GPUs allow, each compared with one GPU's answers."""
    gpus = torch.cuda.device_count()
    todo = layouts(gpus)
    if not todo:
        return {"skipped": f"{gpus} GPU visible: pipeline stages need one each"}
    requests = CONCURRENCY if quick else 2 * CONCURRENCY
    one = _serve(1, 1, requests)["answers"]
    runs = []
    for stages, tp in todo:
        try:
            run = _serve(stages, tp, requests)
            run["same_start"] = [a[:COMPARED_CHARS] == b[:COMPARED_CHARS]
                                 for a, b in zip(run["answers"], one, strict=True)]
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError) as e:
            run = {"stages": stages, "tp": tp, "error": f"{type(e).__name__}: {e}"}
        runs.append(run)
        print(_line(run), flush=True)
    return {"one_gpu_answers": one, "runs": runs}


def _line(run: dict) -> str:
    name = f"PP={run['stages']} x TP={run['tp']}"
    if "error" in run:
        return f"{name}: {run['error']}"
    level = run["level"]
    return (f"{name}: {sum(run['same_start'])}/{len(run['same_start'])} answers start as one "
            f"GPU's; concurrency {CONCURRENCY}: {level['output_tok_s']:.1f} output tok/s, "
            f"TPOT p50 {level['tpot_ms']['p50']:.1f} ms, {level['ok']}/{level['requests']} ok")


def pipeline_failures(section: dict) -> list[str]:
    """One line per layout that failed to serve, answered otherwise, or lost requests."""
    failed = []
    for run in section.get("runs", []):
        name = f"pipeline PP={run['stages']} x TP={run['tp']}"
        if "error" in run:
            failed.append(f"{name}: {run['error']}")
        elif not all(run["same_start"]):
            failed.append(f"{name}: greedy answers differ from one GPU's")
        elif run["level"]["ok"] < run["level"]["requests"]:
            failed.append(f"{name}: {run['level']['errors']}")
    return failed
