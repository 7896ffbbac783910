"""The ``python`` backend: a Python class as a model, with a declared signature."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path
from typing import Any, ClassVar

import anyio
import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from _serve import start_serving
from trioinfer import BackendError, ConfigError, Device, Instance, ModelConfig, open_engine
from trioinfer.abc import InlineInstance
from trioinfer.lowlevel import Placement
from trioinfer.testing import check_backend
from trioinfer_python import PythonBackend, PythonInstance
from trioinfer_python._faults import pass_on_ctrl_c

pytestmark = pytest.mark.python_model

XY = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
    "outputs": [{"name": "y", "dtype": "FP32", "shape": ["batch", 4]}],
}


class Double:
    """A sync model: y = 2 * x, on the instance's worker thread."""

    batches: ClassVar[list[int]] = []

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        assert threading.current_thread().name.startswith("trioinfer-python-")
        Double.batches.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}


class AsyncDouble:
    """An async model: y = 2 * x after *delay* seconds, on the event loop."""

    cancelled = 0

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        try:
            await anyio.sleep(self.delay)
        except anyio.get_cancelled_exc_class():
            AsyncDouble.cancelled += 1
            raise
        return {"y": inputs["x"] * 2}


class Needs:
    """A model whose constructor needs an argument, from the backend option parameters."""

    def __init__(self, scale: float) -> None:
        if scale < 0:
            raise ValueError("negative")
        self.scale = scale

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        return {"y": inputs["x"] * self.scale}


class LoopDouble:
    """A sync model run on the event loop (``dispatch = "inline"``): y = 2 * x."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        return {"y": inputs["x"] * 2}


def config(cls: Any = Double, name: str = "m", **options: Any) -> ModelConfig:
    # No path: the class is given itself, so there is no file to read.
    return ModelConfig(name=name, backend="python", backend_options={"class": cls, **XY, **options})


X = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.mark.parametrize(
    ("cls", "dispatch", "inline"),
    [(Double, "thread", False), (LoopDouble, "inline", True), (AsyncDouble, "thread", False)],
)
async def test_sync_and_async_models_keep_the_backend_contract(
    cls: type, dispatch: str, inline: bool
) -> None:
    await check_backend(PythonBackend(), config(cls, dispatch=dispatch), {"x": X})
    # Only a plain def infer on the loop never suspends (trioinfer.abc.InlineInstance).
    instance = await PythonBackend().load(
        config(cls, dispatch=dispatch), Placement(Device("cpu"), 0)
    )
    try:
        assert isinstance(instance, InlineInstance)
        assert instance.runs_inline is inline
    finally:
        await instance.aclose()


async def test_check_backend_holds_an_inline_instance_to_its_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(PythonInstance, "runs_inline", property(lambda self: True))
    with pytest.raises(AssertionError, match="runs_inline is True, but execute"):
        await check_backend(PythonBackend(), config(AsyncDouble), {"x": X})


async def test_a_model_from_a_repository_on_disk(tmp_path: Path) -> None:
    model_dir = tmp_path / "tokens"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(
        "import numpy as np\n\n"
        "class Model:\n"
        "    def __init__(self, width):\n"
        "        self.width = width\n\n"
        "    def infer(self, inputs):\n"
        "        ids = [[len(w) for w in t.split()][: self.width] for t in inputs['text']]\n"
        "        return {'ids': np.array([r + [0] * (self.width - len(r)) for r in ids])}\n"
    )
    (model_dir / "config.toml").write_text(
        'backend = "python"\n'
        'batcher = "dynamic"\n'
        "[backend_options]\n"
        "parameters = { width = 3 }\n"
        "inputs = [{ name = 'text', dtype = 'BYTES', shape = ['batch'] }]\n"
        "outputs = [{ name = 'ids', dtype = 'int64', shape = ['batch', 3] }]\n"
    )
    loaded = ModelConfig.from_toml(model_dir / "config.toml")
    assert loaded.path == model_dir / "1" / "model.py"
    async with open_engine() as engine:
        info = await engine.load(loaded)
        assert [s.describe() for s in info.signature.inputs] == ["object[batch]"]
        text = np.array(["a bb ccc dddd", "hello"], dtype=object)
        out = await engine.infer("tokens", {"text": text})
    np.testing.assert_array_equal(out["ids"], [[1, 2, 3], [5, 0, 0]])


class Lengths:
    """n = each element's type name and length: what the model was given, as given."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        return {"n": np.array([f"{type(v).__name__} {len(v)}" for v in inputs["s"]], dtype=object)}


