"""`surge bench`: workloads, statistics, and the whole command against a small fake
OpenAI-compatible server whose timings are known (first token after 30 ms, then one every
10 ms)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from aiohttp import web

from surge.bench import chat_workload, fixed_workload, poisson, trace_workload
from surge.cli import main
from surge.loadgen import Result, percentiles, summarize

TTFT_S, TPOT_S = 0.03, 0.01


def test_fixed_workload_lengths_and_shared_prefix():
    bodies = fixed_workload(random.Random(0), 5, input_len=20, output_len=7,
                            shared_prefix_len=12)
    assert all(len(b["prompt"]) == 32 and b["max_tokens"] == 7 and b["ignore_eos"]
               for b in bodies)
    assert len({tuple(b["prompt"][:12]) for b in bodies}) == 1
    assert len({tuple(b["prompt"][12:]) for b in bodies}) == 5
    assert {b["temperature"] for b in bodies} == {0}
    sampled = fixed_workload(random.Random(0), 2, 4, 3, 0, temperature=0.7)
    assert {b["temperature"] for b in sampled} == {0.7}


def test_chat_workload_is_long_tailed_and_clipped():
    bodies = chat_workload(random.Random(0), 2000)
    prompts = sorted(len(b["prompt"]) for b in bodies)
    outputs = [b["max_tokens"] for b in bodies]
    assert prompts[0] >= 8 and prompts[-1] <= 4096 and 4 <= min(outputs) <= max(outputs) <= 1024
    median = prompts[len(prompts) // 2]
    assert 200 <= median <= 320 and prompts[int(0.99 * len(prompts))] > 4 * median


def test_trace_and_poisson(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival": 0.5, "prompt": "hi", "max_tokens": 3}\n\n'
                     '{"arrival": 0.1, "prompt_len": 4, "max_tokens": 2}\n')
    rows = trace_workload(str(trace), random.Random(0))
    assert [a for a, _ in rows] == [0.1, 0.5]
    assert len(rows[0][1]["prompt"]) == 4 and rows[1][1]["prompt"] == "hi"
    trace.write_text('{"arrival": 0.5, "max_tokens": 3}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        trace_workload(str(trace), random.Random(0))
    arrivals = poisson(random.Random(1), [{}] * 4000, rate=20.0)
    assert arrivals[-1][0] / 4000 == pytest.approx(1 / 20, rel=0.05)


def test_summary_percentiles_and_goodput():
    results = [Result(ttft=t / 1000, latency=t / 1000 + 0.1, output_tokens=11, itl=[0.01] * 10)
               for t in range(1, 101)]
    results.append(Result(status=429, error="slow down"))
    out = summarize(results, wall=2.0, slo_ttft_ms=50, slo_tpot_ms=20)
    assert out["ttft_ms"]["p50"] == pytest.approx(50.5)
    assert out["ttft_ms"]["p99"] == pytest.approx(99.01)
    assert out["tpot_ms"]["p50"] == pytest.approx(10.0)
    assert out["errors"] == {"429": 1} and out["ok"] == 100
    assert out["output_tok_s"] == pytest.approx(1100 / 2)
    assert out["goodput"]["share"] == pytest.approx(50 / 101)
    assert out["goodput"]["requests_per_s"] == pytest.approx(25)
    assert all(v != v for v in percentiles([]).values())  # NaN without data
    # The first body of each failing status is kept; goodput needs an SLO to mean anything.
    results.append(Result(status=429, error="second"))
    plain = summarize(results, wall=2.0)
    assert plain["first_errors"] == {"429": "slow down"} and plain["goodput"] is None


def test_result_line_fits_100_columns():
    from surge.bench import _row

    big = {"concurrency": 128, "output_tok_s": 12345.6, "requests_per_s": 123.45,
           "ttft_ms": {"p50": 9999.0, "p95": 23456.0}, "tpot_ms": {"p50": 123.4, "p95": 234.5},
           "goodput": {"share": 1.0}, "errors": {"429": 99, "503": 29}}
    line = _row(big)
    assert len(line) <= 100 and line.startswith("concurrency 128") and "err 128" in line


def test_server_share_never_negative():
    from surge.bench import _server_share

    before = {"time": 0.0, "steps": 0, "worker_compute_s": 0.0, "worker_forward_s": 0.0}
    # Steps planned ahead overlap: their compute may add up past the wall time.
    after = {"time": 10.0, "steps": 100, "worker_compute_s": 10.2, "worker_forward_s": 9.0}
    assert _server_share(before, after)["outside_steps_share"] == 0.0


def test_plot_title_names_model_date_and_points(tmp_path):
    import time

    import matplotlib

    from surge.bench import plot

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG
    row = {"output_tok_s": 10.0, "ttft_ms": {"p95": 5.0}, "tpot_ms": {"p95": 2.0}}
    plot([{"concurrency": 1, **row}, {"concurrency": 4, **row}], str(tmp_path / "p.svg"),
         "SmolLM2-135M-Instruct")
    svg = (tmp_path / "p.svg").read_text()
    assert "SmolLM2-135M-Instruct" in svg and time.strftime("%Y-%m-%d") in svg
    assert "concurrent clients" in svg


@pytest.fixture(scope="module")
def fake_server():
    """A tiny OpenAI-compatible streaming server with fixed timings, in a thread."""
    seen: list[dict] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body.get("max_tokens") == 13:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(TTFT_S)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(TPOT_S)
            await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def chat(request: web.Request) -> web.StreamResponse:
        """As OpenAI streams a chat: the role at once, the content after TTFT_S."""
        body = await request.json()
        seen.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        opening = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
        await response.write(f"data: {json.dumps(opening)}\n\n".encode())
        await asyncio.sleep(TTFT_S)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(TPOT_S)
            await response.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_bench_sweep_writes_json_and_plot(fake_server, tmp_path):
    url, seen = fake_server
    out, png = tmp_path / "result.json", tmp_path / "sweep.png"
    code = main(["bench", "--url", url, "--concurrency", "1", "4", "--num-requests", "8",
                 "--input-len", "5", "--output-len", "6", "--slo-ttft", "1000",
                 "--prompt-format", "tokens",
                 "--output", str(out), "--plot", str(png), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["ok"] == 8 and r["errors"] == {}
        assert r["ttft_ms"]["p50"] == pytest.approx(TTFT_S * 1000, abs=25)
        assert r["tpot_ms"]["p50"] == pytest.approx(TPOT_S * 1000, abs=8)
        assert r["goodput"]["share"] == 1.0
    # Four clients move about four times the tokens of one.
    one, four = (r["output_tok_s"] for r in report["results"])
    assert four > 2.5 * one
    env = report["environment"]
    assert env["server_models"] == [{"id": "fake"}] and env["cpu"] and env["torch"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert all(len(b["prompt"]) == 5 and b["stream"] for b in seen[-8:])


def test_bench_open_loop_trace_and_errors(fake_server, tmp_path, capsys):
    url, _ = fake_server
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival": i * 0.05, "prompt_len": 3,
                                           "max_tokens": 13 if i == 2 else 4})
                               for i in range(6)))
    out = tmp_path / "r.json"
    assert main(["bench", "--url", url, "--workload", "trace", "--trace", str(trace),
                 "--output", str(out), "--no-progress", "--prompt-format", "tokens"]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["requests"] == 6 and result["errors"] == {"429": 1}
    assert result["first_errors"] == {"429": '{"error": {"message": "busy"}}'}
    assert result["goodput"] is None  # no SLO given
    printed = capsys.readouterr().out
    assert "  first 429 error: {\"error\": {\"message\": \"busy\"}}" in printed
    # Without --no-progress and not on a terminal: plain progress lines, no bar.
    assert main(["bench", "--url", url, "--rate", "50", "--num-requests", "10",
                 "--output-len", "3", "--slo-ttft", "1000", "--prompt-format", "tokens"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "rate 50: 10/10 requests" and "\r" not in "".join(lines)
    assert lines[-1].startswith("rate 50 ") and "good 100%" in lines[-1]
    assert len(lines[-1]) <= 100, lines[-1]
    assert main(["bench", "--url", "http://127.0.0.1:9", "--no-progress"]) == 1


@pytest.mark.slow
def test_bench_sends_text_to_other_servers_and_chats(fake_server, tokenizer, capsys):
    url, seen = fake_server
    # Not surge (no /stats): text prompts by default, of exactly --input-len tokens.
    assert main(["bench", "--url", url, "--num-requests", "4", "--input-len", "37",
                 "--output-len", "3", "--no-progress"]) == 0
    prompts = [b["prompt"] for b in seen[-4:]]
    assert all(isinstance(p, str) and len(tokenizer.encode(p)) == 37 for p in prompts)
    assert len(set(prompts)) == 4
    assert main(["bench", "--url", url, "--endpoint", "chat", "--num-requests", "4",
                 "--input-len", "9", "--output-len", "5", "--no-progress"]) == 0
    messages = [b["messages"] for b in seen[-4:]]
    assert all(len(tokenizer.encode(m[0]["content"])) == 9 for m in messages)
    row = capsys.readouterr().out.splitlines()[-1]
    # TTFT is the first content, not the opening role chunk sent at once.
    ttft_p50 = float(row.split("TTFT ")[1].split("/")[0])
    assert ttft_p50 >= TTFT_S * 1000 - 5, row
    assert main(["bench", "--url", url, "--endpoint", "chat", "--prompt-format", "tokens",
                 "--no-progress"]) == 2


def test_engine_stats_waits_for_the_first_report_and_refuses_a_stale_one(monkeypatch):
    """/stats has no time until the scheduler's first report (a moment after ready): that is
    waited for, not returned; past the deadline a report older than asked for gives None."""
    from surge import bench

    replies = iter([{}, {"type": "EngineStats"}, {"time": 5.0, "steps": 1}])
    monkeypatch.setattr(bench, "_get_json", lambda url, headers: next(replies))
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    assert bench.engine_stats("http://127.0.0.1:1")["time"] == 5.0
    clock = iter([0.0, 1.0, 10.0])
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(bench, "_get_json", lambda url, headers: {"time": 5.0})
    assert bench.engine_stats("http://127.0.0.1:1", after=6.0) is None
