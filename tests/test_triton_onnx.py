"""The parts of a config.pbtxt that Triton's ONNX Runtime backend reads.

``optimization`` (graph level, execution accelerators, and what changes nothing
here), the backend's ``parameters``, ``reshape`` on inputs and outputs, and
``optional`` inputs. Mapping is checked on `TritonModel.parse`; reshape and
optional inputs on a served repository written with ``onnx.helper``, asked
with ``tritonclient.http`` (on a thread: it blocks) and httpx.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import trio
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from _serve import start_serving
from trioinfer import ConfigError
from trioinfer.server._triton import TritonModel

pytestmark = pytest.mark.triton_config


def _parse(text: str) -> TritonModel:
    return TritonModel.parse(text, name="m", where="m/config.pbtxt")


# == optimization ===============================================================================


@pytest.mark.parametrize(
    ("level", "expected"), [(-1, "basic"), (0, "all"), (1, "extended"), (2, "disable")]
)
def test_graph_level_as_tritons_onnx_runtime_backend_reads_it(level: int, expected: str) -> None:
    # -1 basic, 1 basic and extended, 2 none; 0 (unset) all, ONNX Runtime's default.
    model = _parse(f"optimization {{ graph {{ level: {level} }} }}")
    assert model.settings["backend_options"]["graph_optimization_level"] == expected


def test_tensorrt_accelerator_runs_gpu_groups_on_the_tensorrt_provider() -> None:
    model = _parse(
        """
        instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] }, { kind: KIND_CPU } ]
        optimization { execution_accelerators { gpu_execution_accelerator [ {
          name: "tensorrt"
          parameters { key: "precision_mode" value: "FP16" }
          parameters { key: "max_workspace_size_bytes" value: "1073741824" }
          parameters { key: "trt_engine_cache_enable" value: "1" }
          parameters { key: "trt_engine_cache_path" value: "/tmp/trt" }
        } ] } }
        """
    )
    assert [g["device"] for g in model.settings["instances"]] == [
        "tensorrt:0",
        "tensorrt:1",
        "cpu",
    ]
    # ONNX Runtime's Python API takes a TensorRT flag as True/False, not Triton's "1".
    assert model.settings["backend_options"]["provider_options"] == {
        "trt_fp16_enable": True,
        "trt_max_workspace_size": 1073741824,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": "/tmp/trt",
    }
    assert model.notes == ()


def test_cuda_accelerator_and_deprecated_cuda_parameters_are_cuda_provider_options() -> None:
    model = _parse(
        """
        instance_group [ { kind: KIND_GPU } ]
        parameters { key: "cudnn_conv_algo_search" value { string_value: "1" } }
        parameters { key: "gpu_mem_limit" value { string_value: "4294967296" } }
        parameters { key: "arena_extend_strategy" value { string_value: "1" } }
        optimization { execution_accelerators { gpu_execution_accelerator [ {
          name: "cuda"
          parameters { key: "do_copy_in_default_stream" value: "0" }
          parameters { key: "cudnn_conv_use_max_workspace" value: "1" }
        } ] } }
        """
    )
    assert model.settings["instances"] == [{"device": "cuda:0", "count": 1}]
    assert model.settings["backend_options"] == {
        "provider_options": {
            "cudnn_conv_algo_search": "HEURISTIC",
            "gpu_mem_limit": 4294967296,
            "arena_extend_strategy": "kSameAsRequested",
            "do_copy_in_default_stream": False,
            "cudnn_conv_use_max_workspace": True,
        }
    }


def test_what_changes_nothing_here_is_accepted_with_a_note() -> None:
    model = _parse(
        """
        optimization {
          priority: PRIORITY_MAX
          cuda { graphs: true busy_wait_events: true }
          input_pinned_memory { enable: true }
          output_pinned_memory { enable: false }
          execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] }
        }
        parameters { key: "share_session_between_instances" value { string_value: "true" } }
        """
    )
    notes = "\n".join(model.notes)
    for field in (
        "optimization.priority",
        "optimization.cuda graphs, busy_wait_events",
        "optimization.input_pinned_memory",
        "optimization.output_pinned_memory",
        "gpu_execution_accelerator 'tensorrt' has no effect: no instance_group runs on a GPU",
        "share_session_between_instances",
    ):
        assert field in notes
    assert model.settings.get("instances") is None
    assert "provider_options" not in model.settings.get("backend_options", {})


def test_onnx_runtime_parameters_take_their_types() -> None:
    # Triton's backend reads "0"/"1" as false/true; trioinfer's options are booleans.
    model = _parse(
        'parameters { key: "enable_mem_arena" value { string_value: "0" } }\n'
        'parameters { key: "enable_mem_pattern" value { string_value: "1" } }'
    )
    assert model.settings["backend_options"] == {
        "enable_mem_arena": False,
        "enable_mem_pattern": True,
    }


def _answered(device: str, optimization: dict[str, Any] | None) -> dict[str, Any]:
    # GET .../config's answer for a model whose one GPU group runs on *device*, as a
    # client edits it and sends it back as a load override.
    doc: dict[str, Any] = {
        "instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0]}],
        "parameters": {
            "trioinfer.instances": {
                "string_value": json.dumps([{"device": device, "count": 1, "capacity": 1.0}])
            }
        },
    }
    if optimization is not None:
        doc["optimization"] = optimization
    return doc


def test_an_edited_answer_s_accelerators_pick_the_provider_not_the_old_device() -> None:
    # The accelerators an answer sent back says win over trioinfer.instances' device
    # (the one that ran): adding tensorrt ran the CUDA provider with TensorRT's
    # options, and emptying the accelerators kept TensorRT.
    trt = {"gpu_execution_accelerator": [{"name": "tensorrt"}], "cpu_execution_accelerator": []}
    added = TritonModel.parse(
        _answered("cuda:0", {"execution_accelerators": trt}), name="m", where="override"
    )
    assert [group["device"] for group in added.settings["instances"]] == ["tensorrt:0"]
    none = {"gpu_execution_accelerator": [], "cpu_execution_accelerator": []}
    emptied = TritonModel.parse(
        _answered("tensorrt:0", {"priority": "PRIORITY_DEFAULT", "execution_accelerators": none}),
        name="m",
        where="override",
    )
    assert [group["device"] for group in emptied.settings["instances"]] == ["cuda:0"]
    # An answer that says nothing of accelerators (a config.toml model's, on
    # tensorrt:0) keeps the device that ran, its other settings kept too.
    for optimization in (None, {"graph": {"level": 1}}):
        kept = TritonModel.parse(_answered("tensorrt:0", optimization), name="m", where="o")
        assert kept.settings["instances"] == [{"device": "tensorrt:0", "count": 1, "capacity": 1.0}]


def test_optimization_round_trips_in_the_json_form() -> None:
    # GET .../config answers it as read, and a load override sends that back.
    text = """
        instance_group [ { kind: KIND_GPU } ]
        optimization {
          graph { level: 1 }
          execution_accelerators { gpu_execution_accelerator [ {
            name: "tensorrt" parameters { key: "precision_mode" value: "INT8" } } ] }
        }
        """
    model = _parse(text)
    doc = model.json()
    assert doc["optimization"] == {
        "graph": {"level": 1},
        "execution_accelerators": {
            "gpu_execution_accelerator": [
                {"name": "tensorrt", "parameters": {"precision_mode": "INT8"}}
            ]
        },
    }
    again = TritonModel.parse(doc, name="m", where="override")
    assert again.settings == model.settings
    assert again.settings["backend_options"]["provider_options"] == {"trt_int8_enable": True}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "optimization { execution_accelerators { cpu_execution_accelerator [ "
            '{ name: "openvino" } ] } }',
            "cpu_execution_accelerator 'openvino' is not supported: .* no OpenVINO",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tvm" '
            "} ] } }",
            "gpu_execution_accelerator 'tvm' is not one trioinfer knows: 'tensorrt' .* 'cuda'",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"'
            ' parameters { key: "precision_mode" value: "FP8" } } ] } }',
            "precision_mode must be FP32, FP16, BF16 or INT8, got 'FP8'",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"'
            ' parameters { key: "trt_warp_drive" value: "1" } } ] } }',
            "'tensorrt' has no parameter 'trt_warp_drive'",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"'
            ' parameters { key: "trt_engine_cache_enable" value: "maybe" } } ] } }',
            "trt_engine_cache_enable must be true or false .*, got 'maybe'",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"'
            ' parameters { key: "max_workspace_size_bytes" value: "lots" } } ] } }',
            "max_workspace_size_bytes must be an integer, got 'lots'",
        ),
        (
            "instance_group [ { kind: KIND_GPU } ]\n"
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"'
            ' }, { name: "cuda" parameters { key: "use_tf32" value: "0" } } ] } }',
            "CUDA provider options .*use_tf32.* with 'tensorrt'",
        ),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "cuda" }'
            ', { name: "cuda" } ] } }',
            "names 'cuda' twice",
        ),
        ("optimization { graph { level: 3 } }", "graph.level must be -1 .* got 3"),
        (
            "optimization { graph { level: 1 } }\n"
            'parameters { key: "graph_optimization_level" value { string_value: "all" } }',
            "graph.level 1 .extended. and parameters graph_optimization_level 'all'",
        ),
        (
            'parameters { key: "cudnn_conv_algo_search" value { string_value: "7" } }',
            "cudnn_conv_algo_search must be 0 .EXHAUSTIVE., 1 .HEURISTIC. or 2 .DEFAULT., got 7",
        ),
        (
            'parameters { key: "enable_mem_arena" value { string_value: "2" } }',
            "enable_mem_arena must be 0 or 1",
        ),
        (
            'platform: "ensemble" optimization { graph { level: 1 } }',
            "an ensemble has no optimization",
        ),
    ],
)
def test_optimization_refusals(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _parse(text)


# == reshape and optional inputs, served =======================================================


def _save(graph: Any, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


def write_flat(path: Path) -> None:
    """y = x + x over float32[N, 4]: the model's own shapes, which reshape hides."""
    _save(
        helper.make_graph(
            [helper.make_node("Add", ["x", "x"], ["y"])],
            "flat",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        ),
        path,
    )