@pytest.mark.parametrize(
    ("utf8", "want"),
    [
        # Unlike an ONNX model's (UTF-8 text: bytes are decoded for it), a declared
        # BYTES input may hold any bytes: the model gets bytes, as Triton's Python
        # backend gives them, str elements encoded as UTF-8.
        (None, ["bytes 2", "bytes 5", "bytes 2"]),
        (False, ["bytes 2", "bytes 5", "bytes 2"]),
        # Declared utf8: str, and bytes that are not UTF-8 are refused (below).
        (True, ["str 2", "str 3", "str 1"]),
    ],
)
async def test_string_inputs_reach_a_python_model_as_declared(
    utf8: bool | None, want: list[str]
) -> None:
    declared: dict[str, Any] = {"name": "s", "dtype": "BYTES", "shape": ["batch"]}
    if utf8 is not None:
        declared["utf8"] = utf8
    signature = {
        "inputs": [declared],
        "outputs": [{"name": "n", "dtype": "BYTES", "shape": ["batch"]}],
    }
    cfg = ModelConfig(
        name="lengths", path="-", backend="python", backend_options={"class": Lengths, **signature}
    )
    async with open_engine() as engine:
        info = await engine.load(cfg)
        assert info.signature.input("s").utf8 is bool(utf8)
        given = np.array([b"ab", "\u00e9t\u00e9", "\u00e9".encode()], dtype=object)
        out = await engine.infer("lengths", {"s": given})
        assert out["n"].tolist() == want
        binary = np.array([b"\xff\x00"], dtype=object)
        if utf8:
            with pytest.raises(trioinfer.InvalidInput, match="index 0 is not UTF-8"):
                await engine.infer("lengths", {"s": binary})
        else:
            assert (await engine.infer("lengths", {"s": binary}))["n"].tolist() == ["bytes 2"]


async def test_importing_a_model_file_leaves_the_event_loop_free(tmp_path: Path) -> None:
    # A model file whose imports take seconds (torch, say) was imported on the event
    # loop, and every other request of the server waited meanwhile. This one's import
    # waits until a task on the loop says so: on the loop, it would give up.
    model_dir = tmp_path / "heavy"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(
        "import pathlib\n"
        "import time\n\n"
        "import numpy as np\n\n"
        "here = pathlib.Path(__file__).parent\n"
        "(here / 'importing').touch()\n"
        "flag = here / 'loop-ran'\n"
        "for _ in range(1000):  # 10 s at most\n"
        "    if flag.exists():\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "else:\n"
        "    raise RuntimeError('the event loop did not run while this file was imported')\n\n"
        "class Model:\n"
        "    def infer(self, inputs):\n"
        "        return {'y': inputs['x']}\n"
    )
    (model_dir / "config.toml").write_text(
        'backend = "python"\n'
        "[backend_options]\n"
        "inputs = [{ name = 'x', dtype = 'float32', shape = [1] }]\n"
        "outputs = [{ name = 'y', dtype = 'float32', shape = [1] }]\n"
    )
    async with open_engine() as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.load, ModelConfig.from_toml(model_dir / "config.toml"))
            while not (model_dir / "1" / "importing").exists():  # noqa: ASYNC110  # a file, or a log line: no event
                await trio.sleep(0.01)
            (model_dir / "1" / "loop-ran").touch()
        out = await engine.infer("heavy", {"x": np.ones(1, dtype=np.float32)})
    np.testing.assert_array_equal(out["y"], [1.0])


async def test_a_slow_constructor_leaves_the_event_loop_free() -> None:
    # A constructor that read weights or a tokenizer for seconds ran on the event loop,
    # so every other model's requests (and health checks) waited for it. This one waits
    # until a request to another model has been answered meanwhile, or gives up.
    entered, answered = threading.Event(), threading.Event()
    seen: list[tuple[bool, str]] = []

    class Slow:
        def __init__(self) -> None:
            entered.set()
            seen.append((answered.wait(timeout=10), threading.current_thread().name))

        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            return {"y": inputs["x"]}

    async with open_engine() as engine:
        await engine.load(config(LoopDouble, name="fast", dispatch="inline"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.load, config(Slow, name="slow"))
            while not entered.is_set():  # noqa: ASYNC110  # set from the constructor's thread
                await trio.sleep(0.01)
            out = await engine.infer("fast", {"x": X})
            answered.set()
        np.testing.assert_array_equal(out["y"], X * 2)
        np.testing.assert_array_equal((await engine.infer("slow", {"x": X}))["y"], X)
    ((released, thread),) = seen
    assert released, "the other model's request waited for the constructor"
    assert thread != threading.current_thread().name


async def test_a_constructor_on_its_thread_sees_the_load_s_context() -> None:
    # The constructor runs on a worker thread (not the event loop): what it may call
    # there (current_engine, current_model_metrics, its metrics keyword, anyio's
    # primitives made for later use on the loop) works as it did on the loop.
    seen: list[tuple[bool, str]] = []

    class Aware:
        def __init__(self, metrics: Any) -> None:
            here = threading.current_thread() is not threading.main_thread()
            engine = trioinfer.lowlevel.current_engine()
            trioinfer.lowlevel.current_model_metrics()
            metrics.counter("aware_built_total", "constructors run")
            self.ready = anyio.Event()
            seen.append((here, type(engine).__name__))

        async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            self.ready.set()
            await self.ready.wait()
            return {"y": inputs["x"]}

    async with open_engine() as engine:
        await engine.load(attrs.evolve(config(Aware), instances=[Instance(count=2)]))
        np.testing.assert_array_equal((await engine.infer("m", {"x": X}))["y"], X)
        assert [f.name for f in engine.custom_metrics()] == ["aware_built"]
    assert seen == [(True, "Engine")] * 2


async def test_a_model_with_a_batch_dimension_receives_batches(
    autojump_clock: trio.testing.MockClock,
) -> None:
    Double.batches = []
    batched = ModelConfig(
        name="m",
        path="-",
        backend="python",
        backend_options={"class": Double, **XY},
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.01},
    )
    results: dict[int, np.ndarray[Any, Any]] = {}
    async with open_engine() as engine:
        await engine.load(batched)

        async def call(i: int) -> None:
            results[i] = (await engine.infer("m", {"x": np.full((1, 4), i, np.float32)}))["y"]

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(call, i)
    assert Double.batches == [5]
    for i in range(5):
        np.testing.assert_array_equal(results[i], np.full((1, 4), 2 * i, np.float32))


