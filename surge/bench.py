"""`surge bench`: load any OpenAI-compatible server with a workload and report latency,
throughput and goodput, for one load level or a sweep."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from surge.bench_text import ENDPOINTS, convert
from surge.loadgen import closed_loop, open_loop, summarize

# Random prompt tokens are drawn from here: inside the vocabulary of any Llama-family model,
# away from the special tokens at the start.
_TOKEN_RANGE = (1000, 20000)


def fixed_workload(rng: random.Random, n: int, input_len: int, output_len: int,
                   shared_prefix_len: int, temperature: float = 0.0) -> list[dict]:
    """n prompts of exactly input_len random tokens (after a shared prefix, if any), each
    generating exactly output_len tokens (greedy unless a temperature is given)."""
    prefix = [rng.randrange(*_TOKEN_RANGE) for _ in range(shared_prefix_len)]
    return [{"prompt": prefix + [rng.randrange(*_TOKEN_RANGE) for _ in range(input_len)],
             "max_tokens": output_len, "ignore_eos": True, "temperature": temperature}
            for _ in range(n)]


def chat_workload(rng: random.Random, n: int) -> list[dict]:
    """Long-tailed lengths like chat traffic: log-normal prompts (median 256 tokens) and
    answers (median 96), clipped to 8..4096 and 4..1024."""
    bodies = []
    for _ in range(n):
        prompt = min(4096, max(8, int(rng.lognormvariate(math.log(256), 1.0))))
        output = min(1024, max(4, int(rng.lognormvariate(math.log(96), 0.8))))
        bodies.append({"prompt": [rng.randrange(*_TOKEN_RANGE) for _ in range(prompt)],
                       "max_tokens": output, "ignore_eos": True, "temperature": 0.7})
    return bodies


def trace_workload(path: str, rng: random.Random) -> list[tuple[float, dict]]:
    """A recorded trace, one JSON object a line: `arrival` (seconds from the start),
    `prompt` (text or token ids) or `prompt_len`, and `max_tokens`."""
    arrivals = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"] if "prompt" in row else \
                    [rng.randrange(*_TOKEN_RANGE) for _ in range(int(row["prompt_len"]))]
                arrivals.append((float(row["arrival"]), {
                    "prompt": prompt, "max_tokens": int(row["max_tokens"]),
                    "ignore_eos": True, "temperature": 0}))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{number}: a trace line needs arrival, prompt or "
                                 f"prompt_len, and max_tokens ({e})") from None
    return sorted(arrivals, key=lambda a: a[0])


def poisson(rng: random.Random, bodies: list[dict], rate: float) -> list[tuple[float, dict]]:
    at, arrivals = 0.0, []
    for body in bodies:
        at += rng.expovariate(rate)
        arrivals.append((at, body))
    return arrivals


def _get_json(url: str, headers: dict) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.load(r)


def fingerprint(url: str, headers: dict) -> dict:
    """What the numbers were measured on: versions, CPU, device, revision, server settings."""
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=5,
                                  cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        revision = None
    info: dict[str, Any] = {
        "python": platform.python_version(), "surge": version("surge"),
        "torch": version("torch"), "platform": platform.platform(), "cpu": cpu,
        "cores": os.cpu_count(), "git_revision": revision,
        "load_average": os.getloadavg()[0], "url": url}
    try:
        info["server_models"] = _get_json(f"{url}/v1/models", headers).get("data")
    except (OSError, ValueError) as e:
        info["server_models"] = f"unavailable: {e}"
    info["server_live_parameters"] = _live_parameters(url)
    return info


def _live_parameters(url: str) -> dict | None:
    """A local surge's live parameters through its admin channel (None for other servers)."""
    from urllib.parse import urlparse

    from surge.admin import ask
    from surge.runtime import find_server

    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost"):
        return None
    try:
        runtime_dir = find_server(parsed.port)
    except LookupError:
        return None
    reply = ask(f"ipc://{runtime_dir}/admin", "get")
    return reply.values if reply.ok else None


def engine_stats(url: str, after: float | None = None, headers: dict | None = None
                 ) -> dict | None:
    """A surge server's running totals (/stats), fresher than `after` if given; None from
    other servers, and when API keys guard /stats and `headers` carry neither the metrics key
    nor an admin tenant's key."""
    deadline = time.monotonic() + 5
    while True:
        try:
            stats = _get_json(f"{url}/stats", headers or {})
        except (OSError, ValueError):
            return None
        # Without a time until the scheduler's first report, a moment after the server is
        # ready; past the deadline a stale report is no answer either.
        fresh = "time" in stats and (after is None or stats["time"] >= after)
        if fresh or time.monotonic() > deadline:
            return stats if fresh else None
        time.sleep(0.2)


