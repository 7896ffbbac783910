"""End to end: ``trioinfer serve`` in its own process, driven by real clients.

Every test here talks to a real server process on 127.0.0.1 (started with
``python -m trioinfer serve --port 0``) through NVIDIA's ``tritonclient`` (sync
and asyncio) or raw ``httpx``, and compares answers with ONNX Runtime or numpy
run in the test process. Three servers are started:

- ``main`` (module-scoped) serves a repository of every kind of model directory:
  the bundled ``digits``, a model with dynamic batching in ``config.toml`` (and a
  Triton ``config.pbtxt`` that must be ignored), one without ``config.toml``, one
  with two versions under ``version_policy = "all"``, an identity model per V2
  datatype, a deliberately slow model with a tiny queue, and a model that the
  hot-reload test rewrites.
- ``locked`` (module-scoped) has small request limits (``--config`` TOML with a
  ``[limits]`` table) and an admin token (``TRIOINFER_ADMIN_TOKEN``); the limit
  tests, the admin tests and the fuzz tests use it.
- The graceful-shutdown test starts and stops its own server.

The slow model runs ``y = x @ W**1000`` on one thread, about 5 ms a row. Tests
that need "a request still queued" or "a request still running" occupy its only
instance with a *blocker*: a request of a few thousand rows sent from a raw
socket, which the test abandons (closes) when done, so that the server aborts it.
Nothing is timed: the tests wait for states the server reports (``/metrics``),
with generous limits only against hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import gzip
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tritonclient.utils import InferenceServerException

from _serve import POLL_S, STOP_S, WAIT_S, log_tail, serve_process, wait_until
from _triton_config import own_setting
from trioinfer import digits_samples, example_repository
from trioinfer.testing import models

HOST = "127.0.0.1"
#: How long to watch for a server closing a connection it said it would keep.
LINGER_S = 2.0

ADMIN_TOKEN = "s3cret-token"  # a test fixture, not a credential

#: Every V2 datatype but BF16 (numpy has no bfloat16), as the identity models hold it.
V2_TYPES: dict[str, npt.DTypeLike] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}

SLOW_WIDTH = 512
#: Rows of a blocker request: seconds of work on one thread, aborted when abandoned.
BLOCKER_ROWS = 2048

ADD_CONFIG = """\
# Dynamic batching: requests arriving together run as one batch.
batcher = "dynamic"
batcher_options = { max_batch_size = 16, max_queue_delay = 0.002 }
"""
TRITON_PBTXT = """\
name: "add"
platform: "onnxruntime_onnx"
max_batch_size: 99
dynamic_batching { max_queue_delay_microseconds: 100 }
"""
SLOW_CONFIG = """\
# One instance on one thread, and room for two waiting requests.
max_queue_size = 2

[[instances]]
device = "cpu"
count = 1
threads = 1
"""
LOCKED_CONFIG = """\
[limits]
max_body_bytes = 65536
max_elements_per_tensor = 4096
max_json_depth = 16
"""


# -- running a server ------------------------------------------------------------------


@attrs.frozen
class Server:
    """A ``trioinfer serve`` process and where it listens."""

    url: str
    process: subprocess.Popen[str]
    log: Path
    repository: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        """``host:port``, as tritonclient takes it."""
        return self.url.removeprefix("http://")

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log, chars)


@contextlib.contextmanager
def run_server(
    repository: Path,
    *args: str,
    log: Path,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """Start ``trioinfer serve`` on a free port; on exit SIGTERM it and require exit code 0.

    The process is killed if anything goes wrong, so none is ever left behind.
    """
    command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0"]
    command += ["--model-repository", str(repository), "--log-level", "info", *args]
    with serve_process(command, log=log, env=env) as started:
        yield Server(started.url, started.process, log, repository)


# -- building the repositories ---------------------------------------------------------


def write_binary_op(path: Path, op: str) -> None:
    """Write ``out = a <op> b`` over float32[batch, 4], replacing *path* atomically."""
    spec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in "ab"]
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["out"], name="op")],
        "binary_op",
        inputs=spec,
        outputs=[helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9, doc_string=op
    )
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A new file renamed over the old: a reader never sees half a model.
    temporary = path.with_name(path.name + ".tmp")
    onnx.save_model(model, temporary)
    os.replace(temporary, path)


def write_slow_model(root: Path) -> None:
    models.write_slow(root / "slow" / "1" / "model.onnx", width=SLOW_WIDTH)
    (root / "slow" / "config.toml").write_text(SLOW_CONFIG, encoding="utf-8")


@pytest.fixture(scope="module")
def main_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    shutil.copytree(example_repository() / "digits", root / "digits")
    # config.toml with dynamic batching, beside a Triton config.pbtxt that says otherwise.
    models.write_add(root / "add" / "1" / "model.onnx")
    (root / "add" / "config.toml").write_text(ADD_CONFIG, encoding="utf-8")
    (root / "add" / "config.pbtxt").write_text(TRITON_PBTXT, encoding="utf-8")
    # No config at all (a model with only config.pbtxt is tested in test_triton_config.py).
    models.write_mlp(root / "mlp" / "1" / "model.onnx", (8, 16, 3))
    # Two versions, both served; they compute different things.
    models.write_mlp(root / "versioned" / "1" / "model.onnx", (4, 3), seed=1)
    models.write_mlp(root / "versioned" / "2" / "model.onnx", (4, 3), seed=2)
    (root / "versioned" / "config.toml").write_text('version_policy = "all"\n', encoding="utf-8")
    for name, dtype in V2_TYPES.items():
        models.write_identity(
            root / f"identity_{name.lower()}" / "1" / "model.onnx", dtype=dtype, shape=("batch", 3)
        )
    write_slow_model(root)
    write_binary_op(root / "reload" / "1" / "model.onnx", "Add")
    (root / "reload" / "config.toml").write_text("max_queue_size = 100\n", encoding="utf-8")
    # Used by the metrics test only, so that its counts are exactly what it sent.
    models.write_mlp(root / "counted" / "1" / "model.onnx", (4, 2), seed=3)
    return root


@pytest.fixture(scope="module")
def main(main_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "main.log"
    with run_server(main_repository, log=log) as server:
        yield server


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Small limits from a --config file and an admin token from the environment."""
    base = tmp_path_factory.mktemp("locked")
    root = base / "repository"
    shutil.copytree(example_repository() / "digits", root / "digits")
    models.write_add(root / "add" / "1" / "model.onnx")
    config = base / "server.toml"
    config.write_text(LOCKED_CONFIG, encoding="utf-8")
    log = base / "server.log"
    with run_server(
        root, "--config", str(config), log=log, env={"TRIOINFER_ADMIN_TOKEN": ADMIN_TOKEN}
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(main: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=main.url, timeout=WAIT_S) as client:
        yield client


@pytest.fixture(scope="module")
def locked_http(locked: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=locked.url, timeout=WAIT_S) as client:
        yield client


@pytest.fixture(scope="module")
def client(main: Server) -> Iterator[triton.InferenceServerClient]:
    with contextlib.closing(triton.InferenceServerClient(main.address)) as out:
        yield out


@functools.cache
def session(path: Path) -> ort.InferenceSession:
    """ONNX Runtime in the test process, to check the server's answers against."""
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", autouse=True)
def _close_local_sessions() -> Iterator[None]:
    # Other test modules count the InferenceSessions alive in this process.
    yield
    session.cache_clear()


def run_locally(path: Path, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, Any]:
    sess = session(path)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, dict(inputs)), strict=True))


@pytest.fixture(scope="module")
def images() -> npt.NDArray[np.float32]:
    return digits_samples()[0]


# -- request helpers ---------------------------------------------------------------------


def v2_input(name: str, array: npt.ArrayLike, datatype: str = "FP32") -> dict[str, Any]:
    values = np.asarray(array)
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(values.shape),
        "data": values.ravel().tolist(),
    }


def add_doc(rows: int = 1, **extra: Any) -> dict[str, Any]:
    """A valid infer request for the ``add`` model (inputs a and b, float32[rows, 4])."""
    a = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return {"inputs": [v2_input("a", a), v2_input("b", a * 10)], **extra}


def add_body(**extra: Any) -> bytes:
    return json.dumps(add_doc(**extra)).encode()


def binary_body(
    inputs: Sequence[tuple[str, npt.NDArray[Any], str]], **extra: Any
) -> tuple[bytes, dict[str, str]]:
    """An infer request with every input as binary data, and its header."""
    doc: dict[str, Any] = {"inputs": [], **extra}
    blobs = []
    for name, array, datatype in inputs:
        blob = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        doc["inputs"].append(
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(blob)},
            }
        )
        blobs.append(blob)
    header = json.dumps(doc).encode()
    return header + b"".join(blobs), {"Inference-Header-Content-Length": str(len(header))}


def split_binary_response(response: httpx.Response) -> tuple[dict[str, Any], bytes]:
    length = int(response.headers["inference-header-content-length"])
    return json.loads(response.content[:length]), response.content[length:]


def error_of(response: httpx.Response) -> str:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"], str), body
    assert body["error"], body
    return str(body["error"])


def raw_post(port: int, path: str, body: bytes, headers: Mapping[str, str]) -> socket.socket:
    """Send a POST from a bare socket and return the socket, without reading the answer."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock = socket.create_connection((HOST, port), timeout=WAIT_S)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


# -- metrics and statistics ------------------------------------------------------------


def scrape(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def samples(families: Mapping[str, Any], sample_name: str, **labels: str) -> list[Sample]:
    family_name = re.sub(r"(_total|_count|_sum|_bucket)$", "", sample_name)
    family = families[family_name]
    return [
        s
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(families: Mapping[str, Any], sample_name: str, **labels: str) -> float:
    """The one sample's value; 0 when there is none (a counter never incremented)."""
    found = samples(families, sample_name, **labels)
    assert len(found) <= 1, found
    return found[0].value if found else 0.0


