"""Fallbacks over HTTP: response parameters, 503 + Retry-After for CircuitOpen, metrics.

A repository of two copies of the bundled digits model, served in-process on
127.0.0.1 with real ONNX Runtime sessions wrapped in `FaultyBackend`, so that
the "GPU" instance of one model fails on purpose.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import trioinfer
from _serve import start_serving
from trioinfer.server import Listening
from trioinfer.testing import FaultyBackend
from trioinfer_onnxruntime import OnnxRuntimeBackend

CONFIG = """
name = "digits"
fallback = "resilient"

[[instances]]
device = "cuda:0"
capacity = 8

[[instances]]
device = "cpu"

[fallback_options]
attempts = 2
models = ["small"]

[fallback_options.breaker]
fail_max = 2
reset_timeout = 600.0
"""


def repository(root: Path) -> Path:
    source = trioinfer.example_repository() / "digits"
    shutil.copytree(source, root / "digits")
    (root / "digits" / "config.toml").write_text(CONFIG)
    shutil.copytree(source / "1", root / "small" / "3")
    return root


@asynccontextmanager
async def serving(
    root: Path, backend: FaultyBackend, failed: list[str] | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        listening: Listening = await start_serving(
            nursery, root, registry=backend.registry("onnxruntime"), shutdown=stop
        )
        if failed is not None:
            failed.extend(listening.failed)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            yield client
        stop.set()


def body(image: list[float]) -> dict[str, object]:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": image}]}


async def test_fallbacks_are_visible_to_http_clients_and_in_metrics(tmp_path: Path) -> None:
    images, _ = trioinfer.digits_samples()
    image = [float(v) for v in images[0].ravel()]
    # The "GPU" instance of every model fails permanently: only the CPU instance works.
    backend = FaultyBackend(
        OnnxRuntimeBackend(), devices=["cuda:0"], error_rate=1.0, transient=False
    )
    async with serving(repository(tmp_path), backend) as client:
        response = await client.post("/v2/models/digits/infer", json=body(image))
        assert response.status_code == 200
        parameters = response.json()["parameters"]
        assert parameters == {
            "trioinfer_served_by": "instance 1 (cpu)",
            "trioinfer_fallbacks": "failover instance 1 (cpu)",
        }
        # A second failure opens the GPU's breaker: the CPU then answers first hand,
        # and the response says nothing of fallbacks.
        await client.post("/v2/models/digits/infer", json=body(image))
        response = await client.post("/v2/models/digits/infer", json=body(image))
        assert "parameters" not in response.json()

        metrics = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families((await client.get("/metrics")).text)
            for sample in family.samples
        }

        def sample(name: str, **labels: str) -> float:
            return metrics[
                name, tuple(sorted({**labels, "model": "digits", "version": "1"}.items()))
            ]

        # Without a GPU here, the "GPU" instance reports the CPU it really runs on.
        out = [dict(labels) for name, labels in metrics if name == "trioinfer_instances"]
        (gpu,) = [labels["device"] for labels in out if labels["state"] == "out"]
        assert sample("trioinfer_instances", device=gpu, state="out") == 1
        assert sample("trioinfer_instances", device="cpu", state="serving") == 1
        assert sample("trioinfer_inference_fallbacks_total", kind="failover") == 2
        assert sample("trioinfer_instance_taken_out_total", instance="0", device=gpu) == 1
        assert sample("trioinfer_instance_taken_out_total", instance="1", device="cpu") == 0


async def test_with_every_instance_out_http_says_503_with_retry_after(tmp_path: Path) -> None:
    images, _ = trioinfer.digits_samples()
    image = [float(v) for v in images[0].ravel()]
    backend = FaultyBackend(OnnxRuntimeBackend(), error_rate=1.0, transient=False)
    root = repository(tmp_path)
    config = (root / "digits" / "config.toml").read_text()
    (root / "digits" / "config.toml").write_text(config.replace('["small"]', "[]"))
    async with serving(root, backend) as client:
        statuses = []
        for _ in range(3):
            response = await client.post("/v2/models/digits/infer", json=body(image))
            statuses.append(response.status_code)
        assert statuses == [500, 500, 503]  # each instance's breaker opens on its 2nd failure
        assert "every instance of model 'digits' (version 1) is out" in response.json()["error"]
        assert 590 <= int(response.headers["retry-after"]) <= 600


async def test_a_fallback_model_answers_with_its_name_in_the_parameters(tmp_path: Path) -> None:
    images, _ = trioinfer.digits_samples()
    image = [float(v) for v in images[0].ravel()]
    backend = FaultyBackend(
        OnnxRuntimeBackend(), devices=["cuda:0"], error_rate=1.0, transient=False
    )
    root = repository(tmp_path)
    config = (root / "digits" / "config.toml").read_text()
    # Both instances on the failing "GPU"; the model "small" (version 3) runs on the CPU.
    config = config.replace('device = "cpu"', 'device = "cuda:0"')
    (root / "digits" / "config.toml").write_text(config)
    async with serving(root, backend) as client:
        response = await client.post("/v2/models/digits/infer", json=body(image))
        assert response.status_code == 200, response.text
        parameters = response.json()["parameters"]
        assert parameters["trioinfer_served_by"] == "model small version 3, instance 0 (cpu)"
        # Without a GPU here, the "GPU" instances report the CPU they really run on.
        assert re.fullmatch(
            r"failover instance 1 \((cpu|cuda:0)\); model small version 3",
            parameters["trioinfer_fallbacks"],
        )


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ('["nowhere"]', "fallback model 'nowhere' of model 'digits' is not in the repository"),
        ('["small:x"]', "fallback model 'small:x' of model 'digits': the version after ':'"),
    ],
)
async def test_fallback_models_must_be_in_the_repository(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, models: str, message: str
) -> None:
    root = repository(tmp_path)
    config = (root / "digits" / "config.toml").read_text().replace('["small"]', models)
    (root / "digits" / "config.toml").write_text(config)
    failed: list[str] = []
    async with serving(root, FaultyBackend(OnnxRuntimeBackend()), failed) as client:
        assert failed == ["digits"]
        index = (await client.post("/v2/repository/index", json={})).json()
    (digits,) = [entry for entry in index if entry["name"] == "digits"]
    assert message in digits["reason"]
    assert message in caplog.text
