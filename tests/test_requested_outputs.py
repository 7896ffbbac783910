"""Only the outputs asked for are computed: ONNX Runtime's, and a pipeline step's.

A request that names outputs (``engine.infer(outputs=...)``) reaches an
``OutputsInstance`` as ``execute_outputs`` with their union where every request
of the execution named some; a pipeline step whose ``output_map`` keeps only
some of its model's outputs names those in its request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import ModelConfig, open_engine
from trioinfer.abc import OutputsInstance
from trioinfer.testing import models

WIDTH = 4
X = np.arange(2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)
BATCHED = {"batcher": "dynamic", "batcher_options": {"max_batch_size": 16, "max_queue_delay": 0.5}}


@pytest.fixture(scope="module")
def two_branches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_two_branches(
        tmp_path_factory.mktemp("outputs") / "two.onnx", width=WIDTH, depth=3
    )


class Spy:
    """An ONNX Runtime session that records the output names each run asked for."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.asked: list[list[str]] = []

    def run(self, names: list[str], *rest: Any) -> Any:
        self.asked.append(list(names))
        return self.session.run(names, *rest)

    def run_async(self, names: list[str], *rest: Any) -> Any:
        self.asked.append(list(names))
        return self.session.run_async(names, *rest)


def spy_on(engine: trioinfer.Engine, model: str) -> Spy:
    instance = engine._runners[model]._instances[0]  # type: ignore[union-attr]
    spy = Spy(instance._session)  # type: ignore[attr-defined]
    instance._session = spy  # type: ignore[attr-defined]
    return spy


def costly(x: np.ndarray[Any, Any], path: Path) -> np.ndarray[Any, Any]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["costly"], {"x": x})[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("dispatch", ["inline", "thread", "ort_async", "auto"])
async def test_onnx_runtime_runs_only_the_outputs_a_request_names(
    two_branches: Path, dispatch: str
) -> None:
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(name="two", path=two_branches, backend_options={"dispatch": dispatch})
        )
        instance = engine._runners["two"]._instances[0]  # type: ignore[union-attr]
        assert isinstance(instance, OutputsInstance)
        spy = spy_on(engine, "two")
        cheap = await engine.infer("two", {"x": X}, outputs=["cheap"])
        assert list(cheap) == ["cheap"]
        np.testing.assert_array_equal(cheap["cheap"], X + X)
        detailed = await engine.infer_detailed("two", {"x": X}, outputs=["costly"])
        np.testing.assert_allclose(detailed.outputs["costly"], costly(X, two_branches))
        both = await engine.infer("two", {"x": X})
        assert sorted(both) == ["cheap", "costly"]
    assert spy.asked == [["cheap"], ["costly"], ["cheap", "costly"]]


async def test_a_batch_whose_requests_all_name_outputs_runs_their_union(
    two_branches: Path, autojump_clock: trio.testing.MockClock
) -> None:
    answers: dict[str, Any] = {}
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="two", path=two_branches, **BATCHED))
        spy = spy_on(engine, "two")

        async def one(name: str, outputs: list[str] | None) -> None:
            answers[name] = await engine.infer("two", {"x": X}, outputs=outputs)

        for requests in ([("a", ["cheap"]), ("b", ["cheap"])], [("c", ["cheap"]), ("d", None)]):
            async with trio.open_nursery() as nursery:
                for name, outputs in requests:
                    nursery.start_soon(one, name, outputs)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "e", ["cheap"])
            nursery.start_soon(one, "f", ["costly"])
    # One execution each: names alone; any request naming none: all; else the union.
    assert [sorted(names) for names in spy.asked] == [
        ["cheap"],
        ["cheap", "costly"],
        ["cheap", "costly"],
    ]
    assert {name: sorted(outputs) for name, outputs in answers.items()} == {
        "a": ["cheap"],
        "b": ["cheap"],
        "c": ["cheap"],
        "d": ["cheap", "costly"],
        "e": ["cheap"],
        "f": ["costly"],
    }
    np.testing.assert_array_equal(answers["e"]["cheap"], X + X)
    np.testing.assert_allclose(answers["f"]["costly"], costly(X, two_branches))


class Lies:
    """An OutputsInstance that answers without an output it was asked for."""

    signature = trioinfer.ModelSignature(
        (trioinfer.TensorSpec("x", np.dtype(np.float32), ("batch", 1), "tensor(float)"),),
        tuple(
            trioinfer.TensorSpec(name, np.dtype(np.float32), ("batch", 1), "tensor(float)")
            for name in ("y", "z")
        ),
    )
    device = "cpu"

    async def execute(self, inputs: Any) -> dict[str, Any]:
        return {"y": inputs["x"], "z": inputs["x"]}

    async def execute_outputs(self, inputs: Any, outputs: tuple[str, ...]) -> dict[str, Any]:
        return {"y": inputs["x"]}

    async def aclose(self) -> None:
        pass


