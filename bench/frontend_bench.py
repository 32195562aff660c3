"""Frontend throughput on one core: tokenize + enqueue + detokenize + SSE framing per request.

The frontend process runs pinned to CPU 0 against bench/echo_scheduler.py (N fixed tokens per
request, no model); wrk (Debian's `wrk`) drives streaming completions from CPU 1 with small
prompts, then the same for non-streaming. Reports requests/s.

Usage: .venv/bin/python -m bench.frontend_bench [--tokens 8] [--seconds 10] [--connections 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.echo_scheduler import run_echo_scheduler
from server.main import run_frontend
from surge.config_load import load_config
from surge.runtime import Channels
from tests.server import free_port

_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"prompt": "Write one short sentence about the sea.", "max_tokens": %d, "stream": %s}'
"""


def _wrk(url: str, tokens: int, stream: bool, seconds: int, connections: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_LUA % (tokens, "true" if stream else "false"))
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", f.name,
         f"{url}/v1/completions"], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"{errors.group(1)} failed requests:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=64)
    opts = parser.parse_args()
    if not shutil.which("wrk"):
        print("needs wrk: apt-get install wrk", file=sys.stderr)
        return 2
    port = free_port()
    cfg = load_config({"port": str(port), "log_level": "warning"}, {})
    channels = Channels.create()
    ctx = mp.get_context("spawn")
    status = ctx.Queue()
    echo = ctx.Process(target=run_echo_scheduler, args=(channels, opts.tokens), daemon=True)
    frontend = ctx.Process(target=run_frontend, args=(cfg, channels, status), daemon=True)
    echo.start()
    frontend.start()
    os.sched_setaffinity(echo.pid, {1})
    os.sched_setaffinity(frontend.pid, {0})
    url = f"http://127.0.0.1:{port}"
    try:
        status.get(timeout=120)
        urllib.request.urlopen(f"{url}/health").read()
        _wrk(url, opts.tokens, True, 2, opts.connections)  # warm-up
        for stream in (True, False):
            rate = _wrk(url, opts.tokens, stream, opts.seconds, opts.connections)
            print(f"{'streaming' if stream else 'non-streaming'}: {rate:.0f} requests/s "
                  f"({opts.tokens} tokens each, frontend on one core, "
                  f"{opts.connections} connections); load average {os.getloadavg()[0]:.2f}",
                  flush=True)
    finally:
        frontend.terminate()
        echo.terminate()
        frontend.join(10)
        echo.join(10)
        channels.remove()
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
