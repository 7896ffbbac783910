"""Triton parity over HTTP: shared memory, config.pbtxt, classification and Triton's wording.

The tests make the calls Triton's own Python HTTP client examples make
(triton-inference-server/client, ``src/python/examples``:
simple_http_shm_client, simple_http_shm_string_client, reuse_infer_objects_client,
simple_http_infer_client, simple_http_model_control, ensemble_image_client's
classification, simple_http_cudashm_client) with ``tritonclient.http`` against
a real ``trioinfer serve`` on 127.0.0.1, over a Triton-layout repository
(``config.pbtxt`` + ``1/model.onnx``) written here with ``onnx.helper``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
import re
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import attrs
import httpx
import numpy as np
import onnx
import pytest
import trio
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper
from tritonclient import utils
from tritonclient.utils import InferenceServerException

import trioinfer
from _triton_config import own_setting
from test_server import Server, run_server
from trioinfer import ConfigError, Device
from trioinfer.server import serve_http
from trioinfer.server._app import RequestError, schedule_parameters
from trioinfer.server._cuda_ipc import probe
from trioinfer.server._shm import SharedMemoryError, SystemSharedMemory
from trioinfer.server._triton import TritonModel, _model_config_class, own_parameters
from trioinfer_onnxruntime import probe_device

pytestmark = [pytest.mark.shm, pytest.mark.triton_config]

SIMPLE_PBTXT = """\
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500 }
instance_group [ { kind: KIND_CPU count: 2 } ]
"""
STRING_PBTXT = """\
name: "simple_string"
backend: "onnxruntime"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
"""
CLASSIFIER_PBTXT = """\
max_batch_size: 4
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 5 ] label_filename: "labels.txt" } ]
dynamic_batching {
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { max_queue_size: 64 }
}
"""
ENSEMBLE_PBTXT = """\
name: "ensemble"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "A" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "B" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "simple"
      model_version: -1
      input_map { key: "INPUT0" value: "A" }
      input_map { key: "INPUT1" value: "B" }
      output_map { key: "OUTPUT0" value: "SUM" }
    }
  ]
}
"""
# As ensemble_image_client's model: an ensemble whose output has the labels.
CLASSIFY_ENSEMBLE_PBTXT = """\
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 5 ] } ]
output [ { name: "CLASSES" data_type: TYPE_FP32 dims: [ 5 ] label_filename: "labels.txt" } ]
ensemble_scheduling {
  step [ {
    model_name: "classifier"
    model_version: 1
    input_map { key: "IMAGE" value: "RAW" }
    output_map { key: "SCORES" value: "CLASSES" }
  } ]
}
"""
LABELS = ["cat", "dog", "bird", "fish", "frog"]


def _save(graph: Any, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, path)


def write_simple(path: Path, dtype: int = TensorProto.INT32) -> None:
    """Triton's "simple" model: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    shape = ["batch", 16]
    inputs = [helper.make_tensor_value_info(f"INPUT{i}", dtype, shape) for i in (0, 1)]
    outputs = [helper.make_tensor_value_info(f"OUTPUT{i}", dtype, shape) for i in (0, 1)]
    if dtype == TensorProto.STRING:
        # Triton's "simple_string": the strings hold integers; so do the answers.
        nodes = [
            helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
            helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Sub", ["a", "b"], ["diff"]),
            helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
            helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING),
        ]
    else:
        nodes = [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ]
    _save(helper.make_graph(nodes, "simple", inputs, outputs), path)


