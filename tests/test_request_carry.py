"""What a request carries through a pipeline's steps and a fallback's failover.

A pipeline request that names its outputs runs only the steps they need, and
one that names an output the pipeline lacks is refused before any step runs;
a step model is told the id the pipeline request's caller gave (as Triton
tells a composing model the ensemble request's); a pipeline's answer carries
no step's response parameters (as a Triton ensemble's response does not); a
request failed over to another model carries its requested outputs there, and
its answer keeps that model's response parameters, while a default answer
given after a failed run or a refused stand-in has none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from _serve import start_serving
from test_pipeline import Step, join_model, pipeline, step, step_model, tensor
from test_triton_python_gaps import MODELS, WAIT_S, write_models
from trioinfer.lowlevel import Request, set_response_parameters
from trioinfer.server._repository import ModelRepository

X = np.ones((1, 4), np.float32)

# -- which steps run -----------------------------------------------------------------------

# IN -> double -> A -> plus -> OUT, and A is an output too: both steps run in turn.
CHAIN = [step("double", "IN", "A"), step("plus", "A", "OUT")]

# A diamond (IN -> double -> A, IN -> plus -> B, A + B -> join -> OUT) beside
# IN -> triple -> SIDE: all side by side.
WIDE = [
    step("double", "IN", "A"),
    step("plus", "IN", "B"),
    {"model": "join", "input_map": {"a": "A", "b": "B"}, "output_map": {"y": "OUT"}},
    step("triple", "IN", "SIDE"),
]


async def load_steps(engine: trioinfer.Engine) -> None:
    await engine.load(step_model("double", factor=2.0))
    await engine.load(step_model("plus", offset=10.0))
    await engine.load(step_model("triple", factor=3.0))
    await engine.load(join_model())
    outputs = {"outputs": [tensor("OUT"), tensor("A")]}
    await engine.load(pipeline(CHAIN, name="chain", options=outputs))
    outputs = {"outputs": [tensor("OUT"), tensor("SIDE")]}
    await engine.load(pipeline(WIDE, name="wide", options=outputs))


def calls() -> dict[str, int]:
    done = dict(Step.calls)
    Step.calls.clear()
    return done


@pytest.mark.pipeline
async def test_a_pipeline_request_naming_outputs_runs_only_the_steps_they_need(
    autojump_clock: trio.testing.MockClock,
) -> None:
    Step.calls.clear()
    async with trioinfer.open_engine() as engine:
        await load_steps(engine)
        out = await engine.infer("chain", {"IN": X}, outputs=["A"])
        assert out.keys() == {"A"}
        np.testing.assert_array_equal(out["A"], X * 2)
        assert calls() == {"double": 1}
        out = await engine.infer("wide", {"IN": X}, outputs=["SIDE"])
        np.testing.assert_array_equal(out["SIDE"], X * 3)
        assert calls() == {"triple": 1}
        result = await engine.infer_detailed("wide", {"IN": X}, outputs=["OUT"])
        np.testing.assert_array_equal(result.outputs["OUT"], X * 2 + X + 10)
        assert calls() == {"double": 1, "plus": 1}  # (join is no Step)
        # Every output named, in another order: every step, as with none named.
        out = await engine.infer("wide", {"IN": X}, outputs=["SIDE", "OUT"])
        assert list(out) == ["SIDE", "OUT"]
        assert calls() == {"double": 1, "plus": 1, "triple": 1}
        out = await engine.infer("chain", {"IN": X})
        assert out.keys() == {"OUT", "A"}
        assert calls() == {"double": 1, "plus": 1}
        # A name the pipeline lacks: refused before any step runs.
        with pytest.raises(trioinfer.InvalidInput, match="model 'wide' has no output 'B'"):
            await engine.infer("wide", {"IN": X}, outputs=["OUT", "B"])
        assert calls() == {}
        assert engine.statistics().models["wide"].succeeded == 3


# -- Triton models in an ensemble, and failed over to ------------------------------------

ENSEMBLE_PBTXT = """\
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "ID" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "ident"
      model_version: -1
      input_map { key: "X" value: "X" }
      output_map { key: "ID" value: "ID" }
    },
    {
      model_name: "tagged"
      model_version: -1
      input_map { key: "X" value: "X" }
      output_map { key: "Y" value: "Y" }
    }
  ]
}
"""

# Fails every execute: its requests go to the models its fallback names.
BROKEN = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("this instance is down")
"""