@attrs.frozen
class SlowState:
    pending: int
    queued: int
    executions: int
    cancelled: int


def slow_state(client: httpx.Client) -> SlowState:
    families = scrape(client)
    labels = {"model": "slow", "version": "1"}
    return SlowState(
        pending=int(value(families, "trioinfer_inference_pending", **labels)),
        queued=int(value(families, "trioinfer_inference_queue_depth", **labels)),
        executions=int(value(families, "trioinfer_inference_executions_total", **labels)),
        cancelled=int(
            value(families, "trioinfer_inference_requests_total", outcome="cancelled", **labels)
        ),
    )


def model_stats(client: httpx.Client, model: str) -> dict[str, Any]:
    response = client.get(f"/v2/models/{model}/stats")
    assert response.status_code == 200, response.text
    (stats,) = response.json()["model_stats"]
    return dict(stats)


@attrs.define
class Blocker:
    """A long request occupying the slow model's only instance, from a socket we control."""

    sock: socket.socket

    def release(self) -> None:
        """Hang up: the server withdraws the request and aborts its execution."""
        self.sock.close()


@contextlib.contextmanager
def blocker(server: Server, client: httpx.Client) -> Iterator[Blocker]:
    """Occupy the slow model until the block ends; the next requests must queue."""
    before = slow_state(client)
    assert before.pending == 0, before
    rows = np.ones((BLOCKER_ROWS, SLOW_WIDTH), dtype=np.float32)
    body, headers = binary_body([("x", rows, "FP32")])
    held = Blocker(raw_post(server.port, "/v2/models/slow/infer", body, headers))
    try:

        def running() -> bool:
            now = slow_state(client)
            return (now.executions, now.pending, now.queued) == (before.executions + 1, 1, 0)

        wait_until(running, "the blocker runs on the slow model")
        yield held
    finally:
        held.release()
    wait_until(lambda: slow_state(client).pending == 0, "the slow model is idle again")


def slow_doc(rows: int = 1, **extra: Any) -> dict[str, Any]:
    return {"inputs": [v2_input("x", np.ones((rows, SLOW_WIDTH), np.float32))], **extra}


# == health and metadata (tritonclient) ================================================


def test_serve_freezes_start_up_objects_for_the_garbage_collector(main: Server) -> None:
    assert re.search(
        r"garbage collector: [1-9]\d* objects from start-up frozen; first threshold 5000",
        main.log.read_text(encoding="utf-8", errors="replace"),
    ), main.log_tail()


def test_health_and_server_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "trioinfer"
    assert metadata["version"]
    # Triton lists the extensions it serves; a client may check for sequence or logging.
    extensions = set(metadata["extensions"])
    assert {"binary_tensor_data", "model_repository", "statistics"} <= extensions
    assert {"logging", "sequence"} <= extensions


def test_model_metadata(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("digits")
    assert metadata == {
        "name": "digits",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
            {"name": "label", "datatype": "INT64", "shape": [-1]},
        ],
    }
    assert client.get_model_metadata("versioned")["versions"] == ["1", "2"]
    assert client.get_model_metadata("versioned", "1")["versions"] == ["1"]


#: What Triton prints of a ModelInput that leaves its other fields unset.
INPUT_DEFAULTS = {
    "format": "FORMAT_NONE",
    "is_shape_tensor": False,
    "allow_ragged_batch": False,
    "optional": False,
}


def test_model_config_comes_from_config_toml_not_pbtxt(
    client: triton.InferenceServerClient,
) -> None:
    config = client.get_model_config("add")
    assert config["name"] == "add"
    assert config["backend"] == "onnxruntime"
    assert config["platform"] == "onnxruntime_onnx"
    # config.toml's dynamic batching, not config.pbtxt's max_batch_size: 99.
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["input"] == [
        {"name": "a", "data_type": "TYPE_FP32", "dims": [4], **INPUT_DEFAULTS},
        {"name": "b", "data_type": "TYPE_FP32", "dims": [4], **INPUT_DEFAULTS},
    ]
    assert own_setting(config, "batcher") == "dynamic"


def test_model_without_config_toml_gets_defaults(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config("mlp")
    assert config["max_batch_size"] == 0
    assert "dynamic_batching" not in config
    # As Triton prints it: every field of the message, at its default when unset.
    assert config["input"] == [
        {"name": "input", "data_type": "TYPE_FP32", "dims": [-1, 8], **INPUT_DEFAULTS}
    ]
    assert config["output"] == [
        {
            "name": "output",
            "data_type": "TYPE_FP32",
            "dims": [-1, 3],
            "label_filename": "",
            "is_shape_tensor": False,
        }
    ]
    assert own_setting(config, "batcher") == "none"
    assert config["instance_group"] == [
        {
            "name": "mlp_0",
            "kind": "KIND_CPU",
            "count": 1,
            "gpus": [],
            "profile": [],
            "passive": False,
            "host_policy": "",
        }
    ]


def test_model_readiness(client: triton.InferenceServerClient) -> None:
    assert client.is_model_ready("digits")
    assert client.is_model_ready("versioned", "1")
    assert client.is_model_ready("versioned", "2")
    assert not client.is_model_ready("versioned", "3")
    assert not client.is_model_ready("no-such-model")


# == inference (tritonclient, sync) =====================================================


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_digits_matches_onnxruntime(
    client: triton.InferenceServerClient,
    main_repository: Path,
    images: npt.NDArray[np.float32],
    binary: bool,
) -> None:
    batch = images[:16]
    given = triton.InferInput("input", list(batch.shape), "FP32")
    given.set_data_from_numpy(batch, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput("probabilities", binary_data=binary),
        triton.InferRequestedOutput("label", binary_data=binary),
    ]
    result = client.infer("digits", [given], outputs=outputs)
    expected = run_locally(main_repository / "digits" / "1" / "model.onnx", {"input": batch})
    probabilities = result.as_numpy("probabilities")
    assert probabilities.dtype == np.float32
    np.testing.assert_allclose(probabilities, expected["probabilities"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("label"), expected["label"])
    response = result.get_response()
    assert response["model_name"] == "digits"
    assert response["model_version"] == "1"
    for output in response["outputs"]:
        assert ("binary_data_size" in output.get("parameters", {})) is binary


def test_infer_output_subset_mixed_encodings_and_request_id(
    client: triton.InferenceServerClient, main_repository: Path, images: npt.NDArray[np.float32]
) -> None:
    batch = images[20:23]
    given = triton.InferInput("input", list(batch.shape), "FP32")
    given.set_data_from_numpy(batch, binary_data=True)
    expected = run_locally(main_repository / "digits" / "1" / "model.onnx", {"input": batch})

    only_label = client.infer(
        "digits",
        [given],
        outputs=[triton.InferRequestedOutput("label", binary_data=False)],
        request_id="req-42",
    )
    assert only_label.as_numpy("probabilities") is None
    np.testing.assert_array_equal(only_label.as_numpy("label"), expected["label"])
    assert only_label.get_response()["id"] == "req-42"
    assert [o["name"] for o in only_label.get_response()["outputs"]] == ["label"]

    mixed = client.infer(
        "digits",
        [given],
        outputs=[
            triton.InferRequestedOutput("label", binary_data=True),
            triton.InferRequestedOutput("probabilities", binary_data=False),
        ],
    )
    names = [o["name"] for o in mixed.get_response()["outputs"]]
    assert names == ["label", "probabilities"], "outputs come in the order asked"
    np.testing.assert_array_equal(mixed.as_numpy("label"), expected["label"])
    np.testing.assert_allclose(
        mixed.as_numpy("probabilities"), expected["probabilities"], rtol=1e-5, atol=1e-6
    )


def test_infer_with_compressed_request_and_response(
    client: triton.InferenceServerClient, images: npt.NDArray[np.float32]
) -> None:
    batch = images[:4]
    given = triton.InferInput("input", list(batch.shape), "FP32")
    given.set_data_from_numpy(batch, binary_data=False)
    plain = client.infer("digits", [given]).as_numpy("label")
    for algorithm in ("gzip", "deflate"):
        result = client.infer("digits", [given], request_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("label"), plain)


def test_infer_specific_versions(
    client: triton.InferenceServerClient, main_repository: Path
) -> None:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    answers = {}
    for version in ("1", "2"):
        given = triton.InferInput("input", [3, 4], "FP32")
        given.set_data_from_numpy(x)
        result = client.infer("versioned", [given], model_version=version)
        assert result.get_response()["model_version"] == version
        expected = run_locally(
            main_repository / "versioned" / version / "model.onnx", {"input": x}
        )["output"]
        np.testing.assert_allclose(result.as_numpy("output"), expected, rtol=1e-5, atol=1e-6)
        answers[version] = result.as_numpy("output")
    assert not np.allclose(answers["1"], answers["2"]), "the two versions must differ"
    # Without a version: the highest one.
    given = triton.InferInput("input", [3, 4], "FP32")
    given.set_data_from_numpy(x)
    latest = client.infer("versioned", [given])
    assert latest.get_response()["model_version"] == "2"
    np.testing.assert_array_equal(latest.as_numpy("output"), answers["2"])


def datatype_values(datatype: str) -> npt.NDArray[Any]:
    """Two rows of three values of *datatype*, reaching its extremes."""
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype == "BYTES":
        return np.array([[b"", b"hello", "h\u00e9\u2603".encode()], [b"a b", b"{}", b"x" * 100]])
    dtype = np.dtype(V2_TYPES[datatype])
    if dtype.kind == "f":
        info = np.finfo(dtype)
        return np.array([[info.min, info.max, 0.0], [1.1, -2.5, info.tiny]], dtype=dtype)
    info_i = np.iinfo(dtype)
    return np.array([[info_i.min, info_i.max, 0], [1, 2, 3]], dtype=dtype)


def test_an_integer_wider_than_64_bits_is_a_400(http: httpx.Client) -> None:
    # orjson reads 2**70 as a float: the answer says what was wrong with the number
    # sent, not with a float the client never wrote.
    body = (
        b'{"inputs":[{"name":"x","shape":[1,3],"datatype":"INT64",'
        b'"data":[1,2,1180591620717411303424]}]}'
    )
    response = http.post("/v2/models/identity_int64/infer", content=body)
    assert response.status_code == 400
    assert error_of(response) == (
        "input 'x': INT64 data must be integers from -9223372036854775808 to "
        "9223372036854775807; got a number past the 64-bit range (about 1.18059e+21)"
    )
    edges = {"name": "x", "shape": [1, 3], "datatype": "INT64", "data": [-(2**63), 2**63 - 1, 0]}
    response = http.post("/v2/models/identity_int64/infer", json={"inputs": [edges]})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [-(2**63), 2**63 - 1, 0]
    top = {"name": "x", "shape": [1, 3], "datatype": "UINT64", "data": [2**64 - 1, 0, 1]}
    response = http.post("/v2/models/identity_uint64/infer", json={"inputs": [top]})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2**64 - 1, 0, 1]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(V2_TYPES))
