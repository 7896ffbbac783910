"""Pipelines: a model that is a graph of steps over other models (Triton's ensembles)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import (
    BackendError,
    ConfigError,
    InvalidInput,
    ModelConfig,
    ModelNotFound,
    QueueFull,
    open_engine,
)
from trioinfer._runner import ModelRunner
from trioinfer.testing import models

pytestmark = pytest.mark.pipeline

Arrays = dict[str, np.ndarray[Any, Any]]


def tensor(
    name: str, dtype: str = "float32", shape: tuple[Any, ...] = ("batch", 4)
) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


class Step:
    """An async Python model: y = x * factor + offset after *delay* seconds; counts its calls."""

    calls: ClassVar[dict[str, int]] = {}
    cancelled: ClassVar[dict[str, int]] = {}
    batches: ClassVar[dict[str, list[int]]] = {}

    def __init__(self, name: str, factor: float = 1.0, offset: float = 0.0, delay: float = 0.0):
        self.name, self.factor, self.offset, self.delay = name, factor, offset, delay

    async def infer(self, inputs: Arrays) -> Arrays:
        Step.calls[self.name] = Step.calls.get(self.name, 0) + 1
        Step.batches.setdefault(self.name, []).append(len(inputs["x"]))
        try:
            await anyio.sleep(self.delay)
        except anyio.get_cancelled_exc_class():
            Step.cancelled[self.name] = Step.cancelled.get(self.name, 0) + 1
            raise
        if self.factor == 0:
            raise RuntimeError(f"{self.name} is broken")
        return {"y": inputs["x"] * self.factor + self.offset}


class Join:
    async def infer(self, inputs: Arrays) -> Arrays:
        return {"y": inputs["a"] + inputs["b"]}


def step_model(name: str, **parameters: Any) -> ModelConfig:
    return ModelConfig(
        name=name,
        path="-",
        backend="python",
        backend_options={
            "class": Step,
            "parameters": {"name": name, **parameters},
            "inputs": [tensor("x")],
            "outputs": [tensor("y")],
        },
        batcher="dynamic",
        batcher_options={"max_batch_size": 16, "max_queue_delay": 0.01},
    )


def join_model() -> ModelConfig:
    return ModelConfig(
        name="join",
        path="-",
        backend="python",
        backend_options={
            "class": Join,
            "inputs": [tensor("a"), tensor("b")],
            "outputs": [tensor("y")],
        },
    )


def pipeline(steps: list[dict[str, Any]], name: str = "p", **kw: Any) -> ModelConfig:
    options = {"inputs": [tensor("IN")], "outputs": [tensor("OUT")], "steps": steps}
    options.update(kw.pop("options", {}))
    return ModelConfig(name=name, path="-", backend="pipeline", backend_options=options, **kw)


def step(model: str, source: str, target: str, own_in: str = "x") -> dict[str, Any]:
    return {"model": model, "input_map": {own_in: source}, "output_map": {"y": target}}


# A diamond: IN -> double -> A; IN -> plus -> B; A + B -> join -> OUT
DIAMOND = [
    step("double", "IN", "A"),
    step("plus", "IN", "B"),
    {"model": "join", "input_map": {"a": "A", "b": "B"}, "output_map": {"y": "OUT"}},
]
X = np.ones((1, 4), np.float32)


@pytest.fixture(autouse=True)
def _reset() -> None:
    Step.calls.clear()
    Step.cancelled.clear()
    Step.batches.clear()


async def load_diamond(engine: trioinfer.Engine, delay: float = 0.0, **kw: Any) -> None:
    await engine.load(step_model("double", factor=2.0, delay=delay))
    await engine.load(step_model("plus", offset=10.0, delay=delay))
    await engine.load(join_model())
    await engine.load(pipeline(DIAMOND, **kw))


async def test_a_pipeline_looks_like_one_model(autojump_clock: trio.testing.MockClock) -> None:
    async with open_engine() as engine:
        await load_diamond(engine)
        info = engine.model("p")
        assert [s.describe() for s in info.signature.inputs] == ["float32[batch, 4]"]
        out = await engine.infer("p", {"IN": X * 3})
        np.testing.assert_array_equal(out["OUT"], X * 3 * 2 + (X * 3 + 10))
        with pytest.raises(InvalidInput, match="model 'p' has no input named 'x'"):
            await engine.infer("p", {"x": X})
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.failed, stats.in_flight) == (1, 0, 0)
        assert stats.request_duration.count == 1
        assert "p" in [m.name for m in engine.models()]


async def test_a_pipelines_inference_count_is_its_requests_rows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # inferences (Triton's inference_count) counts the rows that got outputs, as a
    # model's does (and a pipeline that batches its own requests): on each way a
    # pipeline request runs (its chain as plain calls, side by side steps, _submit's).
    async with open_engine() as engine:
        await load_diamond(engine)
        await engine.load(pipeline([step("double", "IN", "OUT")], name="chain"))
        three = np.ones((3, 4), np.float32)
        for name in ("p", "chain"):
            await engine.infer(name, {"IN": three})
            await engine.infer_detailed(name, {"IN": three})
            stats = engine.statistics().models[name]
            assert (stats.succeeded, stats.inferences) == (2, 6), name


async def test_steps_whose_inputs_are_ready_run_side_by_side(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_diamond(engine, delay=1.0)
        t0 = trio.current_time()
        await engine.infer("p", {"IN": X})
        # double and plus at once (1 s), then join: not 2 s.
        assert trio.current_time() - t0 == pytest.approx(1.01)


async def test_the_callers_deadline_reaches_every_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    chain = [step("first", "IN", "A"), step("second", "A", "B"), step("third", "B", "OUT")]
    async with open_engine() as engine:
        for name in ("first", "second", "third"):
            await engine.load(step_model(name, delay=1.0))
        await engine.load(pipeline(chain))
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(1.5):  # first ends at 1.01 s, second would at 2.02 s
                await engine.infer("p", {"IN": X})
        await trio.testing.wait_all_tasks_blocked()
        assert Step.calls == {"first": 1, "second": 1}  # third never started
        assert Step.cancelled == {"second": 1}
        stats = engine.statistics()
        assert stats.models["p"].cancelled == 1
        assert stats.models["second"].cancelled == 1


async def test_a_failing_step_ends_the_request_once_with_its_error_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await engine.load(step_model("double", factor=0.0))  # raises
        await engine.load(step_model("plus", delay=5.0))
        await engine.load(join_model())
        await engine.load(pipeline(DIAMOND))
        t0 = trio.current_time()
        with pytest.raises(BackendError) as info:
            await engine.infer("p", {"IN": X})
        assert trio.current_time() - t0 < 1  # plus was cancelled, not waited for
        assert str(info.value).startswith("pipeline 'p', step 0 (model 'double'): ")
        assert "double is broken" in str(info.value)
        await trio.testing.wait_all_tasks_blocked()
        assert Step.cancelled == {"plus": 1}
        assert engine.statistics().models["p"].failed == 1


async def test_each_step_batches_requests_from_many_pipeline_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_diamond(engine)
        results: dict[int, np.ndarray[Any, Any]] = {}

        async def call(i: int) -> None:
            results[i] = (await engine.infer("p", {"IN": X * i}))["OUT"]

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(call, i)
    assert Step.batches["double"] == [8]
    for i in range(8):
        np.testing.assert_array_equal(results[i], X * i * 3 + 10)


async def test_in_flight_requests_are_bounded(autojump_clock: trio.testing.MockClock) -> None:
    async with open_engine() as engine:
        await load_diamond(engine, delay=1.0, max_queue_size=2)
        outcomes: list[object] = []

        async def call() -> None:
            try:
                await engine.infer("p", {"IN": X})
                outcomes.append("ok")
            except QueueFull as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(call)
        assert outcomes.count("ok") == 2
        (refused,) = [o for o in outcomes if isinstance(o, QueueFull)]
        assert "pipeline 'p' has 2 requests in flight" in str(refused)
        assert engine.statistics().models["p"].refused == 1


async def test_unloading_a_step_model_fails_the_pipeline_clearly() -> None:
    async with open_engine() as engine:
        await load_diamond(engine)
        await engine.unload("plus")
        with pytest.raises(ModelNotFound, match=r"step 1 \(model 'plus'\): no model named 'plus'"):
            await engine.infer("p", {"IN": X})
        await engine.unload("p")
        with pytest.raises(ModelNotFound):
            await engine.infer("p", {"IN": X})


@pytest.mark.parametrize(
    ("steps", "options", "message"),
    [
        ([step("missing", "IN", "OUT")], {}, "no model named 'missing' is loaded"),
        ([step("double", "NOPE", "OUT")], {}, r"step 0 \(model 'double'\) needs \['NOPE'\]"),
        (
            [step("double", "A", "B"), step("plus", "B", "A"), step("join", "A", "OUT")],
            {},
            "or the steps form a cycle",
        ),
        ([step("double", "IN", "A")], {}, "no step produces its output 'OUT'"),
        (
            [{"model": "double", "input_map": {"x": "IN"}, "output_map": {"z": "OUT"}}],
            {},
            "maps output 'z', which model 'double' does not have",
        ),
        (
            [{"model": "join", "input_map": {"a": "IN"}, "output_map": {"y": "OUT"}}],
            {},
            r"maps no pipeline tensor to \['b'\]",
        ),
        (
            [step("double", "IN", "OUT"), step("plus", "IN", "OUT")],
            {},
            "writes tensor 'OUT', which something else writes already",
        ),
        (
            [step("double", "IN", "OUT")],
            {"inputs": [tensor("IN", "int64")]},
            "input 'x' of model 'double' is float32",
        ),
        (
            [step("double", "IN", "OUT")],
            {"outputs": [tensor("OUT", "int64")]},
            "output 'OUT' is declared int64",
        ),
        ([], {}, "must be a non-empty list of tables"),
        ([{"model": "double"}], {}, "step 0 must be a table of model, input_map and output_map"),
        ([step("double", "IN", "OUT")], {"colour": 1}, "unknown option 'colour'"),
    ],
)
async def test_a_pipeline_that_cannot_work_is_refused_at_load(
    steps: list[dict[str, Any]], options: dict[str, Any], message: str
) -> None:
    async with open_engine() as engine:
        await load_diamond(engine)
        with pytest.raises((ConfigError, ModelNotFound), match=message):
            await engine.load(pipeline(steps, name="q", options=options))
        assert "q" not in [m.name for m in engine.models()]


def test_a_pipeline_runs_on_asyncio() -> None:
    async def main() -> None:
        async with open_engine() as engine:
            await load_diamond(engine)
            await engine.load(pipeline([step("double", "IN", "A"), step("plus", "A", "OUT")], "c"))
            with anyio.fail_after(10):
                out = await engine.infer("p", {"IN": X})
                chained = await engine.infer("c", {"IN": X})
            np.testing.assert_array_equal(out["OUT"], X * 3 + 10)
            np.testing.assert_array_equal(chained["OUT"], X * 2 + 10)

    anyio.run(main, backend="asyncio")


async def test_steps_that_fail_together_end_the_request_with_one_typed_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_diamond(engine)
        # Both parallel steps refuse the input at once; the caller gets one InvalidInput.
        loose = pipeline(
            DIAMOND, name="loose", options={"inputs": [tensor("IN", shape=("batch", -1))]}
        )
        await engine.load(loose)
        with pytest.raises(
            InvalidInput, match=r"^pipeline 'loose', step \d \(model '(double|plus)'\)"
        ):
            await engine.infer("loose", {"IN": np.ones((1, 5), np.float32)})
        assert engine.statistics().models["loose"].failed == 1


async def test_a_step_model_replaced_by_one_without_the_output_fails_the_step_clearly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_diamond(engine)

        class Renamed:
            async def infer(self, inputs: Arrays) -> Arrays:
                return {"z": inputs["x"]}

        other = ModelConfig(
            name="plus",
            path="-",
            backend="python",
            backend_options={"class": Renamed, "inputs": [tensor("x")], "outputs": [tensor("z")]},
        )
        await engine.load(other, replace=True)
        with pytest.raises(
            BackendError, match=r"step 1 \(model 'plus'\): .*without outputs \['y'\]"
        ):
            await engine.infer("p", {"IN": X})


async def test_a_pipeline_that_would_call_itself_is_refused() -> None:
    async with open_engine() as engine:
        await load_diamond(engine)
        with pytest.raises(ConfigError, match="leads back to the pipeline itself"):
            await engine.load(pipeline([step("p", "IN", "OUT")]), replace=True)
        nested = [{"model": "p", "input_map": {"IN": "IN"}, "output_map": {"OUT": "OUT"}}]
        await engine.load(pipeline(nested, name="outer"))
        cycle = [{"model": "outer", "input_map": {"IN": "IN"}, "output_map": {"OUT": "OUT"}}]
        with pytest.raises(ConfigError, match=r"step 0 \(model 'outer'\) leads back"):
            await engine.load(pipeline(cycle), replace=True)


class Streams:
    """A decoupled model: one response per request, as a stream."""

    async def infer(self, inputs: Arrays) -> Any:
        yield {"y": inputs["x"]}


@pytest.mark.parametrize("batcher", ["none", "dynamic"])
async def test_a_pipeline_over_a_decoupled_or_stateful_model_is_refused_at_load(
    batcher: str,
) -> None:
    # A step needs one answer per request, and has no sequence_id to give: it loaded,
    # then every request failed (a 400, the client blamed for the pipeline's config).
    streams = ModelConfig(
        name="streams",
        backend="python",
        backend_options={
            "class": Streams,
            "decoupled": True,
            "inputs": [tensor("x")],
            "outputs": [tensor("y")],
        },
    )
    stateful = ModelConfig(
        name="stateful",
        backend="python",
        backend_options={"class": Join, "inputs": [tensor("x")], "outputs": [tensor("y")]},
        batcher="sequence",
        sequence={},
    )
    async with open_engine() as engine:
        await engine.load(streams)
        with pytest.raises(
            ConfigError, match=r"pipeline 'p': step 0: model 'streams' is decoupled"
        ):
            await engine.load(pipeline([step("streams", "IN", "OUT")], batcher=batcher))
        # Nor can a step give a stateful model the sequence_id each request needs.
        await engine.load(stateful)
        with pytest.raises(
            ConfigError, match=r"pipeline 'p': step 0: model 'stateful' is stateful"
        ):
            await engine.load(pipeline([step("stateful", "IN", "OUT")], batcher=batcher))


async def test_a_failing_step_of_a_chain_ends_the_request_before_the_steps_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    chain = [step("first", "IN", "A"), step("second", "A", "B"), step("third", "B", "OUT")]
    async with open_engine() as engine:
        await engine.load(step_model("first"))
        await engine.load(step_model("second", factor=0.0))  # raises
        await engine.load(step_model("third"))
        await engine.load(pipeline(chain))
        with pytest.raises(BackendError, match=r"^pipeline 'p', step 1 \(model 'second'\): "):
            await engine.infer("p", {"IN": X})
        assert Step.calls == {"first": 1, "second": 1}
        stats = engine.statistics().models
        assert (stats["p"].failed, stats["p"].in_flight, stats["second"].failed) == (1, 0, 1)


async def test_steps_with_nothing_beside_them_run_in_the_callers_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # first, then double and plus side by side, then join: only double and plus
    # need tasks of their own (and join, started as they end, runs in one too).
    graph = [step("first", "IN", "S"), step("double", "S", "A"), step("plus", "S", "B")]
    graph.append({"model": "join", "input_map": {"a": "A", "b": "B"}, "output_map": {"y": "OUT"}})
    chain = [step("first", "IN", "A"), step("double", "A", "OUT")]
    tasks: dict[str, object] = {}
    infer = trioinfer.Engine.infer

    async def recording(self: trioinfer.Engine, model: str, *args: Any, **kw: Any) -> Any:
        tasks[model] = trio.lowlevel.current_task()
        return await infer(self, model, *args, **kw)

    monkeypatch.setattr(trioinfer.Engine, "infer", recording)
    # A step on a plain model takes infer's fast path in the engine's _infer_held.
    infer_held = trioinfer.Engine._infer_held

    async def recording_held(self: trioinfer.Engine, model: str, *args: Any, **kw: Any) -> Any:
        tasks[model] = trio.lowlevel.current_task()
        return await infer_held(self, model, *args, **kw)

    monkeypatch.setattr(trioinfer.Engine, "_infer_held", recording_held)
    run_here = ModelRunner.run_here

    async def recording_here(self: ModelRunner, *args: Any) -> Any:
        # A step run on its idle model in the pipeline's task (join, say).
        tasks[self.config.name] = trio.lowlevel.current_task()
        return await run_here(self, *args)

    monkeypatch.setattr(ModelRunner, "run_here", recording_here)
    async with open_engine() as engine:
        await engine.load(step_model("first"))
        await load_diamond(engine)
        await engine.load(pipeline(graph, name="graph"))
        await engine.load(pipeline(chain, name="chain"))
        caller = trio.lowlevel.current_task()
        out = await engine.infer("graph", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X * 2 + (X + 10))
        assert tasks["first"] is caller
        assert len({id(tasks[m]) for m in ("double", "plus", "join")} | {id(caller)}) == 4
        tasks.clear()
        await engine.infer("chain", {"IN": X})
        assert tasks == {"chain": caller, "first": caller, "double": caller}


async def test_load_with_steps_loads_what_a_pipeline_needs_and_nothing_else(
    tmp_path: Path,
) -> None:
    """The server's table loads a pipeline's step models first, each once, and no others."""
    from trioinfer.server import ModelRepository
    from trioinfer.server._models import ServedModels

    root = tmp_path / "repository"
    shutil.copytree(trioinfer.example_repository(), root)
    (root / "twice").mkdir()
    # Two steps over one model (loaded once), beside models it does not need (not loaded).
    (root / "twice" / "config.toml").write_text(
        'backend = "pipeline"\n[backend_options]\n'
        'inputs = [{ name = "IMAGE", dtype = "uint8", shape = ["batch", 8, 8] }]\n'
        'outputs = [{ name = "B", dtype = "float32", shape = ["batch", 64] }]\n'
        '[[backend_options.steps]]\nmodel = "scale_image"\n'
        'input_map = { image = "IMAGE" }\noutput_map = { input = "A" }\n'
        '[[backend_options.steps]]\nmodel = "scale_image"\n'
        'input_map = { image = "IMAGE" }\noutput_map = { input = "B" }\n'
    )
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(root))
        await served.load_with_steps("twice")
        assert [s.model for s in served.all()] == ["scale_image", "twice"]
        image = np.zeros((1, 8, 8), dtype=np.uint8)
        out = await engine.infer(served.resolve("twice").engine_name, {"IMAGE": image})
        assert out["B"].shape == (1, 64)


@pytest.mark.triton_config
async def test_an_ensemble_whose_step_model_failed_to_load_says_why(tmp_path: Path) -> None:
    """Not "no model named 'classifier' (version 2) is loaded": the step's own failure."""
    from trioinfer.server import ModelRepository
    from trioinfer.server._models import ServedModels

    (tmp_path / "classifier" / "2").mkdir(parents=True)
    (tmp_path / "classifier" / "2" / "model.onnx").write_bytes(b"not an ONNX model")
    (tmp_path / "classifier" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
    )
    (tmp_path / "ensemble" / "1").mkdir(parents=True)
    (tmp_path / "ensemble" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 4\n'
        'input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 5 ] } ]\n'
        'output [ { name: "CLASSES" data_type: TYPE_FP32 dims: [ 5 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "classifier" model_version: 2\n'
        'input_map { key: "IMAGE" value: "RAW" } output_map { key: "SCORES" value: "CLASSES" }'
        " } ] }\n"
    )
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(tmp_path))
        assert await served.load_all() == ["classifier", "ensemble"]
        step_error = served.error("classifier")
        assert step_error.startswith("failed to load 'classifier'")
        message = served.error("ensemble")
        assert message == (
            f"failed to load 'ensemble': its step model 'classifier' is not loaded: {step_error}"
        )
        assert "loaded: none" not in message


