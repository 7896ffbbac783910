"""OpenTelemetry tracing: the spans of a request, its queue, its batch and its compute."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.http
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import trioinfer
from _serve import start_serving
from _spans import named, parent_of, provider_for
from trioinfer import ConfigError, Instance, ModelConfig, example_repository, open_engine
from trioinfer._trace_settings import provider_from_settings, update_trace_settings
from trioinfer._tracing import Tracing
from trioinfer.server import ServerConfig
from trioinfer.testing import FakeBackend, FaultyBackend

pytestmark = pytest.mark.tracing

X = np.ones((1, 4), np.float32)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def batched(name: str = "m", delay: float = 0.01) -> ModelConfig:
    return ModelConfig(
        name=name,
        path="-",
        backend="fake",
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": delay},
    )


@asynccontextmanager
async def traced_engine(
    exporter: InMemorySpanExporter, backend: Any, *configs: ModelConfig, rate: float = 1.0
) -> AsyncIterator[trioinfer.Engine]:
    provider = provider_for(exporter)
    async with open_engine(
        registry=backend.registry(), tracer_provider=provider, trace_rate=rate
    ) as engine:
        for config in configs:
            await engine.load(config)
        yield engine


async def test_a_batch_span_is_linked_to_each_request_it_carries(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    backend = FakeBackend(delay=0.1)
    async with traced_engine(exporter, backend, batched()) as engine, trio.open_nursery() as n:
        for i in range(4):
            n.start_soon(lambda i=i: engine.infer("m", {"x": X}, request_id=f"r{i}"))
    assert backend.executions == [4]  # one batch of four
    spans = exporter.get_finished_spans()
    requests = named(spans, "infer m")
    queues = named(spans, "queue m")
    (batch,) = named(spans, "batch m")
    (compute,) = named(spans, "compute m")
    assert len(requests) == len(queues) == 4
    by_id = {r.context.span_id: r for r in requests}
    # Each request starts its own trace; its queue time is its child.
    assert all(r.parent is None for r in requests)
    assert sorted(parent_of(q) for q in queues) == sorted(by_id)  # type: ignore[type-var]
    assert {r.attributes["trioinfer.request.id"] for r in requests} == {"r0", "r1", "r2", "r3"}
    # One batch span, linked to every request it carried, a child of one of them.
    assert {link.context.span_id for link in batch.links} == set(by_id)
    assert parent_of(batch) in by_id
    assert batch.attributes["trioinfer.batch.requests"] == 4
    assert batch.attributes["trioinfer.batch.size"] == 4
    assert batch.attributes["trioinfer.instance"] == 0
    # The backend's compute is the batch's child; the queue ends as the batch starts.
    assert parent_of(compute) == batch.context.span_id
    assert all(q.end_time <= batch.start_time for q in queues)  # type: ignore[operator]
    assert all(r.attributes["trioinfer.outcome"] == "success" for r in requests)


async def test_a_cancelled_request_ends_its_spans_as_cancelled(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    backend = FakeBackend(delay=1.0)
    engine_scope = traced_engine(exporter, backend, batched(delay=0.0))
    async with engine_scope as engine, trio.open_nursery() as nursery:
        nursery.start_soon(engine.infer, "m", {"x": X})  # runs for 1s
        await trio.sleep(0.1)
        with trio.move_on_after(0.5):  # queued behind it, cancelled there
            await engine.infer("m", {"x": X}, request_id="queued")
        await trio.sleep(0.5)  # the first has finished
        with trio.move_on_after(0.3):  # running, cancelled mid-run
            await engine.infer("m", {"x": X}, request_id="running")
    spans = exporter.get_finished_spans()
    by_request = {s.attributes["trioinfer.request.id"]: s for s in named(spans, "infer m")}
    queued, running = by_request["queued"], by_request["running"]
    assert queued.attributes["trioinfer.outcome"] == "cancelled"
    assert running.attributes["trioinfer.outcome"] == "cancelled"
    assert queued.status.status_code is not StatusCode.ERROR  # a caller leaving is no error
    # The queued one never reached a batch: its queue span ends as it leaves.
    (queue,) = [q for q in named(spans, "queue m") if parent_of(q) == queued.context.span_id]
    assert queue.attributes["trioinfer.outcome"] == "cancelled"
    linked = {link.context.span_id for b in named(spans, "batch m") for link in b.links}
    assert queued.context.span_id not in linked
    # The running one's batch was aborted: nobody waited for it any more.
    (aborted,) = [b for b in named(spans, "batch m") if parent_of(b) == running.context.span_id]
    assert aborted.attributes["trioinfer.outcome"] == "cancelled"


async def test_a_failed_over_request_shows_each_attempt_and_the_model_it_went_to(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    failing = FaultyBackend(error_rate=1.0, transient=False)
    registry = trioinfer.Registry(
        extra={"backends": {"faulty": lambda: failing, "fake": FakeBackend}}
    )

    class Both:
        def registry(self) -> trioinfer.Registry:
            return registry

    m = ModelConfig(
        name="m",
        path="-",
        backend="faulty",
        instances=[Instance(count=2)],
        fallback="resilient",
        fallback_options={"models": ["backup"]},
    )
    backup = ModelConfig(name="backup", path="-", backend="fake")
    async with traced_engine(exporter, Both(), m, backup) as engine:
        result = await engine.infer_detailed("m", {"x": X})
    assert result.model == "backup"
    spans = exporter.get_finished_spans()
    (request,) = named(spans, "infer m")
    (batch,) = named(spans, "batch m")
    computes = named(spans, "compute m")
    # Two attempts on m's two instances, both failed, both children of the batch.
    assert len(computes) == 2
    assert {parent_of(c) for c in computes} == {batch.context.span_id}
    assert all(c.status.status_code is StatusCode.ERROR for c in computes)
    assert {c.attributes["trioinfer.instance"] for c in computes} == {0, 1}
    assert all(c.attributes["error.type"] for c in computes)
    # The failover to backup is a request of its own, inside m's batch, in m's trace.
    (elsewhere,) = named(spans, "infer backup")
    assert parent_of(elsewhere) == batch.context.span_id
    assert elsewhere.context.trace_id == request.context.trace_id
    (backup_compute,) = named(spans, "compute backup")
    assert backup_compute.context.trace_id == request.context.trace_id
    assert backup_compute.status.status_code is StatusCode.UNSET
    assert request.attributes["trioinfer.outcome"] == "success"
    assert batch.attributes["trioinfer.outcome"] == "success"


class Step:
    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"y": inputs["x"] * self.factor}


def step_model(name: str, factor: float) -> ModelConfig:
    spec = {"name": "x", "dtype": "float32", "shape": ["batch", 4]}
    return ModelConfig(
        name=name,
        path="-",
        backend="python",
        backend_options={
            "class": Step,
            "parameters": {"factor": factor},
            "inputs": [spec],
            "outputs": [{**spec, "name": "y"}],
        },
    )


async def test_pipeline_steps_are_children_of_the_pipeline_request(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    spec = {"dtype": "float32", "shape": ["batch", 4]}
    pipeline = ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        backend_options={
            "inputs": [{"name": "IN", **spec}],
            "outputs": [{"name": "OUT", **spec}],
            "steps": [
                {"model": "double", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
                {"model": "triple", "input_map": {"x": "A"}, "output_map": {"y": "OUT"}},
            ],
        },
    )
    provider = provider_for(exporter)
    async with open_engine(tracer_provider=provider) as engine:
        await engine.load(step_model("double", 2.0))
        await engine.load(step_model("triple", 3.0))
        await engine.load(pipeline)
        outputs = await engine.infer("p", {"IN": X})
        spans = exporter.get_finished_spans()
        # A pipeline request not sampled (its model's rate is 0) takes its steps with it,
        # though theirs is 1: no trace starts halfway.
        exporter.clear()
        engine._tracing.model_rates["p"] = 0.0  # type: ignore[union-attr]
        await engine.infer("p", {"IN": X})
        assert exporter.get_finished_spans() == ()
    np.testing.assert_array_equal(outputs["OUT"], X * 6)
    (request,) = named(spans, "infer p")
    assert not named(spans, "queue p")  # a pipeline has no queue of its own
    steps = named(spans, "infer double") + named(spans, "infer triple")
    assert len(steps) == 2
    assert {parent_of(s) for s in steps} == {request.context.span_id}
    assert {s.context.trace_id for s in spans} == {request.context.trace_id}
    # Each step's batch and compute are in the pipeline's trace as well.
    assert len(named(spans, "compute ")) == 2


async def test_sampling_follows_the_parent_or_the_rate(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    backend = FakeBackend()
    async with traced_engine(exporter, backend, batched(), rate=0.0) as engine:
        await engine.infer("m", {"x": X})  # a new trace, at rate 0: nothing
        assert exporter.get_finished_spans() == ()
        # A caller's own sampled span wins over the rate: the request is its child.
        tracer = engine._tracing._tracer  # type: ignore[union-attr]
        with tracer.start_as_current_span("caller") as caller:
            await engine.infer("m", {"x": X})
        (request,) = named(exporter.get_finished_spans(), "infer m")
        assert parent_of(request) == caller.get_span_context().span_id
        exporter.clear()
        # An unsampled parent is followed too: no spans.
        unsampled = trace.NonRecordingSpan(
            trace.SpanContext(1, 2, is_remote=True, trace_flags=trace.TraceFlags(0))
        )
        engine._tracing.rate = 1.0  # type: ignore[union-attr]
        with trace.use_span(unsampled):
            await engine.infer("m", {"x": X})
        assert exporter.get_finished_spans() == ()
        # A rate of one in two, over many requests: about half are traced.
        engine._tracing.rate = 0.5  # type: ignore[union-attr]
        for _ in range(200):
            await engine.infer("m", {"x": X})
        traced = len(named(exporter.get_finished_spans(), "infer m"))
        assert 60 < traced < 140


async def test_a_cache_hit_is_never_queued(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    backend = FakeBackend(delay=0.1)
    config = ModelConfig(name="m", path="-", backend="fake", response_cache=True)
    async with open_engine(
        registry=backend.registry(), cache_size=1 << 20, tracer_provider=provider_for(exporter)
    ) as engine:
        await engine.load(config)
        await engine.infer("m", {"x": X}, request_id="first")
        await engine.infer("m", {"x": X}, request_id="again")
    spans = exporter.get_finished_spans()
    by_request = {s.attributes["trioinfer.request.id"]: s for s in named(spans, "infer m")}
    first, again = by_request["first"], by_request["again"]
    assert first.attributes["trioinfer.cache.hit"] is False
    assert again.attributes["trioinfer.cache.hit"] is True
    (queue,) = named(spans, "queue m")
    assert parent_of(queue) == first.context.span_id
    (batch,) = named(spans, "batch m")
    assert [link.context.span_id for link in batch.links] == [first.context.span_id]


def test_spans_on_asyncio() -> None:
    exporter = InMemorySpanExporter()

    async def main() -> None:
        backend = FakeBackend(delay=0.01)
        engine_scope = traced_engine(exporter, backend, batched())
        async with engine_scope as engine, anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(engine.infer, "m", {"x": X})

    anyio.run(main, backend="asyncio")
    spans = exporter.get_finished_spans()
    requests = {s.context.span_id for s in named(spans, "infer m")}
    assert len(requests) == 3
    linked = {link.context.span_id for b in named(spans, "batch m") for link in b.links}
    assert linked == requests
    assert len(named(spans, "queue m")) == 3


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = (
        "import sys, trio, numpy as np, trioinfer\n"
        "from trioinfer.testing import FakeBackend\n"
        "async def main():\n"
        "    backend = FakeBackend()\n"
        "    async with trioinfer.open_engine(registry=backend.registry()) as engine:\n"
        "        await engine.load(trioinfer.ModelConfig(name='m', path='-', backend='fake'))\n"
        "        await engine.infer('m', {'x': np.ones((1, 4), np.float32)})\n"
        "trio.run(main)\n"
        "import trioinfer.server\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_settings_from_options_and_environment() -> None:
    assert provider_from_settings(None, None, environ={}) is None  # off unless configured
    assert provider_from_settings("none", 1.0, environ={"OTEL_TRACES_EXPORTER": "otlp"}) is None
    assert (
        provider_from_settings(
            None, None, environ={"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}
        )
        is None
    )
    env = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    made = provider_from_settings(None, None, environ=env)
    assert made is not None
    provider, rate = made
    assert rate == 0.25
    provider.shutdown()
    made = provider_from_settings("otlp", 0.001, environ=env)  # the option wins
    assert made is not None
    assert made[1] == 0.001
    made[0].shutdown()
    with pytest.raises(ConfigError, match="one of otlp, console, none"):
        provider_from_settings("jaeger", None, environ={})
    with pytest.raises(ConfigError, match="between 0 and 1"):
        provider_from_settings("console", 2.0, environ={})
    with pytest.raises(ConfigError, match="not one trioinfer can follow"):
        provider_from_settings(None, None, environ={**env, "OTEL_TRACES_SAMPLER": "xray"})
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        provider_from_settings(None, None, environ={**env, "OTEL_TRACES_SAMPLER_ARG": "half"})
    with pytest.raises(ConfigError, match="asks for 'grpc'; set it to http/protobuf"):
        provider_from_settings("otlp", None, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ConfigError, match="ratio between 0 and 1"):
        open_engine(tracer_provider=TracerProvider(), trace_rate=-1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_level": ["LOUD"]}, "OFF or TIMESTAMPS"),
        # Which one wins would be a guess (tracing stayed on); Triton refuses it too.
        ({"trace_level": ["TIMESTAMPS", "OFF"]}, "OFF goes alone"),
        ({"trace_rate": "-3"}, "whole number"),
        ({"trace_rate": "often"}, "whole number"),
        ({"trace_count": "10"}, "trace_count cannot be changed"),
        ({"trace_file": "/tmp/x"}, "trace_file cannot be changed"),
        ({"sampler": "x"}, "unknown trace setting 'sampler'"),
    ],
)
def test_trace_settings_that_do_nothing_here_are_refused(
    settings: dict[str, Any], message: str
) -> None:
    tracing = Tracing(TracerProvider(), 0.5)
    with pytest.raises(ConfigError, match=message):
        update_trace_settings(tracing, None, settings)
    assert (tracing.rate, tracing.enabled) == (0.5, True)  # nothing half-applied


# -- over HTTP ---------------------------------------------------------------------------------

BODY = {
    "inputs": [
        {
            "name": "input",
            "shape": [1, 64],
            "datatype": "FP32",
            "data": trioinfer.digits_samples()[0][:1].ravel().tolist(),
        }
    ]
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@asynccontextmanager
async def serving(tmp_path: Path, config: ServerConfig) -> AsyncIterator[httpx.AsyncClient]:
    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo, config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            yield client
        nursery.cancel_scope.cancel()


async def test_traceparent_over_http_parents_the_server_span(
    exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=0.0)
    async with serving(tmp_path, config) as client:
        answer = await client.post(
            "/v2/models/digits/infer",
            json=BODY,
            headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
        )
        assert answer.status_code == 200, answer.text
        missing = await client.post(
            "/v2/models/digits/versions/9/infer", json=BODY, headers={"traceparent": TRACEPARENT}
        )
        assert missing.status_code == 404
        untraced = await client.post("/v2/models/digits/infer", json=BODY)  # rate 0, no parent
        assert untraced.status_code == 200
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind is trace.SpanKind.SERVER]
    assert len(servers) == 2
    ok, refused = sorted(servers, key=lambda s: s.attributes["http.response.status_code"])
    # The caller's trace continues here: same trace id, the caller's span as parent.
    assert format(ok.context.trace_id, "032x") == TRACE_ID
    assert ok.parent is not None
    assert format(ok.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert ok.context.trace_state.get("vendor") == "1"
    assert ok.attributes["http.route"] == "/v2/models/{model}/infer"
    assert ok.attributes["trioinfer.model.name"] == "digits"
    assert ok.attributes["trioinfer.model.version"] == "1"  # the version that answered
    (engine_span,) = [s for s in spans if s.name.startswith("infer ")]
    assert parent_of(engine_span) == ok.context.span_id
    assert {s.context.trace_id for s in spans} == {ok.context.trace_id}
    assert refused.attributes["http.response.status_code"] == 404
    assert refused.attributes["error.type"] == "404"
    assert refused.attributes["trioinfer.model.version"] == "9"


async def test_the_trace_setting_endpoint_changes_the_rate(
    exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=0.0)
    async with serving(tmp_path, config) as client:

        async def traced_after(n: int) -> int:
            exporter.clear()
            for _ in range(n):
                assert (await client.post("/v2/models/digits/infer", json=BODY)).status_code == 200
            return len([s for s in exporter.get_finished_spans() if s.name.startswith("POST")])

        before = (await client.get("/v2/trace/setting")).json()
        assert await traced_after(5) == 0
        changed = await client.post("/v2/trace/setting", json={"trace_rate": "1"})
        assert changed.status_code == 200, changed.text
        assert changed.json()["trace_rate"] == "1"
        assert await traced_after(5) == 5
        # A model's own rate wins over the server's; null returns it to the server's.
        await client.post("/v2/models/digits/trace/setting", json={"trace_rate": "0"})
        model = (await client.get("/v2/models/digits/trace/setting")).json()
        assert await traced_after(5) == 0
        await client.post("/v2/models/digits/trace/setting", json={"trace_rate": None})
        assert await traced_after(3) == 3
        await client.post("/v2/models/digits/trace/setting", json={"trace_rate": "0"})
        await client.post("/v2/models/digits/trace/setting")  # no settings: the model's go
        assert await traced_after(3) == 3
        # OFF stops tracing, whatever the rate.
        off = await client.post("/v2/trace/setting", json={"trace_level": ["OFF"]})
        assert await traced_after(3) == 0
        exporter.clear()
        parented = await client.post(
            "/v2/models/digits/infer", json=BODY, headers={"traceparent": TRACEPARENT}
        )
        assert parented.status_code == 200
        assert exporter.get_finished_spans() == ()  # OFF is off, a sampled caller too
        refused = await client.post("/v2/trace/setting", json={"trace_level": ["TENSORS"]})
        unknown = await client.get("/v2/models/nope/trace/setting")
    assert before == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "0",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "",
        "trace_mode": "opentelemetry",
    }
    assert model["trace_rate"] == "0"
    assert off.json()["trace_level"] == ["OFF"]
    assert refused.status_code == 400
    assert "TENSORS is not supported" in refused.json()["error"]
    assert unknown.status_code == 404


async def test_the_trace_setting_endpoint_without_tracing(tmp_path: Path) -> None:
    async with serving(tmp_path, ServerConfig()) as client:
        got = (await client.get("/v2/trace/setting")).json()
        refused = await client.post("/v2/trace/setting", json={"trace_rate": "10"})
        metadata = (await client.get("/v2")).json()
    assert got["trace_level"] == ["OFF"]
    assert refused.status_code == 400
    assert "--trace-exporter" in refused.json()["error"]
    assert "trace" in metadata["extensions"]


def test_tritonclient_reads_and_changes_trace_settings(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=1.0)

    async def main() -> tuple[Any, Any]:
        async with serving(tmp_path, config) as client:
            url = str(client.base_url).removeprefix("http://").rstrip("/")

            def use() -> tuple[Any, Any]:
                triton = tritonclient.http.InferenceServerClient(url)
                updated = triton.update_trace_settings(settings={"trace_rate": "1000"})
                model = triton.get_trace_settings(model_name="digits")
                triton.close()
                return updated, model

            return await anyio.to_thread.run_sync(use)

    updated, model = trio.run(main)
    assert updated["trace_rate"] == "1000"
    assert model["trace_rate"] == "1000"
    json.dumps(updated)


def test_serve_exports_spans_with_the_console_exporter(tmp_path: Path) -> None:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "svc"}
    env.pop("TRIOINFER_ADMIN_TOKEN", None)
    command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--trace-rate", "1"]
    log = (tmp_path / "log").open("wb")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                break
        else:
            pytest.fail((tmp_path / "log").read_text())
        answer = httpx.post(
            f"{match.group(1)}/v2/models/digits/infer",
            json=BODY,
            headers={"traceparent": TRACEPARENT},
        )
        assert answer.status_code == 200
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    assert process.returncode == 0
    # Flushed at exit: the server span and the engine's, in the caller's trace.
    assert '"name": "POST /v2/models/{model}/infer"' in out
    assert '"name": "infer digits.v1"' in out
    assert f'"trace_id": "0x{TRACE_ID}"' in out
    assert '"service.name": "svc"' in out


def test_serve_says_tracing_needs_the_otel_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from trioinfer.cli import main

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)  # as if not installed
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--trace-exporter", "console"])
    assert result.exit_code == 1
    assert "--trace-exporter console needs the 'otel' extra" in result.output
    # Set in a --config file, the message names the file's key, not the flag.
    config = tmp_path / "server.toml"
    config.write_text('trace_exporter = "console"\n')
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--config", str(config)])
    assert result.exit_code == 1
    said = " ".join(result.output.split())
    assert f"trace_exporter = 'console' in {config} needs the 'otel' extra" in said


@pytest.mark.grpc
async def test_traceparent_over_grpc_parents_the_server_span(
    exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    config = ServerConfig(tracer_provider=provider_for(exporter), trace_rate=0.0)
    images = trioinfer.digits_samples()[0][:1]

    def call(address: str) -> None:
        client = grpcclient.InferenceServerClient(address)
        try:
            x = grpcclient.InferInput("input", [1, 64], "FP32")
            x.set_data_from_numpy(images)
            client.infer("digits", [x], headers={"traceparent": TRACEPARENT})
            client.infer("digits", [x])  # rate 0 and no parent: not traced
            with pytest.raises(grpcclient.InferenceServerException):
                client.infer("nope", [x], headers={"traceparent": TRACEPARENT})
        finally:
            client.close()

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo, grpc_port=0, config=config)
        await trio.to_thread.run_sync(call, listening.grpc)
        nursery.cancel_scope.cancel()
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind is trace.SpanKind.SERVER]
    assert len(servers) == 2
    ok, refused = sorted(servers, key=lambda s: s.attributes["trioinfer.model.name"])
    assert ok.name == "inference.GRPCInferenceService/ModelInfer"
    assert ok.attributes["rpc.system"] == "grpc"
    # The version that answered, as over HTTP, though the call named none.
    assert ok.attributes["trioinfer.model.version"] == "1"
    assert format(ok.context.trace_id, "032x") == TRACE_ID
    assert ok.parent is not None
    assert format(ok.parent.span_id, "016x") == "00f067aa0ba902b7"
    (engine_span,) = [s for s in spans if s.name.startswith("infer ")]
    assert parent_of(engine_span) == ok.context.span_id
    assert refused.attributes["trioinfer.model.name"] == "nope"
    assert refused.attributes["trioinfer.outcome"] == "error"
    assert refused.status.status_code is StatusCode.ERROR
