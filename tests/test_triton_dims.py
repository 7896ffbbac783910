"""A config.pbtxt's dims are the model's: narrower than its ONNX graph's, they are enforced.

Triton takes the dims a config declares as the model's own: metadata reports
them, requests of another size are refused, and an answer of another size is
an error. The graphs here leave their sizes symbolic; the configs fix them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import trio
from onnx import TensorProto, helper

from _serve import start_serving

pytestmark = pytest.mark.triton_config


def _save(nodes: list[Any], inputs: list[Any], outputs: list[Any], path: Path) -> None:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


def write_doubled(path: Path) -> None:
    """y = Concat(x, x) on axis 1: x float32[N, k], y float32[N, m] (twice x's width)."""
    _save(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "k"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "m"])],
        path,
    )


def write_fixed(path: Path) -> None:
    """y = x + x, both float32[N, 4]: fixed sizes a config can only repeat."""
    _save(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        path,
    )


TOML_SHAPES = """\
[backend_options]
inputs = [{ name = "x", shape = [-1, 2] }]
outputs = [{ name = "y", shape = [-1, 4] }]
"""


PY_DOUBLED = """\
import numpy as np


class Model:
    def infer(self, inputs):
        x = inputs["x"]
        return {"y": np.concatenate([x, x], axis=1)}
"""

PY_CONFIG = """\
backend = "python"

[backend_options]
inputs = [{ name = "x", dtype = "float32", shape = ["N", -1] }]
outputs = [{ name = "y", dtype = "float32", shape = ["N", -1] }]
"""


def _pbtxt(x: list[int], y: list[int], max_batch: int = 8) -> str:
    return (
        f"max_batch_size: {max_batch}\n"
        f'input [ {{ name: "x" data_type: TYPE_FP32 dims: {x} }} ]\n'
        f'output [ {{ name: "y" data_type: TYPE_FP32 dims: {y} }} ]\n'
    )


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    # "right": the config fixes x's width at 2 and y's at 4, as the graph computes them.
    # "wrong": it fixes y's at 3, which the graph does not compute (its answers fail).
    # "unbatched": max_batch_size 0, the dims are the whole shapes.
    # "fixed": the config repeats the graph's fixed sizes; "conflict": it contradicts them.
    for name, pbtxt in (
        ("right", _pbtxt([2], [4])),
        ("wrong", _pbtxt([2], [3])),
        ("unbatched", _pbtxt([1, 2], [1, 4], max_batch=0)),
        ("conflict", _pbtxt([5], [4])),
    ):
        write_doubled(tmp_path / name / "1" / "model.onnx")
        (tmp_path / name / "config.pbtxt").write_text(pbtxt)
    (tmp_path / "conflict" / "1" / "model.onnx").unlink()
    write_fixed(tmp_path / "conflict" / "1" / "model.onnx")
    write_fixed(tmp_path / "fixed" / "1" / "model.onnx")
    (tmp_path / "fixed" / "config.pbtxt").write_text(_pbtxt([4], [4]))
    # "toml": the same sizes as "right", fixed by config.toml's backend options.
    write_doubled(tmp_path / "toml" / "1" / "model.onnx")
    (tmp_path / "toml" / "config.toml").write_text(TOML_SHAPES)
    # "py": a Python model that doubles x, its widths left open by its own declaration.
    (tmp_path / "py" / "1").mkdir(parents=True)
    (tmp_path / "py" / "1" / "model.py").write_text(PY_DOUBLED)
    (tmp_path / "py" / "config.toml").write_text(PY_CONFIG)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as http:
            yield http
        nursery.cancel_scope.cancel()


def _body(rows: int, width: int) -> dict[str, Any]:
    data = np.arange(rows * width, dtype=np.float32)
    return {
        "inputs": [{"name": "x", "shape": [rows, width], "datatype": "FP32", "data": data.tolist()}]
    }


async def test_metadata_and_config_report_the_configs_sizes(client: httpx.AsyncClient) -> None:
    """The graph says [N, k] and [N, m]; metadata says what config.pbtxt fixed, as GET
    config does."""
    meta = (await client.get("/v2/models/right")).json()
    assert [(t["name"], t["shape"]) for t in meta["inputs"]] == [("x", [-1, 2])]
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [("y", [-1, 4])]
    config = (await client.get("/v2/models/right/config")).json()
    assert [t["dims"] for t in config["input"]] == [[2]]
    assert [t["dims"] for t in config["output"]] == [[4]]
    unbatched = (await client.get("/v2/models/unbatched")).json()
    assert [t["shape"] for t in unbatched["inputs"]] == [[1, 2]]
    assert [t["shape"] for t in unbatched["outputs"]] == [[1, 4]]