def test_every_datatype_round_trips(
    client: triton.InferenceServerClient, datatype: str, binary: bool
) -> None:
    model = f"identity_{datatype.lower()}"
    metadata = client.get_model_metadata(model)
    assert metadata["inputs"] == [{"name": "x", "datatype": datatype, "shape": [-1, 3]}]
    assert metadata["outputs"] == [{"name": "y", "datatype": datatype, "shape": [-1, 3]}]
    values = datatype_values(datatype)
    given = triton.InferInput("x", list(values.shape), datatype)
    given.set_data_from_numpy(values, binary_data=binary)
    result = client.infer(
        model, [given], outputs=[triton.InferRequestedOutput("y", binary_data=binary)]
    )
    (output,) = result.get_response()["outputs"]
    assert output["datatype"] == datatype
    assert output["shape"] == [2, 3]
    got = result.as_numpy("y")
    if datatype == "BYTES":
        # tritonclient gives str for JSON and bytes for binary BYTES elements.
        as_bytes = [v if isinstance(v, bytes) else v.encode() for v in got.ravel()]
        assert as_bytes == list(values.ravel())
    else:
        assert got.dtype == values.dtype
        np.testing.assert_array_equal(got, values)


def test_binary_floats_keep_nan_and_infinity(client: triton.InferenceServerClient) -> None:
    values = np.array([[np.nan, np.inf, -np.inf], [0.0, -0.0, 1.0]], dtype=np.float32)
    given = triton.InferInput("x", [2, 3], "FP32")
    given.set_data_from_numpy(values, binary_data=True)
    result = client.infer(
        "identity_fp32", [given], outputs=[triton.InferRequestedOutput("y", binary_data=True)]
    )
    np.testing.assert_array_equal(result.as_numpy("y"), values)


def test_inference_statistics(client: triton.InferenceServerClient) -> None:
    before = client.get_inference_statistics("versioned", "1")["model_stats"][0]
    given = triton.InferInput("input", [5, 4], "FP32")
    given.set_data_from_numpy(np.ones((5, 4), np.float32))
    client.infer("versioned", [given], model_version="1")
    statistics = client.get_inference_statistics("versioned", "1")
    (after,) = statistics["model_stats"]
    assert (after["name"], after["version"]) == ("versioned", "1")
    assert after["inference_count"] - before["inference_count"] == 5
    assert after["execution_count"] - before["execution_count"] == 1
    success = after["inference_stats"]["success"]
    assert success["count"] - before["inference_stats"]["success"]["count"] == 1
    assert success["ns"] > before["inference_stats"]["success"]["ns"]
    assert after["last_inference"] > 0
    both = client.get_inference_statistics("versioned")["model_stats"]
    assert [(s["name"], s["version"]) for s in both] == [("versioned", "1"), ("versioned", "2")]
    everything = client.get_inference_statistics()["model_stats"]
    assert {"digits", "add", "mlp", "slow"} <= {s["name"] for s in everything}


def test_repository_index(client: triton.InferenceServerClient, http: httpx.Client) -> None:
    index = client.get_model_repository_index()
    rows = {(row["name"], row.get("version")): row for row in index}
    assert rows["versioned", "1"]["state"] == "READY"
    assert rows["versioned", "2"]["state"] == "READY"
    assert rows["digits", "1"]["state"] == "READY"
    assert rows["mlp", "1"]["state"] == "READY"
    assert all(name != "config.pbtxt" for name, _ in rows)
    ready_only = http.post("/v2/repository/index", json={"ready": True})
    assert ready_only.status_code == 200
    assert all(row["state"] == "READY" for row in ready_only.json())


def test_unload_and_load(client: triton.InferenceServerClient) -> None:
    given = triton.InferInput("input", [1, 8], "FP32")
    given.set_data_from_numpy(np.ones((1, 8), np.float32))
    client.unload_model("mlp")
    try:
        assert not client.is_model_ready("mlp")
        index = {row["name"]: row for row in client.get_model_repository_index()}
        assert index["mlp"]["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp", [given])
        assert caught.value.status() == "404"
    finally:
        client.load_model("mlp")
    assert client.is_model_ready("mlp")
    assert client.infer("mlp", [given]).as_numpy("output").shape == (1, 3)


def test_load_with_config_override(client: triton.InferenceServerClient) -> None:
    override = {
        "batcher": "dynamic",
        "batcher_options": {"max_batch_size": 8, "max_queue_delay": 0.001},
        "max_queue_size": 7,
    }
    client.load_model("mlp", config=json.dumps(override))
    try:
        config = client.get_model_config("mlp")
        assert config["max_batch_size"] == 8
        assert own_setting(config, "max_queue_size") == 7
        given = triton.InferInput("input", [2, 8], "FP32")
        given.set_data_from_numpy(np.ones((2, 8), np.float32))
        assert client.infer("mlp", [given]).as_numpy("output").shape == (2, 3)
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("mlp", config=json.dumps({"no_such_key": 1}))
        assert caught.value.status() == "400"
        assert "no_such_key" in caught.value.message()
        # A count past the bound is refused before any instance is made.
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("mlp", config=json.dumps({"instances": [{"count": 100_000}]}))
        assert caught.value.status() == "400"
        assert "count 100000 is more than a model may have: at most 256" in caught.value.message()
        # A failed load leaves the served version as it was.
        assert own_setting(client.get_model_config("mlp"), "max_queue_size") == 7
    finally:
        client.load_model("mlp")  # back to the repository's (default) configuration
    assert client.get_model_config("mlp")["max_batch_size"] == 0


# == asyncio client ========================================================================


def test_aio_client_concurrent_requests(
    main: Server, main_repository: Path, images: npt.NDArray[np.float32], http: httpx.Client
) -> None:
    digits_file = main_repository / "digits" / "1" / "model.onnx"
    add_before = model_stats(http, "add")

    async def digits(client: triton_aio.InferenceServerClient, i: int) -> None:
        batch = images[i : i + 1 + i % 4]
        given = triton_aio.InferInput("input", list(batch.shape), "FP32")
        given.set_data_from_numpy(batch, binary_data=i % 2 == 0)
        result = await client.infer("digits", [given], request_id=f"digits-{i}")
        assert result.get_response()["id"] == f"digits-{i}"
        expected = run_locally(digits_file, {"input": batch})
        np.testing.assert_array_equal(result.as_numpy("label"), expected["label"])
        np.testing.assert_allclose(
            result.as_numpy("probabilities"), expected["probabilities"], rtol=1e-5, atol=1e-6
        )

    async def add(client: triton_aio.InferenceServerClient, i: int) -> None:
        a = np.full((1, 4), i, np.float32)
        b = np.arange(4, dtype=np.float32).reshape(1, 4)
        inputs = [triton_aio.InferInput(n, [1, 4], "FP32") for n in "ab"]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = await client.infer("add", inputs)
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)

    async def scenario() -> None:
        client = triton_aio.InferenceServerClient(main.address)
        try:
            assert await client.is_server_live()
            assert await client.is_server_ready()
            assert (await client.get_server_metadata())["name"] == "trioinfer"
            metadata = await client.get_model_metadata("digits")
            assert [i["name"] for i in metadata["inputs"]] == ["input"]
            assert await client.is_model_ready("add")
            await asyncio.gather(
                *(digits(client, i) for i in range(64)), *(add(client, i) for i in range(64))
            )
        finally:
            await client.close()

    asyncio.run(scenario())
    add_after = model_stats(http, "add")
    assert add_after["inference_count"] - add_before["inference_count"] == 64
    # With dynamic batching, 64 concurrent requests take at most 64 executions.
    assert 1 <= add_after["execution_count"] - add_before["execution_count"] <= 64


# == errors (raw httpx) ======================================================================


def j(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def with_inputs(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return j({"inputs": list(inputs), **extra})


A = v2_input("a", [[1, 2, 3, 4]])
B = v2_input("b", [[5, 6, 7, 8]])
_HEADER = j({"inputs": [{**A, "data": None}]})


def _binary_add(size: int, blob: bytes) -> tuple[bytes, dict[str, str]]:
    header = j(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [1, 4]}
                | {"parameters": {"binary_data_size": size}},
                B,
            ]
        }
    )
    return header + blob, {"Inference-Header-Content-Length": str(len(header))}


_FOUR_FLOATS = np.arange(4, dtype="<f4").tobytes()