def write_scores(path: Path) -> None:
    """SCORES = IMAGE (float32[batch, 5]): the scores are what the client sends."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["IMAGE"], ["SCORES"])],
        "scores",
        [helper.make_tensor_value_info("IMAGE", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("SCORES", TensorProto.FLOAT, ["batch", 5])],
    )
    _save(graph, path)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_repository")
    write_simple(root / "simple" / "1" / "model.onnx")
    (root / "simple" / "config.pbtxt").write_text(SIMPLE_PBTXT)
    write_simple(root / "simple_string" / "1" / "model.onnx", TensorProto.STRING)
    (root / "simple_string" / "config.pbtxt").write_text(STRING_PBTXT)
    write_scores(root / "classifier" / "1" / "model.onnx")
    (root / "classifier" / "config.pbtxt").write_text(CLASSIFIER_PBTXT)
    (root / "classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (root / "ensemble" / "1").mkdir(parents=True)  # Triton wants the directory; it is empty
    (root / "ensemble" / "config.pbtxt").write_text(ENSEMBLE_PBTXT)
    (root / "classify_ensemble" / "1").mkdir(parents=True)
    (root / "classify_ensemble" / "config.pbtxt").write_text(CLASSIFY_ENSEMBLE_PBTXT)
    (root / "classify_ensemble" / "labels.txt").write_text("\n".join(LABELS[::-1]) + "\n")
    # Broken on purpose: an accelerator trioinfer does not have, and dims that do not fit.
    write_simple(root / "unsupported" / "1" / "model.onnx")
    (root / "unsupported" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\n'
        "optimization { execution_accelerators {\n"
        '  cpu_execution_accelerator [ { name: "openvino" } ]\n'
        "} }\n"
    )
    write_simple(root / "wrong_dims" / "1" / "model.onnx")
    (root / "wrong_dims" / "config.pbtxt").write_text(
        'max_batch_size: 8\ninput [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 15 ] } ]\n'
    )
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "triton.log"
    with run_server(repository, log=log) as running:
        yield running


@pytest.fixture
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(server.address) as triton:
        triton.unregister_system_shared_memory()
        yield triton
        triton.unregister_system_shared_memory()


@pytest.fixture
def regions() -> Iterator[list[Any]]:
    """Shared-memory regions a test creates, destroyed at the end whatever happens."""
    handles: list[Any] = []
    yield handles
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


#: The names of the regions this test process makes begin so.
REGION_PREFIX = f"trioinfer_test_{os.getpid()}_"


def create_region(handles: list[Any], name: str, size: int) -> tuple[Any, str]:
    key = f"/{REGION_PREFIX}{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(name, key, size)
    handles.append(handle)
    return handle, key


# == system shared memory ===============================================================


def test_simple_http_shm_client(
    client: httpclient.InferenceServerClient, regions: list[Any]
) -> None:
    client.unregister_cuda_shared_memory()  # nothing to unregister, and no error
    input0 = np.arange(16, dtype=np.int32)
    input1 = np.ones(16, dtype=np.int32)
    size = input0.nbytes
    out_handle, out_key = create_region(regions, "output_data", size * 2)
    client.register_system_shared_memory("output_data", out_key, size * 2)
    in_handle, in_key = create_region(regions, "input_data", size * 2)
    shm.set_shared_memory_region(in_handle, [input0])
    shm.set_shared_memory_region(in_handle, [input1], offset=size)
    client.register_system_shared_memory("input_data", in_key, size * 2)

    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory("input_data", size)
    inputs[1].set_shared_memory("input_data", size, offset=size)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=True),
    ]
    outputs[0].set_shared_memory("output_data", size)
    outputs[1].set_shared_memory("output_data", size, offset=size)
    results = client.infer("simple", inputs, outputs=outputs)

    output0 = results.get_output("OUTPUT0")
    output1 = results.get_output("OUTPUT1")
    assert output0["shape"] == [1, 16]
    assert "data" not in output0
    sums = shm.get_contents_as_numpy(
        out_handle, utils.triton_to_np_dtype(output0["datatype"]), output0["shape"]
    )
    diffs = shm.get_contents_as_numpy(
        out_handle, utils.triton_to_np_dtype(output1["datatype"]), output1["shape"], offset=size
    )
    np.testing.assert_array_equal(sums[0], input0 + input1)
    np.testing.assert_array_equal(diffs[0], input0 - input1)

    status = client.get_system_shared_memory_status()
    assert sorted(s["name"] for s in status) == ["input_data", "output_data"]
    assert {"name": "input_data", "key": in_key, "offset": 0, "byte_size": size * 2} in status
    assert client.get_system_shared_memory_status("input_data")[0]["key"] == in_key
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []
    assert len(shm.mapped_shared_memory_regions()) == 2  # the client's own, still mapped


def test_simple_http_shm_string_client(
    client: httpclient.InferenceServerClient, regions: list[Any]
) -> None:
    in0 = np.arange(16, dtype=np.int32)
    in1 = np.ones(16, dtype=np.int32)
    data0 = np.array([str(x).encode() for x in in0], dtype=object)
    data1 = np.array([str(x).encode() for x in in1], dtype=object)
    expected_sum = np.array([str(x).encode() for x in in0 + in1], dtype=object)
    expected_diff = np.array([str(x).encode() for x in in0 - in1], dtype=object)
    serialized = [utils.serialize_byte_tensor(a) for a in (data0, data1)]
    in_sizes = [utils.serialized_byte_size(s) for s in serialized]
    out_sizes = [
        utils.serialized_byte_size(utils.serialize_byte_tensor(a))
        for a in (expected_sum, expected_diff)
    ]
    out_handles = []
    for i, size in enumerate(out_sizes):
        handle, key = create_region(regions, f"output{i}_data", size)
        client.register_system_shared_memory(f"output{i}_data", key, size)
        out_handles.append(handle)
    inputs = []
    for i, size in enumerate(in_sizes):
        handle, key = create_region(regions, f"input{i}_data", size)
        shm.set_shared_memory_region(handle, [serialized[i]])
        client.register_system_shared_memory(f"input{i}_data", key, size)
        inputs.append(httpclient.InferInput(f"INPUT{i}", [1, 16], "BYTES"))
        inputs[-1].set_shared_memory(f"input{i}_data", size)
    outputs = []
    for i, size in enumerate(out_sizes):
        outputs.append(httpclient.InferRequestedOutput(f"OUTPUT{i}", binary_data=True))
        outputs[-1].set_shared_memory(f"output{i}_data", size)
    results = client.infer("simple_string", inputs, outputs=outputs)
    got = []
    for i, handle in enumerate(out_handles):
        output = results.get_output(f"OUTPUT{i}")
        dtype = utils.triton_to_np_dtype(output["datatype"])
        got.append(shm.get_contents_as_numpy(handle, dtype, output["shape"])[0])
    np.testing.assert_array_equal(got[0], expected_sum)
    np.testing.assert_array_equal(got[1], expected_diff)


def test_reuse_infer_objects_between_body_and_shared_memory(
    client: httpclient.InferenceServerClient, regions: list[Any]
) -> None:
    # As reuse_infer_objects_client: the same InferInput/InferRequestedOutput objects
    # go with data in the body, then in shared memory, then in the body again.
    input0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    input1 = np.full((1, 16), 3, dtype=np.int32)
    size = input0.nbytes
    in_handle, in_key = create_region(regions, "input_data", size * 2)
    out_handle, out_key = create_region(regions, "output_data", size * 2)
    shm.set_shared_memory_region(in_handle, [input0, input1])
    client.register_system_shared_memory("input_data", in_key, size * 2)
    client.register_system_shared_memory("output_data", out_key, size * 2)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    # As the example: shared memory, the body, shared memory; then the body again.
    for round_ in range(4):
        use_shm = round_ % 2 == 0
        if use_shm:
            shm.set_shared_memory_region(out_handle, [np.zeros(32, np.int32)])  # stale answers
            inputs[0].set_shared_memory("input_data", size)
            inputs[1].set_shared_memory("input_data", size, offset=size)
            outputs[0].set_shared_memory("output_data", size)
            outputs[1].set_shared_memory("output_data", size, offset=size)
        else:
            inputs[0].set_data_from_numpy(input0, binary_data=round_ == 1)
            inputs[1].set_data_from_numpy(input1, binary_data=True)
            outputs[0].unset_shared_memory()
            outputs[1].unset_shared_memory()
        result = client.infer("simple", inputs, outputs=outputs)
        if use_shm:
            sums = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
            diffs = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=size)
        else:
            sums, diffs = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
        np.testing.assert_array_equal(sums, input0 + input1)
        np.testing.assert_array_equal(diffs, input0 - input1)


def _shm_infer(
    client: httpclient.InferenceServerClient,
    region: str,
    byte_size: int,
    offset: int = 0,
    output: tuple[str, int, int] | None = None,
) -> Any:
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(region, byte_size, offset=offset)
    inputs[1].set_data_from_numpy(np.zeros((1, 16), np.int32))
    outputs = [httpclient.InferRequestedOutput("OUTPUT0")]
    if output is not None:
        outputs[0].set_shared_memory(output[0], output[1], offset=output[2])
    return client.infer("simple", inputs, outputs=outputs)


def test_shared_memory_refusals(
    client: httpclient.InferenceServerClient, regions: list[Any]
) -> None:
    handle, key = create_region(regions, "small", 64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    client.register_system_shared_memory("small", key, 64)
    # The input's offset and size must lie within the region.
    with pytest.raises(InferenceServerException, match="past the end of region 'small'"):
        _shm_infer(client, "small", 64, offset=4)
    # The endpoint it names is the server's, not a host path to hide ("<path><name>").
    with pytest.raises(
        InferenceServerException,
        match=r"unable to find system shared memory.*\(POST /v2/systemsharedmemory/region/<name>/",
    ):
        _shm_infer(client, "nowhere", 64)
    with pytest.raises(InferenceServerException, match="needs 64"):
        _shm_infer(client, "small", 60)
    # An output range outside its region is refused before computing; one too small for
    # the answer, after.
    with pytest.raises(InferenceServerException, match="past the end of region 'small'"):
        _shm_infer(client, "small", 64, output=("small", 64, 32))
    with pytest.raises(InferenceServerException, match="too small for the 64 bytes"):
        _shm_infer(client, "small", 64, output=("small", 32, 0))
    # Registering: twice, a missing object, a region past its end, a key that is a path.
    with pytest.raises(InferenceServerException, match="already registered"):
        client.register_system_shared_memory("small", key, 64)
    with pytest.raises(InferenceServerException, match="no shared memory object"):
        client.register_system_shared_memory("other", "/trioinfer_no_such_region", 64)
    with pytest.raises(InferenceServerException, match="past the end of"):
        client.register_system_shared_memory("other", key, 64, offset=8)
    with pytest.raises(InferenceServerException, match="POSIX shared memory name"):
        client.register_system_shared_memory("other", "/../etc/passwd", 64)
    with pytest.raises(InferenceServerException, match="unable to find"):
        client.get_system_shared_memory_status("other")
    # Unregistered, the region is unknown to later requests.
    client.unregister_system_shared_memory("small")
    with pytest.raises(InferenceServerException, match="unable to find system shared memory"):
        _shm_infer(client, "small", 64)
    result = _shm_infer(client, "small", 64) if False else None
    assert result is None


def test_an_unregistered_region_is_unmapped_once_its_requests_answered(
    server: Server, client: httpclient.InferenceServerClient, regions: list[Any]
) -> None:
    # The runner's worker kept its last batch (and so the request's input, a view of the
    # region) while it waited for the next: an idle server kept every unregistered
    # region mapped until more requests came.
    handle, key = create_region(regions, "held", 64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    client.register_system_shared_memory("held", key, 64)
    result = _shm_infer(client, "held", 64)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(16).reshape(1, 16))
    client.unregister_system_shared_memory("held")
    client.get_system_shared_memory_status()  # one more request answered after it
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert f"/dev/shm{key}" not in maps


@pytest.mark.skipif(probe() is None, reason="CUDA is usable here: CUDA shared memory works")
def test_cuda_shared_memory_is_refused_clearly(client: httpclient.InferenceServerClient) -> None:
    # simple_http_cudashm_client clears both registries first: that works; registering does not.
    client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == []
    handle = base64.b64encode(bytes(64))  # as cuda_shared_memory.get_raw_handle gives it
    with pytest.raises(InferenceServerException, match="not supported on this server") as info:
        client.register_cuda_shared_memory("output_data", handle, 0, 64)
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException, match="unable to find CUDA shared memory"):
        client.get_cuda_shared_memory_status("output_data")


def test_cuda_registration_is_checked(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="not valid base64"):
        client.register_cuda_shared_memory("r", b"not base64!", 0, 64)
    with pytest.raises(InferenceServerException, match="of 64 bytes"):
        client.register_cuda_shared_memory("r", base64.b64encode(bytes(8)), 0, 64)
    registry = SystemSharedMemory()
    with pytest.raises(SharedMemoryError, match="device_id must be an integer"):
        registry.register_cuda("r", bytes(64), -1, 64)


def test_registering_needs_the_admin_token(
    repository: Path, tmp_path: Path, regions: list[Any]
) -> None:
    _, key = create_region(regions, "r", 64)
    env = {"TRIOINFER_ADMIN_TOKEN": "s3cret"}
    with (
        run_server(repository, log=tmp_path / "locked.log", env=env) as locked,
        httpx.Client(base_url=locked.url) as http,
    ):
        body = {"key": key, "offset": 0, "byte_size": 64}
        path = "/v2/systemsharedmemory/region/r/register"
        assert http.post(path, json=body).status_code == 401
        assert http.post("/v2/systemsharedmemory/unregister").status_code == 401
        assert http.get("/v2/systemsharedmemory/status").json() == []
        auth = {"authorization": "Bearer s3cret"}
        assert http.post(path, json=body, headers=auth).status_code == 200
        assert http.get("/v2/systemsharedmemory/status").json()[0]["name"] == "r"


def test_a_region_unregistered_while_in_use_stays_mapped_until_released(
    regions: list[Any],
) -> None:
    handle, key = create_region(regions, "r", 64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    registry = SystemSharedMemory()
    registry.register("r", key, 0, 64)
    with registry.lease() as lease:
        lease.check("r", 0, 64)  # as a request whose output goes there, before it computes
        registry.unregister("r")
        assert registry.status() == []
        # A new request is refused...
        with registry.lease() as other, pytest.raises(SharedMemoryError, match="unable to find"):
            other.read("r", 0, 64)
        # ... while the one that holds it still writes its answer and reads the region.
        lease.write("r", 0, 4, [np.int32(7).tobytes()])
        view = lease.read("r", 0, 64)
        assert np.frombuffer(view, np.int32).tolist() == [7, *range(1, 16)]
        region = lease._held["r"]
    # Released, the mapping would close, but a view outlives the lease: it cannot close
    # under the view (Python's mmap refuses), and is closed once the view is gone.
    assert not region.mapping.closed
    assert np.frombuffer(view, np.int32)[0] == 7
    del view
    region.close()
    assert region.mapping.closed


def test_a_region_whose_object_shrank_is_refused(regions: list[Any]) -> None:
    _, key = create_region(regions, "r", 64)
    registry = SystemSharedMemory()
    registry.register("r", key, 0, 64)
    os.truncate(f"/dev/shm{key}", 16)  # reading the mapping past 16 bytes would kill us
    with registry.lease() as lease, pytest.raises(SharedMemoryError, match="now holds 16 bytes"):
        lease.read("r", 0, 8)
    registry.unregister()


def test_views_of_a_region_are_read_only(regions: list[Any]) -> None:
    _, key = create_region(regions, "r", 64)
    registry = SystemSharedMemory()
    registry.register("r", key, 0, 64)
    with registry.lease() as lease:
        view = lease.read("r", 16, 32)
        assert view.readonly
        assert len(view) == 32
        with pytest.raises(SharedMemoryError, match="past the end"):
            lease.read("r", 40, 32)
    registry.unregister()


class FakeDeviceMemory:
    """Stands in for `IpcMemory` (another process's GPU memory) where there is no GPU."""

    opened: ClassVar[list[FakeDeviceMemory]] = []

    def __init__(self, raw_handle: bytes, device_id: int) -> None:
        self.memory = bytearray(raw_handle * 4)  # 256 bytes, filled from the handle
        self.size = len(self.memory)
        self.device_id = device_id
        self.closed = False
        FakeDeviceMemory.opened.append(self)

    def read(self, offset: int, size: int) -> bytearray:
        assert not self.closed
        return self.memory[offset : offset + size]

    def write(self, offset: int, data: bytes) -> None:
        assert not self.closed
        self.memory[offset : offset + len(data)] = data

    def close(self) -> None:
        self.closed = True


def test_cuda_regions_in_the_registry(monkeypatch: pytest.MonkeyPatch, regions: list[Any]) -> None:
    monkeypatch.setattr("trioinfer.server._shm.probe", lambda: None)
    monkeypatch.setattr("trioinfer.server._shm.IpcMemory", FakeDeviceMemory)
    registry = SystemSharedMemory()
    handle = bytes(range(64))
    with pytest.raises(SharedMemoryError, match="past the end of the allocation"):
        registry.register_cuda("gpu", handle, 1, 257)
    assert FakeDeviceMemory.opened[-1].closed
    registry.register_cuda("gpu", handle, 1, 256)
    (device,) = FakeDeviceMemory.opened[-1:]
    assert [attrs.asdict(s) for s in registry.cuda_status()] == [
        {"name": "gpu", "device_id": 1, "byte_size": 256}
    ]
    assert registry.status() == []  # the system registry's status lists system regions only
    _, key = create_region(regions, "sys", 64)
    with pytest.raises(SharedMemoryError, match="already registered"):
        registry.register("gpu", key, 0, 64)  # one name across both kinds
    with registry.lease() as lease:
        assert bytes(lease.read("gpu", 8, 8)) == bytes(range(8, 16))
        assert lease.write("gpu", 0, 4, [b"\xff" * 4]) == 4
        with pytest.raises(SharedMemoryError, match="past the end of region 'gpu'"):
            lease.read("gpu", 250, 8)
        registry.unregister_cuda("gpu")
        assert not device.closed  # held by the request
        lease.write("gpu", 4, 4, [b"\xee" * 4])
    assert device.closed
    assert bytes(device.memory[:8]) == b"\xff" * 4 + b"\xee" * 4
    with pytest.raises(SharedMemoryError, match="unable to find CUDA shared memory region"):
        registry.cuda_status("gpu")


# == Triton's wording ===================================================================


def test_unknown_model_wording(client: httpclient.InferenceServerClient) -> None:
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("wrong_model_name", inputs)
    assert info.value.message().startswith("Request for unknown model")
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", inputs, model_version="7")
    assert info.value.message().startswith("Request for unknown model")


def test_simple_http_model_control(client: httpclient.InferenceServerClient) -> None:
    client.load_model("simple")
    assert client.is_model_ready("simple")
    # A config override that is not even JSON.
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    # Triton's keys, as JSON (max_batch_size as a string, as protobuf's JSON allows).
    client.load_model("simple", config='{"max_batch_size":"16"}')
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]  # the rest is kept
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("wrong_model_name")
    # An override with a key config.pbtxt does not have names it.
    with pytest.raises(InferenceServerException, match=r"failed to load.*'batcher'"):
        client.load_model("simple", config='{"batcher": "none"}')
    client.load_model("simple")
    assert client.get_model_config("simple")["max_batch_size"] == 8


