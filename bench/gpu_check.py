"""The device check for one NVIDIA H200 (bench/gpu_check.sh sets up .venv and runs it; it must
finish within 8 minutes).

1. Environment: torch, Triton and CUDA versions, the GPU and its memory.
2. Device-to-device copy bandwidth, the reference for the kernels' achieved bandwidth.
3. Each Triton kernel against its PyTorch reference (the same name in kernels/) on
   Llama-8B-like shapes in bf16 and fp16: max abs error, median times (CUDA events, L2 flushed),
   achieved bandwidth = bytes it must read and write / time, as a fraction of the copy's.
4. `surge bench` (128 in / 128 out) against the real server at concurrency 1, 16, 64, 256;
   a Triton kernel the server compiled during a level fails the check (it stalled a step).
5. With two or more GPUs visible: the same at concurrency 64 and 256 with one data-parallel
   replica per GPU (--data-parallel-size), against step 4's single GPU.
6. With several GPUs, pipeline parallelism (bench/gpu_pipeline.py): PP=2 (and with 4 GPUs PP=4
   and TP=2 x PP=2), greedy answers against one GPU's and one bench level each.

--interpret-smoke runs 1-3 on the CPU, the kernels in Triton's interpreter on tiny fp32 shapes,
so that this code runs in the test suite: its times (perf_counter) and its copy bandwidth (a
CPU copy) mean nothing. Everything measured is printed and written as JSON to --out; the exit
code is 1 if any check failed.

Usage: bench/gpu_check.sh [--quick] [--skip-kernels] [--skip-server] [--skip-dp]
       [--skip-pipeline] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Run as a file, Python puts bench/ on sys.path, not the repo root that holds tests.server.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels
from bench.gpu_cases import H200, SMOKE, Case, Shapes, cases, planned_decode
from bench.gpu_pipeline import pipeline_failures, pipeline_runs
from tests.server import ServerProcess

KERNELS = ("store_kv", "decode_attention", "prefill_attention", "rms_norm", "add_rms_norm",
           "apply_rotary_")
# As tests/test_triton_kernels.py: a few units in the last place of each dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LEVELS = (1, 16, 64, 256)
DP_LEVELS = (64, 256)  # where replicas can help: enough requests to keep each one busy
# 256 sequences in one batch (the default is 128), and KV room for all of them at 256 tokens.
SERVER_ARGS = ("--device", "cuda", "--max-num-seqs", "256")
SERVER_KV_CACHE = "4GiB"
# No request starts after this many seconds of a level, so a slow server still ends in time.
LEVEL_SECONDS = 40

Timer = Callable[[Callable[[], object]], float]


def cuda_timer(runs: int) -> Timer:
    """Median seconds of a call over `runs` after three warm-up calls, by CUDA events."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def median_seconds(fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        events = []
        for _ in range(runs):
            # Each call starts with a cold L2 (50 MB on an H200), as in a model step; the memset
            # also keeps the GPU busy while the call is launched, so launch latency is not timed.
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3

    return median_seconds


def cpu_timer(runs: int) -> Timer:
    """Median seconds of a call over `runs` after one warm-up call, by perf_counter."""

    def median_seconds(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return median_seconds


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer) -> float:
    """GB/s read plus written by one large copy_, the most a kernel can hope to move."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9


def environment(device: torch.device) -> dict:
    import triton  # only now: --interpret-smoke sets TRITON_INTERPRET first

    info = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    if device.type != "cuda":
        return {**info, "device": "cpu (Triton interpreter)"}
    props = torch.cuda.get_device_properties(device)
    return {**info, "device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count}


def check(case: Case, impl: Callable, reference: Callable, timer: Timer, copy_gb_s: float
          ) -> dict:
    """impl against reference on the case's inputs, both timed; FAIL, with the error, when they
    differ by more than the dtype's tolerance or anything raises."""
    row: dict[str, Any] = {"kernel": case.kernel, "dtype": str(case.dtype).removeprefix("torch."),
                           "shape": case.shape}
    try:
        # The kernel runs first, so memory it leaves unwritten cannot hold the reference's answer.
        args = case.inputs()
        got = case.outputs(args, impl(*args))
        ref_args = case.inputs()
        want = case.outputs(ref_args, reference(*ref_args))
        tol = TOLERANCE[case.dtype]
        pairs = list(zip(got, want, strict=True))
        error = max((g.float() - w.float()).abs().max().item() for g, w in pairs)
        close = all(torch.allclose(g, w, rtol=tol, atol=tol) for g, w in pairs)
        seconds = timer(lambda: impl(*args))
        reference_seconds = timer(lambda: reference(*ref_args))
    except Exception as e:  # a broken kernel is a result here, not a reason to stop
        return {**row, "status": "FAIL", "error": f"{type(e).__name__}: {e}"}
    gb_s = case.nbytes / seconds / 1e9
    row |= {"status": "PASS" if close else "FAIL", "max_abs_error": error, "tolerance": tol,
            "triton_us": seconds * 1e6, "torch_us": reference_seconds * 1e6,
            "speedup": reference_seconds / seconds, "gb_s": gb_s,
            "copy_fraction": gb_s / copy_gb_s}
    if not close:
        row["error"] = f"max abs error {error:.3g} over the tolerance {tol:g}"
    return row


