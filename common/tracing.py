"""OpenTelemetry set-up, once per process, and W3C trace-context helpers.

Export goes over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-specific
variable) is set, to the console with `console=True` (one compact line per span, see
`CompactSpanExporter`), and nowhere otherwise. The services
install a provider only when spans go somewhere (`exporting`): without one every span is a
no-op, so a batched step of many sessions pays nothing for tracing.
`OTEL_SERVICE_NAME` overrides the service name. Tests pass their own exporter.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_provider: TracerProvider | None = None
_propagator = TraceContextTextMapPropagator()

MAX_CONSOLE_ATTRIBUTES = 6  # attributes shown per span line
MAX_CONSOLE_VALUE = 40      # characters shown per attribute value


def _short(value) -> str:
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if isinstance(value, float):
        text = f"{value:.4g}"
    return text if len(text) <= MAX_CONSOLE_VALUE else text[:MAX_CONSOLE_VALUE - 3] + "..."


def format_span(span: ReadableSpan) -> str:
    """`span NAME 12.3 ms trace 1a2b3c4d [ERROR] key=value ...`: one line, the first attributes."""
    duration_ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
    trace_id = format(span.context.trace_id, "032x")[:8] if span.context is not None else "-"
    parts = [f"span {span.name} {duration_ms:.1f} ms trace {trace_id}"]
    if span.status is not None and span.status.status_code is trace.StatusCode.ERROR:
        parts.append("ERROR" + (f" ({_short(span.status.description)})" if span.status.description else ""))
    attributes = list((span.attributes or {}).items())
    parts += [f"{key}={_short(value)}" for key, value in attributes[:MAX_CONSOLE_ATTRIBUTES]]
    if len(attributes) > MAX_CONSOLE_ATTRIBUTES:
        parts.append(f"(+{len(attributes) - MAX_CONSOLE_ATTRIBUTES} attributes)")
    return " ".join(parts)


class CompactSpanExporter(SpanExporter):
    """Writes one `format_span` line per finished span to `stream` (stdout), flushed at once:
    what `--trace-console` prints, readable beside the logs (the SDK's console exporter writes
    a multi-line JSON document per span)."""

    def __init__(self, stream: TextIO | None = None):
        self._stream = stream

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        stream = self._stream or sys.stdout
        for span in spans:
            stream.write(format_span(span) + "\n")
        stream.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def exporting(console: bool = False) -> bool:
    """Whether spans would go anywhere: OTLP configured in the environment, or the console."""
    return console or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                           or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str, *, console: bool = False, exporter: SpanExporter | None = None) -> TracerProvider:
    """Install the process's tracer provider (first call wins; later calls return it)."""
    global _provider
    if _provider is not None:
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        provider.add_span_processor(SimpleSpanProcessor(CompactSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop exporters (call on server shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def current_span(tracer_: trace.Tracer, name: str) -> contextlib.AbstractContextManager[trace.Span]:
    """`tracer_.start_as_current_span(name)`, or where no provider is installed (`setup_tracing`) a
    context that does nothing and yields a span that records nothing, as the no-op tracer's does,
    without its cost: its context attach and detach cost microseconds, several times per step."""
    return tracer_.start_as_current_span(name) if _provider is not None else _NO_SPAN


def use_span(span: trace.Span, end_on_exit: bool = False) -> contextlib.AbstractContextManager:
    """`trace.use_span(span, end_on_exit)`, or nothing where no provider is installed: `span` then
    records nothing, and neither would the spans under it."""
    return trace.use_span(span, end_on_exit=end_on_exit) if _provider is not None else _NO_SPAN


def current_traceparent() -> str:
    """The W3C traceparent of the current span ('' when there is none)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent of `span` ('' when it records nothing)."""
    if not span.is_recording():
        return ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> otel_context.Context | None:
    """A context whose parent is the remote span named by `traceparent` (None if empty/invalid)."""
    if not traceparent:
        return None
    ctx = _propagator.extract({"traceparent": traceparent})
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return ctx if span_ctx.is_valid else None
