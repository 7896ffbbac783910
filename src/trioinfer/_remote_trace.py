"""Trace context for backends whose work runs elsewhere (another process, another node).

These are the `trioinfer.lowlevel` names; they never import ``opentelemetry``:
while tracing is off (``trioinfer._tracing`` not imported) each is one dict
look-up, and while it is on, a backend call that is not traced costs one
context-variable read.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


def current_trace_context() -> dict[str, str]:
    """The W3C trace context of the backend call this task makes, if it is traced.

    ``{"traceparent": ..., "tracestate": ...}`` (``tracestate`` only when set)
    while the engine runs a traced batch's backend call (its ``compute`` span
    is the parent it names); ``{}`` otherwise, and always with tracing off.
    A backend that sends the work elsewhere sends this with it, and records
    what ran there with [`record_span()`][trioinfer.lowlevel.record_span].
    An empty answer tells it that nobody will look at timings: it can skip
    measuring them.
    """
    tracing = sys.modules.get("trioinfer._tracing")
    if tracing is None:
        return {}
    context: dict[str, str] = tracing.current_trace_context()
    return context


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    parent: Mapping[str, str],
    attributes: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Record a finished span of work done elsewhere, as a child of *parent*.

    For a backend whose remote side has no exporter of its own: the remote side
    measures (``time.time_ns()`` there, nanoseconds since the epoch), sends the
    times back with the result, and the backend records them here, in the
    engine's tracer, during its ``execute`` call. *parent* is
    [`current_trace_context()`][trioinfer.lowlevel.current_trace_context], or
    what an earlier call returned (for nested spans). *attributes* are
    OpenTelemetry attribute values (str, bool, int, float, or sequences of one).

    Returns:
        The new span's own trace context, to parent further spans; ``{}``
        (and nothing recorded) when the call is not traced or *parent* is empty.
    """
    tracing = sys.modules.get("trioinfer._tracing")
    if tracing is None:
        return {}
    carrier: dict[str, str] = tracing.record_span(name, start_ns, end_ns, parent, attributes)
    return carrier