def write_vector(path: Path) -> None:
    """y = -x over float32[N]: one number a row, as Triton's dims [1] reshape [] serve."""
    _save(
        helper.make_graph(
            [helper.make_node("Neg", ["x"], ["y"])],
            "vector",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        ),
        path,
    )


def write_biased(path: Path) -> None:
    """y = x + b over float32[N, 4]; b is an input with an initializer (ones): overridable.

    b is batched as x is (Triton gives every input of a batched model the batch
    dimension); its initializer is one row, which Add broadcasts over x's rows.
    """
    _save(
        helper.make_graph(
            [helper.make_node("Add", ["x", "b"], ["y"])],
            "biased",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
            initializer=[numpy_helper.from_array(np.ones((1, 4), np.float32), "b")],
        ),
        path,
    )


RESHAPED = """\
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape { shape: [ 4 ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4, 1 ] reshape { shape: [ 4 ] } } ]
"""
SCALAR = """\
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } } ]
"""
UNBATCHED = """\
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 8 ] reshape { shape: [ 2, 4 ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2, 2, 2 ] reshape { shape: [ 2, 4 ] } } ]
"""
OPTIONAL = """\
max_batch_size: 8
input [
  { name: "x" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "b" data_type: TYPE_FP32 dims: [ 4 ] optional: true }
]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""
REQUIRED = """\
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] optional: true } ]
"""
# On a machine without a usable GPU the group runs on the CPU (cpu_fallback), as here.
TENSORRT = """\
max_batch_size: 8
instance_group [ { kind: KIND_GPU count: 1 } ]
optimization {
  graph { level: -1 }
  priority: PRIORITY_MAX
  execution_accelerators { gpu_execution_accelerator [ {
    name: "tensorrt"
    parameters { key: "precision_mode" value: "FP16" }
    parameters { key: "max_workspace_size_bytes" value: "1073741824" }
  } ] }
}
parameters { key: "enable_mem_arena" value { string_value: "0" } }
"""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[str]:
    for name, writer, pbtxt in (
        ("reshaped", write_flat, RESHAPED),
        ("scalar", write_vector, SCALAR),
        ("unbatched", write_flat, UNBATCHED),
        ("optional", write_biased, OPTIONAL),
        ("required", write_flat, REQUIRED),
        ("tensorrt", write_flat, TENSORRT),
    ):
        writer(tmp_path / name / "1" / "model.onnx")
        (tmp_path / name / "config.pbtxt").write_text(pbtxt)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path)
        yield listening.urls[0]
        nursery.cancel_scope.cancel()


async def test_get_config_gives_back_what_was_read_and_it_loads_again(served: str) -> None:
    async with httpx.AsyncClient(base_url=served) as http:
        for model in ("tensorrt", "reshaped"):
            config = (await http.get(f"/v2/models/{model}/config")).json()
            load = await http.post(
                f"/v2/repository/models/{model}/load",
                json={"parameters": {"config": json.dumps(config)}},
            )
            assert load.status_code == 200, load.text
            again = (await http.get(f"/v2/models/{model}/config")).json()
            if model == "tensorrt":
                # Loaded back, it asks for the device it ran on, as trioinfer.instances says.
                del config["parameters"]["trioinfer.instances"]
                del again["parameters"]["trioinfer.instances"]
                config.pop("instance_group"), again.pop("instance_group")
            assert again == config
            if model == "tensorrt":
                assert config["optimization"] == {
                    "graph": {"level": -1},
                    "priority": "PRIORITY_MAX",
                    "execution_accelerators": {
                        "gpu_execution_accelerator": [
                            {
                                "name": "tensorrt",
                                "parameters": {
                                    "precision_mode": "FP16",
                                    "max_workspace_size_bytes": "1073741824",
                                },
                            }
                        ],
                        "cpu_execution_accelerator": [],
                    },
                }
                assert config["parameters"]["enable_mem_arena"] == {"string_value": "0"}
    x = np.ones((2, 4), dtype=np.float32)
    result = await trio.to_thread.run_sync(_infer, served, "tensorrt", {"x": x})
    np.testing.assert_array_equal(result.as_numpy("y"), x + x)


@pytest.mark.grpc
async def test_grpc_model_config_answers_optimization_and_reshape_too(served: str) -> None:
    # gRPC's ModelConfig is the same document parsed strictly: every key must be a field.
    pytest.importorskip("grpc_tools")
    from google.protobuf import json_format

    from trioinfer.server import _grpc_proto as pb

    async with httpx.AsyncClient(base_url=served) as http:
        for model in ("tensorrt", "reshaped", "optional"):
            config = (await http.get(f"/v2/models/{model}/config")).json()
            message = json_format.ParseDict(config, pb.ModelConfigResponse().config)
            assert json_format.MessageToDict(message, preserving_proto_field_name=True)
    assert message.input[1].optional


def _infer(url: str, model: str, arrays: dict[str, np.ndarray[Any, Any]]) -> Any:
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        inputs = []
        for name, array in arrays.items():
            item = httpclient.InferInput(name, list(array.shape), "FP32")
            item.set_data_from_numpy(array, binary_data=True)
            inputs.append(item)
        return client.infer(model, inputs)
    finally:
        client.close()


async def test_reshape_clients_see_dims_the_model_gets_reshape(served: str) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    result = await trio.to_thread.run_sync(_infer, served, "reshaped", {"x": x})
    y = result.as_numpy("y")
    assert y.shape == (3, 4, 1)
    np.testing.assert_array_equal(y, (x + x).reshape(3, 4, 1))
    async with httpx.AsyncClient(base_url=served) as http:
        meta = (await http.get("/v2/models/reshaped")).json()
        config = (await http.get("/v2/models/reshaped/config")).json()
        # A row of another shape than dims is the client's error, however many numbers.
        bad = await http.post(
            "/v2/models/reshaped/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]},
        )
    assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [("x", [-1, 2, 2])]
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [("y", [-1, 4, 1])]
    assert config["input"][0]["dims"] == [2, 2]
    assert config["input"][0]["reshape"] == {"shape": [4]}
    assert config["output"][0]["reshape"] == {"shape": [4]}
    assert bad.status_code == 400, bad.text


async def test_reshape_to_no_dims_and_without_a_batch(served: str) -> None:
    x = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    result = await trio.to_thread.run_sync(_infer, served, "scalar", {"x": x})
    np.testing.assert_array_equal(result.as_numpy("y"), -x)
    x = np.arange(8, dtype=np.float32)
    result = await trio.to_thread.run_sync(_infer, served, "unbatched", {"x": x})
    np.testing.assert_array_equal(result.as_numpy("y"), (x + x).reshape(2, 2, 2))
    async with httpx.AsyncClient(base_url=served) as http:
        config = (await http.get("/v2/models/scalar/config")).json()
    # reshape { shape: [ ] } as Triton answers it: the message, its list empty.
    assert config["input"][0]["reshape"] == {"shape": []}


async def test_an_optional_input_that_the_graph_can_go_without(served: str) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    # Left out, the graph's own b (ones); sent, the request's.
    result = await trio.to_thread.run_sync(_infer, served, "optional", {"x": x})
    np.testing.assert_array_equal(result.as_numpy("y"), x + 1)
    b = np.full((2, 4), 10, dtype=np.float32)
    result = await trio.to_thread.run_sync(_infer, served, "optional", {"x": x, "b": b})
    np.testing.assert_array_equal(result.as_numpy("y"), x + 10)
    async with httpx.AsyncClient(base_url=served) as http:
        config = (await http.get("/v2/models/optional/config")).json()
        metadata = (await http.get("/v2/models/optional")).json()
        index = (await http.post("/v2/repository/index")).json()
        # The optional input does not stand in for a required one.
        alone = {"name": "b", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}
        missing = await http.post("/v2/models/optional/infer", json={"inputs": [alone]})
        # Sent, it is checked as any input: the rows of x.
        short = [
            {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [0] * 8},
            {"name": "b", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4},
        ]
        misfit = await http.post("/v2/models/optional/infer", json={"inputs": short})
    assert missing.status_code == 400, missing.text
    assert "needs input 'x'" in missing.json()["error"]
    assert misfit.status_code == 400, misfit.text
    assert "disagree" in misfit.json()["error"]
    # Metadata lists it (Triton's has no optional flag); the config says optional.
    assert [t["name"] for t in metadata["inputs"]] == ["x", "b"]
    assert metadata["inputs"][1] == {"name": "b", "datatype": "FP32", "shape": [-1, 4]}
    assert (config["input"][1]["name"], config["input"][1]["optional"]) == ("b", True)
    (required,) = [row for row in index if row["name"] == "required"]
    assert required["state"] == "UNAVAILABLE"
    assert "declares input 'x' optional" in required["reason"]
    assert "the graph needs it" in required["reason"]


async def test_an_optional_flag_the_graph_disagrees_with_fails_the_load(tmp_path: Path) -> None:
    # optional: true on an input the graph does not have; no optional on the input the
    # graph gives a value of its own (an initializer). (optional: true on an input the
    # graph needs: the served fixture's "required".) Triton refuses "unmarked" too: its
    # ONNX Runtime backend counts the config's inputs not marked optional against the
    # graph's inputs without an initializer ("configuration expects 2 inputs, model
    # provides 1"), onnxruntime_backend src/onnxruntime.cc, ValidateInputs.
    unknown = OPTIONAL.replace('name: "b"', 'name: "w"')
    unmarked = OPTIONAL.replace(" optional: true", "")
    for name, pbtxt in (("unknown", unknown), ("unmarked", unmarked)):
        write_biased(tmp_path / name / "1" / "model.onnx")
        (tmp_path / name / "config.pbtxt").write_text(pbtxt)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as http:
            index = (await http.post("/v2/repository/index")).json()
        nursery.cancel_scope.cancel()
    reasons = {row["name"]: row["reason"] for row in index}
    assert [row["state"] for row in index] == ["UNAVAILABLE", "UNAVAILABLE"]
    assert "declares input 'w' optional, which the graph does not have" in reasons["unknown"]
    assert "its inputs are 'x'" in reasons["unknown"]
    assert (
        "declares input 'b' required, but the graph gives it a value of its own"
        in reasons["unmarked"]
    )
    assert "optional: true" in reasons["unmarked"]


@pytest.mark.grpc
async def test_an_optional_input_over_grpc(tmp_path: Path) -> None:
    # tritonclient.grpc: metadata lists b, and a request may send it or leave it out.
    pytest.importorskip("grpc_tools")
    import tritonclient.grpc as grpcclient

    write_biased(tmp_path / "optional" / "1" / "model.onnx")
    (tmp_path / "optional" / "config.pbtxt").write_text(OPTIONAL)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)

    def use(address: str) -> tuple[Any, ...]:
        with grpcclient.InferenceServerClient(address) as client:
            metadata = client.get_model_metadata("optional", as_json=True)
            config = client.get_model_config("optional", as_json=True)["config"]
            answers = []
            for names in (("x",), ("x", "b")):
                inputs = []
                for name in names:
                    item = grpcclient.InferInput(name, [1, 4], "FP32")
                    item.set_data_from_numpy(x * 10 if name == "b" else x)
                    inputs.append(item)
                answers.append(client.infer("optional", inputs).as_numpy("y"))
            return metadata, config, answers

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path, grpc_port=0)
        assert listening.grpc is not None
        metadata, config, (left_out, sent) = await trio.to_thread.run_sync(use, listening.grpc)
        nursery.cancel_scope.cancel()
    assert [t["name"] for t in metadata["inputs"]] == ["x", "b"]
    assert config["input"][1]["optional"] is True
    np.testing.assert_array_equal(left_out, x + 1)
    np.testing.assert_array_equal(sent, x + x * 10)


async def test_optional_input_sent_and_left_out_batch_apart(served: str) -> None:
    # Requests in flight together, some sending b, some not: each answered with its own
    # b (the dynamic batcher puts together only requests that send the same inputs).
    def one(i: int) -> None:
        x = np.full((1 + i % 3, 4), i, dtype=np.float32)
        arrays = {"x": x} if i % 2 else {"x": x, "b": x * 100}
        result = _infer(served, "optional", arrays)
        np.testing.assert_array_equal(result.as_numpy("y"), x + (1 if i % 2 else x * 100))

    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(trio.to_thread.run_sync, one, i)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            'max_batch_size: 2 input [ { name: "x" dims: [ 3 ] reshape { shape: [ 2 ] } } ]',
            "input 'x' reshape .2. holds 2 elements; its dims .3. hold 3",
        ),
        (
            'max_batch_size: 2 input [ { name: "x" dims: [ -1 ] reshape { shape: [ -1 ] } } ]',
            "input 'x': reshape needs fixed dims",
        ),
        (
            'platform: "ensemble" input [ { name: "x" dims: [ 1 ] optional: true } ]',
            "input 'x' sets optional",
        ),
    ],
)
def test_reshape_and_optional_refusals(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        _parse(text)


def test_reshape_and_optional_reach_the_backend_options() -> None:
    model = _parse(
        RESHAPED + 'input [ { name: "b" data_type: TYPE_FP32 dims: [ 4 ] optional: true } ]'
    )
    assert model.declared["inputs"] == (
        {"name": "x", "shape": [-1, 2, 2], "reshape": [-1, 4]},
        {"name": "b", "shape": [-1, 4], "optional": True},
    )
    assert model.declared["outputs"] == ({"name": "y", "shape": [-1, 4, 1], "reshape": [-1, 4]},)


async def test_an_optional_input_of_config_toml_is_optional_in_the_config_answer(
    tmp_path: Path,
) -> None:
    # No config.pbtxt: the answer is worked out from the signature, which marks b optional.
    write_biased(tmp_path / "biased" / "1" / "model.onnx")
    (tmp_path / "biased" / "config.toml").write_text(
        '[backend_options]\ninputs = [{ name = "b", shape = [-1, 4], optional = true }]\n'
    )
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as http:
            config = (await http.get("/v2/models/biased/config")).json()
            x = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}
            left_out = await http.post("/v2/models/biased/infer", json={"inputs": [x]})
        nursery.cancel_scope.cancel()
    assert [(t["name"], t["optional"]) for t in config["input"]] == [("x", False), ("b", True)]
    assert left_out.json()["outputs"][0]["data"] == [1.0] * 4


async def test_a_config_toml_reshape_round_trips_through_get_config(tmp_path: Path) -> None:
    # GET .../config of a config.toml model whose backend options reshape answers
    # reshape, as Triton would; sent back as a load override, the model loads again
    # (its dims alone replaced the option, the graph's shape lost: the load failed).
    write_flat(tmp_path / "toml" / "1" / "model.onnx")
    (tmp_path / "toml" / "config.toml").write_text(
        'batcher = "dynamic"\n'
        "batcher_options = { max_batch_size = 8 }\n"
        "[backend_options]\n"
        'inputs = [{ name = "x", shape = [-1, 2, 2], reshape = [-1, 4] }]\n'
        'outputs = [{ name = "y", shape = [-1, 4, 1], reshape = [-1, 4] }]\n'
    )
    async with trio.open_nursery() as nursery:
        url = (await start_serving(nursery, tmp_path)).urls[0]
        async with httpx.AsyncClient(base_url=url) as http:
            config = (await http.get("/v2/models/toml/config")).json()
            load = await http.post(
                "/v2/repository/models/toml/load",
                json={"parameters": {"config": json.dumps(config)}},
            )
            again = (await http.get("/v2/models/toml/config")).json()
        x = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
        result = await trio.to_thread.run_sync(_infer, url, "toml", {"x": x})
        nursery.cancel_scope.cancel()
    assert config["input"][0]["dims"] == [2, 2]
    assert config["input"][0]["reshape"] == {"shape": [4]}
    assert config["output"][0]["reshape"] == {"shape": [4]}
    assert load.status_code == 200, load.text
    assert again["input"] == config["input"]
    assert again["output"] == config["output"]
    np.testing.assert_array_equal(result.as_numpy("y"), (x + x).reshape(2, 4, 1))


BATCHED = """\
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape { shape: [ 4 ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4, 1 ] reshape { shape: [ 4 ] } } ]
dynamic_batching { max_queue_delay_microseconds: 100000 }
response_cache { enable: true }
model_warmup [ {
  name: "zeros" batch_size: 2
  inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2, 2 ] zero_data: true } }
} ]
"""
STEP = """\
platform: "ensemble"
max_batch_size: 8
input [ { name: "a" data_type: TYPE_FP32 dims: [ 2, 2 ] } ]
output [ { name: "b" data_type: TYPE_FP32 dims: [ 4, 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "batched" model_version: -1 input_map { key: "x" value: "a" }
  output_map { key: "y" value: "b" }
} ] }
"""


async def test_reshape_under_the_dynamic_batcher_the_cache_and_a_pipeline(tmp_path: Path) -> None:
    # Requests of 1 to 4 rows, batched together as the queue delay lets them, are
    # reshaped as one (the batch dimension the sum of theirs) and split back by rows;
    # warm-up samples are in the clients' dims; a cached answer and an ensemble step's
    # answer keep the clients' shape.
    from trioinfer.server import ServerConfig

    write_flat(tmp_path / "batched" / "1" / "model.onnx")
    (tmp_path / "batched" / "config.pbtxt").write_text(BATCHED)
    (tmp_path / "pipe" / "1").mkdir(parents=True)
    (tmp_path / "pipe" / "config.pbtxt").write_text(STEP)
    answers: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path, config=ServerConfig(cache_size=1 << 20))
        url = listening.urls[0]

        async def one(rows: int) -> None:
            x = (np.arange(4 * rows, dtype=np.float32) + 100 * rows).reshape(rows, 2, 2)
            result = await trio.to_thread.run_sync(_infer, url, "batched", {"x": x})
            answers[rows] = (x, result.as_numpy("y"))

        async with trio.open_nursery() as requests:
            for rows in range(1, 5):
                requests.start_soon(one, rows)
        x, y = answers[3]
        cached = await trio.to_thread.run_sync(_infer, url, "batched", {"x": x})
        piped = await trio.to_thread.run_sync(_infer, url, "pipe", {"a": x})
        async with httpx.AsyncClient(base_url=url) as http:
            stats = (await http.get("/v2/models/batched/stats")).json()["model_stats"][0]
        nursery.cancel_scope.cancel()
    for rows, (x, y) in answers.items():
        np.testing.assert_array_equal(y, (x + x).reshape(rows, 4, 1))
    np.testing.assert_array_equal(cached.as_numpy("y"), answers[3][1])
    np.testing.assert_array_equal(piped.as_numpy("b"), answers[3][1])
    assert stats["inference_stats"]["cache_hit"]["count"] >= 1


OPTIONAL_CACHED = (
    OPTIONAL
    + """response_cache { enable: true }