def test_config_toml_model_takes_triton_keys_in_an_override(
    repository: Path, tmp_path: Path
) -> None:
    root = tmp_path / "repo"
    write_simple(root / "plain" / "1" / "model.onnx")
    (root / "plain" / "config.toml").write_text(
        'max_queue_size = 10\nlabels = { OUTPUT0 = "sums.txt" }\n'
    )
    (root / "plain" / "sums.txt").write_text("".join(f"sum{i}\n" for i in range(16)))
    with (
        run_server(root, log=tmp_path / "plain.log") as running,
        httpclient.InferenceServerClient(running.address) as triton,
    ):
        triton.load_model("plain", config=json.dumps({"max_batch_size": 4}))
        config = triton.get_model_config("plain")
        assert config["max_batch_size"] == 4
        assert own_setting(config, "batcher") == "dynamic"
        assert own_setting(config, "max_queue_size") == 10
        # Classification with labels from config.toml's `labels`.
        inputs = [httpclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
        inputs[0].set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        inputs[1].set_data_from_numpy(np.ones((1, 16), np.int32))
        top = [httpclient.InferRequestedOutput("OUTPUT0", class_count=2)]
        result = triton.infer("plain", inputs, outputs=top)
        assert result.as_numpy("OUTPUT0").tolist() == [[b"16:15:sum15", b"15:14:sum14"]]


def test_labels_in_config_toml_are_checked(tmp_path: Path) -> None:
    from trioinfer.server import ModelRepository

    write_simple(tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "config.toml").write_text('labels = "labels.txt"\n')
    with pytest.raises(ConfigError, match="labels must be a table of output"):
        ModelRepository(tmp_path).entry("m")
    (tmp_path / "m" / "config.toml").write_text('labels = { OUTPUT0 = "../x.txt" }\n')
    entry = ModelRepository(tmp_path).entry("m")
    # Said as a labels file, not as config.toml's path of a model file.
    with pytest.raises(ConfigError) as info:
        entry.labels(None)
    assert str(info.value) == (
        "model 'm': output 'OUTPUT0' labels file '../x.txt': must be a relative path to a file "
        "inside the model directory, e.g. 'labels.txt': a file, not absolute, no '..', and '/' "
        "as the separator"
    )


# == config.pbtxt ===========================================================================


async def test_default_model_filename_names_the_file_in_each_version(tmp_path: Path) -> None:
    # Triton reads <version>/<default_model_filename>; trioinfer refused any name but
    # model.onnx.
    from trioinfer.server import ModelRepository

    for version in (1, 2):
        write_simple(tmp_path / "m" / str(version) / "simple.onnx")
    write_simple(tmp_path / "m" / "3" / "model.onnx")  # not the configured name: no version
    (tmp_path / "m" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\ndefault_model_filename: "simple.onnx"\n'
        "version_policy { all { } }\n"
    )
    entry = ModelRepository(tmp_path).entry("m")
    assert entry.versions == (1, 2)
    assert entry.model_file == "simple.onnx"
    assert "ignored version directory 3 (it holds no simple.onnx)" in entry.notes
    config = entry.config(2)
    assert (config.path.parent.name, config.path.name) == ("2", "simple.onnx")
    async with trioinfer.open_engine() as engine:
        await engine.load(config)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        outputs = await engine.infer("m", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(outputs["OUTPUT0"], a + a)
    # A load override may repeat the name, not change it: the versions were found by it.
    assert entry.config(1, {"default_model_filename": "simple.onnx"}).path.name == "simple.onnx"
    with pytest.raises(ConfigError, match="may not change default_model_filename"):
        entry.config(1, {"default_model_filename": "other.onnx"})


def test_triton_config_is_served_as_triton_shaped(
    client: httpclient.InferenceServerClient,
) -> None:
    config = client.get_model_config("simple")
    assert config["name"] == "simple"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == 8
    # As Triton prints it: every field of the message, at its default when unset.
    assert config["input"][0] == {
        "name": "INPUT0",
        "data_type": "TYPE_INT32",
        "dims": [16],
        **INPUT_DEFAULTS,
    }
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [4, 8],
        "max_queue_delay_microseconds": 500,
        "preserve_ordering": False,
        "priority_levels": 0,
        "default_priority_level": 0,
        "priority_queue_policy": {},
    }
    assert config["instance_group"] == [
        {"name": "simple_0", "kind": "KIND_CPU", "count": 2, "gpus": [], **GROUP_DEFAULTS}
    ]
    assert config["default_model_filename"] == ""
    # No backend parameters; trioinfer's own settings are parameters with its prefix.
    assert all(key.startswith("trioinfer.") for key in config["parameters"])
    assert own_setting(config, "batcher_options")["max_queue_delay"] == 0.0005
    assert [i["count"] for i in own_setting(config, "instances")] == [2]
    # Without input and output in config.pbtxt, they come from the model (auto-complete).
    classifier = client.get_model_config("classifier")
    assert classifier["input"] == [
        {"name": "IMAGE", "data_type": "TYPE_FP32", "dims": [5], **INPUT_DEFAULTS}
    ]
    assert classifier["dynamic_batching"]["priority_levels"] == 3


async def test_an_instance_group_without_count_is_answered_with_count_1(tmp_path: Path) -> None:
    # Triton normalizes a group's unset count to the one instance it runs; /config said
    # count 0 (the field's protobuf default) for a group that runs one instance.
    write_simple(tmp_path / "c" / "1" / "model.onnx")
    pbtxt = SIMPLE_PBTXT.replace('name: "simple"', 'name: "c"')
    pbtxt = pbtxt.replace("{ kind: KIND_CPU count: 2 }", "{ kind: KIND_CPU }")
    (tmp_path / "c" / "config.pbtxt").write_text(pbtxt)
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(
            partial(serve_http, tmp_path, host="127.0.0.1", port=0, handle_signals=False)
        )
        async with httpx.AsyncClient(base_url=listening.urls[0]) as http:
            config = (await http.get("/v2/models/c/config")).json()
        nursery.cancel_scope.cancel()
    assert config["instance_group"] == [
        {"name": "c_0", "kind": "KIND_CPU", "count": 1, "gpus": [], **GROUP_DEFAULTS}
    ]
    assert [group["count"] for group in own_setting(config, "instances")] == [1]


CUDA_REASON = probe_device(Device("cuda", 0))
#: What Triton prints of a ModelInput, or a ModelInstanceGroup, that leaves them unset.
INPUT_DEFAULTS = {
    "format": "FORMAT_NONE",
    "is_shape_tensor": False,
    "allow_ragged_batch": False,
    "optional": False,
}
GROUP_DEFAULTS = {"profile": [], "passive": False, "host_policy": ""}


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here; this checks the fallback")
async def test_a_gpu_instance_group_that_runs_on_the_cpu_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The ONNX Runtime backend falls back to the CPU (cpu_fallback, on by default) and
    # says why; /config then says what runs, not what config.pbtxt asked for.
    write_simple(tmp_path / "g" / "1" / "model.onnx")
    pbtxt = SIMPLE_PBTXT.replace('name: "simple"', 'name: "g"')
    pbtxt = pbtxt.replace("{ kind: KIND_CPU count: 2 }", "{ kind: KIND_GPU count: 2 }")
    (tmp_path / "g" / "config.pbtxt").write_text(pbtxt)
    with caplog.at_level(logging.WARNING):
        async with trio.open_nursery() as nursery:
            listening = await nursery.start(
                partial(serve_http, tmp_path, host="127.0.0.1", port=0, handle_signals=False)
            )
            async with httpx.AsyncClient(base_url=listening.urls[0]) as http:
                config = (await http.get("/v2/models/g/config")).json()
                # What /config says loads back as it is, and says the same again.
                reload = await http.post(
                    "/v2/repository/models/g/load",
                    json={"parameters": {"config": json.dumps(config)}},
                )
                assert reload.status_code == 200, reload.text
                again = (await http.get("/v2/models/g/config")).json()
            nursery.cancel_scope.cancel()
    assert config["instance_group"] == [
        {"name": "g_0", "kind": "KIND_CPU", "count": 2, "gpus": [], **GROUP_DEFAULTS}
    ]
    assert own_setting(config, "instances")[0]["device"] == "cuda:0"  # what was asked
    # Loaded back, it asks for the CPU and runs there: the same answer, now as asked.
    assert own_setting(again, "instances")[0]["device"] == "cpu"
    del again["parameters"]["trioinfer.instances"], config["parameters"]["trioinfer.instances"]
    assert again == config
    backend = [r.getMessage() for r in caplog.records if r.name == "trioinfer.onnxruntime"]
    assert len(backend) == 2
    assert all("cuda:0 is not usable (" in m and "running on the CPU" in m for m in backend)
    (server,) = [r.getMessage() for r in caplog.records if r.name == "trioinfer.server"]
    assert server == (
        "model 'g' version 1: its instance_group asked for KIND_GPU (cuda:0 x2) but runs on "
        "cpu, cpu; the backend's warnings above say why, and GET /v2/models/g/config reports "
        "the instance_group that runs (KIND_CPU)"
    )


def test_simple_http_infer_client_on_a_triton_repository(
    client: httpclient.InferenceServerClient,
) -> None:
    input0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    input1 = np.ones((1, 16), dtype=np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(input0, binary_data=False)
    inputs[1].set_data_from_numpy(input1, binary_data=True)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    result = client.infer(
        "simple",
        inputs,
        outputs=outputs,
        query_params={"test_1": 1, "test_2": 2},
        request_compression_algorithm="gzip",
        response_compression_algorithm="deflate",
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), input0 + input1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), input0 - input1)
    assert len(client.get_inference_statistics("simple")["model_stats"]) == 1
    result = client.infer("simple", inputs, outputs=None, request_compression_algorithm="deflate")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), input0 + input1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), input0 - input1)