def _kernel_line(row: dict) -> str:
    head = f"{row['status']} {row['kernel']:<18} {row['dtype']:<9} {row['shape']:<38}"
    if "triton_us" not in row:
        return f"{head} {row['error']}"
    return (f"{head} err {row['max_abs_error']:8.2e}  triton {row['triton_us']:9.1f} us  "
            f"torch {row['torch_us']:9.1f} us ({row['speedup']:5.1f}x)  "
            f"{row['gb_s']:7.1f} GB/s = {row['copy_fraction']:4.0%} of copy")


def implementations(triton: bool) -> dict[str, Callable]:
    """Every checked kernel, Triton or reference, as the worker's kernels.for_device picks."""
    ops = kernels.for_device(torch.device("cuda"), "triton" if triton else "reference")
    impls = {name: getattr(ops, name) for name in KERNELS}
    impls["decode_attention"] = planned_decode(ops.plan_decode, ops.decode_attention)
    return impls


def kernel_checks(shapes: Shapes, device: torch.device, timer: Timer, copy_gb_s: float
                  ) -> list[dict]:
    triton_impls, references = implementations(True), implementations(False)
    rows = []
    for case in cases(shapes, device):
        rows.append(check(case, triton_impls[case.kernel], references[case.kernel], timer,
                          copy_gb_s))
        print(_kernel_line(rows[-1]), flush=True)
    return rows