def _server_share(before: dict, after: dict) -> dict:
    """Where a surge server's time went over the run: the model forward, the rest of the
    worker's step (inputs, sampling), and everything else (scheduling, IPC, waiting)."""
    span = after["time"] - before["time"]
    forward = after.get("worker_forward_s", 0) - before.get("worker_forward_s", 0)
    compute = after["worker_compute_s"] - before["worker_compute_s"]
    return {"seconds": span, "steps": after["steps"] - before["steps"],
            "forward_share": forward / span, "step_outside_forward_share": (compute - forward)
            / span,
            # Steps planned ahead overlap, so their compute can add up to a little more than
            # the span: then nothing was spent outside them.
            "outside_steps_share": max(0.0, 1 - compute / span)}


def _levels(opts: argparse.Namespace) -> list[tuple[str, float]]:
    if opts.rate:
        return [("rate", r) for r in opts.rate]
    return [("concurrency", c) for c in opts.concurrency or [1]]


def run_level(opts: argparse.Namespace, kind: str, level: float, headers: dict,
              tokenizer: Any | None) -> dict:
    """One load level; tokenizer: send prompts as text checked with it (None: token ids)."""
    rng = random.Random(opts.seed)
    times: list[float] = []
    if opts.workload == "trace":
        arrivals = trace_workload(opts.trace, rng)[: opts.num_requests]
        times, bodies = [a for a, _ in arrivals], [b for _, b in arrivals]
    elif opts.workload == "chat":
        bodies = chat_workload(rng, opts.num_requests)
    else:
        bodies = fixed_workload(rng, opts.num_requests, opts.input_len, opts.output_len,
                                opts.shared_prefix_len, opts.temperature)
    bodies = convert(bodies, tokenizer, opts.endpoint)
    if opts.model:
        bodies = [{**b, "model": opts.model} for b in bodies]
    label = f"{kind} {level:g}"
    path = ENDPOINTS[opts.endpoint]
    before = engine_stats(opts.url, headers=headers)
    with progress(len(bodies), label, opts.no_progress) as done:
        if kind == "rate" or opts.workload == "trace":
            arrivals = list(zip(times, bodies, strict=True)) if times else \
                poisson(rng, bodies, level)
            results, wall = asyncio.run(open_loop(opts.url, arrivals, headers, opts.duration,
                                                  done=done, path=path))
        else:
            results, wall = asyncio.run(closed_loop(opts.url, bodies, int(level), headers,
                                                    opts.duration, done=done, path=path))
    result = {kind: level, **summarize(results, wall, opts.slo_ttft, opts.slo_tpot)}
    after = engine_stats(opts.url, before["time"] + wall, headers) if before else None
    if before and after:
        result["server"] = _server_share(before, after)
    return result


@contextlib.contextmanager
def progress(total: int, label: str, quiet: bool) -> Iterator[Callable[[], None]]:
    """A callback per finished request: a bar on a terminal; into a file or a pipe, a plain
    line at each tenth of the way (a bar's redraws would fill a log)."""
    if quiet:
        yield lambda: None
    elif sys.stdout.isatty():
        with tqdm(total=total, desc=label, unit="req") as bar:
            yield bar.update
    else:
        count = [0]

        def done() -> None:
            count[0] += 1
            if count[0] * 10 // total > (count[0] - 1) * 10 // total:
                print(f"{label}: {count[0]}/{total} requests", flush=True)

        yield done


def _row(result: dict) -> str:
    """One line of at most 100 columns per load level (p50/p95 of TTFT and TPOT)."""
    kind = "rate" if "rate" in result else "concurrency"
    ttft, tpot = result["ttft_ms"], result["tpot_ms"]
    level = f"{kind} {result[kind]:g}"
    good = f" good {result['goodput']['share']:.0%}" if result["goodput"] else ""
    return (f"{level:<15}{result['output_tok_s']:8.1f} tok/s {result['requests_per_s']:6.2f} "
            f"req/s  TTFT {ttft['p50']:.0f}/{ttft['p95']:.0f}ms  "
            f"TPOT {tpot['p50']:.1f}/{tpot['p95']:.1f}ms{good} "
            f"err {sum(result['errors'].values())}")