async def test_an_answer_without_an_output_asked_for_fails_clearly() -> None:
    class Backend:
        async def load(self, config: Any, placement: Any) -> Lies:
            return Lies()

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    async with open_engine(registry=registry) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="b"))
        x = np.ones((1, 1), np.float32)
        assert list(await engine.infer("m", {"x": x}, outputs=["y"])) == ["y"]
        with pytest.raises(trioinfer.BackendError, match=r"asked for \['z'\] \(missing \['z'\]\)"):
            await engine.infer("m", {"x": x}, outputs=["z"])
        assert sorted(await engine.infer("m", {"x": x})) == ["y", "z"]


async def test_an_instance_is_asked_for_its_execute_outputs_once() -> None:
    # Looked up at each execution whose requests named outputs, a getattr that misses
    # (an instance without it) raised and caught an AttributeError each time.
    class Counted(Lies):
        looked_up = 0

        def __getattribute__(self, name: str) -> Any:
            if name == "execute_outputs":
                type(self).looked_up += 1
            return super().__getattribute__(name)

    class Backend:
        async def load(self, config: Any, placement: Any) -> Counted:
            return Counted()

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    async with open_engine(registry=registry) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="b"))
        before = Counted.looked_up
        x = np.ones((1, 1), np.float32)
        for _ in range(5):
            assert list(await engine.infer("m", {"x": x}, outputs=["y"])) == ["y"]
        assert Counted.looked_up == before


def two_step_pipeline(keep: dict[str, str], name: str = "p", **kw: Any) -> ModelConfig:
    outputs = [
        {"name": shared, "dtype": "float32", "shape": ["batch", WIDTH]} for shared in keep.values()
    ]
    return ModelConfig(
        name=name,
        path="-",
        backend="pipeline",
        backend_options={
            "inputs": [{"name": "IN", "dtype": "float32", "shape": ["batch", WIDTH]}],
            "outputs": outputs,
            "steps": [{"model": "two", "input_map": {"x": "IN"}, "output_map": keep}],
        },
        **kw,
    )


@pytest.mark.pipeline
@pytest.mark.parametrize(
    ("dispatch", "pipeline_options", "concurrent"),
    [
        ("inline", {}, 1),  # each step a plain call (run_now)
        ("thread", {}, 1),  # in the caller's task on the idle model (run_here)
        ("thread", {}, 6),  # through the step model's queue and batcher
        ("inline", BATCHED, 6),  # a batched pipeline's steps
    ],
)
async def test_a_step_asks_its_model_for_the_outputs_its_map_keeps(
    two_branches: Path,
    dispatch: str,
    pipeline_options: dict[str, Any],
    concurrent: int,
) -> None:
    answers: list[Any] = []
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(
                name="two", path=two_branches, backend_options={"dispatch": dispatch}, **BATCHED
            )
        )
        await engine.load(two_step_pipeline({"cheap": "OUT"}, **pipeline_options))
        await engine.load(
            two_step_pipeline({"cheap": "A", "costly": "B"}, name="all", **pipeline_options)
        )
        spy = spy_on(engine, "two")

        async def one(model: str) -> None:
            answers.append(await engine.infer(model, {"IN": X}))

        async with trio.open_nursery() as nursery:
            for _ in range(concurrent):
                nursery.start_soon(one, "p")
        assert spy.asked
        assert all(names == ["cheap"] for names in spy.asked)
        for answer in answers:
            assert list(answer) == ["OUT"]
            np.testing.assert_array_equal(answer["OUT"], X + X)
        spy.asked.clear()
        whole = await engine.infer("all", {"IN": X})
        np.testing.assert_allclose(whole["B"], costly(X, two_branches))
        assert spy.asked == [["cheap", "costly"]]


class Reads:
    """A RequestsInstance (as a Triton Python model's): records what each request named."""

    signature = Lies.signature
    device = "cpu"

    def __init__(self) -> None:
        self.named: list[tuple[str, ...]] = []

    async def execute(self, inputs: Any) -> dict[str, Any]:
        return {"y": inputs["x"], "z": inputs["x"]}

    async def execute_requests(self, requests: Any) -> list[dict[str, Any]]:
        await trio.lowlevel.checkpoint()
        answers = []
        for request in requests:
            self.named.append(request.requested_outputs)
            answers.append({name: request.inputs["x"] for name in request.requested_outputs})
        return answers

    async def aclose(self) -> None:
        pass