async def test_an_async_model_is_cancelled_at_the_callers_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    AsyncDouble.cancelled = 0
    async with open_engine() as engine:
        await engine.load(config(AsyncDouble, parameters={"delay": 60.0}))
        t0 = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(0.5):
                await engine.infer("m", {"x": X})
        assert trio.current_time() - t0 == 0.5
        await trio.testing.wait_all_tasks_blocked()  # the abort reaches the execution
        assert AsyncDouble.cancelled == 1
        stats = engine.statistics().models["m"]
        assert (stats.cancelled, stats.in_flight) == (1, 0)


async def test_a_sync_model_runs_to_its_end_unless_it_can_abort() -> None:
    class Waits:
        """Waits for a go-ahead that only abort() gives."""

        aborted = threading.Event()

        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            if not Waits.aborted.wait(timeout=30):
                raise RuntimeError("abort() was never called")
            return {"y": inputs["x"]}

        def abort(self) -> None:
            Waits.aborted.set()

    async with open_engine() as engine:
        await engine.load(config(Waits))
        with trio.move_on_after(0.2) as scope:
            await engine.infer("m", {"x": X})
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()  # the abort reaches the execution
        assert Waits.aborted.is_set()
        # The instance takes the next call: the aborted one ended.
        Waits.aborted.set()
        out = await engine.infer("m", {"x": X})
    np.testing.assert_array_equal(out["y"], X)


async def test_hooks_run_once_each_on_the_right_thread_and_device_is_passed() -> None:
    calls: list[tuple[str, str, str]] = []

    class Hooked:
        def __init__(self, device: str, scale: float) -> None:
            self.device, self.scale = device, scale

        def load(self) -> None:
            calls.append(("load", self.device, threading.current_thread().name))

        async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            return {"y": inputs["x"] * self.scale}

        async def close(self) -> None:
            calls.append(("close", self.device, threading.current_thread().name))

    hooked = ModelConfig(
        name="m",
        path="-",
        backend="python",
        backend_options={"class": Hooked, "parameters": {"scale": 3.0}, **XY},
        instances=[Instance(count=2)],
    )
    async with open_engine() as engine:
        await engine.load(hooked)
        out = await engine.infer("m", {"x": X})
        assert [c[0] for c in calls] == ["load", "load"]
    np.testing.assert_array_equal(out["y"], X * 3)
    assert [c[:2] for c in calls] == [("load", "cpu")] * 2 + [("close", "cpu")] * 2
    assert all(name.startswith("trioinfer-python-m-") for kind, _, name in calls if kind == "load")
    assert all(name == threading.current_thread().name for k, _, name in calls if k == "close")
    assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-python-")]


def outputs_of(result: Any) -> type:
    class Returns:
        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> Any:
            return result(inputs["x"])

    return Returns


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (lambda x: [x], "infer returned list; expected a dict of arrays by output name"),
        (lambda x: {}, r"infer returned outputs \[\]; the config declares \['y'\] \(missing"),
        (lambda x: {"y": x, "z": x}, r"undeclared \['z'\]"),
        (
            lambda x: {"y": x.astype(np.float64)},
            r"output 'y' has dtype float64; the config declares float32\[batch, 4\] \(return it "
            r'with \.astype\(numpy\.float32\), or declare dtype = "float64" in config\.toml\)$',
        ),
        (lambda x: {"y": x[:, :2]}, r"output 'y' has shape \[2, 2\]; the config declares"),
        (lambda x: {"y": x[0]}, r"output 'y' has shape \[4\]"),
        (lambda x: {"y": "text"}, "output 'y' is str, not convertible to float32"),
        (lambda x: 1 / 0, "infer raised ZeroDivisionError: division by zero"),
    ],
)
async def test_outputs_are_checked_against_the_declared_signature(
    result: Any, message: str
) -> None:
    async with open_engine() as engine:
        await engine.load(config(outputs_of(result)))
        with pytest.raises(BackendError, match=message):
            await engine.infer("m", {"x": X})


async def test_an_error_in_infer_names_its_line_and_logs_its_traceback_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A newcomer's KeyError over HTTP is a 500 saying only "KeyError: 'X'": the message
    # names the model's own line (not numpy's, not the worker thread's), and the log has
    # the traceback, once per place, not once per failing request.
    class Typo:
        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            return {"y": inputs["X"]}

    line = Typo.infer.__code__.co_firstlineno + 1
    caplog.set_level(logging.ERROR, logger="trioinfer.python")
    async with open_engine() as engine:
        await engine.load(config(Typo))
        for _ in range(3):
            with pytest.raises(BackendError) as caught:
                await engine.infer("m", {"x": X})
            assert str(caught.value) == (
                "model 'm' instance 0: infer raised KeyError: 'X' "
                f"(test_python_backend.py, line {line}, in infer)"
            )
    [record] = caplog.records
    assert record.exc_info is not None
    assert record.exc_info[0] is KeyError
    assert "logged once per place it fails at" in record.getMessage()