BAD_REQUESTS = [
    pytest.param("/v2/models/nope/infer", add_body(), {}, 404, "'nope'", id="unknown-model-infer"),
    pytest.param(
        "/v2/models/add/versions/9/infer", add_body(), {}, 404, "version '9'", id="unknown-version"
    ),
    pytest.param(
        "/v2/models/add/versions/one/infer",
        add_body(),
        {},
        404,
        "version 'one'",
        id="non-numeric-version",
    ),
    pytest.param(
        "/v2/models/add/infer", b'{"inputs": [', {}, 400, "not valid JSON", id="malformed-json"
    ),
    pytest.param("/v2/models/add/infer", b"", {}, 400, "empty", id="empty-body"),
    pytest.param("/v2/models/add/infer", j([1, 2]), {}, 400, "JSON object", id="json-not-object"),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "datatype": "INT32"}, B),
        {},
        400,
        "'a'",
        id="wrong-dtype",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "datatype": "FLOAT"}, B),
        {},
        400,
        "'datatype'",
        id="unknown-datatype",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "data": [1, 2, 3]}, B),
        {},
        400,
        "3 values",
        id="shape-vs-data-length",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs(v2_input("a", [[1, 2, 3, 4, 5]]), v2_input("b", [[1, 2, 3, 4, 5]])),
        {},
        400,
        "dimension 1",
        id="shape-vs-model",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "shape": [1, -4]}, B),
        {},
        400,
        "'shape'",
        id="negative-shape",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "data": ["1", "2", "3", "4"]}, B),
        {},
        400,
        "numbers",
        id="non-numeric-data",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "data": [1, True, 3, 4]}, B),
        {},
        400,
        "true",
        id="bool-in-numeric-data",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "data": [1, None, 3, 4]}, B),
        {},
        400,
        "'a'",
        id="null-in-data",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs(A, B, v2_input("c", [[1, 2, 3, 4]])),
        {},
        400,
        "'c'",
        id="unknown-input",
    ),
    pytest.param("/v2/models/add/infer", with_inputs(A), {}, 400, "'b'", id="missing-input"),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs(A, A, B),
        {},
        400,
        "more than once",
        id="duplicate-input",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs(A, B, outputs=[{"name": "product"}]),
        {},
        400,
        "'product'",
        id="unknown-output",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs(A, B, outputs=[{"name": "sum"}, {"name": "sum"}]),
        {},
        400,
        "more than once",
        id="duplicate-output",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(),
        {"Inference-Header-Content-Length": "abc"},
        400,
        "Inference-Header-Content-Length",
        id="header-length-not-a-number",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(),
        {"Inference-Header-Content-Length": "-1"},
        400,
        "Inference-Header-Content-Length",
        id="header-length-negative",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(),
        {"Inference-Header-Content-Length": "999999"},
        400,
        "Inference-Header-Content-Length",
        id="header-length-past-body",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(),
        {"Inference-Header-Content-Length": "10"},
        400,
        "not valid JSON",
        id="header-length-cuts-json",
    ),
    pytest.param(
        "/v2/models/add/infer",
        *_binary_add(15, _FOUR_FLOATS[:15]),
        400,
        "binary_data_size",
        id="binary-size-vs-shape",
    ),
    pytest.param(
        "/v2/models/add/infer",
        *_binary_add(16, _FOUR_FLOATS[:12]),
        400,
        "binary_data_size 16",
        id="binary-data-short",
    ),
    pytest.param(
        "/v2/models/add/infer",
        *_binary_add(16, _FOUR_FLOATS + b"junk"),
        400,
        "4 bytes follow",
        id="binary-data-long",
    ),
    pytest.param(
        "/v2/models/add/infer",
        _binary_add(16, b"")[0],
        {},
        400,
        "Inference-Header-Content-Length",
        id="binary-without-header-length",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(parameters={"priority": "high"}),
        {},
        400,
        "priority",
        id="priority-string",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(parameters={"priority": 1.5}),
        {},
        400,
        "priority",
        id="priority-float",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(parameters={"priority": 3_000_000_000}),
        {},
        400,
        "must be an integer from -2**31 to 2**31, got 3000000000",
        id="priority-out-of-range",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(parameters={"timeout": -5}),
        {},
        400,
        "timeout",
        id="timeout-negative",
    ),
    pytest.param(
        "/v2/models/add/infer",
        with_inputs({**A, "shape": [2**40, 16], "data": list(range(16))}, B),
        {},
        400,
        "elements",
        id="huge-declared-shape",
    ),
    pytest.param(
        "/v2/models/add/infer",
        add_body(),
        {"Content-Encoding": "br"},
        415,
        "Content-Encoding",
        id="brotli",
    ),
    pytest.param(
        "/v2/models/add/infer",
        gzip.compress(gzip.compress(add_body())),
        {"Content-Encoding": "gzip, gzip"},
        415,
        "Content-Encoding",
        id="two-codings",
    ),
    pytest.param(
        "/v2/models/add/infer",
        b"\x1f\x8b not really gzip",
        {"Content-Encoding": "gzip"},
        400,
        "gzip",
        id="corrupt-gzip",
    ),
    pytest.param(
        "/v2/models/add/infer",
        gzip.compress(add_body())[:-8],
        {"Content-Encoding": "gzip"},
        400,
        "truncated",
        id="truncated-gzip",
    ),
    pytest.param(
        "/v2/repository/models/mlp/load",
        j({"parameters": {"config": "{not json"}}),
        {},
        400,
        "not valid JSON",
        id="load-config-not-json",
    ),
    pytest.param(
        "/v2/repository/models/nope/load", b"", {}, 404, "'nope'", id="load-unknown-model"
    ),
    pytest.param(
        "/v2/repository/models/mlp/load",
        j({"parameters": {"config": 5}}),
        {},
        400,
        "parameters.config",
        id="load-config-not-object",
    ),
    pytest.param(
        "/v2/repository/models/mlp/load",
        j({"parameters": {"config": json.dumps({"name": "other"})}}),
        {},
        400,
        "'name'",
        id="load-config-sets-name",
    ),
    pytest.param(
        "/v2/repository/models/mlp/load",
        j({"parameters": {"file:1/model.onnx": "AAAA"}}),
        {},
        400,
        "not supported",
        id="load-file-upload",
    ),
    pytest.param(
        "/v2/repository/models/mlp/unload",
        j({"parameters": {"force": True}}),
        {},
        400,
        "unload_dependents",
        id="unload-unknown-parameter",
    ),
    pytest.param(
        "/v2/repository/index", j({"ready": "yes"}), {}, 400, "'ready'", id="index-ready-not-bool"
    ),
]


