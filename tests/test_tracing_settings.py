"""Trace settings over gRPC (Triton's ``TraceSetting``), and checking them without a provider."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import trioinfer
from _serve import start_serving
from _spans import provider_for
from trioinfer import ConfigError, example_repository
from trioinfer._trace_settings import check_trace_settings
from trioinfer.server import ServerConfig

pytestmark = pytest.mark.tracing


@pytest.mark.grpc
async def test_tritonclient_grpc_reads_and_changes_trace_settings(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    exporter = InMemorySpanExporter()
    provider = provider_for(exporter)
    config = ServerConfig(tracer_provider=provider, trace_rate=0.0)
    images = trioinfer.digits_samples()[0][:1]

    def use(address: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with grpcclient.InferenceServerClient(address) as client:
            x = grpcclient.InferInput("input", [1, 64], "FP32")
            x.set_data_from_numpy(images)
            seen["before"] = client.get_trace_settings(as_json=True)
            client.infer("digits", [x])  # rate 0: not traced
            seen["updated"] = client.update_trace_settings(
                settings={"trace_rate": "1"}, as_json=True
            )
            client.infer("digits", [x])  # traced now
            seen["model"] = client.update_trace_settings(
                model_name="digits", settings={"trace_rate": "0"}, as_json=True
            )
            client.infer("digits", [x])  # the model's own rate: not traced
            # Reading a model's settings (no settings sent) leaves them as they are.
            seen["model again"] = client.get_trace_settings(model_name="digits", as_json=True)
            seen["cleared"] = client.update_trace_settings(
                model_name="digits", settings={"trace_rate": None}, as_json=True
            )
            for name, call in [
                (
                    "tensors",
                    lambda: client.update_trace_settings(settings={"trace_level": ["TENSORS"]}),
                ),
                ("unknown", lambda: client.get_trace_settings(model_name="nope")),
            ]:
                with pytest.raises(grpcclient.InferenceServerException) as raised:
                    call()
                seen[name] = raised.value
        return seen

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo, grpc_port=0, config=config)
        seen = await trio.to_thread.run_sync(use, listening.grpc)
        nursery.cancel_scope.cancel()
    assert seen["before"]["settings"]["trace_rate"]["value"] == ["0"]
    assert seen["before"]["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
    assert seen["before"]["settings"]["trace_mode"]["value"] == ["opentelemetry"]
    assert seen["updated"]["settings"]["trace_rate"]["value"] == ["1"]
    assert seen["model"]["settings"]["trace_rate"]["value"] == ["0"]
    assert seen["model again"]["settings"]["trace_rate"]["value"] == ["0"]
    assert seen["cleared"]["settings"]["trace_rate"]["value"] == ["1"]  # the server's again
    assert seen["tensors"].status() == "StatusCode.INVALID_ARGUMENT"
    assert "TENSORS is not supported" in seen["tensors"].message()
    assert seen["unknown"].status() == "StatusCode.NOT_FOUND"
    servers = [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.SERVER]
    assert len(servers) == 1  # only the request made at rate 1


def test_trace_settings_are_checked_without_building_a_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trioinfer.cli import serve

    def no(*args: object, **kwargs: object) -> None:
        raise AssertionError("the supervisor built a tracer provider")

    monkeypatch.setattr("trioinfer._trace_settings.provider_from_settings", no)
    settings = {"trace_exporter": "console", "trace_rate": 0.5}
    assert serve._tracing(settings, build=False) == (None, 0.5)
    assert serve._tracing({"trace_exporter": "none"}, build=False) is None
    with pytest.raises(ConfigError, match="trace exporter must be one of"):
        serve._tracing({"trace_exporter": "zipkin"}, build=False)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        serve._tracing({"trace_exporter": "console", "trace_rate": 2.0}, build=False)
    environ = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(ConfigError, match="http/protobuf"):
        check_trace_settings(None, None, environ=environ)
    assert check_trace_settings(None, None, environ={"OTEL_TRACES_EXPORTER": "otlp"}) == (
        "otlp",
        1.0,
    )