async def test_an_error_in_numpy_names_the_models_line_not_numpys() -> None:
    class Mismatch:
        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            return {"y": np.concatenate([inputs["x"], np.zeros((2, 3))])}

    line = Mismatch.infer.__code__.co_firstlineno + 1
    async with open_engine() as engine:
        await engine.load(config(Mismatch, dispatch="inline"))
        where = rf"\(test_python_backend\.py, line {line}, in infer\)$"
        with pytest.raises(BackendError, match=where):
            await engine.infer("m", {"x": X})


async def test_an_output_in_the_other_byte_order_passes() -> None:
    # float32 read from a big-endian file (numpy.frombuffer(blob, ">f4")): float32 values,
    # which every codec sends little-endian; it was refused as "has dtype float32; the
    # config declares float32[batch, 4]".
    async with open_engine() as engine:
        await engine.load(config(outputs_of(lambda x: {"y": x.astype(">f4")})))
        out = await engine.infer("m", {"x": X})
    assert out["y"].tolist() == X.tolist()


async def test_lists_are_converted_to_the_declared_dtype() -> None:
    async with open_engine() as engine:
        await engine.load(config(outputs_of(lambda x: {"y": x.tolist()})))
        out = await engine.infer("m", {"x": X})
    assert out["y"].dtype == np.float32


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"colour": 1}, ConfigError, "unknown python backend option 'colour'"),
        ({"ouputs": []}, ConfigError, "; did you mean 'outputs' for 'ouputs'[?]$"),
        ({"inputs": None}, ConfigError, "^inputs of model 'm' must be a non-empty list"),
        (
            {"inputs": None},
            ConfigError,
            r"\(none declared\): in config.toml, inputs = \[\{ name = \.\.\., dtype = \.\.\., "
            r"shape = \[\.\.\.\] \}\] in \[backend_options\]$",
        ),
        (
            {"inputs": [{"name": "x", "dtype": "float32"}]},
            ConfigError,
            "must be a table of name, dtype, shape",
        ),
        (
            {"inputs": [{"name": "x", "dtype": "complex", "shape": [1]}]},
            ConfigError,
            "dtype 'complex' is not one of",
        ),
        (
            {"inputs": [{"name": "x", "dtype": "FP32", "shape": [-2]}]},
            ConfigError,
            "each dimension must be a size >= 0",
        ),
        (
            {"inputs": [{"name": "x", "dtype": "FP32", "shape": [1]}] * 2},
            ConfigError,
            "'x' is declared twice",
        ),
        ({"class": "not a name"}, ConfigError, "must be a class name such as 'Model'"),
        ({"parameters": [1]}, ConfigError, "parameters of model 'm' must be a table"),
        (
            {"parameters": {"unknown": 1}},
            ConfigError,
            r"Double\(\) cannot be called with the backend option parameters \(unknown\): got "
            r"an unexpected keyword argument 'unknown'; set its arguments with parameters = ",
        ),
        (
            {"class": Needs},
            ConfigError,
            r"Needs\(scale\) cannot be called with the backend option parameters \(none\): "
            r"missing a required argument: 'scale'; set its arguments with parameters = \{",
        ),
        # A constructor that raises on its own is the model's error, at its line.
        (
            {"class": Needs, "parameters": {"scale": -1}},
            BackendError,
            r"Needs\(\.\.\.\) raised ValueError: negative \(test_python_backend\.py, line \d+, "
            r"in __init__\)$",
        ),
    ],
)
async def test_bad_configs_are_refused_at_load(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    async with open_engine() as engine:
        with pytest.raises(error, match=message):
            await engine.load(config(**options))


@pytest.mark.parametrize(
    ("source", "cls", "message"),
    [
        ("class Other:\n    pass\n", "Model", "model.py defines no class 'Model'"),
        ("raise RuntimeError('broken')\n", "Model", "importing model.py raised RuntimeError"),
        ("class Model:\n    pass\n", "Model", "class Model has no infer"),
        (
            "class Model:\n    def load(self):\n        1 / 0\n\n    def infer(self, x):\n"
            "        return x\n",
            "Model",
            r"load\(\) raised ZeroDivisionError",
        ),
    ],
)
async def test_bad_model_files_are_refused_at_load(
    tmp_path: Path, source: str, cls: str, message: str
) -> None:
    (tmp_path / "model.py").write_text(source)
    broken = ModelConfig(
        name="m",
        path=tmp_path / "model.py",
        backend="python",
        backend_options={"class": cls, **XY},
    )
    async with open_engine() as engine:
        with pytest.raises(BackendError, match=message):
            await engine.load(broken)
    assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-python-")]


class Exits:
    """A model whose infer calls sys.exit(), as a script's error path does."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        raise SystemExit(3)


class AsyncExits:
    """`Exits`, with an async def infer."""

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        raise SystemExit(3)


class StreamExits:
    """A decoupled model whose generator calls sys.exit() after one response."""

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> Any:
        yield {"y": inputs["x"]}
        raise SystemExit(3)


class Interrupts:
    """A model whose infer raises KeyboardInterrupt (a script's own Ctrl+C handling)."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        raise KeyboardInterrupt("3")


class AsyncInterrupts:
    """`Interrupts`, with an async def infer."""

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        raise KeyboardInterrupt("3")


class StreamInterrupts:
    """A decoupled model whose generator raises KeyboardInterrupt after one response."""

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> Any:
        yield {"y": inputs["x"]}
        raise KeyboardInterrupt("3")


@pytest.mark.parametrize(
    ("cls", "dispatch"),
    [
        (Exits, "thread"),
        (Exits, "inline"),
        (AsyncExits, "thread"),
        (Interrupts, "thread"),
        (Interrupts, "inline"),
        (AsyncInterrupts, "thread"),
    ],
)
async def test_a_model_that_calls_sys_exit_fails_its_request_not_the_engine(
    cls: type, dispatch: str
) -> None:
    # SystemExit and KeyboardInterrupt are no Exception: they went past the backend's
    # handlers, out of the engine's task group, and ended `trioinfer serve` with every
    # other model's requests.
    async with open_engine() as engine:
        await engine.load(config(cls, dispatch=dispatch))
        await engine.load(config(Double, name="other"))
        raised = "KeyboardInterrupt" if "Interrupts" in cls.__name__ else "SystemExit"
        with pytest.raises(BackendError, match=rf"'m' instance 0: infer raised {raised}: 3 \("):
            await engine.infer("m", {"x": X})
        assert (await engine.infer("other", {"x": X}))["y"].tolist() == (X * 2).tolist()


@pytest.mark.streaming
@pytest.mark.parametrize("cls", [StreamExits, StreamInterrupts])
async def test_a_streaming_model_that_calls_sys_exit_ends_its_stream_with_an_error(
    cls: type,
) -> None:
    async with open_engine() as engine:
        await engine.load(config(cls, decoupled=True))
        got: list[Any] = []

        async def read() -> None:
            async with engine.infer_stream("m", {"x": X}) as responses:
                async for outputs in responses:
                    got.append(outputs["y"].tolist())

        with pytest.raises(BackendError, match=r"infer raised (SystemExit|KeyboardInterrupt): 3"):
            await read()
        assert got == [X.tolist()]
        await engine.load(config(Double, name="other"))  # the engine serves on


@pytest.mark.parametrize("fault", ["SystemExit", "KeyboardInterrupt"])
@pytest.mark.parametrize(
    "source",
    [
        "import sys\nraise FAULT(3)\n",
        "class Model:\n    def __init__(self):\n        raise FAULT(3)\n\n"
        "    def infer(self, x):\n        return x\n",
        "class Model:\n    def load(self):\n        raise FAULT(3)\n\n"
        "    def infer(self, x):\n        return x\n",
    ],
    ids=["import", "constructor", "load"],
)
async def test_a_model_file_that_calls_sys_exit_fails_its_load_not_the_engine(
    tmp_path: Path, source: str, fault: str
) -> None:
    # A model.py that parses sys.argv with argparse at import exits when it finds no
    # arguments: that ended `trioinfer serve` (every model with it) at start. A
    # KeyboardInterrupt the model raises itself did too.
    (tmp_path / "model.py").write_text(source.replace("FAULT", fault))
    exits = ModelConfig(name="m", path=tmp_path / "model.py", backend="python", backend_options=XY)
    async with open_engine() as engine:
        with pytest.raises(BackendError, match=rf"raised {fault}: 3 \(model\.py, line \d+"):
            await engine.load(exits)
        await engine.load(config(Double, name="other"))  # the engine serves on
    assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-python-")]


async def test_a_missing_model_file_is_a_backend_error(tmp_path: Path) -> None:
    missing = ModelConfig(
        name="m", path=tmp_path / "model.py", backend="python", backend_options=XY
    )
    async with open_engine() as engine:
        with pytest.raises(BackendError, match=r"no model file model\.py"):
            await engine.load(missing)


async def test_a_class_named_without_a_path_is_a_config_error() -> None:
    """A class given by name is looked for in model.py: without a path, the message says so."""
    nameless = ModelConfig(name="m", backend="python", backend_options={"class": "Model", **XY})
    async with open_engine() as engine:
        with pytest.raises(
            ConfigError,
            match=r"model 'm' has no path: the python backend needs the model\.py that "
            r"defines class 'Model' \(or, in Python, backend_options=\{'class': TheClass\}\)",
        ):
            await engine.load(nameless)


async def test_the_old_placeholder_path_still_loads_a_class_given_in_code() -> None:
    old = ModelConfig(name="m", path="-", backend="python", backend_options={"class": Double, **XY})
    async with open_engine() as engine:
        await engine.load(old)
        out = await engine.infer("m", {"x": X})
    np.testing.assert_array_equal(out["y"], X * 2)


def test_signature_dtypes_and_shapes() -> None:
    signature = trioinfer.ModelSignature.declared(
        [
            {"name": "a", "dtype": "TYPE_INT32", "shape": [-1, 3]},
            {"name": "b", "dtype": "string", "shape": ["n"]},
            {"name": "c", "dtype": "bool", "shape": []},
        ],
        [{"name": "d", "dtype": "FP64", "shape": [2]}],
        model="m",
    )
    assert [s.describe() for s in signature.inputs] == ["int32[?, 3]", "object[n]", "bool[]"]
    assert [s.type_name for s in signature.inputs] == [
        "tensor(int32)",
        "tensor(string)",
        "tensor(bool)",
    ]
    assert not signature.batched


async def test_a_python_model_is_served_over_http(tmp_path: Path) -> None:
    httpx = pytest.importorskip("httpx")

    model_dir = tmp_path / "repo" / "scale"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(
        "class Model:\n    async def infer(self, inputs):\n        return {'y': inputs['x'] * 10}\n"
    )
    (model_dir / "config.toml").write_text(
        'backend = "python"\n[backend_options]\n'
        "inputs = [{ name = 'x', dtype = 'FP32', shape = ['batch', 2] }]\n"
        "outputs = [{ name = 'y', dtype = 'FP32', shape = ['batch', 2] }]\n"
    )
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "repo")
        url = listening.urls[0]
        async with httpx.AsyncClient(base_url=url) as client:
            meta = (await client.get("/v2/models/scale")).json()
            body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
            answer = (await client.post("/v2/models/scale/infer", json=body)).json()
        nursery.cancel_scope.cancel()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    assert answer["outputs"][0]["data"] == [10.0, 20.0]


MISFITS = {
    # model name: (what its infer returns, what the 500 says)
    "f64": (
        "{'y': inputs['x'].astype('float64')}",
        "model 'f64' (version 1) instance 0: output 'y' has dtype float64; the config declares "
        "float32[batch, 2]",
    ),
    "rank": (
        "{'y': inputs['x'][:, 0]}",  # the fixed dimension missing
        "model 'rank' (version 1) instance 0: output 'y' has shape [2]; the config declares "
        "float32[batch, 2]",
    ),
    "fixed": (
        "{'y': inputs['x'][:, :1]}",
        "model 'fixed' (version 1) instance 0: output 'y' has shape [2, 1]; the config declares "
        "float32[batch, 2]",
    ),
    "rows": (
        "{'y': inputs['x'][:-1]}",  # 1 row back for a 2-row request
        "model 'rows' (version 1): instance 0 (cpu) returned output 'y' with shape [1, 2] "
        "for a batch of 2 rows",
    ),
}


async def test_outputs_that_do_not_fit_are_a_500_naming_the_output_over_http(
    tmp_path: Path,
) -> None:
    """A float64 answer for FP32 must not reach a client as FP64 under FP32 metadata."""
    httpx = pytest.importorskip("httpx")

    for name, (returns, _) in MISFITS.items():
        model_dir = tmp_path / "repo" / name
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "1" / "model.py").write_text(
            f"class Model:\n    def infer(self, inputs):\n        return {returns}\n"
        )
        (model_dir / "config.toml").write_text(
            'backend = "python"\n[backend_options]\ndispatch = "inline"\n'
            "inputs = [{ name = 'x', dtype = 'FP32', shape = ['batch', 2] }]\n"
            "outputs = [{ name = 'y', dtype = 'FP32', shape = ['batch', 2] }]\n"
        )
    body = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    answers = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listening = await start_serving(nursery, tmp_path / "repo")
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                for name in MISFITS:
                    response = await client.post(f"/v2/models/{name}/infer", json=body)
                    answers[name] = (response.status_code, response.json()["error"])
            nursery.cancel_scope.cancel()
    for name, (_, said) in MISFITS.items():
        assert answers[name][0] == 500, answers[name]
        assert answers[name][1].startswith(said), answers[name]