@pytest.mark.parametrize(("path", "body", "headers", "status", "fragment"), BAD_REQUESTS)
def test_bad_request(
    http: httpx.Client,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    fragment: str,
) -> None:
    response = http.post(path, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert fragment in error_of(response)


def test_unknown_model_and_version_metadata_is_404(http: httpx.Client) -> None:
    for path in (
        "/v2/models/nope",
        "/v2/models/nope/ready",
        "/v2/models/nope/config",
        "/v2/models/nope/stats",
        "/v2/models/add/versions/7",
        "/v2/models/add/versions/7/config",
    ):
        response = http.get(path)
        assert response.status_code == 404, path
        assert "add" in error_of(response) or "nope" in error_of(response)
    # A model the repository holds, in a version it does not serve, is "not ready": 400.
    response = http.get("/v2/models/add/versions/7/ready")
    assert response.status_code == 400
    assert "not ready" in error_of(response)


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    missing = http.get("/v3/everything")
    assert missing.status_code == 404
    # Starlette's "Not Found" said neither what was wrong nor where the endpoints are.
    message = error_of(missing)
    assert message.startswith("no endpoint GET /v3/everything; "), message
    # A few of them: it said "the KServe V2 endpoints are", leaving out generate, the
    # repository's load and unload, traffic, shared memory, trace and log settings.
    assert "the main endpoints are GET /v2 " in message
    assert "'HTTP server' lists them all" in message
    assert "/v2/health/ready" in message
    assert "POST /v2/repository/index" in message  # what GET /v2/models is guessed for
    assert "/v2/models/add" not in error_of(http.get("/v2/models"))
    # The 405 says which method the route takes, in the JSON body and in Allow (sorted:
    # Starlette's own lists a set, in an order that changes between runs).
    for method, path, allow, message in (
        (
            "GET",
            "/v2/models/add/infer",
            "POST",
            "POST /v2/models/add/infer: method GET not allowed; use POST",
        ),
        (
            "GET",
            "/v2/models/add/versions/1/infer",
            "POST",
            "POST /v2/models/add/versions/1/infer: method GET not allowed; use POST",
        ),
        (
            "DELETE",
            "/v2/health/live",
            "GET, HEAD",
            "GET /v2/health/live: method DELETE not allowed; use GET",
        ),
        (
            "PUT",
            "/v2/repository/models/add/load",
            "POST",
            "POST /v2/repository/models/add/load: method PUT not allowed; use POST",
        ),
        ("POST", "/metrics", "GET, HEAD", "GET /metrics: method POST not allowed; use GET"),
        (
            "PUT",
            "/v2/logging",
            "GET, HEAD, POST",
            "GET/POST /v2/logging: method PUT not allowed; use GET or POST",
        ),
    ):
        response = http.request(method, path)
        assert response.status_code == 405, (method, path)
        assert response.headers["allow"] == allow, (method, path)
        assert error_of(response) == message


def test_nesting_too_deep_is_400(http: httpx.Client, locked_http: httpx.Client) -> None:
    deep: Any = 1.0
    for _ in range(40):
        deep = [deep]
    # Nested past max_json_depth in `data`, in parameters, and past orjson's own limit.
    for client in (http, locked_http):
        data = with_inputs({**A, "data": deep}, B)
        response = client.post("/v2/models/add/infer", content=data)
        assert response.status_code == 400
        assert "deep" in error_of(response)
        response = client.post("/v2/models/add/infer", content=add_body(parameters={"x": deep}))
        assert response.status_code == 400
        assert "deep" in error_of(response)
    bottomless = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = http.post("/v2/models/add/infer", content=bottomless)
    assert response.status_code == 400
    assert "not valid JSON" in error_of(response)


def test_encodings_and_content_types_that_are_accepted(http: httpx.Client) -> None:
    expected = np.arange(4, dtype=np.float32) * 11
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflate = raw.compress(add_body()) + raw.flush()
    cases: list[tuple[bytes, dict[str, str]]] = [
        (add_body(), {}),  # no Content-Type at all
        (add_body(), {"Content-Type": "application/json"}),
        (add_body(), {"Content-Type": "application/octet-stream"}),
        (add_body(), {"Content-Type": "text/plain; charset=utf-8"}),
        (add_body(), {"Content-Encoding": "identity"}),
        (gzip.compress(add_body()), {"Content-Encoding": "gzip"}),
        (gzip.compress(add_body()), {"Content-Encoding": "x-gzip"}),
        (zlib.compress(add_body()), {"Content-Encoding": "deflate"}),
        (raw_deflate, {"Content-Encoding": "deflate"}),
    ]
    for body, headers in cases:
        response = http.post("/v2/models/add/infer", content=body, headers=headers)
        assert response.status_code == 200, (headers, response.text)
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        assert outputs["sum"]["data"] == expected.tolist()


def test_raw_binary_request_and_response(http: httpx.Client) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, np.float32)
    body, headers = binary_body(
        [("a", a, "FP32"), ("b", b, "FP32")],
        id="bin-1",
        parameters={"binary_data_output": True},
        outputs=[{"name": "diff"}, {"name": "sum", "parameters": {"binary_data": False}}],
    )
    response = http.post("/v2/models/add/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    doc, blob = split_binary_response(response)
    assert doc["id"] == "bin-1"
    diff, total = doc["outputs"]
    assert diff["name"] == "diff"
    assert diff["parameters"]["binary_data_size"] == len(blob) == 32
    np.testing.assert_array_equal(np.frombuffer(blob, "<f4").reshape(2, 4), a - b)
    assert total["data"] == (a + b).ravel().tolist()


def test_priority_and_generous_timeout_are_accepted(http: httpx.Client) -> None:
    # timeout 0 is no timeout, as in Triton (not one that passed before the request was read).
    for parameters in ({"priority": 3}, {"priority": -1}, {"timeout": 60_000_000}, {"timeout": 0}):
        response = http.post("/v2/models/add/infer", content=add_body(parameters=parameters))
        assert response.status_code == 200, (parameters, response.text)


# -- limits, on the locked server -----------------------------------------------------------


def over_the_limit(size: int, framing: str) -> Any:
    """A body *size* bytes over the locked server's limit, with a Content-Length or chunked."""
    if framing == "content-length":
        return add_body() + b" " * size

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield add_body()
        for _ in range(size // 4096):
            yield b" " * 4096

    return chunks()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("size", [70_000, 1_000_000])
def test_body_over_the_limit_is_413(locked: Server, size: int, framing: str) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for path, headers in (
        ("/v2/models/add/infer", {}),
        ("/v2/repository/models/add/load", admin),
        ("/v2/repository/index", {}),
    ):
        # A client per request: see test_early_413_closes_the_connection_saying_so_or_keeps_it.
        with httpx.Client(base_url=locked.url, timeout=WAIT_S) as client:
            response = client.post(path, content=over_the_limit(size, framing), headers=headers)
            assert response.status_code == 413, path
            assert "65536" in error_of(response)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 response with a Content-Length from *sock*."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection; got {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, text = line.partition(":")
        headers[name.strip().lower()] = text.strip()
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection inside a response body")
        body += chunk
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_early_413_closes_the_connection_saying_so_or_keeps_it(
    locked: Server, framing: str
) -> None:
    """A 413 sent before the body has arrived must not leave the client a dead connection.

    Either the response says ``Connection: close``, or the server reads (and
    drops) the rest of the body and serves the next request on the connection.
    Otherwise a keep-alive client (httpx, tritonclient) sends its next request
    down a connection the server has closed and gets "Server disconnected
    without sending a response".
    """
    head = f"POST /v2/models/add/infer HTTP/1.1\r\nHost: {HOST}\r\n"
    over = 70_000
    if framing == "content-length":
        first = f"{head}Content-Length: {over}\r\n\r\n".encode()
        rest = b" " * over
    else:
        first = f"{head}Transfer-Encoding: chunked\r\n\r\n{over:x}\r\n".encode()
        first += b" " * over + b"\r\n"
        rest = b"0\r\n\r\n"
    good = add_body()
    follow_up = f"{head}Content-Length: {len(good)}\r\n\r\n".encode() + good
    with socket.create_connection((HOST, locked.port), timeout=WAIT_S) as sock:
        sock.sendall(first)  # the body is not all there (yet): the server answers at once
        status, headers, body = read_response(sock)
        assert status == 413, body
        if headers.get("connection", "").lower() == "close":
            return
        # Not a timing assertion: a server that closes now, without having said so, shows it
        # at once (EOF); one that waits for the rest of the body shows nothing in this window.
        readable, _, _ = select.select([sock], [], [], LINGER_S)
        if readable:
            assert sock.recv(65536) != b"", "closed after a 413 without 'Connection: close'"
        sock.sendall(rest + follow_up)
        status, _, body = read_response(sock)
        assert status == 200, body


def test_gzip_bomb_is_413(locked_http: httpx.Client) -> None:
    bomb = gzip.compress(add_body() + b" " * 10_000_000)
    assert len(bomb) < 65536
    response = locked_http.post(
        "/v2/models/add/infer", content=bomb, headers={"Content-Encoding": "gzip"}
    )
    assert response.status_code == 413
    assert "65536" in error_of(response)
    deflated = zlib.compress(add_body() + b" " * 10_000_000)
    response = locked_http.post(
        "/v2/models/add/infer", content=deflated, headers={"Content-Encoding": "deflate"}
    )
    assert response.status_code == 413


def test_tensor_over_element_limit_is_400(locked_http: httpx.Client) -> None:
    declared = with_inputs({**A, "shape": [2**40, 16], "data": list(range(16))}, B)
    response = locked_http.post("/v2/models/add/infer", content=declared)
    assert response.status_code == 400
    assert "4096" in error_of(response)
    ones = np.ones((1025, 4), np.float32)  # 4100 elements, one input over the limit
    body, headers = binary_body([("a", ones, "FP32"), ("b", ones, "FP32")])
    response = locked_http.post("/v2/models/add/infer", content=body, headers=headers)
    assert response.status_code == 400
    assert "4096" in error_of(response)
    # Under the limits it works.
    fine = np.ones((8, 4), np.float32)
    body, headers = binary_body([("a", fine, "FP32"), ("b", fine, "FP32")])
    assert locked_http.post("/v2/models/add/infer", content=body, headers=headers).is_success


# -- the admin token -----------------------------------------------------------------------


@pytest.mark.parametrize("action", ["load", "unload"])
def test_admin_token(locked_http: httpx.Client, action: str) -> None:
    path = f"/v2/repository/models/add/{action}"
    missing = locked_http.post(path)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "Bearer" in error_of(missing)
    for wrong in (
        f"Bearer {ADMIN_TOKEN}x",
        "Bearer",
        f"bearer {ADMIN_TOKEN[:-1]}",
        f"Basic {ADMIN_TOKEN}",
        ADMIN_TOKEN,
    ):
        response = locked_http.post(path, headers={"Authorization": wrong})
        assert response.status_code == 401, wrong
        error_of(response)
    assert locked_http.get("/v2/models/add/ready").status_code == 200, "refused: no change"
    right = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        assert locked_http.post(path, headers=right).status_code == 200
        ready = locked_http.get("/v2/models/add/ready").status_code
        assert ready == (200 if action == "load" else 400)
    finally:
        assert locked_http.post("/v2/repository/models/add/load", headers=right).is_success
    # Inference needs no token on this server (protect_inference is off).
    assert locked_http.post("/v2/models/add/infer", content=add_body()).status_code == 200


# -- overload, deadlines, disconnects (the slow model) ----------------------------------------


def test_queue_full_is_503_with_retry_after(main: Server, http: httpx.Client) -> None:
    flood = 6  # the queue holds 2 behind the blocker; the other 4 are refused at once

    async def scenario(held: Blocker) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=main.url, timeout=WAIT_S) as client:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(client.post("/v2/models/slow/infer", json=slow_doc()))
                    for _ in range(flood)
                ]
                deadline = time.monotonic() + WAIT_S
                while sum(t.done() for t in tasks) < flood - 2:
                    assert time.monotonic() < deadline, "refusals did not arrive"
                    await asyncio.sleep(POLL_S)
                metrics = await client.get("/metrics")
                families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
                assert (
                    value(families, "trioinfer_inference_queue_depth", model="slow", version="1")
                    == 2
                )
                held.release()  # the two queued requests run now
            return [t.result() for t in tasks]

    with blocker(main, http) as held:
        responses = asyncio.run(scenario(held))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 503, 503, 503, 503]
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["retry-after"]) >= 1
            assert "max_queue_size" in error_of(response)
        else:
            assert response.json()["outputs"][0]["shape"] == [1, SLOW_WIDTH]
    families = scrape(http)
    assert (
        value(
            families,
            "trioinfer_inference_requests_total",
            model="slow",
            version="1",
            outcome="queue_full",
        )
        >= 4
    )


def test_timeout_parameter_too_short_is_504(main: Server, http: httpx.Client) -> None:
    with blocker(main, http):
        before = slow_state(http)
        response = http.post("/v2/models/slow/infer", json=slow_doc(parameters={"timeout": 1000}))
        assert response.status_code == 504, response.text
        assert "timeout" in error_of(response)
        after = slow_state(http)
        assert after.executions == before.executions, "an expired request never runs"
        assert after.pending == 1, "only the blocker is left"