@pytest.mark.pipeline
@pytest.mark.parametrize("batched", [False, True])
async def test_a_model_that_reads_its_requests_is_told_what_the_step_keeps(
    batched: bool, autojump_clock: trio.testing.MockClock
) -> None:
    instance = Reads()

    class Backend:
        async def load(self, config: Any, placement: Any) -> Reads:
            return instance

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    spec = {"name": "IN", "dtype": "float32", "shape": ["batch", 1]}
    async with open_engine(registry=registry) as engine:
        await engine.load(
            ModelConfig(name="m", path="-", backend="b", **(BATCHED if batched else {}))
        )
        await engine.load(
            ModelConfig(
                name="p",
                path="-",
                backend="pipeline",
                backend_options={
                    "inputs": [spec],
                    "outputs": [{**spec, "name": "OUT"}],
                    "steps": [{"model": "m", "input_map": {"x": "IN"}, "output_map": {"z": "OUT"}}],
                },
            )
        )
        answers = []

        async def one() -> None:
            answers.append(await engine.infer("p", {"IN": np.ones((1, 1), np.float32)}))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
    assert instance.named == [("z",)] * 3
    assert [list(answer) for answer in answers] == [["OUT"]] * 3


class Honest:
    """An OutputsInstance with the outputs it is made with: records each execution's ask."""

    device = "cpu"

    def __init__(
        self, outputs: tuple[str, ...], asked: list[tuple[str, ...] | None], hold: list[trio.Event]
    ) -> None:
        self.signature = trioinfer.ModelSignature(
            Lies.signature.inputs,
            tuple(
                trioinfer.TensorSpec(name, np.dtype(np.float32), ("batch", 1), "tensor(float)")
                for name in outputs
            ),
        )
        self.asked = asked
        self.hold = hold

    async def execute(self, inputs: Any) -> dict[str, Any]:
        self.asked.append(None)
        if self.hold:  # a test keeps the model busy
            await self.hold[0].wait()
        return {spec.name: inputs["x"] for spec in self.signature.outputs}

    async def execute_outputs(self, inputs: Any, outputs: tuple[str, ...]) -> dict[str, Any]:
        self.asked.append(outputs)
        known = {spec.name for spec in self.signature.outputs}
        if not set(outputs) <= known:
            raise trioinfer.BackendError(f"no outputs {sorted(set(outputs) - known)}")
        return {name: inputs["x"] for name in outputs}

    async def aclose(self) -> None:
        pass


@pytest.mark.pipeline
@pytest.mark.parametrize("pipeline_options", [{}, BATCHED])
@pytest.mark.parametrize("busy", [False, True])
async def test_a_step_whose_model_is_replaced_asks_the_new_one_for_what_it_has(
    pipeline_options: dict[str, Any], busy: bool, autojump_clock: trio.testing.MockClock
) -> None:
    # The outputs a step asks for follow its model's load: a step kept "y" of ("y", "z").
    made: list[tuple[str, ...]] = [("y", "z")]
    asked: list[tuple[str, ...] | None] = []
    hold: list[trio.Event] = []

    class Backend:
        async def load(self, config: Any, placement: Any) -> Honest:
            return Honest(made[-1], asked, hold)

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    spec = {"name": "IN", "dtype": "float32", "shape": ["batch", 1]}
    step = ModelConfig(name="m", path="-", backend="b")
    x = np.ones((1, 1), np.float32)
    async with open_engine(registry=registry) as engine:
        await engine.load(step)
        await engine.load(
            ModelConfig(
                name="p",
                path="-",
                backend="pipeline",
                backend_options={
                    "inputs": [spec],
                    "outputs": [{**spec, "name": "OUT"}],
                    "steps": [{"model": "m", "input_map": {"x": "IN"}, "output_map": {"y": "OUT"}}],
                },
                **pipeline_options,
            )
        )

        async def through() -> Any:
            if not busy:
                return await engine.infer("p", {"IN": x})
            # The step's model busy: the step's request goes through engine.infer.
            answers = []

            async def one() -> None:
                try:
                    answers.append(await engine.infer("p", {"IN": x}))
                except trioinfer.TrioInferError as exc:
                    answers.append(exc)

            hold.append(trio.Event())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.infer, "m", {"x": x})
                await trio.testing.wait_all_tasks_blocked()
                asked.clear()  # (that request's)
                nursery.start_soon(one)
                await trio.testing.wait_all_tasks_blocked()
                hold.pop().set()
            if isinstance(answers[0], Exception):
                raise answers[0]
            return answers[0]

        assert list(await through()) == ["OUT"]
        assert ("y",) in asked
        # Its only output now: the step asks for every one (execute).
        made.append(("y",))
        await engine.load(step, replace=True)
        asked.clear()
        assert list(await through()) == ["OUT"]
        assert ("y",) not in asked
        assert None in asked
        # More outputs than before: it asks for the one it keeps.
        made.append(("y", "z", "w"))
        await engine.load(step, replace=True)
        asked.clear()
        assert list(await through()) == ["OUT"]
        assert ("y",) in asked
        # Without the one it keeps: the step fails as the model's answer (not asked for
        # an output it lacks, nor as the client's fault).
        made.append(("z",))
        await engine.load(step, replace=True)
        asked.clear()
        with pytest.raises(trioinfer.BackendError, match=r"without outputs \['y'\]"):
            await through()
        assert ("y",) not in asked