def test_trioinfer_lists_the_plugin() -> None:
    assert "python" in trioinfer.Registry().names("backends")


async def test_a_trioinfer_error_the_model_raises_reaches_the_caller_as_it_is() -> None:
    class Refuses:
        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            raise trioinfer.InvalidInput("x must be positive")

    async with open_engine() as engine:
        await engine.load(config(Refuses))
        with pytest.raises(trioinfer.InvalidInput, match=r"^x must be positive$"):
            await engine.infer("m", {"x": X})


async def test_unloading_drops_the_modules_its_instances_imported(tmp_path: Path) -> None:
    import sys

    (tmp_path / "model.py").write_text(
        "class Model:\n    def infer(self, inputs):\n        return {'y': inputs['x']}\n"
    )
    on_disk = ModelConfig(
        name="m", path=tmp_path / "model.py", backend="python", backend_options=dict(XY),
        instances=[Instance(count=2)],
    )  # fmt: skip
    before = {name for name in sys.modules if name.startswith("trioinfer_python_model_")}
    async with open_engine() as engine:
        for _ in range(3):
            await engine.load(on_disk, replace=True)
        await engine.unload("m")
    after = {name for name in sys.modules if name.startswith("trioinfer_python_model_")}
    assert after == before


@pytest.mark.parametrize(
    "source",
    [
        "class Other:\n    pass\n",  # no class Model
        "class Model:\n    def __init__(self):\n        raise ValueError('x')\n",
        "class Model:\n    def __init__(self, width):\n        pass\n",  # no parameters
        "class Model:\n    pass\n",  # no infer
        "class Model:\n    def load(self):\n        raise ValueError('x')\n"
        "    def infer(self, inputs):\n        return {'y': inputs['x']}\n",
    ],
)
async def test_a_failed_load_drops_the_module_it_imported(tmp_path: Path, source: str) -> None:
    # Else every failed try (a repository poll retrying a broken model.py) keeps a
    # module, and all its top level holds, for the life of the process.
    import sys

    (tmp_path / "model.py").write_text(source)
    on_disk = ModelConfig(
        name="m", path=tmp_path / "model.py", backend="python", backend_options=dict(XY)
    )
    before = {name for name in sys.modules if name.startswith("trioinfer_python_model_")}
    async with open_engine() as engine:
        with pytest.raises((BackendError, ConfigError)):
            await engine.load(on_disk)
    after = {name for name in sys.modules if name.startswith("trioinfer_python_model_")}
    assert after == before