async def test_a_pipeline_without_steps_says_what_a_pipeline_needs(tmp_path: Path) -> None:
    """A load override {"backend": "pipeline"} on another model: not a complaint about inputs."""
    from trioinfer.server import ModelRepository
    from trioinfer.server._models import ServedModels

    shutil.copytree(trioinfer.example_repository() / "digits", tmp_path / "digits")
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(tmp_path))
        with pytest.raises(ConfigError) as caught:
            await served.load("digits", {"backend": "pipeline"})
        message = str(caught.value)
        assert "has backend 'pipeline' but its backend_options describe no pipeline" in message
        assert "backend_options.steps" in message
        assert "backend_options.inputs and .outputs" in message
        with pytest.raises(ConfigError, match=r"describe no pipeline \(they hold none\)"):
            await engine.load(ModelConfig(name="p", path="-", backend="pipeline"))


class Blob:
    """y: each element of x as bytes, then bytes that are not UTF-8; kind: what x held."""

    def infer(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        blobs = np.array([bytes(v) + b"\xff\x00" for v in x.ravel()], dtype=object)
        kinds = np.array([type(v).__name__ for v in x.ravel()], dtype=object)
        return {"y": blobs.reshape(x.shape), "kind": kinds.reshape(x.shape)}


def blob_model(name: str) -> ModelConfig:
    strings = {"dtype": "BYTES", "shape": ["batch"]}
    return ModelConfig(
        name=name,
        path="-",
        backend="python",
        backend_options={
            "class": Blob,
            "inputs": [{"name": "x", **strings}],
            "outputs": [{"name": "y", **strings}, {"name": "kind", **strings}],
        },
    )


async def test_bytes_pass_between_steps_as_they_are(tmp_path: Path) -> None:
    # BYTES a step makes reach the next step as its own model takes them: a Python
    # model's as bytes, byte for byte; an ONNX string input's as text, so bytes
    # that are not UTF-8 are the client's error there, naming the step and element.
    strings = {"dtype": "BYTES", "shape": ["batch"]}
    signature = {"inputs": [{"name": "IN", **strings}], "outputs": [{"name": "OUT", **strings}]}
    twice = [
        {"model": "first", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
        {"model": "second", "input_map": {"x": "A"}, "output_map": {"y": "OUT"}},
    ]
    into_onnx = [
        {"model": "first", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
        {"model": "text", "input_map": {"x": "A"}, "output_map": {"y": "OUT"}},
    ]
    models.write_identity(tmp_path / "text.onnx", dtype=object, shape=("batch",))
    async with open_engine() as engine:
        await engine.load(blob_model("first"))
        await engine.load(blob_model("second"))
        await engine.load(ModelConfig(name="text", path=tmp_path / "text.onnx"))
        await engine.load(
            ModelConfig(
                name="p",
                path="-",
                backend="pipeline",
                backend_options={**signature, "steps": twice},
            )
        )
        await engine.load(
            ModelConfig(
                name="q",
                path="-",
                backend="pipeline",
                backend_options={**signature, "steps": into_onnx},
            )
        )
        out = await engine.infer("p", {"IN": np.array(["a\u00e9", b"\x00"], dtype=object)})
        assert out["OUT"].tolist() == [
            "a\u00e9".encode() + b"\xff\x00\xff\x00",
            b"\x00\xff\x00\xff\x00",
        ]
        with pytest.raises(InvalidInput) as info:
            await engine.infer("q", {"IN": np.array([b"ok"], dtype=object)})
    assert str(info.value).startswith("pipeline 'q', step 1 (model 'text'): input 'x' of model ")
    assert "element at index 0 is not UTF-8" in str(info.value)


class Doubles:
    """A step that doubles its input in place: its input is another step's output, or the
    pipeline caller's array."""

    def infer(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        x *= 2
        return {"y": x}


class Passes:
    """A step that answers its input as it is."""

    def infer(self, inputs: Arrays) -> Arrays:
        return {"y": inputs["x"]}


def inline_model(name: str, cls: type) -> ModelConfig:
    options = {"class": cls, "inputs": [tensor("x")], "outputs": [tensor("y")]}
    return ModelConfig(
        name=name, path="-", backend="python", backend_options={**options, "dispatch": "inline"}
    )


@pytest.mark.python_model
@pytest.mark.parametrize("batcher", ["none", "dynamic"])
async def test_a_step_cannot_change_the_callers_array_or_another_steps_output(
    batcher: str,
) -> None:
    # IN -> passes -> A; A -> doubles -> OUT, the pipeline answering A and OUT: the step
    # doubling its input in place doubled A (the first step's answer, the caller's
    # array itself) after the first step had answered it, and the caller's own array.
    async with open_engine() as engine:
        await engine.load(inline_model("passes", Passes))
        await engine.load(inline_model("doubles", Doubles))
        await engine.load(
            pipeline(
                [step("passes", "IN", "A"), step("doubles", "A", "OUT")],
                options={"outputs": [tensor("A"), tensor("OUT")]},
                batcher=batcher,
            )
        )
        x = X.copy()
        with pytest.raises(
            trioinfer.BackendError,
            match=r"step 1 \(model 'doubles'\).*a model's inputs are read-only",
        ):
            await engine.infer("p", {"IN": x})
        assert x.tolist() == X.tolist()


class MaybeJoin:
    """y = a + b, where the request sends b (optional), else y = a."""

    async def infer(self, inputs: Arrays) -> Arrays:
        return {"y": inputs["a"] + inputs["b"] if "b" in inputs else inputs["a"]}


async def test_a_step_leaves_an_optional_input_it_maps_nothing_to_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maybe = ModelConfig(
        name="maybe",
        backend="python",
        backend_options={
            "class": MaybeJoin,
            "inputs": [tensor("a"), {**tensor("b"), "optional": True}],
            "outputs": [tensor("y")],
        },
    )
    async with open_engine() as engine:
        await engine.load(maybe)
        both = {"model": "maybe", "input_map": {"a": "IN", "b": "IN"}, "output_map": {"y": "OUT"}}
        one = {"model": "maybe", "input_map": {"a": "IN"}, "output_map": {"y": "OUT"}}
        await engine.load(pipeline([both], name="both"))
        await engine.load(pipeline([one], name="one"))
        np.testing.assert_array_equal((await engine.infer("both", {"IN": X}))["OUT"], X + X)
        np.testing.assert_array_equal((await engine.infer("one", {"IN": X}))["OUT"], X)
        # A pipeline's own inputs are all sent: one declared optional is refused.
        optional = pipeline(
            [one], name="opt", options={"inputs": [{**tensor("IN"), "optional": True}]}
        )
        with pytest.raises(trioinfer.ConfigError, match=r"input 'IN' is optional, which a pipe"):
            await engine.load(optional)
