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
import trio.lowlevel
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import trioinfer
from _serve import start_serving
from _spans import named, parent_of, provider_for
from trioinfer import ModelConfig, open_engine
from trioinfer._stream import STREAM_AHEAD
from trioinfer.server import ServerConfig

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


def config(name: str = "m", **fields: Any) -> ModelConfig:
    options = {"class": Counting, "decoupled": True, **SIGNATURE}
    return ModelConfig(name=name, path="-", backend="python", backend_options=options, **fields)


def n(count: int) -> Arrays:
    return {"n": np.array([count], np.int32)}


async def test_a_stream_has_a_span_and_its_generator_a_child_span() -> None:
    exporter = InMemorySpanExporter()
    provider = provider_for(exporter)
    caller = provider.get_tracer("test")
    async with open_engine(tracer_provider=provider, trace_rate=0.0) as engine:
        await engine.load(config())
        with caller.start_as_current_span("caller") as mine:
            async with engine.infer_stream("m", n(3), request_id="full") as responses:
                assert [int(r["i"][0]) async for r in responses] == [0, 1, 2]
            # More responses than the model may make ahead: it is still at work.
            async with engine.infer_stream("m", n(40), request_id="left") as responses:
                async for _ in responses:
                    break  # the reader leaves after one response
            async with engine.infer_stream("m", n(99), request_id="broke") as responses:
                with pytest.raises(trioinfer.BackendError):
                    async for _ in responses:
                        pass
            with trio.CancelScope() as scope:  # the caller's scope: a deadline, a client gone
                async with engine.infer_stream("m", n(40), request_id="cancelled") as responses:
                    async for _ in responses:
                        scope.cancel()
                        await trio.lowlevel.checkpoint()
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
    # Its first response was read: time to first response is there too.
    assert [e.name for e in generators[streams["left"].context.span_id].events] == [
        "first response"
    ]
    # Responses handed over: the one read, and those the model made ahead meanwhile.
    assert 1 <= streams["left"].attributes["trioinfer.stream.responses"] <= 1 + STREAM_AHEAD
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
        s
        for s in named(exporter.get_finished_spans(), "stream m")
        if s.attributes["trioinfer.request.id"] == "refused"
    ]
    assert refused.attributes["trioinfer.outcome"] == "error"
    assert refused.attributes["error.type"] == "QueueFull"
    assert refused.attributes["trioinfer.stream.responses"] == 0


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(trioinfer.example_repository() / "repeat_int32", root / "repeat_int32")
    return root


REPEAT = {"IN": [4, 2, 0, 1], "DELAY": [0, 0, 0, 0], "WAIT": 0}


async def test_generate_stream_over_http_is_traced_under_its_server_span(
    repository: Path,
) -> None:
    exporter = InMemorySpanExporter()
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=0.0)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repository, config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            streamed = await client.post(
                "/v2/models/repeat_int32/generate_stream",
                json=REPEAT,
                headers={"traceparent": TRACEPARENT},
            )
            one = await client.post(
                "/v2/models/repeat_int32/generate",
                json={"IN": [7], "DELAY": [0], "WAIT": 0},
                headers={"traceparent": TRACEPARENT},
            )
            untraced = await client.post("/v2/models/repeat_int32/generate_stream", json=REPEAT)
        nursery.cancel_scope.cancel()
    assert streamed.status_code == one.status_code == untraced.status_code == 200
    spans = exporter.get_finished_spans()
    servers = {s.name: s for s in spans if s.kind is trace.SpanKind.SERVER}
    assert set(servers) == {
        "POST /v2/models/{model}/generate_stream",
        "POST /v2/models/{model}/generate",
    }
    server = servers["POST /v2/models/{model}/generate_stream"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["trioinfer.model.version"] == "1"
    by_parent = {parent_of(s): s for s in named(spans, "stream repeat_int32")}
    stream = by_parent[server.context.span_id]
    assert stream.attributes["trioinfer.stream.responses"] == 4
    assert stream.attributes["trioinfer.outcome"] == "success"
    assert (
        by_parent[servers["POST /v2/models/{model}/generate"].context.span_id].attributes[
            "trioinfer.stream.responses"
        ]
        == 1
    )
    (work,) = [s for s in named(spans, "generate ") if parent_of(s) == stream.context.span_id]
    assert work.attributes["trioinfer.stream.responses"] == 4


@pytest.mark.grpc
async def test_model_stream_infer_is_traced_under_its_server_span(repository: Path) -> None:
    import queue

    import tritonclient.grpc as grpcclient

    exporter = InMemorySpanExporter()
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=0.0)

    def call(address: str) -> list[Any]:
        answers: queue.Queue[Any] = queue.Queue()
        inputs = []
        for name, array, datatype in [
            ("IN", np.array([4, 2, 0], np.int32), "INT32"),
            ("DELAY", np.zeros(3, np.uint32), "UINT32"),
            ("WAIT", np.zeros(1, np.uint32), "UINT32"),
        ]:
            inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
            inputs[-1].set_data_from_numpy(array)
        with grpcclient.InferenceServerClient(address) as client:
            client.start_stream(
                callback=lambda result, error: answers.put(error),
                headers={"traceparent": TRACEPARENT},
            )
            client.async_stream_infer("repeat_int32", inputs, request_id="r1")
            got = [answers.get(timeout=30) for _ in range(3)]
            client.stop_stream()
        return got

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repository, grpc_port=0, config=config)
        assert await trio.to_thread.run_sync(call, listening.grpc) == [None] * 3
        nursery.cancel_scope.cancel()
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind is trace.SpanKind.SERVER]
    assert server.name == "inference.GRPCInferenceService/ModelStreamInfer"
    assert format(server.context.trace_id, "032x") == TRACE_ID
    (stream,) = named(spans, "stream repeat_int32")
    assert parent_of(stream) == server.context.span_id
    assert stream.attributes["trioinfer.request.id"] == "r1"
    assert stream.attributes["trioinfer.stream.responses"] == 3
    assert stream.attributes["trioinfer.outcome"] == "success"


async def test_a_stream_that_fails_after_its_200_says_so_on_its_server_span(
    repository: Path,
) -> None:
    # The status went out with the first event, the error in one last event: the server
    # span said "success" (gRPC's said "error") though the stream did not end whole.
    exporter = InMemorySpanExporter()
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=1.0)
    late = {"IN": [1, 2], "DELAY": [0, 60_000], "WAIT": 0, "parameters": {"timeout": 300_000}}
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repository, config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            cut = await client.post("/v2/models/repeat_int32/generate_stream", json=late)
        nursery.cancel_scope.cancel()
    assert cut.status_code == 200
    assert '"error"' in cut.text.splitlines()[-2]  # the last event (then a blank line)
    (server,) = [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.SERVER]
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["trioinfer.outcome"] == "error"
    assert server.attributes["error.type"] == "DeadlineExceeded"