def bench_level(url: str, concurrency: int, requests: int) -> dict:
    """`surge bench`'s JSON result for one closed-loop level (its own line goes to stdout)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "surge.cli", "bench", "--url", url, "--concurrency",
               str(concurrency), "--num-requests", str(requests), "--input-len", "128",
               "--output-len", "128", "--duration", str(LEVEL_SECONDS), "--no-progress",
               "--output", str(out)]
        # Exit code 1 only says some request failed: the JSON counts them.
        code = subprocess.run(cmd, timeout=LEVEL_SECONDS + 120).returncode
        if code not in (0, 1) or not out.exists():
            raise RuntimeError(f"surge bench exited with {code}")
        return json.loads(out.read_text())["results"][0]


def compiled_kernels(cache: Path) -> dict[str, str]:
    """Each kernel variant Triton has compiled into `cache` (a folder each): folder -> name."""
    return {d.name: next((f.stem for f in d.glob("*.json") if not f.name.startswith("__grp")),
                         "?")
            for d in cache.iterdir() if d.is_dir()}


def server_benchmark(quick: bool, replicas: int = 1) -> dict:
    """The real server on the GPU (the default model, dtype auto; `replicas` data-parallel
    engines, one GPU each), loaded by `surge bench` at each concurrency level; a level that
    fails is recorded and the next one still runs. The server's own Triton cache shows any
    kernel it compiled while serving, which stalled a step: the warm-up should have."""
    args = (*SERVER_ARGS, "--data-parallel-size", str(replicas)) if replicas > 1 else SERVER_ARGS
    cache = tempfile.TemporaryDirectory(prefix="surge-triton-")
    server = ServerProcess(*args, dtype="auto", kv_cache_memory=SERVER_KV_CACHE,
                           env={"TRITON_CACHE_DIR": cache.name})
    try:
        server.wait_ready(timeout=180)
        seen = compiled_kernels(Path(cache.name))
        print(f"{len(seen)} Triton kernel variants compiled by the start-up", flush=True)
        # The worker's line names the device and dtype; the scheduler's the KV capacity.
        startup = [line for line in server.output().splitlines() if " ready" in line]
        print(*startup, sep="\n", flush=True)
        levels = []
        for concurrency in LEVELS if replicas == 1 else DP_LEVELS:
            requests = max(concurrency, 4) if quick else max(2 * concurrency, 16)
            try:
                levels.append(bench_level(server.url, concurrency, requests))
                now = compiled_kernels(Path(cache.name))
                levels[-1]["compiled"] = sorted(now[k] for k in now.keys() - seen.keys())
                seen = now
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                levels.append({"concurrency": concurrency, "error": f"{type(e).__name__}: {e}"})
    finally:
        server.stop()
        cache.cleanup()
    return {"args": [*args, "--kv-cache-memory", SERVER_KV_CACHE], "startup": startup,
            "levels": levels}


def _level_line(level: dict) -> str:
    if "error" in level:
        return f"{level['concurrency']:>11}  {level['error']}"
    ttft, tpot = level["ttft_ms"], level["tpot_ms"]
    return (f"{level['concurrency']:>11} {level['requests']:>9} {level['output_tok_s']:>13.1f} "
            f"{ttft['p50']:>9.1f} / {ttft['p95']:>7.1f} {tpot['p50']:>9.1f} / {tpot['p95']:>7.1f} "
            f"{sum(level['errors'].values()):>7}"
            + (f"  compiled while serving: {', '.join(level['compiled'])}"
               if level.get("compiled") else ""))


def print_levels(levels: list[dict]) -> None:
    print(f"{'concurrency':>11} {'requests':>9} {'output tok/s':>13} {'TTFT p50 / p95 ms':>19} "
          f"{'TPOT p50 / p95 ms':>19} {'errors':>7}")
    for level in levels:
        print(_level_line(level), flush=True)


def failures(report: dict) -> list[str]:
    """One line per failed check: a kernel case, the server, or a level with errors."""
    failed = [f"{r['kernel']} {r['dtype']} {r['shape']}: {r['error']}"
              for r in report.get("kernels", []) if r["status"] == "FAIL"]
    for key in ("server", "dp_server"):
        server = report.get(key, {})
        if "error" in server:
            failed.append(f"{key}: {server['error']}")
        where = "" if key == "server" else "data parallel, "
        failed += [f"{where}concurrency {level['concurrency']}: "
                   f"{level.get('error') or level['errors']}"
                   for level in server.get("levels", [])
                   if "error" in level or level["ok"] < level["requests"]]
        failed += [f"{where}concurrency {level['concurrency']}: Triton compiled "
                   f"{', '.join(level['compiled'])} while serving (the warm-up should have)"
                   for level in server.get("levels", []) if level.get("compiled")]
    return failed + pipeline_failures(report.get("pipeline", {}))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    out_dir = os.environ.get("OUT")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(out_dir, "gpu_check.json") if out_dir
                        else "gpu_check.json", help="the JSON report (default: $OUT/ if set)")
    parser.add_argument("--quick", action="store_true", help="fewer runs and requests")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-dp", action="store_true",
                        help="no data-parallel run even with several GPUs")
    parser.add_argument("--skip-pipeline", action="store_true",
                        help="no pipeline-parallel runs (they need 2+ GPUs)")
    parser.add_argument("--interpret-smoke", action="store_true",
                        help="kernel checks only, on the CPU in Triton's interpreter, tiny fp32 "
                             "shapes; the times mean nothing")
    return parser.parse_args(argv)


def save(report: dict, path: str) -> list[str]:
    """Write the report with the failures so far (a run cut short still leaves one); those."""
    report["failed"] = failures(report)
    Path(path).write_text(json.dumps(report, indent=2))
    return report["failed"]


def run(opts: argparse.Namespace) -> dict:
    """Every step the options ask for, printed as it goes and saved after each; the report."""
    smoke = opts.interpret_smoke
    device = torch.device("cpu" if smoke else "cuda")
    report: dict[str, Any] = {"mode": "interpret-smoke" if smoke else "cuda",
                              "environment": environment(device)}
    print(*(f"{k}: {v}" for k, v in report["environment"].items()), sep="\n", flush=True)
    if not opts.skip_kernels:
        runs = 2 if smoke else 8 if opts.quick else 30
        timer = cpu_timer(runs) if smoke else cuda_timer(runs)
        copy_gb_s = copy_bandwidth(device, (64 if smoke else 1024) << 20, timer)
        print(f"copy bandwidth: {copy_gb_s:.1f} GB/s (read + write)", flush=True)
        report["copy_gb_s"] = copy_gb_s
        report["kernels"] = kernel_checks(SMOKE if smoke else H200, device, timer, copy_gb_s)
        save(report, opts.out)
    if not (smoke or opts.skip_server):
        try:
            # The server's worker needs the memory the kernel checks left cached.
            torch.cuda.empty_cache()
            report["server"] = server_benchmark(opts.quick)
            print_levels(report["server"]["levels"])
        except Exception as e:  # a server that does not start is a result too
            report["server"] = {"error": f"{type(e).__name__}: {e}"}
        save(report, opts.out)
    gpus = 0 if smoke else torch.cuda.device_count()
    if gpus > 1 and not (opts.skip_server or opts.skip_dp):
        try:
            report["dp_server"] = server_benchmark(opts.quick, replicas=gpus)
            print(f"data parallel, {gpus} replicas of one GPU:")
            print_levels(report["dp_server"]["levels"])
        except Exception as e:
            report["dp_server"] = {"error": f"{type(e).__name__}: {e}"}
        save(report, opts.out)
    if not (smoke or opts.skip_pipeline):
        try:
            report["pipeline"] = pipeline_runs(opts.quick)
        except Exception as e:
            report["pipeline"] = {"runs": [{"stages": 0, "tp": 0,
                                            "error": f"{type(e).__name__}: {e}"}]}
    return report


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.interpret_smoke:
        # Triton picks its interpreter when a kernel is defined: before kernels.*_triton load.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print(f"no CUDA device for torch {torch.__version__}; --interpret-smoke runs on the CPU",
              file=sys.stderr)
        return 2
    failed = save(run(opts), opts.out)
    for line in failed:
        print(f"FAIL {line}")
    print(f"{'FAILED' if failed else 'PASSED'}: {len(failed)} failed checks; report in {opts.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