def test_bytes_data_that_holds_numbers_is_a_400(server: Server) -> None:
    # A JSON BYTES input whose data are numbers: refused before the model, which would
    # have taken each number's str() without a word, and saying which element it was.
    strings = {"name": "INPUT1", "shape": [1, 16], "datatype": "BYTES", "data": ["1"] * 16}
    numbers = {**strings, "name": "INPUT0", "data": ["1"] * 3 + [4] + ["1"] * 12}
    with httpx.Client(base_url=server.url) as http:
        answer = http.post("/v2/models/simple_string/infer", json={"inputs": [numbers, strings]})
    assert answer.status_code == 400
    assert "input 'INPUT0'" in answer.json()["error"]
    assert "BYTES data must be strings; got 4 at index 3" in answer.json()["error"]


def test_ensemble_runs_as_a_pipeline(client: httpclient.InferenceServerClient) -> None:
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = [
        httpclient.InferInput("A", [2, 16], "INT32"),
        httpclient.InferInput("B", [2, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer("ensemble", inputs)
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + a)
    config = client.get_model_config("ensemble")
    assert config["platform"] == "ensemble"
    assert client.get_model_metadata("ensemble")["platform"] == "ensemble"
    assert config["ensemble_scheduling"]["step"][0]["model_name"] == "simple"


def test_bad_triton_configs_are_named(client: httpclient.InferenceServerClient) -> None:
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["unsupported"]["state"] == "UNAVAILABLE"
    assert "cpu_execution_accelerator 'openvino' is not supported" in index["unsupported"]["reason"]
    assert index["wrong_dims"]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("wrong_dims")
    assert "failed to load 'wrong_dims'" in info.value.message()
    assert "input 'INPUT0' with shape [-1, 15]" in info.value.message()
    assert "the graph's is [batch, 16]" in info.value.message()
    assert not client.is_model_ready("wrong_dims")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('platform: "tensorrt_plan"', "not served by trioinfer"),
        ("max_batch_size: 0\ndynamic_batching { }", "needs max_batch_size > 0"),
        (
            "max_batch_size: 2\n"
            "dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
            "DELAY is not supported",
        ),
        ("instance_group [ { kind: KIND_GPU gpus: [0, 0] } ]", "distinct GPU numbers"),
        ("instance_group [ { kind: KIND_MODEL } ]", "KIND_MODEL is not supported"),
        ('default_model_filename: "../m.onnx"', "default_model_filename must be a file name"),
        (
            'default_model_filename: "1/m.onnx"',
            "e.g. 'model.onnx' .no directories.; got '1/m.onnx'",
        ),
        (
            "instance_group [ { kind: KIND_CPU count: 100000 } ]",
            "instance_group count 100000 is more than a model may have: at most 256",
        ),
        ('instance_group [ { kind: KIND_CPU profile: "p" } ]', "sets profile"),
        (
            'output [ { name: "y" dims: [ 2 ] reshape { shape: [1] } } ]',
            "output 'y' reshape [1] holds 1 elements; its dims [2] hold 2",
        ),
        ("max_batch_size: 2\ndynamic_batching { priority_levels: 2 }", "default_priority_level"),
        (
            # A uint64 count of levels once kept the server busy, unanswering, building
            # a queue policy for each.
            "max_batch_size: 2\n"
            "dynamic_batching { priority_levels: 1099511627776 default_priority_level: 1 }",
            "priority_levels 1099511627776 is more than trioinfer serves: at most 65536",
        ),
        ('name: "other"', "differs from the directory's name"),
        ('platform: "ensemble"', "needs ensemble_scheduling"),
        ("sequence_batching { iterative_sequence: true }", "sets iterative_sequence"),
        (
            "sequence_batching { oldest { max_queue_delay_microseconds: 100 } }",
            "oldest.max_queue_delay_microseconds is not supported",
        ),
        (
            "sequence_batching { direct { minimum_slot_utilization: 0.5 } }",
            "direct sets minimum_slot_utilization",
        ),
        (
            'sequence_batching { control_input [ { name: "S" control [ { kind: '
            "CONTROL_SEQUENCE_START int32_false_true: [ 1, 0 ] } ] } ] }",
            "int32_false_true must be [0, 1], got [1, 0]",
        ),
        (
            'sequence_batching { control_input [ { name: "S" control [ { kind: '
            "CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 2 ] } ] } ] }",
            "fp32_false_true must be [0, 1]",
        ),
        (
            'sequence_batching { control_input [ { name: "S" control [ { kind: '
            "CONTROL_SEQUENCE_END } ] } ] }",
            "needs one of int32_false_true",
        ),
        (
            'sequence_batching { control_input [ { name: "S" control [ { kind: '
            "CONTROL_SEQUENCE_START int32_false_true: [0, 1] }, { kind: CONTROL_SEQUENCE_END "
            "int32_false_true: [0, 1] } ] } ] }",
            "exactly one control",
        ),
        (
            'sequence_batching { state [ { input_name: "a" output_name: "b" dims: [ -1 ] } ] }',
            "growable state is not supported",
        ),
        (
            'sequence_batching { state [ { input_name: "a" output_name: "b" dims: [ 1 ] '
            'initial_state { data_file: "init.bin" } } ] }',
            "data_file is not supported",
        ),
        (
            'sequence_batching { state [ { input_name: "a" output_name: "b" '
            "use_growable_memory: true } ] }",
            "sets use_growable_memory",
        ),
        ("sequence_batching { direct { } oldest { } }", "config.pbtxt"),
        ("max_batch_size: [", "config.pbtxt"),
        (
            'parameters { key: "trioinfer.max_queue_size" value { string_value: "ten" } }',
            "parameters 'trioinfer.max_queue_size' must hold JSON",
        ),
        (
            'parameters { key: "trioinfer.path" value { string_value: "x" } }',
            "'trioinfer.path' is not a trioinfer setting",
        ),
        (
            'platform: "ensemble" parameters { key: "threads" value { string_value: "1" } }',
            "an ensemble takes no parameters .*; got threads",
        ),
        # trioinfer.sequence beside sequence_batching, malformed: a 500 (TypeError) once.
        (
            'sequence_batching { state [ { input_name: "a" output_name: "b" } ] } '
            'parameters { key: "trioinfer.sequence" value { string_value: "{\\"state\\": 5}" } }',
            "parameters 'trioinfer.sequence': its state must be a list of tables",
        ),
        (
            'sequence_batching { state [ { input_name: "a" output_name: "b" } ] } '
            'parameters { key: "trioinfer.sequence" value { string_value: '
            '"{\\"state\\": [{\\"input\\": [1], \\"initial\\": 1}]}" } }',
            "parameters 'trioinfer.sequence': its state must be a list of tables",
        ),
    ],
)
def test_triton_config_refusals(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        TritonModel.parse(text, name="m", where="m/config.pbtxt")


@pytest.mark.sequence
def test_sequence_batching_maps_onto_the_sequence_table() -> None:
    model = TritonModel.parse(
        """
        max_batch_size: 4
        sequence_batching {
          max_sequence_idle_microseconds: 2500000
          oldest { max_candidate_sequences: 3 preferred_batch_size: [ 2 ] preserve_ordering: true }
          control_input [
            { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
            { name: "E" control [
              { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
            { name: "R" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
            { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
          ]
          state [ {
            input_name: "SI" output_name: "SO" data_type: TYPE_INT32 dims: [ 2 ]
            initial_state { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true name: "z" }
          } ]
        }
        """,
        name="m",
        where="m/config.pbtxt",
    )
    assert model.settings == {
        "batcher": "sequence",
        "sequence": {
            "max_batch_size": 4,
            "max_sequence_idle": 2.5,
            "strategy": "oldest",
            "max_candidate_sequences": 3,
            "control": {"start": "S", "end": "E", "ready": "R", "corrid": "C"},
            "state": [{"input": "SI", "output": "SO", "shape": [2]}],
        },
    }
    assert len(model.notes) == 2  # preferred_batch_size and preserve_ordering: no effect
    config = trioinfer.ModelConfig(name="m", path="m.onnx", **model.settings)
    assert config.sequence is not None
    assert config.sequence.max_candidate_sequences == 3
    assert model.json()["sequence_batching"]["max_sequence_idle_microseconds"] == 2500000
    # Triton's default strategy is direct; a model without a batch dimension has one row.
    plain = TritonModel.parse("sequence_batching { }", name="m", where="m/config.pbtxt")
    assert plain.settings["sequence"] == {
        "max_batch_size": 1,
        "strategy": "direct",
        "control": {},
        "state": [],
    }


@pytest.mark.sequence
def test_own_parameters_fill_what_tritons_fields_leave_unsaid() -> None:
    # A state's non-zero initial value, which sequence_batching cannot say.
    state = {"input": "S_IN", "output": "S_OUT", "initial": 5}
    sequence = json.dumps(json.dumps({"state": [state]}))  # a JSON string in protobuf text
    text = (
        'sequence_batching { state [ { input_name: "S_IN" output_name: "S_OUT" } ] }\n'
        f'parameters {{ key: "trioinfer.sequence" value {{ string_value: {sequence} }} }}\n'
        'parameters { key: "trioinfer.max_queue_size" value { string_value: "9" } }'
    )
    model = TritonModel.parse(text, name="m", where="m/config.pbtxt")
    assert model.settings["sequence"]["state"] == [state]
    assert model.settings["max_queue_size"] == 9
    assert "backend_options" not in model.settings  # trioinfer.* are no backend options
    # A batched pipeline (GET .../config of read_digit): its batcher and options kept,
    # the batch size max_batch_size's; Triton's own dynamic_batching fields win likewise.
    ensemble = {
        "platform": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "A", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "B", "data_type": "TYPE_INT32", "dims": [1]}],
        "ensemble_scheduling": {
            "step": [{"model_name": "s", "input_map": {"x": "A"}, "output_map": {"y": "B"}}]
        },
        "parameters": own_parameters(
            {
                "batcher": "dynamic",
                "batcher_options": {"max_batch_size": 32, "max_queue_delay": 0.002},
            }
        ),
    }
    settings = TritonModel.parse(ensemble, name="p", where="p").settings
    assert settings["batcher"] == "dynamic"
    assert settings["batcher_options"] == {"max_batch_size": 8, "max_queue_delay": 0.002}
    batched = {
        "max_batch_size": 4,
        "dynamic_batching": {"max_queue_delay_microseconds": 100},
        "parameters": own_parameters(
            {"batcher": "dynamic", "batcher_options": {"max_batch_size": 2, "pad_axis": 1}}
        ),
    }
    options = TritonModel.parse(batched, name="m", where="m").settings["batcher_options"]
    assert options == {"max_batch_size": 4, "max_queue_delay": 0.0001, "pad_axis": 1}