def test_client_that_leaves_while_queued_is_never_computed(
    main: Server, http: httpx.Client
) -> None:
    stats_before = model_stats(http, "slow")
    state_before = slow_state(http)
    with blocker(main, http):
        # A request from a socket we hang up ourselves, once the server has queued it.
        sock = raw_post(main.port, "/v2/models/slow/infer", j(slow_doc()), {})
        wait_until(lambda: slow_state(http).queued == 1, "the request is queued")
        sock.close()
        wait_until(lambda: slow_state(http).pending == 1, "the abandoned request is withdrawn")
        # The same with a real client that gives up on its own.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{main.url}/v2/models/slow/infer",
                json=slow_doc(),
                timeout=httpx.Timeout(WAIT_S, read=0.5),
            )
        wait_until(lambda: slow_state(http).pending == 1, "the timed-out request is withdrawn")
        during = slow_state(http)
        assert during.queued == 0
        assert during.executions == state_before.executions + 1, "only the blocker ran"
    stats_after = model_stats(http, "slow")
    state_after = slow_state(http)
    # The blocker started once and was aborted: Triton's execution_count counts only
    # executions that answered, so it is unchanged; neither queued request ever ran.
    assert stats_after["execution_count"] == stats_before["execution_count"]
    assert state_after.executions - state_before.executions == 1
    queue_counts = (
        stats_before["inference_stats"]["queue"]["count"],
        stats_after["inference_stats"]["queue"]["count"],
    )
    assert queue_counts[1] - queue_counts[0] == 1
    # Triton's inference_count: rows of requests that succeeded. None did: the
    # blocker was aborted and the queued requests never ran.
    assert stats_after["inference_count"] == stats_before["inference_count"]
    success = [s["inference_stats"]["success"]["count"] for s in (stats_before, stats_after)]
    assert success[0] == success[1]
    # The blocker and both queued requests were abandoned by their clients.
    assert state_after.cancelled - state_before.cancelled == 3


def test_client_that_leaves_mid_body_is_not_an_error(tmp_path: Path) -> None:
    # Its own server, so that what this test finds in the log is this test's doing.
    models.write_add(tmp_path / "repository" / "add" / "1" / "model.onnx")
    with (
        run_server(tmp_path / "repository", log=tmp_path / "server.log") as server,
        httpx.Client(base_url=server.url, timeout=WAIT_S) as client,
    ):
        sock = socket.create_connection((HOST, server.port), timeout=WAIT_S)
        head = (
            f"POST /v2/models/add/infer HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 100000\r\n\r\n"
        )
        sock.sendall(head.encode() + add_body())
        sock.close()

        def idle() -> bool:
            return value(scrape(client), "trioinfer_http_inference_in_flight") == 0

        wait_until(idle, "the server has finished with the abandoned request")
        assert client.post("/v2/models/add/infer", content=add_body()).status_code == 200
        log = server.log.read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]


# == hot reload ===================================================================================


def test_hot_reload_keeps_serving(main: Server, http: httpx.Client) -> None:
    a = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    b = np.array([[10.0, 20.0, 30.0, 40.0]], np.float32)
    body = with_inputs(v2_input("a", a), v2_input("b", b))

    def answer(client: httpx.Client) -> tuple[int, list[float] | None]:
        response = client.post("/v2/models/reload/infer", content=body)
        if response.status_code != 200:
            return response.status_code, None
        return 200, response.json()["outputs"][0]["data"]

    assert answer(http) == (200, (a + b).ravel().tolist())
    seen: list[tuple[int, list[float] | None]] = []
    stop = threading.Event()
    loaded = threading.Event()
    after_load = []

    def hammer() -> None:
        with httpx.Client(base_url=main.url, timeout=WAIT_S) as client:
            while not stop.is_set():
                # Only requests sent after the load returned must get the new version.
                sent_after_load = loaded.is_set()
                seen.append(answer(client))
                if sent_after_load:
                    after_load.append(seen[-1])

    worker = threading.Thread(target=hammer, daemon=True)
    worker.start()
    try:
        wait_until(lambda: len(seen) >= 3, "requests flow before the reload")
        write_binary_op(main.repository / "reload" / "1" / "model.onnx", "Sub")
        response = http.post("/v2/repository/models/reload/load")
        assert response.status_code == 200, response.text
        loaded.set()
        wait_until(lambda: len(after_load) >= 3, "requests flow after the reload")
    finally:
        stop.set()
        worker.join(timeout=WAIT_S)
    assert not worker.is_alive()
    old, new = (a + b).ravel().tolist(), (a - b).ravel().tolist()
    assert all(status == 200 for status, _ in seen), {status for status, _ in seen}
    assert all(data in (old, new) for _, data in seen)
    assert all(data == new for _, data in after_load), "the new version answers after load"
    assert answer(http) == (200, new)

    # A changed config.toml is picked up by the next load as well.
    (main.repository / "reload" / "config.toml").write_text(
        "max_queue_size = 50\n", encoding="utf-8"
    )
    assert http.post("/v2/repository/models/reload/load").status_code == 200
    config = http.get("/v2/models/reload/config").json()
    assert own_setting(config, "max_queue_size") == 50
    assert answer(http) == (200, new)


# == metrics ======================================================================================


def test_metrics(http: httpx.Client) -> None:
    rows = [1, 2, 3]
    for n in rows:
        doc = {"inputs": [v2_input("input", np.ones((n, 4), np.float32))]}
        assert http.post("/v2/models/counted/infer", json=doc).status_code == 200
    for _ in range(2):
        bad = {"inputs": [v2_input("input", np.ones((1, 5), np.float32))]}
        assert http.post("/v2/models/counted/infer", json=bad).status_code == 400
    assert http.post("/v2/models/nowhere/infer", json=add_doc()).status_code == 404

    families = scrape(http)
    types = {
        "trioinfer_inference_requests": "counter",
        "trioinfer_http_inference_in_flight": "gauge",
        "trioinfer_inference_in_flight": "gauge",
        "trioinfer_inference_executions": "counter",
        "trioinfer_inference_executions_succeeded": "counter",
        "trioinfer_inferences": "counter",
        "trioinfer_inference_queue_depth": "gauge",
        "trioinfer_inference_pending": "gauge",
        "trioinfer_instances": "gauge",
        "trioinfer_inference_queue_duration_seconds": "histogram",
        "trioinfer_inference_compute_duration_seconds": "histogram",
        "trioinfer_inference_request_duration_seconds": "histogram",
        "trioinfer_inference_batch_rows": "histogram",
    }
    for name, kind in types.items():
        assert families[name].type == kind, name
    # The machine's, as Triton's nv_cpu_* (test_host_metrics.py reads them from a fake /proc).
    if Path("/proc/meminfo").exists():
        assert (
            0
            < value(families, "trioinfer_cpu_memory_used_bytes")
            <= value(families, "trioinfer_cpu_memory_total_bytes")
        )
        assert 0 <= value(families, "trioinfer_cpu_utilization") <= 1

    counted = {"model": "counted", "version": "1"}
    requests = "trioinfer_inference_requests_total"
    assert value(families, requests, outcome="success", **counted) == 3
    assert value(families, requests, outcome="invalid_input", **counted) == 2
    # Requests for unknown models are counted without echoing the client's model name.
    assert value(families, requests, model="", version="", outcome="not_found") >= 1
    assert not samples(families, requests, model="nowhere")
    assert value(families, "trioinfer_inference_executions_total", **counted) == 3
    assert value(families, "trioinfer_inference_executions_succeeded_total", **counted) == 3
    assert value(families, "trioinfer_inference_queue_depth", **counted) == 0
    assert value(families, "trioinfer_inference_pending", **counted) == 0
    assert value(families, "trioinfer_instances", device="cpu", state="serving", **counted) == 1
    histograms = (
        "trioinfer_inference_queue_duration_seconds",
        "trioinfer_inference_compute_duration_seconds",
        "trioinfer_inference_request_duration_seconds",
        "trioinfer_inference_batch_rows",
    )
    for histogram in histograms:
        assert value(families, f"{histogram}_count", **counted) == 3, histogram
        assert value(families, f"{histogram}_bucket", le="+Inf", **counted) == 3, histogram
        buckets = [s.value for s in samples(families, f"{histogram}_bucket", **counted)]
        assert buckets == sorted(buckets), f"{histogram} buckets are cumulative"
    assert value(families, "trioinfer_inference_batch_rows_sum", **counted) == sum(rows)
    # The refused requests never ran: the rows that got outputs are the same rows.
    assert value(families, "trioinfer_inferences_total", **counted) == sum(rows)
    # Every served version has its own labelled series.
    executions = {
        (s.labels["model"], s.labels["version"])
        for s in samples(families, "trioinfer_inference_executions_total")
    }
    assert {("versioned", "1"), ("versioned", "2"), ("digits", "1"), ("slow", "1")} <= executions
    # And /stats agrees.
    stats = model_stats(http, "counted")
    assert stats["inference_count"] == sum(rows)
    assert stats["execution_count"] == 3
    assert stats["inference_stats"]["success"]["count"] == 3


# == fuzzing ======================================================================================

_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)


def _json_containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function, not a lambda: hypothesis reads recursive()'s extend from its
    # source to check that it recurses, and a multi-line lambda's source may not parse.
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)


_JSON = st.recursive(_JSON_LEAVES, _json_containers, max_leaves=12)
_NUMBERS = st.one_of(
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(width=32),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
#: Models the fuzz tests target: their inputs, each float32[rows, width], and outputs.
_FUZZ_MODELS = {
    "add": ({"a": 4, "b": 4}, ["sum", "diff"]),
    "digits": ({"input": 64}, ["probabilities", "label"]),
}
_FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "name": st.sampled_from(["a", "b", "input", "x", "", "A"]) | _JSON,
    "datatype": st.sampled_from([*V2_TYPES, "BF16", "FLOAT", "fp32", ""]) | _JSON,
    "shape": (
        st.lists(st.integers(min_value=-2, max_value=2**64), max_size=4)
        | st.lists(st.integers(0, 70), max_size=4)
        | _JSON
    ),
    "data": (
        st.lists(_NUMBERS, max_size=70)
        | st.lists(st.lists(st.floats(width=32), max_size=65), max_size=4)
        | _JSON
    ),
    "parameters": (
        st.fixed_dictionaries(
            {},
            optional={
                "binary_data_size": _JSON_LEAVES,
                "shared_memory_region": _JSON_LEAVES,
            },
        )
        | _JSON
    ),
}
# Any priority; a timeout only where it is invalid (a valid short one is a fair 504).
_REQUEST_PARAMETERS = st.fixed_dictionaries(
    {},
    optional={
        "priority": _JSON_LEAVES,
        "timeout": st.none() | st.text(max_size=4) | st.floats() | st.integers(max_value=-1),
        "binary_data_output": _JSON_LEAVES,
    },
)


