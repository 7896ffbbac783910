"""`trioinfer.lowlevel.current_trace_context` and `record_span`: tracing work done elsewhere."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from _spans import parent_of, provider_for
from trioinfer import ModelConfig, open_engine
from trioinfer.lowlevel import current_trace_context, record_span
from trioinfer.testing import FakeBackend

pytestmark = pytest.mark.tracing

X = np.ones((1, 4), np.float32)


def remote_backend(seen: list[dict[str, str]]) -> FakeBackend:
    """A backend whose "remote side" ran 1 ms of queue and 2 ms of run, reported in ns."""

    def compute(inputs: dict[str, Any]) -> dict[str, Any]:
        context = current_trace_context()  # in the backend's execute, as a plugin calls it
        seen.append(context)
        start = time.time_ns()
        outer = record_span("remote m", start, start + 3_000_000, context, {"node": "n1"})
        record_span("run m", start + 1_000_000, start + 3_000_000, outer)
        return {"y": inputs["x"] * 2}

    return FakeBackend(compute)


async def test_a_remote_backend_records_spans_under_the_compute_span() -> None:
    exporter = InMemorySpanExporter()
    provider = provider_for(exporter)
    seen: list[dict[str, str]] = []
    backend = remote_backend(seen)
    config = ModelConfig(name="m", path="-", backend="fake")
    async with open_engine(
        registry=backend.registry(), tracer_provider=provider, trace_rate=1.0
    ) as engine:
        await engine.load(config)
        await engine.infer("m", {"x": X})
        # Not traced (rate 0): the backend is told so, and records nothing.
        engine._tracing.rate = 0.0  # type: ignore[union-attr]
        await engine.infer("m", {"x": X})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    compute, remote, run = spans["compute m"], spans["remote m"], spans["run m"]
    assert seen[0]["traceparent"].startswith(
        f"00-{compute.context.trace_id:032x}-{compute.context.span_id:016x}-"
    )
    assert seen[1] == {}
    assert parent_of(remote) == compute.context.span_id
    assert parent_of(run) == remote.context.span_id
    assert remote.context.trace_id == compute.context.trace_id
    assert remote.end_time - remote.start_time == 3_000_000  # type: ignore[operator]
    assert run.start_time - remote.start_time == 1_000_000  # type: ignore[operator]
    assert remote.attributes == {"node": "n1"}
    assert len(spans) == 6  # infer, queue, batch, compute, remote, run: one request's


async def test_without_tracing_the_hooks_answer_empty_and_record_nothing() -> None:
    seen: list[dict[str, str]] = []
    backend = remote_backend(seen)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="fake"))
        await engine.infer("m", {"x": X})
    assert seen == [{}]
    assert current_trace_context() == {}
    assert record_span("x", 0, 1, {"traceparent": "00-" + "1" * 32 + "-" + "1" * 16 + "-01"}) == {}