model_warmup [ {
  name: "x alone" batch_size: 2
  inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
} ]
"""
)


async def test_an_optional_input_through_shared_memory_the_cache_and_warm_up(
    tmp_path: Path,
) -> None:
    # x in a system shared memory region, b left out or sent in the body; answers
    # cached apart (a hit for each); a warm-up sample that leaves b out loads.
    import tritonclient.utils.shared_memory as shm

    from trioinfer.server import ServerConfig

    write_biased(tmp_path / "optional" / "1" / "model.onnx")
    (tmp_path / "optional" / "config.pbtxt").write_text(OPTIONAL_CACHED)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    key = f"/trioinfer_test_optional_{os.getpid()}"

    def use(url: str) -> tuple[list[Any], Any]:
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        handle = shm.create_shared_memory_region("x", key, x.nbytes)
        try:
            shm.set_shared_memory_region(handle, [x])
            client.register_system_shared_memory("x", key, x.nbytes)
            from_region = httpclient.InferInput("x", [1, 4], "FP32")
            from_region.set_shared_memory("x", x.nbytes)
            b = httpclient.InferInput("b", [1, 4], "FP32")
            b.set_data_from_numpy(x * 10)
            answers = [
                client.infer("optional", inputs).as_numpy("y")
                for inputs in ([from_region], [from_region, b], [from_region], [from_region, b])
            ]
            stats = client.get_inference_statistics("optional")["model_stats"][0]
            client.unregister_system_shared_memory("x")
            return answers, stats["inference_stats"]
        finally:
            shm.destroy_shared_memory_region(handle)
            client.close()

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path, config=ServerConfig(cache_size=1 << 20))
        answers, stats = await trio.to_thread.run_sync(use, listening.urls[0])
        nursery.cancel_scope.cancel()
    for answer, b_sent in zip(answers, (False, True, False, True), strict=True):
        np.testing.assert_array_equal(answer, x + (x * 10 if b_sent else 1))
    assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (2, 2)