async def test_an_input_of_another_size_than_the_config_fixes_is_refused(
    client: httpx.AsyncClient,
) -> None:
    """x's width is 2 by the config: 3 is the client's error (400), 2 is answered."""
    ok = await client.post("/v2/models/right/infer", json=_body(3, 2))
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"][0]["shape"] == [3, 4]
    bad = await client.post("/v2/models/right/infer", json=_body(3, 3))
    assert bad.status_code == 400
    assert "'x'" in bad.json()["error"]
    assert "2" in bad.json()["error"]
    unbatched = await client.post("/v2/models/unbatched/infer", json=_body(2, 2))
    assert unbatched.status_code == 400  # [1, 2] fixed: 2 rows do not fit


async def test_an_answer_of_another_size_than_the_config_fixes_fails(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """y's width is 3 by the config, and the graph computes 4 (from x's 2, which the
    config fixes too): the operator is warned at load, and the answer never reaches
    the client that metadata told 3; the model's fault (500), naming the output."""
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "instance 0: its graph does not prove its outputs' shapes (the signature "
        "declares output 'y' float32[N, 3], but its operators compute [N, 4])"
        in message
        and message.startswith("model 'wrong'")
        for message in warned
    ), warned
    meta = (await client.get("/v2/models/wrong")).json()
    assert meta["outputs"][0]["shape"] == [-1, 3]
    answer = await client.post("/v2/models/wrong/infer", json=_body(2, 2))
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert "output 'y' with shape [2, 4]" in error
    assert "float32[N, 3]" in error


async def test_a_config_that_repeats_the_graphs_fixed_sizes_changes_nothing(
    client: httpx.AsyncClient,
) -> None:
    meta = (await client.get("/v2/models/fixed")).json()
    assert meta["inputs"][0]["shape"] == meta["outputs"][0]["shape"] == [-1, 4]
    answer = await client.post("/v2/models/fixed/infer", json=_body(1, 4))
    assert answer.status_code == 200, answer.text


async def test_a_config_that_contradicts_a_size_the_graph_fixes_fails_to_load(
    client: httpx.AsyncClient,
) -> None:
    load = await client.post("/v2/repository/models/conflict/load")
    assert load.status_code == 400
    error = load.json()["error"]
    assert "input 'x' with shape [-1, 5]" in error
    assert "the graph's is [N, 4]" in error


async def test_a_load_override_fixes_sizes_as_config_pbtxt_does(
    client: httpx.AsyncClient,
) -> None:
    """A JSON load override's input and output dims narrow the graph's too."""
    config = {
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [6]}],
    }
    load = await client.post(
        "/v2/repository/models/right/load", json={"parameters": {"config": _json(config)}}
    )
    assert load.status_code == 200, load.text
    meta = (await client.get("/v2/models/right")).json()
    assert meta["inputs"][0]["shape"] == [-1, 3]
    assert meta["outputs"][0]["shape"] == [-1, 6]
    assert (await client.post("/v2/models/right/infer", json=_body(1, 2))).status_code == 400
    assert (await client.post("/v2/models/right/infer", json=_body(1, 3))).status_code == 200


def _json(doc: dict[str, Any]) -> str:
    import json

    return json.dumps(doc)


async def test_a_load_without_the_override_drops_its_sizes(client: httpx.AsyncClient) -> None:
    """The override's dims are that load's: a load without one serves config.pbtxt's."""
    config = {
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [6]}],
    }
    load = await client.post(
        "/v2/repository/models/right/load", json={"parameters": {"config": _json(config)}}
    )
    assert load.status_code == 200, load.text
    load = await client.post("/v2/repository/models/right/load")
    assert load.status_code == 200, load.text
    meta = (await client.get("/v2/models/right")).json()
    assert meta["inputs"][0]["shape"] == [-1, 2]
    assert meta["outputs"][0]["shape"] == [-1, 4]
    config_now = (await client.get("/v2/models/right/config")).json()
    assert [t["dims"] for t in config_now["input"]] == [[2]]
    assert (await client.post("/v2/models/right/infer", json=_body(1, 2))).status_code == 200


def _dims_override(x: list[int], y: list[int], **more: Any) -> dict[str, Any]:
    config = {
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": x}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": y}],
        **more,
    }
    return {"parameters": {"config": _json(config)}}


async def _shapes(client: httpx.AsyncClient, model: str) -> tuple[list[int], list[int]]:
    meta = (await client.get(f"/v2/models/{model}")).json()
    return meta["inputs"][0]["shape"], meta["outputs"][0]["shape"]