def plot(results: list[dict], path: str, model: str) -> None:
    """Throughput against TTFT p95 and TPOT p95 across the sweep, each point labelled with
    its load level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tput = [r["output_tok_s"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT p95 (ms)"),
                          (axes[1], "tpot_ms", "TPOT p95 (ms)")):
        ax.plot(tput, [r[key]["p95"] for r in results], marker="o")
        for r, x in zip(results, tput, strict=True):
            kind = "rate" if "rate" in r else "concurrency"
            ax.annotate(f"{r[kind]:g}", (x, r[key]["p95"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    kind = "rate" if "rate" in results[0] else "concurrency"
    what = "requests/s offered (open loop)" if kind == "rate" else "concurrent clients"
    fig.suptitle(f"surge bench: {model}, {time.strftime('%Y-%m-%d %H:%M')}; "
                 f"points labelled with {what}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server (any OpenAI-compatible one); only it is contacted")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model", default=None, help="model name to send (default: none)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", metavar="N",
                      help="closed loop with N clients (several values: a sweep); default 1")
    load.add_argument("--rate", type=float, nargs="+", metavar="R",
                      help="open loop, Poisson arrivals at R requests/s (several: a sweep)")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions",
                        help="/v1/completions, or /v1/chat/completions with the prompt as one "
                             "user message (its length before the chat template)")
    parser.add_argument("--prompt-format", choices=["text", "tokens"], default=None,
                        help="random token ids, or text of exactly that many tokens by "
                             "--tokenizer (default: tokens against surge, text otherwise)")
    parser.add_argument("--tokenizer", default="default",
                        help="for text prompts: the served model's tokenizer, a .gguf, a "
                             "Hugging Face folder (e.g. from surge export-tokenizer) or "
                             "'default' (the bundled model's)")
    parser.add_argument("--workload", choices=["fixed", "chat", "trace"], default="fixed")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="tokens of prefix every prompt shares (prefix-cache workloads)")
    parser.add_argument("--trace", help="JSONL trace to replay (with --workload trace)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="--workload fixed: sample at this temperature (default greedy)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--duration", type=float, default=None,
                        help="start no request after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="MS")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="MS")
    parser.add_argument("--output", help="write the JSON result here")
    parser.add_argument("--plot", help="PNG of throughput vs TTFT/TPOT p95 across the sweep")
    parser.add_argument("--no-progress", action="store_true")


def run_bench(opts: argparse.Namespace) -> int:
    if opts.workload == "trace" and not opts.trace:
        print("surge bench: --workload trace needs --trace FILE", file=sys.stderr)
        return 2
    if min(opts.input_len, opts.output_len, opts.num_requests) < 1:
        print("surge bench: lengths and --num-requests must be at least 1", file=sys.stderr)
        return 2
    opts.url = opts.url.rstrip("/")
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    try:
        _get_json(f"{opts.url}/v1/models", headers)
    except (OSError, ValueError) as e:
        print(f"surge bench: cannot reach {opts.url}/v1/models: {e}", file=sys.stderr)
        return 1
    if opts.prompt_format is None:
        opts.prompt_format = "tokens" if engine_stats(opts.url, headers=headers) is not None \
            else "text"
    if opts.endpoint == "chat" and opts.prompt_format == "tokens":
        print("surge bench: --endpoint chat sends text: use --prompt-format text",
              file=sys.stderr)
        return 2
    tokenizer = None
    if opts.prompt_format == "text":
        from server.tokenizer import Tokenizer
        from surge.model_files import ModelError, resolve_tokenizer

        try:
            tokenizer = Tokenizer(resolve_tokenizer(opts.tokenizer))
        except ModelError as e:
            print(f"surge bench: {e}", file=sys.stderr)
            return 2
    results = []
    for kind, level in _levels(opts):
        results.append(run_level(opts, kind, level, headers, tokenizer))
        print(_row(results[-1]), flush=True)
        for status, body in results[-1]["first_errors"].items():
            print(f"  first {status} error: {body}", flush=True)
    environment = fingerprint(opts.url, headers)
    report = {"environment": environment,
              "workload": {k: v for k, v in vars(opts).items()
                           if k not in ("api_key", "output", "plot", "no_progress")},
              "results": results}
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(report, f, indent=2)
    if opts.plot:
        models = environment["server_models"]
        served = models[0].get("id") if isinstance(models, list) and models else None
        plot(results, opts.plot, opts.model or served or opts.url)
    return 0 if all(r["ok"] for r in results) else 1