def failing_over(pbtxt: str, options: dict[str, Any]) -> str:
    """*pbtxt* with the resilient fallback and *options*, in trioinfer's Triton parameters."""
    quoted = json.dumps(json.dumps(options))
    parameter = 'parameters {{ key: "trioinfer.{}" value: {{ string_value: {} }} }}\n'
    return (
        pbtxt
        + parameter.format("fallback", '"resilient"')
        + parameter.format("fallback_options", quoted)
    )


# Outputs Z, not Y: it answers, but cannot stand in for a model whose output is Y.
ODD_PBTXT = MODELS["tagged"][0].replace('name: "Y"', 'name: "Z"')
ODD = MODELS["tagged"][1].replace('"Y"', '"Z"')

CARRY_MODELS = {
    **{name: MODELS[name] for name in ("ident", "tagged", "picky")},
    "ens": (ENSEMBLE_PBTXT, ""),
    "odd": (ODD_PBTXT, ODD),
    # Each of tagged's signature, failing over to tagged; to odd, then a default.
    "down": (failing_over(MODELS["tagged"][0], {"attempts": 1, "models": ["tagged"]}), BROKEN),
    "down_odd": (
        failing_over(
            MODELS["tagged"][0], {"attempts": 1, "models": ["odd"], "default": {"Y": [9]}}
        ),
        BROKEN,
    ),
    # picky's, failing over to picky.
    "down_picky": (failing_over(MODELS["picky"][0], {"attempts": 1, "models": ["picky"]}), BROKEN),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_models(tmp_path_factory.mktemp("carry") / "models", CARRY_MODELS)
    (root / "ens" / "1" / "model.py").unlink()  # an ensemble is its config alone
    return root


async def load(engine: trioinfer.Engine, repository: Path, *names: str) -> None:
    repo = ModelRepository(repository)
    for name in names:
        await engine.load(repo.entry(name).config(1))


@pytest.mark.pipeline
@pytest.mark.python_model
@pytest.mark.triton_config
async def test_a_step_model_is_told_the_pipeline_callers_id_and_gives_it_no_parameters(
    repository: Path,
) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "ident", "tagged", "ens")
        x = {"X": np.array([4], np.int32)}
        with trio.fail_after(WAIT_S):
            result = await engine.infer_detailed("ens", x, request_id="abc")
            assert result.outputs["ID"].tolist() == [b"abc"]
            # As a Triton ensemble's response: none of its steps' response parameters.
            assert dict(result.parameters) == {}
            # None given: the step's model is told none (the engine's own id is not it).
            assert (await engine.infer("ens", x))["ID"].tolist() == [b""]
            out = await engine.infer("ens", x, outputs=["ID"], request_id="d")
            assert out.keys() == {"ID"}
            assert out["ID"].tolist() == [b"d"]
        stats = engine.statistics().models
        assert (stats["ident"].succeeded, stats["tagged"].succeeded) == (3, 2)


@pytest.mark.python_model
@pytest.mark.triton_config
async def test_a_failed_over_request_keeps_the_answering_models_response_parameters(
    repository: Path,
) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "tagged", "odd", "picky", "down", "down_odd", "down_picky")
        with trio.fail_after(WAIT_S):
            result = await engine.infer_detailed("down", {"X": np.array([4], np.int32)})
            assert (result.model, result.fallbacks) == ("tagged", ("model tagged",))
            assert result.outputs["Y"].tolist() == [4]
            assert dict(result.parameters) == {"index": 0, "even": True, "word": "w4"}
            # odd answers (with parameters), but without Y: the default answers, as
            # the fallback's own, with none of odd's parameters, made by no model.
            result = await engine.infer_detailed("down_odd", {"X": np.array([4], np.int32)})
            assert result.outputs["Y"].tolist() == [9]
            assert (result.model, result.instance, result.fallbacks) == (
                "down_odd",
                None,
                ("default",),
            )
            assert dict(result.parameters) == {}
            # The outputs asked for reach the model failed over to.
            x = {"X": np.array([[5]], np.int32)}
            out = await engine.infer("down_picky", x, outputs=["B", "ASKED"])
            assert out.keys() == {"B", "ASKED"}
            assert (out["ASKED"].tolist(), out["B"].tolist()) == ([[b"B,ASKED"]], [[7]])
            assert (await engine.infer("down_picky", x))["ASKED"].tolist() == [[b"A,B,ASKED"]]