def test_triton_config_mapping() -> None:
    model = TritonModel.parse(
        """
        max_batch_size: 8
        dynamic_batching {
          preferred_batch_size: [ 2, 4 ]
          max_queue_delay_microseconds: 250
          priority_levels: 2
          default_priority_level: 2
          default_queue_policy { max_queue_size: 10 default_timeout_microseconds: 5000 }
          priority_queue_policy { key: 1 value { max_queue_size: 3 } }
        }
        instance_group [ { kind: KIND_GPU count: 2 gpus: [ 1, 2 ] }, { kind: KIND_CPU } ]
        parameters { key: "threads" value { string_value: "2" } }
        version_policy { specific { versions: [ 1, 3 ] } }
        response_cache { enable: true }
        """,
        name="m",
        where="m/config.pbtxt",
    )
    assert model.settings == {
        "scheduler": "priority",
        "batcher": "dynamic",
        "batcher_options": {
            "max_batch_size": 8,
            "max_queue_delay": 0.00025,
            "preferred_batch_sizes": [2, 4],
        },
        # Level 1 (Triton's highest) is the engine's higher priority.
        "queue_timeouts": {"0": 0.005},
        "queue_sizes": {"1": 3, "0": 10},
        "instances": [
            {"device": "cuda:1", "count": 2},
            {"device": "cuda:2", "count": 2},
            {"device": "cpu", "count": 1},
        ],
        "backend_options": {"threads": 2},
        "response_cache": True,
    }
    assert model.version_policy == {"specific": [1, 3]}
    assert [model.engine_priority(level) for level in (0, 1, 2)] == [0, 1, 0]


