"""OpenTelemetry traces (--otlp-traces-endpoint): one span per request, with child spans for
its time queued, its prefill and its decode, exported over OTLP/HTTP. An incoming W3C
traceparent makes it part of the caller's trace. The SDK is imported only when tracing is on:
off, it costs nothing. Spans never carry prompt or answer text."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from surge import __version__

# Seconds between exports of the finished spans (the SDK's default is 5).
_EXPORT_DELAY_MS = 1000


class Tracing:
    def __init__(self, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create(
            {"service.name": "surge", "service.version": __version__}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=_EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("surge")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, kind: str, request_id: str, headers: Mapping[str, str] | None,
              attributes: dict[str, Any]) -> RequestTrace:
        from opentelemetry.trace import SpanKind

        parent = self.propagator.extract(headers) if headers is not None else None
        span = self.tracer.start_span(f"surge {kind}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"surge.request_id": request_id,
                                                  **attributes})
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Export what is left (at exit)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span, and the times its child spans are drawn from once it ends."""

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self.tracing = tracing
        self.span = span
        self.started_ns = time.time_ns()
        self.first_ns: int | None = None
        self.timing: tuple[float, int] | None = None  # (seconds queued, prompt tokens cached)

    def piece(self, timing: tuple[float, int] | None) -> None:
        if self.first_ns is None:
            self.first_ns = time.time_ns()
            self.span.add_event("first_token", timestamp=self.first_ns)
        if timing is not None and self.timing is None:
            self.timing = timing

    def end(self, outcome: str, reasons: list[str], prompt_tokens: int,
            generated: int) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        end_ns = time.time_ns()
        span = self.span
        span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens,
                             "gen_ai.usage.output_tokens": generated,
                             "gen_ai.response.finish_reasons": reasons, "surge.outcome": outcome})
        context = trace.set_span_in_context(span)
        child = self.tracing.tracer.start_span
        if self.timing is not None and self.first_ns is not None:
            queued_s, cached = self.timing
            scheduled_ns = min(self.started_ns + int(queued_s * 1e9), self.first_ns)
            child("queue", context=context, start_time=self.started_ns).end(scheduled_ns)
            prefill = child("prefill", context=context, start_time=scheduled_ns, attributes={
                "surge.prompt_tokens.cached": cached,
                "surge.prompt_tokens.computed": prompt_tokens - cached})
            prefill.end(self.first_ns)
            child("decode", context=context, start_time=self.first_ns,
                  attributes={"gen_ai.usage.output_tokens": generated}).end(end_ns)
        span.add_event("finish", attributes={"surge.outcome": outcome}, timestamp=end_ns)
        if outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_ns)
