"""Speculative decoding on and off, side by side, on a copying task and a free-form task.

Starts one surge server per method (in the serving dtype), runs the same streamed requests at
each concurrency against it, and prints output tokens/s, TPOT p50, the acceptance rate and the
mean tokens gained per verification, with the speed ratio against speculation off.

- copy: the user pastes a passage of the Apache license and asks for it back word for word
  (editing and quoting tasks look like this: most of the answer is in the prompt).
- free: short open questions (nothing to look up in the prompt).

Usage: .venv/bin/python -m bench.speculative_bench [--methods off,ngram,draft]
       [--draft-layers 12] [--num-speculative-tokens 4] [--concurrency 1 8]
       [--output result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.request

from server.tokenizer import Tokenizer
from surge.loadgen import closed_loop, summarize
from surge.model_files import resolve_model
from tests.server import ServerProcess

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "apache-2.0.txt")
QUESTIONS = ["Why is the sky blue?", "Describe a day at the beach.",
             "What makes a good friend?", "How do plants grow?",
             "Write a short story about a lost key.", "What is the best way to learn to cook?",
             "Explain how a bicycle works.", "Describe your favourite season and why."]


def prompts(task: str, n: int, tokenizer: Tokenizer) -> list[list[int]]:
    if task == "free":
        asks = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    else:
        with open(TEXT) as f:
            paragraphs = [" ".join(p.split()) for p in f.read().split("\n\n")]
        passages = [p for p in paragraphs if 300 <= len(p) <= 900]
        asks = [f"Repeat the following text exactly, word for word:\n\n"
                f"{passages[i % len(passages)]}" for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}]) for a in asks]


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as r:
        return json.load(r)


def measure(url: str, task: str, concurrency: int, tokenizer: Tokenizer, max_tokens: int,
            temperature: float) -> dict:
    n = 4 if concurrency == 1 else 2 * concurrency
    bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": temperature, "seed": i}
              for i, p in enumerate(prompts(task, n, tokenizer))]
    asyncio.run(closed_loop(url, bodies[:1], 1))  # warm-up
    before = _stats(url)
    results, wall = asyncio.run(closed_loop(url, bodies, concurrency))
    time.sleep(1.2)  # the scheduler reports its totals about once a second
    after = _stats(url)
    summary = summarize(results, wall)
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verified = after["spec_verifications"] - before["spec_verifications"]
    return {"tokens_per_s": summary["output_tok_s"],
            "tpot_p50_ms": summary["tpot_ms"]["p50"], "requests": summary["ok"],
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": accepted / verified + 1 if verified else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="off,ngram")
    parser.add_argument("--draft-layers", type=int, default=12)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tasks", default="copy,free")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output")
    opts = parser.parse_args()
    tokenizer = Tokenizer(resolve_model("default"))
    table: dict[str, dict] = {}
    for method in opts.methods.split(","):
        args = ["--speculative-method", method,
                "--num-speculative-tokens", str(opts.num_speculative_tokens)]
        if method == "draft":
            args += ["--draft-layers", str(opts.draft_layers)]
        server = ServerProcess(*args, dtype="auto", kv_cache_memory="1GiB").wait_ready()
        try:
            for task in opts.tasks.split(","):
                for c in opts.concurrency:
                    row = measure(server.url, task, c, tokenizer, opts.max_tokens,
                                  opts.temperature)
                    table[f"{method} {task} c{c}"] = row
                    print(method, task, f"c{c}", json.dumps(row), flush=True)
        finally:
            server.stop()
    print(f"\n{'run':<22}{'tok/s':>8}{'vs off':>8}{'TPOT p50':>10}{'accept':>8}{'len':>6}")
    for name, row in table.items():
        method, rest = name.split(" ", 1)
        base = table.get(f"off {rest}")
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        length = "-" if row["mean_accepted_length"] is None else \
            f"{row['mean_accepted_length']:.2f}"
        print(f"{name:<22}{row['tokens_per_s']:>8.1f}{ratio:>8}{row['tpot_p50_ms']:>9.1f}m"
              f"{acc:>8}{length:>6}")
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"load_average": os.getloadavg(), "runs": table}, f, indent=2)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
