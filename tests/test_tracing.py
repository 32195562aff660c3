"""OpenTelemetry traces: the real server exports to a real OTLP/HTTP receiver (protobuf decoded
with opentelemetry-proto); an incoming traceparent is continued; prompts never leave."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.server import ServerProcess

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
PROMPT = "Name three rivers of Portugal, in one line, and nothing else at all please."


class Receiver:
    """An OTLP/HTTP trace endpoint: every span posted, and every raw body."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.bodies: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                receiver.bodies.append(body)
                receiver.spans += [span for resource in request.resource_spans
                                   for scope in resource.scope_spans for span in scope.spans]
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def wait_for(self, count: int, name: str, timeout: float = 30) -> list[Span]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.spans if s.name == name]
            if len(found) >= count:
                return found
            time.sleep(0.2)
        raise AssertionError(f"{count} {name!r} spans expected: {[s.name for s in self.spans]}")


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[ServerProcess, Receiver]]:
    receiver = Receiver()
    server = ServerProcess("--otlp-traces-endpoint", receiver.url).wait_ready()
    yield server, receiver
    server.stop()
    receiver.http.shutdown()


def _attributes(span: Span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = ([v.string_value for v in value.array_value.values]
                       if kind == "array_value" else getattr(value, kind))
    return out


def test_request_spans_continue_the_callers_trace(traced) -> None:
    server, receiver = traced
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    first, second = receiver.wait_for(2, "surge chat")
    for span in (first, second):
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
        assert span.kind == Span.SpanKind.SPAN_KIND_SERVER
        attributes = _attributes(span)
        assert attributes["surge.tenant"] == "default"
        assert attributes["gen_ai.usage.output_tokens"] == 6
        assert attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert attributes["surge.priority"] == 0
        assert [e.name for e in span.events] == ["first_token", "finish"]
        children = {s.name: s for s in receiver.spans if s.parent_span_id == span.span_id}
        assert set(children) == {"queue", "prefill", "decode"}, children
        queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
        assert span.start_time_unix_nano <= queue.start_time_unix_nano <= \
            queue.end_time_unix_nano <= prefill.start_time_unix_nano <= \
            prefill.end_time_unix_nano <= decode.start_time_unix_nano <= \
            decode.end_time_unix_nano <= span.end_time_unix_nano
        split = _attributes(prefill)
        assert split["surge.prompt_tokens.cached"] + split["surge.prompt_tokens.computed"] \
            == attributes["gen_ai.usage.input_tokens"]
    assert _attributes(_prefill(receiver, first))["surge.prompt_tokens.cached"] == 0
    assert _attributes(_prefill(receiver, second))["surge.prompt_tokens.cached"] > 0
    assert not any(b"Portugal" in body for body in receiver.bodies)  # no prompt text


def _prefill(receiver: Receiver, span: Span) -> Span:
    (found,) = [s for s in receiver.spans
                if s.parent_span_id == span.span_id and s.name == "prefill"]
    return found


def test_a_stream_without_traceparent_starts_its_own_trace(traced) -> None:
    server, receiver = traced
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt="Once upon", max_tokens=5,
                                            stream=True))
    assert chunks
    (span,) = receiver.wait_for(1, "surge completion")
    assert span.trace_id.hex() != TRACE_ID and not span.parent_span_id  # a trace of its own
    assert _attributes(span)["surge.outcome"] == "ok"


def test_tracing_off_imports_nothing() -> None:
    """Without an endpoint the frontend never imports the OpenTelemetry SDK."""
    code = ("import sys, server.app, server.main; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out