@st.composite
def infer_documents(draw: st.DrawFn) -> tuple[str, Any]:
    """A valid infer request for ``add`` or ``digits``, then up to four fields changed."""
    model = draw(st.sampled_from(sorted(_FUZZ_MODELS)))
    widths, output_names = _FUZZ_MODELS[model]
    path = draw(
        st.sampled_from([f"/v2/models/{model}/infer", f"/v2/models/{model}/versions/1/infer"])
    )
    rows = draw(st.integers(1, 3))
    inputs: list[Any] = []
    for name, width in widths.items():
        # Valid values from a drawn seed: drawing 64 floats one by one is slow, and the
        # mutations below, not these values, are what the test is about.
        rng = np.random.default_rng(draw(st.integers(0, 2**32)))
        values = rng.uniform(-1e3, 1e3, rows * width).astype(np.float32).tolist()
        if draw(st.booleans()):
            values = [round(v) for v in values]  # JSON integers are valid FP32 data too
        data: list[Any] = values
        if draw(st.booleans()):  # nested to match the shape
            data = [values[i * width : (i + 1) * width] for i in range(rows)]
        inputs.append({"name": name, "datatype": "FP32", "shape": [rows, width], "data": data})
    doc: dict[str, Any] = {"inputs": inputs}
    if draw(st.booleans()):
        chosen = draw(st.lists(st.sampled_from(output_names), unique=True))
        doc["outputs"] = [
            {"name": n, "parameters": {"binary_data": draw(st.booleans())}} for n in chosen
        ]
    if draw(st.booleans()):
        doc["parameters"] = {"priority": draw(st.integers(-5, 5))}
    if draw(st.booleans()):
        doc["id"] = draw(st.text(max_size=8))

    for _ in range(draw(st.integers(0, 4))):
        where = draw(st.sampled_from(["input", "input", "input", "inputs", "request"]))
        if where == "input":
            objects = [i for i in inputs if isinstance(i, dict)]
            item = draw(st.sampled_from(objects)) if objects else {}
            field = draw(st.sampled_from(sorted(_FIELD_VALUES)))
            if draw(st.integers(0, 4)) == 0:
                item.pop(field, None)
            else:
                item[field] = draw(_FIELD_VALUES[field])
        elif where == "inputs":
            action = draw(st.sampled_from(["drop", "duplicate", "junk", "replace"]))
            if action == "drop" and inputs:
                inputs.pop(draw(st.integers(0, len(inputs) - 1)))
            elif action == "duplicate" and inputs:
                inputs.append(copy.deepcopy(draw(st.sampled_from(inputs))))
            elif action == "junk":
                inputs.append(draw(_JSON))
            else:
                doc["inputs"] = draw(_JSON)
        else:
            key = draw(st.sampled_from(["outputs", "parameters", "id", "extra"]))
            if key == "parameters":
                doc[key] = draw(
                    _REQUEST_PARAMETERS | _JSON.filter(lambda v: "timeout" not in str(v))
                )
            elif key == "outputs":
                doc[key] = draw(
                    st.lists(
                        st.fixed_dictionaries(
                            {"name": st.sampled_from([*output_names, "nope", ""]) | _JSON},
                            optional={"parameters": _JSON},
                        ),
                        max_size=3,
                    )
                    | _JSON
                )
            else:
                doc[key] = draw(_JSON)
    return path, doc


_PATHS = st.sampled_from(
    ["/v2/models/add/infer", "/v2/models/digits/infer", "/v2/models/add/versions/1/infer"]
)
_HEADER_TEXT = st.binary(max_size=24).map(
    lambda b: bytes(c for c in b if c == 0x20 or 0x21 <= c <= 0x7E or c >= 0x80).strip()
)


def _assert_no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error_of(response)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=infer_documents())
def test_fuzz_structured_bodies_never_5xx(
    locked_http: httpx.Client, request: tuple[str, Any]
) -> None:
    path, doc = request
    _assert_no_server_error(locked_http.post(path, content=json.dumps(doc).encode()))


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, bytes]]:
    """A valid request for ``add`` (JSON or binary), then byte, header and encoding edits."""
    rows = draw(st.integers(1, 3))
    a = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    if draw(st.booleans()):
        body, text_headers = binary_body(
            [("a", a, "FP32"), ("b", a, "FP32")],
            parameters={"binary_data_output": draw(st.booleans())},
        )
    else:
        body, text_headers = add_body(rows=rows), {}
    headers = {k: v.encode() for k, v in text_headers.items()}
    data = bytearray(body)
    for position, kind, chunk in draw(
        st.lists(
            st.tuples(
                st.integers(0, 10_000),
                st.sampled_from(["set", "insert", "delete"]),
                st.binary(max_size=4),
            ),
            max_size=3,
        )
    ):
        at = position % (len(data) + 1)
        if kind == "set":
            data[at : at + len(chunk)] = chunk
        elif kind == "insert":
            data[at:at] = chunk
        else:
            del data[at : at + len(chunk) + 1]
    body = bytes(data)
    if draw(st.integers(0, 3)) == 0:
        length = draw(
            st.none()
            | st.integers(-3, len(body) + 3).map(lambda n: str(n).encode())
            | st.sampled_from([b"0", b"+5", b"5 5", b"1e2", b"0x10", b"\xb2", b"9" * 30])
            | _HEADER_TEXT
        )
        headers.pop("Inference-Header-Content-Length", None)
        if length is not None:
            headers["Inference-Header-Content-Length"] = length
    encoding = draw(
        st.sampled_from([None, None, None, b"gzip", b"x-gzip", b"deflate", b"identity", b"GZIP"])
        | st.sampled_from([b"br", b"gzip,deflate", b"gzip, identity", b"compress"])
        | _HEADER_TEXT
    )
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if draw(st.integers(0, 4)) > 0:
            if encoding.lower() in (b"gzip", b"x-gzip", b"gzip, identity"):
                body = gzip.compress(body)
            elif encoding == b"deflate":
                body = zlib.compress(body)
        if draw(st.integers(0, 4)) == 0:
            body = body[: draw(st.integers(0, len(body)))]
    content_type = draw(
        st.sampled_from([None, b"application/json", b"application/octet-stream"]) | _HEADER_TEXT
    )
    if content_type is not None:
        headers["Content-Type"] = content_type
    return body, headers


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=mutated_requests(), path=_PATHS)
def test_fuzz_mutated_requests_never_5xx(
    locked_http: httpx.Client, request: tuple[bytes, dict[str, bytes]], path: str
) -> None:
    body, headers = request
    _assert_no_server_error(locked_http.post(path, content=body, headers=headers))


# == shutdown =====================================================================


