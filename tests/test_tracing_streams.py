"""OpenTelemetry tracing of streams (decoupled models) in the engine, over HTTP and over gRPC."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import trioinfer
from trioinfer import ModelConfig, open_engine
from trioinfer.server import ServerConfig, serve_http

pytestmark = pytest.mark.tracing

Arrays = dict[str, np.ndarray[Any, Any]]
SIGNATURE = {
    "inputs": [{"name": "n", "dtype": "int32", "shape": [1]}],
    "outputs": [{"name": "i", "dtype": "int32", "shape": [1]}],
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Counting:
    """A decoupled model: 0, 1, ... n - 1; n = 99 fails after two responses."""

    async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
        for i in range(int(inputs["n"][0])):
            if i == 2 and inputs["n"][0] == 99:
                raise ValueError("no third response")
            yield {"i": np.array([i], np.int32)}
            await trio.sleep(0)


def config(name: str = "m", **fields: Any) -> ModelConfig:
    options = {"class": Counting, "decoupled": True, **SIGNATURE}
    return ModelConfig(name=name, path="-", backend="python", backend_options=options, **fields)


def n(count: int) -> Arrays:
    return {"n": np.array([count], np.int32)}


def provider_for(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def named(spans: Any, prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_stream_has_a_span_and_its_generator_a_child_span() -> None:
    exporter = InMemorySpanExporter()
    provider = provider_for(exporter)
    caller = provider.get_tracer("test")
    async with open_engine(tracer_provider=provider, trace_rate=0.0) as engine:
        await engine.load(config())
        with caller.start_as_current_span("caller") as mine:
            async with engine.infer_stream("m", n(3), request_id="full") as responses:
                assert [int(r["i"][0]) async for r in responses] == [0, 1, 2]
            async with engine.infer_stream("m", n(10), request_id="left") as responses:
                async for _ in responses:
                    break  # the reader leaves after one response
            async with engine.infer_stream("m", n(99), request_id="broke") as responses:
                with pytest.raises(trioinfer.BackendError):
                    async for _ in responses:
                        pass
            with trio.CancelScope() as scope:  # the caller's scope: a deadline, a client gone
                async with engine.infer_stream("m", n(10), request_id="cancelled") as responses:
                    async for _ in responses:
                        scope.cancel()
                        await trio.sleep(0)
        # Rate 0 and no caller's span: not traced.
        async with engine.infer_stream("m", n(2), request_id="untraced") as responses:
            assert len([r async for r in responses]) == 2
    spans = exporter.get_finished_spans()
    streams = {s.attributes["trioinfer.request.id"]: s for s in named(spans, "stream m")}
    assert set(streams) == {"full", "left", "broke", "cancelled"}
    generators = {parent_of(s): s for s in named(spans, "generate m")}
    assert len(generators) == 4
    for stream in streams.values():
        assert parent_of(stream) == mine.get_span_context().span_id
        assert stream.attributes["trioinfer.model.name"] == "m"
        assert stream.attributes["trioinfer.instance"] == 0
        assert stream.context.span_id in generators  # the model's work is its child
    full = streams["full"]
    assert full.attributes["trioinfer.outcome"] == "success"
    assert full.attributes["trioinfer.stream.responses"] == 3
    work = generators[full.context.span_id]
    assert work.attributes["trioinfer.outcome"] == "success"
    assert work.attributes["trioinfer.stream.responses"] == 3
    assert [e.name for e in work.events] == ["first response"]
    assert streams["left"].attributes["trioinfer.outcome"] == "abandoned"
    assert streams["left"].attributes["trioinfer.stream.responses"] == 1
    assert streams["left"].status.status_code is not StatusCode.ERROR
    broke = streams["broke"]
    assert broke.attributes["trioinfer.outcome"] == "error"
    assert broke.attributes["error.type"] == "BackendError"
    assert broke.attributes["trioinfer.stream.responses"] == 2
    assert generators[broke.context.span_id].attributes["error.type"] == "BackendError"
    cancelled = streams["cancelled"]
    assert cancelled.attributes["trioinfer.outcome"] == "cancelled"
    assert cancelled.status.status_code is not StatusCode.ERROR
    assert generators[cancelled.context.span_id].attributes["trioinfer.outcome"] == "cancelled"


async def test_a_refused_stream_ends_its_span_as_an_error() -> None:
    exporter = InMemorySpanExporter()
    async with open_engine(tracer_provider=provider_for(exporter)) as engine:
        await engine.load(config(max_queue_size=1))
        async with engine.infer_stream("m", n(2)) as responses:
            with pytest.raises(trioinfer.QueueFull):
                async with engine.infer_stream("m", n(2), request_id="refused"):
                    pass  # pragma: no cover - refused on entry
            assert len([r async for r in responses]) == 2
    (refused,) = [
        s for s in named(exporter.get_finished_spans(), "stream m")
        if s.attributes["trioinfer.request.id"] == "refused"
    ]
    assert refused.attributes["trioinfer.outcome"] == "error"
    assert refused.attributes["error.type"] == "QueueFull"
    assert refused.attributes["trioinfer.stream.responses"] == 0