class TagsOnce:
    """A model of per-request answers (y = x) whose first execution gives its requests
    response parameters, then fails: the next answers with none."""

    signature = trioinfer.ModelSignature(
        (trioinfer.TensorSpec("x", np.dtype(np.float32), ("batch", 1), "tensor(float)"),),
        (trioinfer.TensorSpec("y", np.dtype(np.float32), ("batch", 1), "tensor(float)"),),
    )
    device = "cpu"

    def __init__(self) -> None:
        self.executions = 0

    async def execute(self, inputs: Any) -> dict[str, Any]:
        return {"y": inputs["x"]}

    async def execute_requests(self, requests: Sequence[Request]) -> list[Any]:
        await trio.lowlevel.checkpoint()
        self.executions += 1
        if self.executions == 1:
            for request in requests:
                set_response_parameters(request, {"first": True})
            raise RuntimeError("broke after it tagged its requests")
        return [{"y": request.inputs["x"]} for request in requests]

    async def aclose(self) -> None:
        pass


async def test_a_retried_request_has_no_parameters_from_the_run_that_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    instance = TagsOnce()

    class Backend:
        async def load(self, config: Any, placement: Any) -> TagsOnce:
            return instance

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    config = trioinfer.ModelConfig(
        name="m",
        path="-",
        backend="b",
        instances=[trioinfer.Instance(count=2)],
        fallback="resilient",
        fallback_options={"attempts": 2},
    )
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        result = await engine.infer_detailed("m", {"x": np.ones((1, 1), np.float32)})
    assert result.fallbacks == ("failover instance 1 (cpu)",)
    assert (instance.executions, dict(result.parameters)) == (2, {})


class Tags(TagsOnce):
    """Per-request answers (y = x), each with the response parameter ``tagged``."""

    async def execute_requests(self, requests: Sequence[Request]) -> list[Any]:
        await trio.lowlevel.checkpoint()
        for request in requests:
            set_response_parameters(request, {"tagged": True})
        return [{"y": request.inputs["x"]} for request in requests]


class AsksThenRuns:
    """A fallback that asks model ``tagger`` for each request's answer, then answers
    with its own model's run."""

    async def execute(self, execution: trioinfer.Execution) -> None:
        for request in execution.pending():
            await execution.infer_elsewhere("tagger", request)
        await execution.run()


async def test_a_run_after_an_answer_from_elsewhere_has_none_of_its_parameters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Cleared only after a failed run: the other model's parameters stayed on the answer
    # of this model's run, which gave none.
    class Plain:
        signature = TagsOnce.signature
        device = "cpu"

        async def execute(self, inputs: Any) -> dict[str, Any]:
            return {"y": inputs["x"]}

        async def aclose(self) -> None:
            pass

    class Backend:
        async def load(self, config: Any, placement: Any) -> TagsOnce | Plain:
            return Tags() if config.name == "tagger" else Plain()

    registry = trioinfer.Registry(
        extra={"backends": {"b": Backend}, "fallbacks": {"asks": AsksThenRuns}}
    )
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(trioinfer.ModelConfig(name="tagger", path="-", backend="b"))
        await engine.load(trioinfer.ModelConfig(name="m", path="-", backend="b", fallback="asks"))
        result = await engine.infer_detailed("m", {"x": np.ones((1, 1), np.float32)})
    assert (result.model, result.fallbacks) == ("m", ())
    assert dict(result.parameters) == {}


# -- over HTTP ---------------------------------------------------------------------------


@pytest.mark.pipeline
@pytest.mark.python_model
@pytest.mark.triton_config
async def test_http_ensemble_ids_outputs_and_failover_parameters(repository: Path) -> None:
    x = {"inputs": [{"name": "X", "datatype": "INT32", "shape": [1], "data": [4]}]}
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        listening = await start_serving(nursery, repository, shutdown=stop)
        async with httpx.AsyncClient(base_url=listening.urls[0], timeout=WAIT_S) as client:
            asked = {**x, "id": "h1", "outputs": [{"name": "ID"}]}
            answer = (await client.post("/v2/models/ens/infer", json=asked)).json()
            assert [o["name"] for o in answer["outputs"]] == ["ID"]
            assert (answer["id"], answer["outputs"][0]["data"]) == ("h1", ["h1"])
            assert "parameters" not in answer
            # The ID asked for alone: tagged's step did not run.
            stats = (await client.get("/v2/models/tagged/stats")).json()
            assert stats["model_stats"][0]["inference_count"] == 0
            refused = await client.post(
                "/v2/models/ens/infer", json={**x, "outputs": [{"name": "Q"}]}
            )
            assert refused.status_code == 400
            assert "'Q' is not an output of model 'ens'" in refused.json()["error"]
            answer = (await client.post("/v2/models/down/infer", json=x)).json()
            assert answer["outputs"][0]["data"] == [4]
            # The model's own parameters, beside those that say a fallback answered.
            given = answer["parameters"]
            assert (given["index"], given["even"], given["word"]) == (0, True, "w4")
            assert given["trioinfer_fallbacks"] == "model tagged version 1"
        stop.set()