async def test_a_load_overrides_dims_replace_config_toml_backend_options(
    client: httpx.AsyncClient,
) -> None:
    """config.toml's inputs/outputs options fix x at 2 and y at 4; a load override's
    dims, the later and explicit instruction, are what the model is loaded with."""
    assert await _shapes(client, "toml") == ([-1, 2], [-1, 4])
    load = await client.post("/v2/repository/models/toml/load", json=_dims_override([3], [6]))
    assert load.status_code == 200, load.text
    assert await _shapes(client, "toml") == ([-1, 3], [-1, 6])
    assert (await client.post("/v2/models/toml/infer", json=_body(1, 2))).status_code == 400
    assert (await client.post("/v2/models/toml/infer", json=_body(1, 3))).status_code == 200
    # Loaded again without an override: config.toml's own sizes are back.
    assert (await client.post("/v2/repository/models/toml/load")).status_code == 200
    assert await _shapes(client, "toml") == ([-1, 2], [-1, 4])


async def test_an_override_giving_dims_and_options_that_differ_is_refused(
    client: httpx.AsyncClient,
) -> None:
    """One instruction that says x's shape twice, two ways: a 400 naming both, and the
    model loaded before stays as it was."""
    options = {"inputs": [{"name": "x", "shape": [-1, 5]}]}
    load = await client.post(
        "/v2/repository/models/toml/load",
        json=_dims_override([3], [6], backend_options=options),
    )
    assert load.status_code == 400, load.text
    error = load.json()["error"]
    assert "the load override gives inputs' shapes twice" in error
    assert "input dims say x [-1, 3]" in error
    assert "backend_options inputs say x [-1, 5]" in error
    assert await _shapes(client, "toml") == ([-1, 2], [-1, 4])
    # Saying the same twice is no conflict.
    same = {"inputs": [{"name": "x", "shape": [-1, 3]}]}
    load = await client.post(
        "/v2/repository/models/toml/load", json=_dims_override([3], [6], backend_options=same)
    )
    assert load.status_code == 200, load.text
    assert await _shapes(client, "toml") == ([-1, 3], [-1, 6])


async def test_dims_a_python_model_cannot_take_are_refused_not_ignored(
    client: httpx.AsyncClient,
) -> None:
    """The python backend's shapes are its own declaration: an override whose dims fix
    a width it leaves open would be the config's word only (metadata -1, any width
    served), so the load fails saying where the sizes belong; dims that leave them open
    load."""
    assert (await client.get("/v2/models/py/ready")).status_code == 200
    load = await client.post("/v2/repository/models/py/load", json=_dims_override([3], [6]))
    assert load.status_code == 400, load.text
    error = load.json()["error"]
    assert "fixing sizes the model leaves open ([-1])" in error
    assert "'python' backend's shapes are its own declaration" in error
    # A failed reload leaves the version that was served serving (checked against the
    # model once loaded, the config used to unload it: a typo took the model down).
    assert (await client.get("/v2/models/py/ready")).status_code == 200
    assert (await client.post("/v2/models/py/infer", json=_body(2, 3))).status_code == 200
    same = await client.post("/v2/repository/models/py/load", json=_dims_override([-1], [-1]))
    assert same.status_code == 200, same.text
    assert (await client.post("/v2/models/py/infer", json=_body(2, 3))).status_code == 200


def test_a_ray_models_dims_narrow_its_onnxruntime_table() -> None:
    """On the ray backend the dims become its actors' ONNX Runtime options, beside the
    ray options it has; the later instruction wins there too."""
    from trioinfer.server._triton import TritonModel, with_declared_shapes

    triton = TritonModel(
        doc={},
        settings={},
        declared={"inputs": ({"name": "x", "shape": [-1, 3]},)},
    )
    settings = {
        "backend": "ray",
        "backend_options": {"codec": "uint8", "onnxruntime": {"log_severity": 4}},
    }
    out = with_declared_shapes(settings, triton, where="model 'r'")
    assert out["backend_options"] == {
        "codec": "uint8",
        "onnxruntime": {"log_severity": 4, "inputs": [{"name": "x", "shape": [-1, 3]}]},
    }
    assert settings["backend_options"]["onnxruntime"] == {"log_severity": 4}  # not changed
    toml = {"onnxruntime": {"inputs": [{"name": "x", "shape": [-1, 2]}]}}
    later = with_declared_shapes(
        {"backend": "ray", "backend_options": toml},
        triton,
        where="model 'r'",
        dims_overridden=["inputs"],
    )
    assert later["backend_options"]["onnxruntime"]["inputs"] == [{"name": "x", "shape": [-1, 3]}]
