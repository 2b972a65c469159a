"""OpenTelemetry set-up, once per process, and W3C trace-context helpers.

Export goes over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-specific
variable) is set, to the console with `console=True`, and nowhere otherwise. The services
install a provider only when spans go somewhere (`exporting`): without one every span is a
no-op, so a batched step of many sessions pays nothing for tracing.
`OTEL_SERVICE_NAME` overrides the service name. Tests pass their own exporter.
"""
from __future__ import annotations

import os

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_provider: TracerProvider | None = None
_propagator = TraceContextTextMapPropagator()


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
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop exporters (call on server shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


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