def test_a_triton_priority_that_is_no_level_of_the_model_is_its_default_level() -> None:
    # As Triton's InferenceRequest::SetPriority: 0 and a level past priority_levels take
    # the default level, so a client that sends one priority to every model is served by
    # each (Triton's priority is unsigned: a negative one reads as a huge level).
    model = TritonModel.parse(
        "max_batch_size: 8\ndynamic_batching { priority_levels: 3 default_priority_level: 2 }",
        name="m",
        where="m/config.pbtxt",
    )
    levels = (0, 1, 2, 3, 4, 2**31, -1)
    assert [model.engine_priority(level) for level in levels] == [1, 2, 1, 0, 1, 1, 1]
    served: Any = SimpleNamespace(triton=model, model="m")  # all it reads of a ServedVersion
    assert schedule_parameters({"priority": 4}, served) == (1, None)
    assert schedule_parameters({"priority": 1, "timeout": 5}, served) == (2, 5e-06)
    with pytest.raises(RequestError, match="from -2\\*\\*31 to 2\\*\\*31"):
        schedule_parameters({"priority": 2**31 + 1}, served)


def test_per_level_queue_bounds_are_not_cut_short_by_the_default_whole_queue_bound() -> None:
    # Triton bounds each level's queue and nothing else. With every level bounded, the
    # whole queue holds up to their sum: trioinfer's default max_queue_size (1024)
    # refused requests long before the levels' bounds were reached.
    text = (
        "max_batch_size: 8\ndynamic_batching { priority_levels: 2 default_priority_level: 2 "
        "default_queue_policy { max_queue_size: 1000 } "
        "priority_queue_policy { key: 1 value { max_queue_size: 600 } } }"
    )
    model = TritonModel.parse(text, name="m", where="m/config.pbtxt")
    assert model.settings["queue_sizes"] == {"1": 600, "0": 1000}
    assert model.settings["max_queue_size"] == 1600
    assert trioinfer.ModelConfig(name="m", **model.settings).max_queue_size == 1600
    # trioinfer's own max_queue_size, when the configuration gives one, still holds.
    own = text + '\nparameters { key: "trioinfer.max_queue_size" value { string_value: "50" } }'
    assert TritonModel.parse(own, name="m", where="m/config.pbtxt").settings["max_queue_size"] == 50
    # Bounds whose sum is within the default change nothing; nor does a level left
    # unbounded (Triton's queue is unbounded then; trioinfer's default bound holds).
    small = TritonModel.parse(
        "max_batch_size: 8\ndynamic_batching { priority_levels: 2 default_priority_level: 2 "
        "default_queue_policy { max_queue_size: 10 } }",
        name="m",
        where="m/config.pbtxt",
    )
    assert "max_queue_size" not in small.settings
    partial = TritonModel.parse(
        "max_batch_size: 8\ndynamic_batching { priority_levels: 2 default_priority_level: 2 "
        "priority_queue_policy { key: 1 value { max_queue_size: 2000 } } }",
        name="m",
        where="m/config.pbtxt",
    )
    assert "max_queue_size" not in partial.settings


def test_without_priority_levels_every_request_has_the_default_queue_policy() -> None:
    # Triton serves every request of a model without priority_levels at one level: a
    # client's priority changes nothing, and default_queue_policy's timeout holds for
    # all. It held only for priority 0 (queue_timeouts' level), so a request that sent
    # priority=2 waited in the queue for as long as it took.
    model = TritonModel.parse(
        "max_batch_size: 8\n"
        "dynamic_batching { default_queue_policy { default_timeout_microseconds: 5000 } }",
        name="m",
        where="m/config.pbtxt",
    )
    assert model.settings["queue_timeouts"] == {"0": 0.005}
    for scheduler in ("fifo", "deadline", "fair"):
        served: Any = SimpleNamespace(
            triton=model, model="m", config=trioinfer.ModelConfig(name="m", scheduler=scheduler)
        )
        assert schedule_parameters({"priority": 2}, served) == (0, None)
    # A scheduler that reads priorities (chosen by trioinfer's own parameters, or a
    # config.toml model's) keeps them: its levels are trioinfer's.
    served = SimpleNamespace(
        triton=model, model="m", config=trioinfer.ModelConfig(name="m", scheduler="priority")
    )
    assert schedule_parameters({"priority": 2}, served) == (2, None)
    # Without a queue timeout of Triton's, the priority is passed on as it is, to the
    # queue_timeouts trioinfer's own parameters may give per level.
    own = json.dumps({"1": 0.5})
    plain = TritonModel.parse(
        f'max_batch_size: 8\nparameters {{ key: "trioinfer.queue_timeouts" '
        f"value {{ string_value: {json.dumps(own)} }} }}",
        name="m",
        where="m/config.pbtxt",
    )
    assert plain.settings["queue_timeouts"] == {"1": 0.5}
    served = SimpleNamespace(triton=plain, model="m", config=trioinfer.ModelConfig(name="m"))
    assert schedule_parameters({"priority": 1}, served) == (1, None)


def test_a_config_pbtxt_without_protobuf_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "google.protobuf", None)
    with pytest.raises(ConfigError, match=r"the 'triton' extra"):
        TritonModel.parse('platform: "onnxruntime_onnx"', name="m", where="m/config.pbtxt")


def _repeated(field: Any) -> bool:
    # protobuf 7 dropped FieldDescriptor.label for is_repeated.
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == field.LABEL_REPEATED)


def test_message_definitions_match_tritons() -> None:
    # tritonclient ships Triton's own model_config_pb2 (in its grpc package, which
    # needs grpcio to import, so the file is loaded on its own here).
    import tritonclient

    path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("_triton_model_config_pb2", path)
    assert spec is not None
    assert spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    checked: list[str] = []

    def walk(mine: Any, theirs: Any, where: str) -> None:
        for field in mine.fields:
            other = theirs.fields_by_name.get(field.name)
            assert other is not None, f"{where}.{field.name} is not Triton's"
            assert (field.number, field.type, _repeated(field)) == (
                other.number,
                other.type,
                _repeated(other),
            ), f"{where}.{field.name}"
            checked.append(f"{where}.{field.name}")
            if field.message_type is not None:
                walk(field.message_type, other.message_type, f"{where}.{field.name}")
            if field.enum_type is not None:
                for value in field.enum_type.values:
                    assert other.enum_type.values_by_name[value.name].number == value.number

    walk(_model_config_class().DESCRIPTOR, reference.ModelConfig.DESCRIPTOR, "ModelConfig")
    assert len(checked) > 50