def test_sigterm_drains_in_flight_request_and_exits_0(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    write_slow_model(root)
    log = tmp_path / "server.log"
    with run_server(root, "--drain-period", "300", log=log) as server:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as control:
            # Long enough to be running still when the signal arrives; the drain lets it finish.
            doc = slow_doc(rows=256)
            outcome: list[httpx.Response | BaseException] = []

            def send() -> None:
                try:
                    outcome.append(
                        httpx.post(f"{server.url}/v2/models/slow/infer", json=doc, timeout=STOP_S)
                    )
                except BaseException as exc:  # handed to the test thread
                    outcome.append(exc)

            worker = threading.Thread(target=send, daemon=True)
            worker.start()
            wait_until(
                lambda: slow_state(control).executions == 1, "the request runs on the server"
            )
        server.process.send_signal(signal.SIGTERM)

        def not_ready() -> bool:
            try:
                return httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code != 200
            except httpx.TransportError:
                return True  # the listener is closed: not ready either

        wait_until(not_ready, "the server stops being ready")
        assert worker.is_alive(), "the request must still be in flight when readiness goes"
        with contextlib.suppress(httpx.TransportError):
            refused = httpx.post(
                f"{server.url}/v2/models/slow/infer", json=slow_doc(), timeout=WAIT_S
            )
            assert refused.status_code == 503
        worker.join(timeout=STOP_S)
        assert not worker.is_alive()
        (response,) = outcome
        assert isinstance(response, httpx.Response), response
        assert response.status_code == 200, response.text
        (y,) = response.json()["outputs"]
        assert y["shape"] == [256, SLOW_WIDTH]
        assert server.process.wait(timeout=STOP_S) == 0
    assert "SIGTERM" in log.read_text(errors="replace")


STUCK_CONFIG = """\
backend = "python"
[backend_options]
inputs = [{ name = "x", dtype = "float32", shape = ["batch", 1] }]
outputs = [{ name = "y", dtype = "float32", shape = ["batch", 1] }]
"""

STUCK_MODEL = """\
import pathlib
import time


class Model:
    def infer(self, inputs):
        # On its thread: nothing can interrupt it; it ends when the test says so.
        here = pathlib.Path(__file__).parent
        (here / "running").touch()
        while not (here / "go").exists():
            time.sleep(0.01)
        return {"y": inputs["x"]}
"""


async def test_closing_says_what_it_waits_for_when_an_execution_cannot_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After the drain, the engine waits for an execution on a thread, which no
    # cancellation stops: the log said "closing the engine", then nothing while the
    # process seemed to hang.
    import trio

    from trioinfer.server import ServerConfig, serve_http
    from trioinfer.server import _serve as serve_module

    monkeypatch.setattr(serve_module, "CLOSE_NOTICE_S", 0.0)
    (tmp_path / "stuck" / "1").mkdir(parents=True)
    (tmp_path / "stuck" / "config.toml").write_text(STUCK_CONFIG)
    (tmp_path / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)
    stop = trio.Event()
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    caplog.set_level("INFO", logger="trioinfer.server")

    def said(text: str) -> bool:
        return any(text in r.getMessage() for r in caplog.records)

    async with trio.open_nursery() as nursery:
        listening = await nursery.start(
            functools.partial(
                serve_http,
                tmp_path,
                port=0,
                handle_signals=False,
                shutdown=stop,
                config=ServerConfig(drain_period=0.0),
            )
        )

        async def send() -> None:
            async with httpx.AsyncClient(base_url=listening.urls[0], timeout=WAIT_S) as client:
                with contextlib.suppress(httpx.TransportError):  # cut at the drain's end
                    await client.post("/v2/models/stuck/infer", json=body)

        nursery.start_soon(send)
        with trio.fail_after(WAIT_S):
            while not (tmp_path / "stuck" / "1" / "running").exists():  # noqa: ASYNC110  # a file, or a log line: no event
                await trio.sleep(0.01)
            stop.set()
            while not said("still closing the engine"):  # noqa: ASYNC110  # a file, or a log line: no event
                await trio.sleep(0.01)
        (tmp_path / "stuck" / "1" / "go").touch()
    assert said("a second SIGINT or SIGTERM stops at once")


def test_unload_lets_the_request_in_flight_finish(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    write_slow_model(root)
    with (
        run_server(root, "--drain-period", "300", log=tmp_path / "server.log") as server,
        httpx.Client(base_url=server.url, timeout=STOP_S) as control,
    ):
        outcome: list[httpx.Response | BaseException] = []

        def send() -> None:
            try:
                outcome.append(
                    httpx.post(
                        f"{server.url}/v2/models/slow/infer",
                        json=slow_doc(rows=256),
                        timeout=STOP_S,
                    )
                )
            except BaseException as exc:  # handed to the test thread
                outcome.append(exc)

        worker = threading.Thread(target=send, daemon=True)
        worker.start()
        wait_until(lambda: slow_state(control).executions == 1, "the request runs on the server")
        # Unloading waits for the request in flight, which gets its answer.
        assert control.post("/v2/repository/models/slow/unload").status_code == 200
        worker.join(timeout=STOP_S)
        (response,) = outcome
        assert isinstance(response, httpx.Response), response
        assert response.status_code == 200, response.text
        after = control.post("/v2/models/slow/infer", json=slow_doc())
        assert after.status_code == 404
        assert "'slow' is not served" in error_of(after)


# == last: the servers survived everything above ===============================


def test_asyncio_loop(
    main_repository: Path,
    images: npt.NDArray[np.float32],
    tmp_path: Path,
) -> None:
    """The same server on asyncio (the same HTTP stack): clients, errors, disconnects, shutdown."""
    digits_file = main_repository / "digits" / "1" / "model.onnx"
    batch = images[:8]
    expected = run_locally(digits_file, {"input": batch})
    with (
        run_server(main_repository, "--loop", "asyncio", log=tmp_path / "server.log") as server,
        httpx.Client(base_url=server.url, timeout=WAIT_S) as http,
        contextlib.closing(triton.InferenceServerClient(server.address)) as client,
    ):
        assert client.is_server_ready()
        for binary in (False, True):
            given = triton.InferInput("input", list(batch.shape), "FP32")
            given.set_data_from_numpy(batch, binary_data=binary)
            out = triton.InferRequestedOutput("label", binary_data=binary)
            result = client.infer("digits", [given], outputs=[out])
            np.testing.assert_array_equal(result.as_numpy("label"), expected["label"])
        for case in BAD_REQUESTS:
            path, body, headers, status, fragment = case.values
            response = http.post(path, content=body, headers=headers)
            assert response.status_code == status, (case.id, response.text)
            assert fragment in error_of(response), case.id

        async def concurrent() -> None:
            aio = triton_aio.InferenceServerClient(server.address)
            try:

                async def one(i: int) -> None:
                    given = triton_aio.InferInput("input", [1, 64], "FP32")
                    given.set_data_from_numpy(images[i : i + 1], binary_data=i % 2 == 0)
                    result = await aio.infer("digits", [given])
                    assert result.as_numpy("label")[0] == expected_label(digits_file, images, i)

                await asyncio.gather(*(one(i) for i in range(32)))
            finally:
                await aio.close()

        asyncio.run(concurrent())
        before = slow_state(http)
        with blocker(server, http):
            sock = raw_post(server.port, "/v2/models/slow/infer", j(slow_doc()), {})
            wait_until(lambda: slow_state(http).queued == 1, "the request is queued")
            sock.close()
            wait_until(lambda: slow_state(http).pending == 1, "the abandoned request is withdrawn")
        assert slow_state(http).executions == before.executions + 1, "only the blocker ran"


def expected_label(model: Path, images: npt.NDArray[np.float32], i: int) -> int:
    return int(run_locally(model, {"input": images[i : i + 1]})["label"][0])


@pytest.mark.parametrize("which", ["main", "locked"])
def test_servers_survived(request: pytest.FixtureRequest, which: str) -> None:
    server: Server = request.getfixturevalue(which)
    assert server.process.poll() is None, server.log_tail()
    response = httpx.post(f"{server.url}/v2/models/add/infer", content=add_body(), timeout=WAIT_S)
    assert response.status_code == 200
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    assert "unexpected error" not in log, log[-4000:]


def test_requests_like_ones_before_with_new_ids_are_answered_with_their_own(
    http: httpx.Client,
) -> None:
    # From the third on, each is decoded by the plan its layout made (its id cut out).
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    for n in range(4):
        doc = {"id": f"json-{n}", "inputs": [v2_input("a", a + n), v2_input("b", a)]}
        response = http.post("/v2/models/add/infer", content=j(doc))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"] == f"json-{n}"
        assert body["outputs"][0]["data"] == (2 * a + n).ravel().tolist()
        content, headers = binary_body([("a", a + n, "FP32"), ("b", a, "FP32")], id=f"binary-{n}")
        response = http.post("/v2/models/add/infer", content=content, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["id"] == f"binary-{n}"
        assert response.json()["outputs"][0]["data"] == (2 * a + n).ravel().tolist()


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([1, "2", 3, 4], "FP32 data must be numbers"),
        ([1, 2, 3], "'data' has 3 values but shape [1, 4] holds 4"),
        ([1, 2, 3, True], "FP32 data must be numbers; got true"),
        ([1, 2, 3, 1e39], "numbers within +-3.40282e+38"),
    ],
)
def test_a_request_like_ones_before_with_bad_data_is_400(
    http: httpx.Client, data: list[Any], fragment: str
) -> None:
    a = [1.0, 2.0, 3.0, 4.0]
    for n in range(3):  # a plan is made for this layout
        doc = {"id": str(n), "inputs": [v2_input("a", [a]), v2_input("b", [a])]}
        assert http.post("/v2/models/add/infer", content=j(doc)).status_code == 200
    doc["inputs"][1]["data"] = data
    response = http.post("/v2/models/add/infer", content=j(doc))
    assert response.status_code == 400
    assert "input 'b'" in error_of(response)
    assert fragment in error_of(response)


_HEADER_NAMES = st.sampled_from(
    [b"content-length", b"authorization", b"trioinfer-routing-key", b"x-\xe9", b"host"]
)


@given(
    raw=st.lists(st.tuples(_HEADER_NAMES, st.binary(max_size=8)), max_size=6),
    asked=st.sampled_from(
        ["content-length", "Authorization", "trioinfer-routing-key", "x-\xe9", "absent"]
    ),
)
def test_infer_route_headers_read_as_the_decoded_mapping(
    raw: list[tuple[bytes, bytes]], asked: str
) -> None:
    # The route's header mapping decodes values only when asked: it must read as
    # the whole decoded, lower-case-keyed mapping would (a repeated field: its last).
    from trioinfer.server._app import _Headers

    expected = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
    headers = _Headers(raw)
    key = asked.lower()
    assert headers.get(asked) == expected.get(key)
    assert headers.get(asked, "default") == expected.get(key, "default")
    assert (asked in headers) == (key in expected)
    assert dict(headers) == expected
    assert len(headers) == len(expected)
    if key in expected:
        assert headers[asked] == expected[key]
    else:
        with pytest.raises(KeyError):
            headers[asked]


def test_output_names_are_made_once_per_signature() -> None:
    from trioinfer._tensors import ModelSignature, TensorSpec
    from trioinfer.server._app import _output_names

    def signature(*names: str) -> ModelSignature:
        return ModelSignature(
            inputs=(TensorSpec("x", np.dtype(np.float32), (1,)),),
            outputs=tuple(TensorSpec(n, np.dtype(np.float32), (1,)) for n in names),
        )

    first, second = signature("b", "a"), signature("c")
    assert _output_names(first) == ("b", "a")
    assert _output_names(first) is _output_names(first)
    assert _output_names(second) == ("c",)
    assert _output_names(first) == ("b", "a")


def test_config_reports_a_batchers_own_defaults() -> None:
    # A config.toml with batcher = "dynamic" and no options runs at the batcher's defaults
    # (32 rows, 5 ms); /config said max_batch_size 0, since the dynamic batcher's class
    # signature is its __new__'s (pad_axis only), which hid __init__'s defaults.
    from types import SimpleNamespace

    from trioinfer._registry import Registry
    from trioinfer.server._app import _effective_options

    state: Any = SimpleNamespace(
        models=SimpleNamespace(engine=SimpleNamespace(registry=Registry()))
    )
    options = _effective_options(state, "dynamic", {})
    assert (options["max_batch_size"], options["max_queue_delay"]) == (32, 0.005)
    assert _effective_options(state, "dynamic", {"max_batch_size": 8})["max_batch_size"] == 8
    assert _effective_options(state, "no-such-batcher", {"a": 1}) == {"a": 1}
