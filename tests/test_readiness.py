"""``serve --strict-readiness`` and ``--exit-on-error`` (Triton's flags of those names).

A repository holding the digits model and a broken one, served on 127.0.0.1.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient

from _serve import start_serving
from test_grpc import run_server
from trioinfer import (
    BackendUnavailable,
    Instance,
    ModelConfig,
    ModelSignature,
    Registry,
    example_repository,
    open_engine,
)
from trioinfer.abc import Arrays
from trioinfer.lowlevel import Placement
from trioinfer.testing import FakeBackend
from trioinfer.testing._fake import FakeInstance

WAIT_S = 60.0


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repository"
    shutil.copytree(example_repository() / "digits", root / "digits")
    (root / "broken" / "1").mkdir(parents=True)
    shutil.copy(example_repository() / "digits" / "1" / "model.onnx", root / "broken" / "1")
    (root / "broken" / "config.toml").write_text("max_queue_size = -1\n")
    return root


def test_exit_on_error_stops_when_a_model_fails_to_load(repository: Path) -> None:
    command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--no-grpc"]
    command += ["--model-repository", str(repository), "--exit-on-error"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--exit-on-error: model(s) 'broken' failed to load at start" in done.stderr
    assert "max_queue_size" in done.stderr  # the log said why


@pytest.mark.grpc
def test_strict_readiness_waits_for_every_model(repository: Path, tmp_path: Path) -> None:
    with run_server(repository, "--strict-readiness", log=tmp_path / "log") as server:
        ready = httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S)
        assert ready.status_code == 503
        assert "model(s) 'broken' failed to load" in ready.json()["error"]
        with grpcclient.InferenceServerClient(server.grpc) as client:
            assert client.is_server_live()
            assert not client.is_server_ready()
            # The others serve meanwhile.
            assert client.is_model_ready("digits")
            (repository / "broken" / "config.toml").write_text("max_queue_size = 8\n")
            client.load_model("broken")
            assert client.is_server_ready()
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        # A reload that fails leaves the served version serving: still ready.
        (repository / "broken" / "config.toml").write_text("max_queue_size = -1\n")
        failed = httpx.post(f"{server.url}/v2/repository/models/broken/load", timeout=WAIT_S)
        assert failed.status_code == 400
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        # A load of a model the repository does not hold is a 404, not a model that
        # failed to load: Triton's readiness counts the models it found and tried (its
        # LiveModelStates), and this one never was.
        missing = httpx.post(f"{server.url}/v2/repository/models/nosuch/load", timeout=WAIT_S)
        assert missing.status_code == 404
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        index = httpx.post(f"{server.url}/v2/repository/index", timeout=WAIT_S).json()
        assert "nosuch" not in {row["name"] for row in index}


def test_without_the_flags_a_failed_model_leaves_the_server_ready(
    repository: Path, tmp_path: Path
) -> None:
    with run_server(repository, "--no-grpc", log=tmp_path / "log", want_grpc=False) as server:
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200


class Mortal:
    """A backend whose instances can be marked gone, as the ray backend's are when their
    actor dies: their ``gone`` says why, and their executions fail."""

    def __init__(self) -> None:
        self.fake = FakeBackend()
        self.instances: dict[int, MortalInstance] = {}  # the latest, by instance index

    async def load(self, config: ModelConfig, placement: Placement) -> MortalInstance:
        instance = MortalInstance(await self.fake.load(config, placement))
        self.instances[placement.index] = instance
        return instance


class MortalInstance:
    def __init__(self, inner: FakeInstance) -> None:
        self.inner = inner
        self.gone: str | None = None

    @property
    def signature(self) -> ModelSignature:
        return self.inner.signature

    @property
    def device(self) -> str:
        return self.inner.device

    async def execute(self, inputs: Arrays) -> dict[str, Any]:
        if self.gone is not None:
            raise BackendUnavailable(self.gone)
        return await self.inner.execute(inputs)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_model_whose_every_instance_is_gone_is_not_ready() -> None:
    """An instance whose process died (a Ray actor killed) left its model ready while every
    request failed: with none serving, the model says why it is not ready, and each gone
    instance shows as out."""
    mortal = Mortal()
    config = ModelConfig(name="m", path=Path("m.onnx"), backend="mortal")
    config = attrs.evolve(config, instances=[Instance(count=2, device="cpu")])
    registry = Registry(extra={"backends": {"mortal": lambda: mortal}})
    async with open_engine(registry=registry) as engine:
        await engine.load(config)
        first, second = mortal.instances[0], mortal.instances[1]
        first.gone = "instance 0's actor is gone (RayActorError): killed"
        # One instance left: the model is ready, and it serves.
        assert engine.model("m").unavailable is None
        replicas = engine.statistics().models["m"].replicas
        assert [(r.state, r.reason) for r in replicas] == [
            ("out", "gone: instance 0's actor is gone (RayActorError): killed"),
            ("serving", None),
        ]
        second.gone = "instance 1's actor is gone (RayActorError): its node died"
        unavailable = engine.model("m").unavailable
        assert unavailable is not None
        assert "no instance of model 'm' serves it" in unavailable
        assert "instance 1 (cpu): gone: instance 1's actor is gone" in unavailable
        assert engine.model("m").out_of_service is None  # no plugin broke its contract
        with pytest.raises(BackendUnavailable, match="is gone"):
            await engine.infer("m", {"x": np.ones((1, 4), np.float32)})
        # Loaded again: fresh instances, ready.
        await engine.load(config, replace=True)
        assert engine.model("m").unavailable is None
        await engine.infer("m", {"x": np.ones((1, 4), np.float32)})


async def test_over_http_a_model_with_no_live_instance_is_not_ready(tmp_path: Path) -> None:
    """Model readiness, the repository index and the instances metric say what the engine
    says, until the model is loaded again."""
    mortal = Mortal()
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "m" / "config.toml").write_text('backend = "mortal"\n')
    registry = Registry(extra={"backends": {"mortal": lambda: mortal}})
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            listening = await start_serving(nursery, tmp_path, registry=registry, shutdown=stop)
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                assert (await client.get("/v2/models/m/ready")).status_code == 200
                instance = mortal.instances[0]
                instance.gone = "instance 0's actor is gone (RayActorError): killed"
                ready = await client.get("/v2/models/m/ready")
                assert ready.status_code == 400
                assert "is not ready: no instance of model" in ready.json()["error"]
                assert "actor is gone" in ready.json()["error"]
                index = (await client.post("/v2/repository/index", json={})).json()
                assert [(i["name"], i["version"], i["state"]) for i in index] == [
                    ("m", "1", "UNAVAILABLE")
                ]
                assert "actor is gone" in index[0]["reason"]
                ready_only = await client.post("/v2/repository/index", json={"ready": True})
                assert ready_only.json() == []
                metrics = (await client.get("/metrics")).text
                assert re.search(r'trioinfer_instances\{[^}]*state="out"[^}]*\} 1\.0', metrics)
                failed = await client.post("/v2/models/m/infer", json=body)
                assert failed.status_code >= 500
                assert "is gone" in failed.json()["error"]
                # The server itself stays ready (as with a model that failed to load).
                assert (await client.get("/v2/health/ready")).status_code == 200
                loaded = await client.post("/v2/repository/models/m/load")
                assert loaded.status_code == 200, loaded.text
                assert (await client.get("/v2/models/m/ready")).status_code == 200
                assert (await client.post("/v2/models/m/infer", json=body)).status_code == 200
            stop.set()