# == classification ===========================================================================


def test_classification_with_labels(client: httpclient.InferenceServerClient) -> None:
    # As ensemble_image_client asks: the top 3 classes of each image, with labels.
    scores = np.array([[0.1, 0.7, 0.05, 0.9, 0.7], [5, 4, 3, 2, 1]], dtype=np.float32)
    inputs = [httpclient.InferInput("IMAGE", [2, 5], "FP32")]
    inputs[0].set_data_from_numpy(scores)
    outputs = [httpclient.InferRequestedOutput("SCORES", binary_data=True, class_count=3)]
    result = client.infer("classifier", inputs, outputs=outputs)
    top = result.as_numpy("SCORES")
    assert top.shape == (2, 3)
    assert [t.decode() for t in top[0]] == ["0.900000:3:fish", "0.700000:1:dog", "0.700000:4:frog"]
    assert [t.decode().split(":")[2] for t in top[1]] == ["cat", "dog", "bird"]
    # More classes than there are: every class.
    outputs = [httpclient.InferRequestedOutput("SCORES", binary_data=False, class_count=9)]
    result = client.infer("classifier", inputs, outputs=outputs)
    assert result.as_numpy("SCORES").shape == (2, 5)


def test_classification_through_an_ensemble(client: httpclient.InferenceServerClient) -> None:
    # ensemble_image_client: one input in the config, max_batch_size as the batch, and
    # "score:index:label" per class, parsed from bytes.
    config = client.get_model_config("classify_ensemble")
    assert len(config["input"]) == 1
    assert config["max_batch_size"] == 4
    scores = np.array([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], dtype=np.float32)
    inputs = [httpclient.InferInput("RAW", list(scores.shape), "FP32")]
    inputs[0].set_data_from_numpy(scores)
    outputs = [httpclient.InferRequestedOutput("CLASSES", binary_data=True, class_count=2)]
    result = client.infer("classify_ensemble", inputs, outputs=outputs)
    classes = result.as_numpy("CLASSES")
    assert len(classes) == 2
    parsed = [["".join(chr(x) for x in item).split(":") for item in row] for row in classes]
    assert parsed == [
        [["5.000000", "4", "cat"], ["4.000000", "3", "dog"]],
        [["5.000000", "0", "frog"], ["4.000000", "1", "fish"]],
    ]


def test_triton_priority_levels(server: Server, client: httpclient.InferenceServerClient) -> None:
    inputs = [httpclient.InferInput("IMAGE", [1, 5], "FP32")]
    inputs[0].set_data_from_numpy(np.zeros((1, 5), np.float32))
    # 4 is no level of the model's: as in Triton, it is served at the default level.
    for level in (0, 1, 3, 4):
        client.infer("classifier", inputs, priority=level)


def test_server_metadata_lists_the_extensions(client: httpclient.InferenceServerClient) -> None:
    extensions = client.get_server_metadata()["extensions"]
    assert {"system_shared_memory", "classification", "model_configuration"} <= set(extensions)


def test_no_region_is_left_behind() -> None:
    # This process's regions only: other test runs on the machine make their own.
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(REGION_PREFIX)]
    assert leftovers == []


def test_triton_onnxruntime_parameters_take_trioinfer_names() -> None:
    # Triton's ONNX configs set these often; each has a trioinfer setting of another name.
    model = TritonModel.parse(
        """
        max_batch_size: 8
        instance_group [ { kind: KIND_GPU count: 2 }, { kind: KIND_CPU } ]
        parameters { key: "intra_op_thread_count" value { string_value: "4" } }
        parameters { key: "inter_op_thread_count" value { string_value: "2" } }
        parameters { key: "execution_mode" value { string_value: "1" } }
        """,
        name="m",
        where="m/config.pbtxt",
    )
    assert model.settings["instances"] == [
        {"device": "cuda:0", "count": 2, "threads": 4},
        {"device": "cpu", "count": 1, "threads": 4},
    ]
    assert model.settings["backend_options"] == {
        "inter_op_threads": 2,
        "execution_mode": "parallel",
    }
    # Without instance_group: the one CPU instance a config would get anyway.
    model = TritonModel.parse(
        'parameters { key: "intra_op_thread_count" value { string_value: "1" } }',
        name="m",
        where="m/config.pbtxt",
    )
    assert model.settings["instances"] == [{"device": "cpu", "count": 1, "threads": 1}]
    assert model.settings["backend_options"] == {}
    with pytest.raises(ConfigError, match=r"intra_op_thread_count must be an integer >= 0"):
        TritonModel.parse(
            'parameters { key: "intra_op_thread_count" value { string_value: "many" } }',
            name="m",
            where="m/config.pbtxt",
        )
    with pytest.raises(ConfigError, match=r"both inter_op_thread_count and inter_op_threads"):
        TritonModel.parse(
            'parameters { key: "inter_op_thread_count" value { string_value: "1" } }\n'
            'parameters { key: "inter_op_threads" value { string_value: "1" } }',
            name="m",
            where="m/config.pbtxt",
        )


# == load overrides as Triton's clients send them ==============================================


def test_the_config_answered_can_be_sent_back_in_a_load_override(
    client: httpclient.InferenceServerClient,
) -> None:
    # Triton's clients fetch the config, change a field and load with it. The name and
    # version_policy it holds were refused ("may not set 'name'"), and the instance_group
    # worked out for a config.pbtxt without one held a "device" key that Triton's
    # ModelInstanceGroup has no field for.
    for model in ("simple", "classifier"):
        config = client.get_model_config(model)
        config["max_batch_size"] = 16
        client.load_model(model, config=json.dumps(config))
        assert client.get_model_config(model)["max_batch_size"] == 16
        client.load_model(model)
    groups = client.get_model_config("classifier")["instance_group"]
    assert groups == [
        {"name": "classifier_0", "kind": "KIND_CPU", "count": 1, "gpus": [], **GROUP_DEFAULTS}
    ]
    # Every config answered loads back unchanged: loaded with it, a model answers it again
    # (the parts worked out from the model and those config.pbtxt gives print alike, with
    # their defaults; an ensemble answers no backend and no instance_group, which Triton
    # refuses in one).
    for model in ("simple", "simple_string", "classifier", "ensemble", "classify_ensemble"):
        answered = client.get_model_config(model)
        client.load_model(model, config=json.dumps(answered))
        assert client.get_model_config(model) == answered, model
        client.load_model(model)
    # Another name, or another version policy, is still refused, and says why.
    with pytest.raises(InferenceServerException, match="differs from the directory's name"):
        client.load_model("simple", config=json.dumps({"name": "other"}))
    # The keys earlier releases answered beside Triton's are not Triton's: named, and where
    # trioinfer's settings are now.
    old = {**client.get_model_config("simple"), "version": "1", "trioinfer": {}}
    with pytest.raises(InferenceServerException, match=r"'trioinfer', 'version'.*parameters"):
        client.load_model("simple", config=json.dumps(old))


def test_a_load_override_replaces_the_field_a_config_pbtxt_gets_wrong(tmp_path: Path) -> None:
    # As in Triton, whose override replaces the file: the file's fields were judged (and
    # DELAY refused) before the override's replaced them, so no override could fix it.
    from trioinfer.server import ModelRepository

    write_simple(tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "config.pbtxt").write_text(
        "max_batch_size: 8\ndynamic_batching { default_queue_policy { timeout_action: DELAY } }\n"
    )
    repository = ModelRepository(tmp_path)
    with pytest.raises(ConfigError, match="DELAY is not supported"):
        repository.entry("m")
    override = {"dynamic_batching": {"max_queue_delay_microseconds": 100}}
    entry = repository.entry("m", override)
    assert entry.config(1, override).batcher_options["max_queue_delay"] == 0.0001
    # Served so, the repository index lists it as ready, not with the file's refusal.
    with (
        run_server(tmp_path, log=tmp_path / "server.log") as running,
        httpclient.InferenceServerClient(running.address) as triton,
    ):
        triton.load_model("m", config=json.dumps(override))
        index = [row for row in triton.get_model_repository_index() if row["name"] == "m"]
        assert index == [{"name": "m", "version": "1", "state": "READY", "reason": ""}]
    # An override that brings the refused field itself says so, and where it came from.
    with pytest.raises(ConfigError, match=r"config.pbtxt with the config override: .*DELAY"):
        repository.entry("m", {"max_batch_size": 4})