async def test_unloading_drops_a_module_whose_class_it_imported(tmp_path: Path) -> None:
    import sys

    (tmp_path / "impl.py").write_text(
        "class Impl:\n    def infer(self, inputs):\n        return {'y': inputs['x']}\n"
    )
    (tmp_path / "model.py").write_text(
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom impl import Impl as Model\n"
    )
    on_disk = ModelConfig(
        name="m", path=tmp_path / "model.py", backend="python", backend_options=dict(XY)
    )
    before = {name for name in sys.modules if name.startswith("trioinfer_python_model_")}
    try:
        async with open_engine() as engine:
            await engine.load(on_disk)
            await engine.unload("m")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("impl", None)
    after = {name for name in sys.modules if name.startswith("trioinfer_python_model_")}
    assert after == before


async def test_a_reload_runs_model_py_as_edited_within_the_same_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python's bytecode cache trusts a source of the same size and whole-second mtime:
    # an edit that keeps both (0.5 made 0.7, within the second it was loaded) reloaded
    # as the old code, with bytecode writing on, as it is by default.
    import os
    import sys

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    model = tmp_path / "model.py"
    on_disk = ModelConfig(name="m", path=model, backend="python", backend_options=dict(XY))
    source = (
        "class Model:\n    def infer(self, inputs):\n        return {{'y': inputs['x'] * {}}}\n"
    )
    async with open_engine() as engine:
        model.write_text(source.format(5))
        os.utime(model, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        await engine.load(on_disk)
        assert (await engine.infer("m", {"x": X}))["y"][0, 1] == 5
        model.write_text(source.format(7))
        os.utime(model, ns=(1_700_000_000_100_000_000, 1_700_000_000_100_000_000))
        await engine.load(on_disk, replace=True)
        assert (await engine.infer("m", {"x": X}))["y"][0, 1] == 7
    assert not (tmp_path / "__pycache__").exists()  # nor is the repository written to


async def test_dispatch_inline_runs_a_plain_infer_on_the_event_loop() -> None:
    seen: list[str] = []

    class Cheap:
        def load(self) -> None:
            seen.append(threading.current_thread().name)

        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            seen.append(threading.current_thread().name)
            return {"y": inputs["x"] * 2}

    async with open_engine() as engine:
        await engine.load(config(Cheap, dispatch="inline"))
        out = await engine.infer("m", {"x": X})
        with pytest.raises(ConfigError, match="dispatch of model 'n' must be 'thread' or 'inline'"):
            await engine.load(config(Cheap, name="n", dispatch="process"))
    np.testing.assert_array_equal(out["y"], X * 2)
    assert seen == [threading.current_thread().name] * 2
    assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-python-")]


async def test_an_infer_the_constructor_sets_runs_where_dispatch_says() -> None:
    # The hooks are the object's: a constructor that sets self.infer to a plain
    # function (a wrapper, a compiled callable) must not run on the event loop
    # when dispatch is "thread", the default.
    seen: list[str] = []

    def double(inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        seen.append(threading.current_thread().name)
        return {"y": inputs["x"] * 2}

    class Wrapped:
        def __init__(self) -> None:
            self.infer = double

    async with open_engine() as engine:
        await engine.load(config(Wrapped))
        out = await engine.infer("m", {"x": X})
    np.testing.assert_array_equal(out["y"], X * 2)
    assert len(seen) == 1
    assert seen[0].startswith("trioinfer-python-m-")


class InPlace:
    """A model that doubles its input in place (``x *= 2``), which would be its caller's array."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        x = inputs["x"]
        x *= 2
        return {"y": x}


class AsyncInPlace:
    """InPlace's ``async def`` twin, that writes by item assignment."""

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        x = inputs["x"]
        x[:] = x * 2
        return {"y": x}


class CopiesFirst:
    """The way to change an input: on a copy of it."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        x = inputs["x"].copy()
        x *= 2
        return {"y": x}


@pytest.mark.parametrize(
    ("cls", "dispatch"),
    [(InPlace, "thread"), (InPlace, "inline"), (AsyncInPlace, "thread")],
)
@pytest.mark.parametrize("batcher", ["none", "dynamic"])
async def test_a_model_cannot_change_its_callers_inputs_in_place(
    cls: type, dispatch: str, batcher: str
) -> None:
    # The model's inputs are the caller's arrays as sent (engine.infer copies nothing):
    # `inputs["x"] *= 2` doubled the caller's array, and the next request built from it.
    # They reach the model read-only: the write fails, saying how to change an input.
    x = X.copy()
    async with open_engine() as engine:
        await engine.load(attrs.evolve(config(cls, dispatch=dispatch), batcher=batcher))
        with pytest.raises(
            BackendError,
            match=r"infer raised ValueError: .*read-only.* \(test_python_backend\.py, line "
            r"\d+, in infer\); a model's inputs are read-only \(they may be its caller's "
            r"arrays\): change a copy, inputs\['x'\]\.copy\(\)",
        ):
            await engine.infer("m", {"x": x})
        assert x.tolist() == X.tolist()
        await engine.load(
            attrs.evolve(config(CopiesFirst, dispatch=dispatch), batcher=batcher), replace=True
        )
        out = await engine.infer("m", {"x": x})
        assert out["y"].tolist() == (2 * X).tolist()
        assert x.tolist() == X.tolist()


async def test_a_streaming_model_cannot_change_its_callers_inputs_in_place() -> None:
    class Streams:
        async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> Any:
            yield {"y": inputs["x"] * 2}
            inputs["x"][0, 0] = 100.0
            yield {"y": inputs["x"]}

    x = X.copy()
    async with open_engine() as engine:
        await engine.load(config(Streams, decoupled=True))
        answers: list[Any] = []

        async def read() -> None:
            async with engine.infer_stream("m", {"x": x}) as responses:
                async for outputs in responses:
                    answers.append(outputs)

        with pytest.raises(BackendError, match=r"a model's inputs are read-only"):
            await read()
        assert len(answers) == 1
    assert x.tolist() == X.tolist()


class Scaled:
    """y = x * scale, where the request sends scale (an optional input), else y = x."""

    batches: ClassVar[list[tuple[list[str], int]]] = []

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        Scaled.batches.append((sorted(inputs), len(inputs["x"])))
        return {"y": inputs["x"] * inputs["scale"] if "scale" in inputs else inputs["x"]}


SCALED = {
    "inputs": [
        {"name": "x", "dtype": "float32", "shape": ["batch", 4]},
        {"name": "scale", "dtype": "float32", "shape": ["batch", 1], "optional": True},
    ],
    "outputs": [{"name": "y", "dtype": "FP32", "shape": ["batch", 4]}],
}


async def test_a_python_model_gets_the_optional_inputs_that_were_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Requests that leave the optional input out and requests that send it, in flight
    together: each batch holds one kind, and the model gets the inputs sent."""
    Scaled.batches = []
    scaled = ModelConfig(
        name="m",
        backend="python",
        backend_options={"class": Scaled, **SCALED},
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.01},
    )
    results: dict[int, np.ndarray[Any, Any]] = {}
    async with open_engine() as engine:
        info = await engine.load(scaled)
        assert [spec.optional for spec in info.signature.inputs] == [False, True]

        async def call(i: int) -> None:
            x = np.full((1, 4), i, np.float32)
            inputs = {"x": x} if i < 3 else {"x": x, "scale": np.full((1, 1), 10, np.float32)}
            results[i] = (await engine.infer("m", inputs))["y"]

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(call, i)
                await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trioinfer.InvalidInput, match=r"needs input 'x'"):
            await engine.infer("m", {"scale": np.ones((1, 1), np.float32)})
    assert Scaled.batches == [(["x"], 3), (["scale", "x"], 3)]
    for i in range(6):
        np.testing.assert_array_equal(results[i], np.full((1, 4), i * (1 if i < 3 else 10)))


