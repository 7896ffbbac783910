"""Reading the spans that the tracing tests record in memory."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def provider_for(exporter: InMemorySpanExporter) -> TracerProvider:
    """A tracer provider that hands each span to *exporter* as it ends."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def named(spans: Any, prefix: str) -> list[ReadableSpan]:
    """The spans whose name starts with *prefix*, in the order given."""
    return [s for s in spans if s.name.startswith(prefix)]


def parent_of(span: ReadableSpan) -> int | None:
    """The span id of *span*'s parent; None for a root span."""
    return span.parent.span_id if span.parent is not None else None