def test_a_config_pbtxt_override_may_set_the_version_policy(tmp_path: Path) -> None:
    from trioinfer.server import ModelRepository

    for version in (1, 2, 3):
        write_simple(tmp_path / "m" / str(version) / "model.onnx")
    (tmp_path / "m" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    repository = ModelRepository(tmp_path)
    assert repository.entry("m").selected() == (3,)
    policy = {"version_policy": {"specific": {"versions": ["1", "3"]}}}  # int64 as strings
    entry = repository.entry("m", policy)
    assert entry.selected() == (1, 3)
    assert entry.config(1, policy).path.parent.name == "1"
    # A config.toml model's override may repeat its name and policy, not change them.
    (tmp_path / "t" / "1").mkdir(parents=True)
    write_simple(tmp_path / "t" / "1" / "model.onnx")
    (tmp_path / "t" / "config.toml").write_text('version_policy = "all"\n')
    entry = ModelRepository(tmp_path).entry("t")
    same = {"name": "t", "version_policy": {"all": {}}, "max_queue_size": 3}
    assert entry.config(1, same).max_queue_size == 3
    with pytest.raises(ConfigError, match=r"may not set 'version_policy' other than .*\"all\""):
        entry.config(1, {"version_policy": {"latest": {"num_versions": 2}}})


@pytest.mark.pipeline
@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        (
            {"output": [{"name": "SUM", "data_type": "TYPE_INT32", "dims": [15]}]},
            "output 'SUM' is declared int32.batch, 15., but its step produces int32.batch, 16.",
        ),
        (
            {
                "input": [
                    {"name": "A", "data_type": "TYPE_INT32", "dims": [16]},
                    {"name": "B", "data_type": "TYPE_INT32", "dims": [8]},
                ]
            },
            "input 'INPUT1' of model 'simple' .* is int32.batch, 16., but its tensor 'B' is "
            "int32.batch, 8.",
        ),
    ],
)
def test_an_ensemble_whose_dims_do_not_fit_its_steps_is_refused(
    client: httpclient.InferenceServerClient, tensors: dict[str, Any], fragment: str
) -> None:
    # Only the types were compared: an ensemble declaring SUM [15] loaded, its metadata said
    # [-1, 15] and its answers were [n, 16]; with B [8] every request failed in the step.
    with pytest.raises(InferenceServerException, match=f"failed to load 'ensemble'.*{fragment}"):
        client.load_model("ensemble", config=json.dumps(tensors))
    client.load_model("ensemble")
    assert client.is_model_ready("ensemble")


def test_rate_limiter_maps_onto_resource_needs() -> None:
    """Triton's rate_limiter: per-device and global resources, and the priority weight."""
    model = TritonModel.parse(
        """
        instance_group [
          {
            kind: KIND_GPU count: 2 gpus: [ 0, 1 ]
            rate_limiter {
              resources [ { name: "R1" count: 4 }, { name: "G" global: true count: 1 } ]
              priority: 2
            }
          },
          { kind: KIND_CPU rate_limiter { resources [ { name: "R1" count: 0 } ] priority: 0 } }
        ]
        """,
        name="m",
        where="m/config.pbtxt",
    )
    needs = {"resources": {"R1": 4}, "global_resources": {"G": 1}, "resource_priority": 2}
    assert model.settings["instances"] == [
        {"device": "cuda:0", "count": 2, **needs},
        {"device": "cuda:1", "count": 2, **needs},
        # A count of 0 needs nothing; a priority of 0 is 1, as Triton reads both.
        {"device": "cpu", "count": 1},
    ]
    # The engine's config takes it as it is.
    config = trioinfer.ModelConfig.from_dict({"name": "m", "path": "m.onnx", **model.settings})
    assert dict(config.instances[0].global_resources) == {"G": 1}
    assert config.instances[1].resource_priority == 2


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "instance_group [ { rate_limiter { resources [ { count: 1 } ] } } ]",
            "rate_limiter has a resource without a name",
        ),
        (
            'instance_group [ { rate_limiter { resources [ { name: "R" count: 1 }, '
            '{ name: "R" global: true count: 2 } ] } } ]',
            "names resource 'R' twice",
        ),
    ],
)
def test_rate_limiter_refusals(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        TritonModel.parse(text, name="m", where="m/config.pbtxt")


@pytest.mark.parametrize("rate_limit", ["execution_count", "off"])
async def test_a_served_rate_limiter_takes_its_pools(tmp_path: Path, rate_limit: str) -> None:
    """--rate-limit execution_count: config.pbtxt's needs are taken from the sized pools."""
    from prometheus_client.parser import text_string_to_metric_families

    from _serve import start_serving
    from trioinfer.server import ServerConfig

    write_simple(tmp_path / "simple" / "1" / "model.onnx")
    (tmp_path / "simple" / "config.pbtxt").write_text(
        SIMPLE_PBTXT.replace(
            "count: 2 }",
            'count: 2 rate_limiter { resources [ { name: "R" count: 2 } ] } }',
        )
    )
    config = ServerConfig(rate_limit=rate_limit, rate_limit_resources=("R:3", "R:2:cpu"))
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    body = {
        "inputs": [
            {"name": name, "shape": [1, 16], "datatype": "INT32", "data": a.ravel().tolist()}
            for name in ("INPUT0", "INPUT1")
        ]
    }
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path, config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            answer = (await client.post("/v2/models/simple/infer", json=body)).json()
            metrics = (await client.get("/metrics")).text
            served = (await client.get("/v2/models/simple/config")).json()
        nursery.cancel_scope.cancel()
    assert answer["outputs"][0]["data"] == (a + a).ravel().tolist()
    assert served["instance_group"][0]["rate_limiter"] == {
        "resources": [{"name": "R", "count": 2, "global": False}],
        "priority": 0,
    }
    samples = {
        (s.name, s.labels.get("device")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name.startswith("trioinfer_resource_")
    }
    if rate_limit == "off":
        assert samples == {}
    else:
        # The CPU's pool is sized by its own flag, not the one for every device.
        assert samples[("trioinfer_resource_pool_size", "cpu")] == 2
        assert samples[("trioinfer_resource_in_use", "cpu")] == 0


async def test_a_config_toml_models_needs_are_answered_as_triton_s_rate_limiter(
    tmp_path: Path,
) -> None:
    """GET .../config: a config.toml group's needs read as a config.pbtxt's do, and load back."""
    from _serve import start_serving
    from trioinfer.server import ServerConfig

    write_simple(tmp_path / "t" / "1" / "model.onnx")
    (tmp_path / "t" / "config.toml").write_text(
        "[[instances]]\ncount = 2\nresources = { R = 2 }\nglobal_resources = { G = 1 }\n"
        "resource_priority = 3\n"
        "[[instances]]\n"  # no needs: a group of its own, without a rate_limiter
    )
    config = ServerConfig(rate_limit="execution_count")
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path, config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            served = (await client.get("/v2/models/t/config")).json()
            reload = await client.post(
                "/v2/repository/models/t/load",
                json={"parameters": {"config": json.dumps(served)}},
            )
            assert reload.status_code == 200, reload.text
            again = (await client.get("/v2/models/t/config")).json()
        nursery.cancel_scope.cancel()
    needs, plain = served["instance_group"]
    assert (needs["count"], plain["count"]) == (2, 1)
    assert needs["rate_limiter"] == {
        "resources": [
            {"name": "R", "global": False, "count": 2},
            {"name": "G", "global": True, "count": 1},
        ],
        "priority": 3,
    }
    assert "rate_limiter" not in plain
    assert again == served


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("R",), "must be NAME:COUNT[:DEVICE]"),
        (("R:0",), "a COUNT of 1 or more"),
        (("R:x:0",), "must be NAME:COUNT"),
        (("R:1:gpu",), "device"),
        (("R:1:0", "R:2:cuda:0"), "sized twice for cuda:0"),
    ],
)
def test_rate_limit_resource_flags_are_checked(flags: tuple[str, ...], said: str) -> None:
    from trioinfer.server import ServerConfig

    with pytest.raises(ConfigError, match=re.escape(said)):
        ServerConfig(rate_limit_resources=flags)
    with pytest.raises(ConfigError, match="'off' or 'execution_count'"):
        ServerConfig(rate_limit="on")


def test_rate_limit_resource_flags_as_pool_sizes() -> None:
    from trioinfer.server import ServerConfig

    config = ServerConfig(rate_limit_resources=("R1:10", "R1:4:0", "R2:1:cpu"))
    assert config.resource_sizes == {"R1": {"*": 10, "cuda:0": 4}, "R2": {"cpu": 1}}