def test_optional_is_for_inputs_and_is_true_or_false() -> None:
    with pytest.raises(ConfigError, match=r"an output takes no optional"):
        trioinfer.ModelSignature.declared(
            SCALED["inputs"], [{**SCALED["outputs"][0], "optional": True}], model="m"
        )
    with pytest.raises(ConfigError, match=r"optional must be true or false, got 1"):
        trioinfer.ModelSignature.declared(
            [{**SCALED["inputs"][1], "optional": 1}], SCALED["outputs"], model="m"
        )


class CtrlC:
    """A model on the event loop's thread that the operator's Ctrl+C interrupts."""

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        signal.raise_signal(signal.SIGINT)  # Trio's handler raises KeyboardInterrupt here
        return {"y": inputs["x"]}  # pragma: no cover  # the signal interrupted infer


async def test_the_operators_ctrl_c_in_a_model_on_the_loop_still_interrupts() -> None:
    # A model's own KeyboardInterrupt fails its request; one a SIGINT raised is not the
    # model's: it goes on, as Ctrl+C must.

    async def serve_one() -> None:
        async with open_engine() as engine:
            await engine.load(config(CtrlC, dispatch="inline"))
            await engine.infer("m", {"x": X})

    with pytest.raises(BaseException) as caught:  # noqa: PT011  # KI, maybe in a group
        await serve_one()
    group = caught.value
    while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
        group = group.exceptions[0]
    assert isinstance(group, KeyboardInterrupt), caught.value


def test_the_operators_second_ctrl_c_on_asyncio_still_interrupts() -> None:
    # asyncio.Runner's SIGINT handler is a functools.partial (no __code__ of its own):
    # its first Ctrl+C cancels the main task, its second raises KeyboardInterrupt in
    # the handler, here in a model's code. That one was taken for the model's own.
    passed_on: list[bool] = []

    async def interrupted() -> None:
        try:
            signal.raise_signal(signal.SIGINT)  # the first: the main task is cancelled
            signal.raise_signal(signal.SIGINT)  # the second: KeyboardInterrupt here
        except KeyboardInterrupt as exc:
            try:
                pass_on_ctrl_c(exc)  # (while asyncio's handler is the one in place)
            except KeyboardInterrupt:
                passed_on.append(True)
            else:
                passed_on.append(False)

    # (The run ends as asyncio ends one its first Ctrl+C cancelled: KeyboardInterrupt.)
    with pytest.raises(KeyboardInterrupt), asyncio.Runner() as runner:
        runner.run(interrupted())
    assert passed_on == [True]
