"""The ONNX Runtime backend: conformance, dispatch modes, abort on cancel, device checks."""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import trioinfer
import trioinfer._inline
import trioinfer_onnxruntime as ort_backend
from trioinfer import Device, Instance, ModelConfig, open_engine
from trioinfer.lowlevel import Placement, WorkerThread
from trioinfer.testing import check_backend, models
from trioinfer_onnxruntime import (
    AUTO_SAMPLES,
    OnnxRuntimeBackend,
    _backend,
    _device,
    _instance,
    _options,
    _ort,
    _tuning,
    probe_device,
)

CUDA_REASON = probe_device(Device("cuda", 0))
needs_cuda = pytest.mark.skipif(
    CUDA_REASON is not None, reason=f"CUDA is not usable here: {CUDA_REASON}"
)


def pair(rows: int = 2) -> dict[str, np.ndarray]:
    a = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return {"a": a, "b": np.ones_like(a)}


@pytest.mark.parametrize(("dispatch", "threads"), [("thread", 1), ("thread", 0), ("ort_async", 2)])
async def test_backend_passes_the_conformance_check(
    add_model: Path, dispatch: str, threads: int
) -> None:
    config = ModelConfig(name="add", path=add_model, backend_options={"dispatch": dispatch})
    await check_backend(
        OnnxRuntimeBackend(), config, pair(), placement=Placement(Device("cpu"), 0, threads)
    )


async def test_a_model_without_a_path_is_a_config_error_at_load() -> None:
    """The ONNX Runtime backend needs a file: no path says so, before a thread is started."""
    threads = threading.active_count()
    with pytest.raises(
        trioinfer.ConfigError,
        match=r"model 'x' has no path: the onnxruntime backend needs the \.onnx file to load",
    ):
        await OnnxRuntimeBackend().load(ModelConfig(name="x"), Placement(Device("cpu"), 0))
    assert threading.active_count() == threads


async def test_signature_is_read_from_the_session(model_dir: Path) -> None:
    path = models.write_identity(model_dir / "id_i64.onnx", dtype=np.int64, shape=("n", 3, None))
    instance = await OnnxRuntimeBackend().load(
        ModelConfig(name="id", path=path), Placement(Device("cpu"), 0)
    )
    try:
        (spec,) = instance.signature.inputs
        assert (spec.name, spec.dtype, spec.shape) == ("x", np.dtype(np.int64), ("n", 3, None))
        assert spec.describe() == "int64[n, 3, ?]"
        assert instance.signature.outputs[0].name == "y"
    finally:
        await instance.aclose()


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int8, np.uint32, np.bool_, np.str_])
async def test_every_numpy_dtype_round_trips(model_dir: Path, dtype: type) -> None:
    path = models.write_identity(model_dir / f"id_{np.dtype(dtype).name}.onnx", dtype=dtype)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="id", path=path))
        x = np.array([["a", "b", "c"]]) if dtype is np.str_ else np.ones((1, 3), dtype=dtype)
        out = await engine.infer("id", {"x": x})
        np.testing.assert_array_equal(out["y"], x.astype(object) if dtype is np.str_ else x)


async def test_a_string_input_holding_numbers_is_invalid_input(model_dir: Path) -> None:
    # ONNX Runtime would take str(1) for the 1 without a word; the engine refuses it first.
    path = models.write_identity(model_dir / "id_strings.onnx", dtype=object, shape=["batch"])
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="id", path=path))
        with pytest.raises(trioinfer.InvalidInput) as info:
            await engine.infer("id", {"x": np.array(["a", 1], dtype=object)})
        assert str(info.value) == (
            "input 'x' of model 'id' is a string (BYTES) tensor: its elements must be bytes "
            "or str, got int 1 at index 1"
        )
        out = await engine.infer("id", {"x": np.array(["a", "b"], dtype=object)})
        assert out["y"].tolist() == ["a", "b"]


def write_parse_strings(path: Path) -> Path:
    """y = x (string[batch, 2]), n = x parsed as integers (int64[batch, 2])."""
    from onnx import TensorProto, helper, save_model

    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["y"]),
            helper.make_node("Cast", ["x"], ["n"], to=TensorProto.INT64),
        ],
        "parse_strings",
        [helper.make_tensor_value_info("x", TensorProto.STRING, ["batch", 2])],
        [
            helper.make_tensor_value_info("y", TensorProto.STRING, ["batch", 2]),
            helper.make_tensor_value_info("n", TensorProto.INT64, ["batch", 2]),
        ],
    )
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


async def test_bytes_elements_reach_onnx_runtime_as_utf8_text(model_dir: Path) -> None:
    # ONNX Runtime reads an object array's elements by their str(): b"12" was "b'12'",
    # which the model echoed back, and could not parse as a number.
    path = write_parse_strings(model_dir / "parse_strings.onnx")
    async with open_engine() as engine:
        info = await engine.load(ModelConfig(name="parse", path=path))
        assert info.signature.input("x").utf8
        given = np.array([[b"12", "-3"], [np.bytes_(b"7"), b"+40"]], dtype=object)
        out = await engine.infer("parse", {"x": given})
        assert out["y"].tolist() == [["12", "-3"], ["7", "+40"]]
        assert out["n"].tolist() == [[12, -3], [7, 40]]
        # The caller's array is left as it was given.
        assert given[0, 0] == b"12"
        # A numpy bytes array takes the same way.
        out = await engine.infer("parse", {"x": np.array([[b"1", b"2"]])})
        assert out["y"].tolist() == [["1", "2"]]
        with pytest.raises(trioinfer.InvalidInput) as info_error:
            await engine.infer(
                "parse", {"x": np.array([["1", "2"], [b"3", b"\xff4"]], dtype=object)}
            )
        assert str(info_error.value) == (
            "input 'x' of model 'parse' is a string tensor of UTF-8 text, but its element at "
            "index [1, 1] is not UTF-8 (invalid start byte at byte 0 of b'\\xff4'); send "
            "UTF-8 encoded bytes, or str"
        )


@pytest.mark.parametrize("dispatch", ["thread", "ort_async"])
async def test_cancelled_execution_is_terminated_in_ort(slow_model: Path, dispatch: str) -> None:
    backend = OnnxRuntimeBackend()
    config = ModelConfig(name="slow", path=slow_model, backend_options={"dispatch": dispatch})
    instance = await backend.load(config, Placement(Device("cpu"), 0, threads=2))
    x = np.ones((256, 512), dtype=np.float32)
    try:
        # A full run of this model takes about a second; the caller gives up far sooner.
        with trio.move_on_after(0.05) as scope:
            await instance.execute({"x": x})
        assert scope.cancelled_caught
        assert instance.aborted == 1
        out = await instance.execute({"x": x[:1]})
        assert out["y"].shape == (1, 512)
    finally:
        await instance.aclose()


async def test_engine_aborts_execution_when_its_only_caller_leaves(slow_model: Path) -> None:
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(name="slow", path=slow_model, instances=[Instance(threads=1)])
        )
        x = np.ones((256, 512), dtype=np.float32)
        with trio.move_on_after(0.05):
            await engine.infer("slow", {"x": x})
        stats = engine.statistics().models["slow"]
        assert (stats.executions, stats.cancelled, stats.succeeded) == (1, 1, 0)
        out = await engine.infer("slow", {"x": x[:1]})
        assert out["y"].shape == (1, 512)


async def test_bad_backend_options_are_refused_at_load(add_model: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"no option 'dispath'; it knows .*; did you mean 'dispatch' for 'dispath'[?]$",
        ):
            await engine.load(
                ModelConfig(name="a", path=add_model, backend_options={"dispath": "thread"})
            )
        with pytest.raises(trioinfer.ConfigError, match="needs threads >= 2"):
            await engine.load(
                ModelConfig(
                    name="a",
                    path=add_model,
                    instances=[Instance(threads=1)],
                    backend_options={"dispatch": "ort_async"},
                )
            )
        with pytest.raises(trioinfer.ConfigError, match="graph_optimization_level"):
            await engine.load(
                ModelConfig(
                    name="a", path=add_model, backend_options={"graph_optimization_level": 9}
                )
            )


async def test_session_options_are_applied(add_model: Path) -> None:
    options = {
        "graph_optimization_level": "basic",
        "execution_mode": "parallel",
        "inter_op_threads": 2,
        "enable_mem_arena": False,
        "allow_spinning": False,
    }
    instance = await OnnxRuntimeBackend().load(
        ModelConfig(name="a", path=add_model, backend_options=options),
        Placement(Device("cpu"), 0, threads=2),
    )
    try:
        so = instance.session.get_session_options()
        assert so.intra_op_num_threads == 2
        assert so.inter_op_num_threads == 2
        assert not so.enable_cpu_mem_arena
        assert str(so.graph_optimization_level).endswith("ORT_ENABLE_BASIC")
        assert str(so.execution_mode).endswith("ORT_PARALLEL")
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        await instance.aclose()


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here; this checks the fallback")
async def test_unusable_cuda_falls_back_to_cpu_with_one_line(
    add_model: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    with caplog.at_level(logging.WARNING, logger="trioinfer.onnxruntime"):
        async with open_engine() as engine:
            info = await engine.load(
                ModelConfig(name="a", path=add_model, instances=[Instance("cuda:0")])
            )
            assert info.devices == ("cpu",)
            out = await engine.infer("a", pair())
            np.testing.assert_array_equal(out["sum"], pair()["a"] + 1)
    (record,) = caplog.records
    assert "cuda:0 is not usable" in record.getMessage()
    assert "\n" not in record.getMessage()
    # ONNX Runtime's own multi-line load errors never reach the user.
    captured = capfd.readouterr()
    assert "onnxruntime" not in captured.err.lower()
    assert "EP Error" not in captured.out + captured.err


@pytest.mark.parametrize(
    ("options", "dispatch"),
    [({}, "auto"), ({"dispatch": "thread"}, "thread"), ({"dispatch": "inline"}, "inline")],
)
async def test_an_instance_fallen_back_to_the_cpu_dispatches_as_a_cpu_instance(
    add_model: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], dispatch: str
) -> None:
    """A cuda:0 instance that runs on the CPU gets the CPU's default dispatch ('auto':
    measured on its thread, inline when cheaper), not the GPU's ('thread'), and one
    worker thread, gone at close; a dispatch the config names is kept."""
    # As where CUDA is not usable (the GPU machine too: the probe says so).
    monkeypatch.setattr(_backend, "probe_device", lambda device: "no CUDA in this test")
    config = ModelConfig(name="fb", path=add_model, backend_options=options)
    instance = await OnnxRuntimeBackend().load(config, Placement(Device("cuda", 0), 0))
    try:
        assert instance.device == "cpu"
        assert instance.dispatch == dispatch
        assert [t.name for t in instance_threads("fb")] == ["trioinfer-fb-0"]
        out = await instance.execute(pair())
        np.testing.assert_array_equal(out["sum"], pair()["a"] + 1)
    finally:
        await instance.aclose()
    assert instance_threads("fb") == []


@pytest.mark.skipif(CUDA_REASON is None, reason="CUDA is usable here; this checks the refusal")
@pytest.mark.parametrize("device", ["cuda:0", "tensorrt:0"])
async def test_unusable_gpu_without_fallback_is_refused(add_model: Path, device: str) -> None:
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendUnavailable, match=f"{device} is not usable: ") as info:
            await engine.load(
                ModelConfig(
                    name="a", path=add_model, instances=[Instance(device)], cpu_fallback=False
                )
            )
        assert "\n" not in str(info.value)
        assert "cpu_fallback" in str(info.value)


@needs_cuda
@pytest.mark.gpu
async def test_cuda_instance_runs_on_the_gpu(add_model: Path) -> None:
    async with open_engine() as engine:
        info = await engine.load(
            ModelConfig(
                name="a", path=add_model, instances=[Instance("cuda:0")], cpu_fallback=False
            )
        )
        assert info.devices == ("cuda:0",)
        out = await engine.infer("a", pair(64))
        np.testing.assert_array_equal(out["sum"], pair(64)["a"] + 1)


async def test_without_onnx_runtime_a_load_says_which_extra_to_install(
    add_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on an install without the cpu or gpu extra: `import onnxruntime` fails.
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendUnavailable, match="'cpu' extra") as info:
            await engine.load(ModelConfig(name="add", path=add_model))
    assert "'gpu' extra" in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


def test_probe_says_why_in_one_line() -> None:
    assert probe_device(Device("cpu")) is None
    reason = probe_device(Device("cuda", 0))
    if reason is not None:
        assert "\n" not in reason
        assert reason.strip()


def test_probe_holds_back_onnxruntimes_output_without_touching_this_process(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A device not probed yet: ONNX Runtime's loaders print why CUDA libraries
    # fail to load, and its C++ log writes to fd 2. The trial session is made in
    # a child process, so none of that reaches this process's streams, and
    # nothing here swaps sys.stdout or sys.stderr under other threads' feet.
    import onnxruntime

    made_here: list[object] = []

    def session_here(*args: object, **kwargs: object) -> None:
        made_here.append(args)
        raise RuntimeError("the probe made its trial session in this process")

    monkeypatch.setattr(onnxruntime, "InferenceSession", session_here)
    streams = (sys.stdout, sys.stderr)
    reason = probe_device(Device("cuda", 5))
    assert made_here == []
    assert (sys.stdout, sys.stderr) == streams
    assert capfd.readouterr() == ("", "")
    assert reason is None or "\n" not in reason


def test_a_probe_that_cannot_run_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device.sys, "executable", "/bin/false")
    reason = probe_device(Device("cuda", 6))
    if "has no CUDAExecutionProvider" not in str(reason):  # a CPU-only ONNX Runtime build
        assert reason == "probing cuda:6 failed (exit status 1)"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
async def test_cpu_affinity_pins_the_instance_thread(add_model: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    instance = await OnnxRuntimeBackend().load(
        ModelConfig(name="a", path=add_model), Placement(Device("cpu"), 0, cpu_affinity=(cpu,))
    )
    try:
        assert await instance._worker.run_sync(os.sched_getaffinity, 0) == {cpu}
        # One CPU named and no thread count: one compute thread.
        assert instance.session.get_session_options().intra_op_num_threads == 1
        out = await instance.execute(pair())
        assert out["sum"].shape == (2, 4)
    finally:
        await instance.aclose()


async def test_unknown_cpu_is_a_clear_error(add_model: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(trioinfer.ConfigError, match=r"cpu_affinity \[4095\] cannot be applied"):
            await engine.load(
                ModelConfig(name="a", path=add_model, instances=[Instance(cpu_affinity=[4095])])
            )


async def test_a_worker_thread_that_cannot_start_is_not_blamed_on_cpu_affinity(
    add_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def exhausted(name: str, *, cpu_affinity: object = None) -> object:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(WorkerThread, "start", exhausted)
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendError, match="cannot start its worker thread") as err:
            await engine.load(ModelConfig(name="a", path=add_model))
    assert "cpu_affinity" not in str(err.value)
    assert "Too many open files" in str(err.value)


async def test_inline_dispatch_passes_the_conformance_check(add_model: Path) -> None:
    config = ModelConfig(name="add", path=add_model, backend_options={"dispatch": "inline"})
    await check_backend(OnnxRuntimeBackend(), config, pair())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # A TOML list or table is unhashable: it raised TypeError, not a ConfigError.
        ({"graph_optimization_level": ["all"]}, r"graph_optimization_level must be one of"),
        ({"graph_optimization_level": {"x": 1}}, r"'disable', 'basic', .* got \{'x': 1\}"),
        ({"log_severity": 7}, r"log_severity must be an integer from 0 .* to 4 .*, got 7"),
        # ORT starts every thread at load: 100000 held the load for minutes, 2**40 a TypeError.
        ({"inter_op_threads": 100_000}, r"inter_op_threads must be at most 1024, got 100000"),
        ({"inter_op_threads": 2**40}, r"inter_op_threads must be at most 1024"),
        # It would win over the instance's device, which metadata and statistics report.
        ({"provider_options": {"device_id": 1}}, r"provider_options may not set device_id"),
    ],
)
def test_a_wrong_option_value_of_any_type_is_a_config_error_naming_it(
    options: dict[str, Any], message: str
) -> None:
    config = ModelConfig(name="m", path="m.onnx", backend_options=options)
    with pytest.raises(trioinfer.ConfigError, match=message):
        _options._check_options(config, Placement(Device("cpu"), 0))


def test_an_instance_asking_for_more_threads_than_a_session_may_start_is_refused() -> None:
    config = ModelConfig(name="m", path="m.onnx")
    with pytest.raises(
        trioinfer.ConfigError, match=r"'m' instance 0: threads must be at most 1024 .*got 5000"
    ):
        _options._check_options(config, Placement(Device("cpu"), 0, 5000))


@pytest.mark.parametrize(("device", "expected"), [("cpu", "auto"), ("cuda:0", "thread")])
async def test_dispatch_defaults_to_auto_on_the_cpu_and_thread_on_a_gpu(
    add_model: Path, device: str, expected: str
) -> None:
    config = ModelConfig(name="add", path=add_model)
    options = _options._check_options(config, Placement(Device(device), 0))
    assert options["dispatch"] == expected
    if device == "cpu":
        instance = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0))
        try:
            assert instance.dispatch == "auto"
        finally:
            await instance.aclose()


async def test_auto_dispatch_goes_inline_for_a_cheap_model(
    add_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ModelConfig(
        name="add", path=add_model, backend_options={"dispatch": "auto", "inline_budget_us": 1e6}
    )
    instance = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0, threads=1))
    try:
        with caplog.at_level(logging.INFO, logger="trioinfer.onnxruntime"):
            for _ in range(AUTO_SAMPLES):
                assert instance.dispatch == "auto"
                await instance.execute(pair())
        assert instance.dispatch == "inline"
        assert "dispatch inline" in caplog.text
        out = await instance.execute(pair())
        np.testing.assert_array_equal(out["sum"], pair()["a"] + 1)
    finally:
        await instance.aclose()


async def test_auto_tries_inline_and_goes_back_quietly_when_it_costs_too_much(
    slow_model: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread's figure only screens out models that could hold the loop for
    # long (here nothing is, with a huge trial bound); inline, the budget decides.
    monkeypatch.setattr(_instance, "AUTO_TRIAL_BUDGETS", 1e9)
    config = ModelConfig(
        name="slow", path=slow_model, backend_options={"dispatch": "auto", "inline_budget_us": 1}
    )
    instance = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0, threads=1))
    x = {"x": np.ones((1, 512), np.float32)}
    try:
        with caplog.at_level(logging.INFO, logger="trioinfer.onnxruntime"):
            for _ in range(AUTO_SAMPLES):
                await instance.execute(x)
            assert instance.dispatch == "inline"  # tried, though over one budget
            await instance.execute(x)  # seeds the inline measurement
            await instance.execute(x)  # decides
        assert instance.dispatch == "thread"
        moved = [r for r in caplog.records if "over inline_budget_us" in r.getMessage()]
        assert [r.levelno for r in moved] == [logging.INFO]  # expected for auto: no warning
    finally:
        await instance.aclose()


class _WaitingSession:
    """A real session whose runs first sleep: wall time a GPU run spends waiting."""

    def __init__(self, session: Any, wait_s: float) -> None:
        self._session, self._wait_s = session, wait_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def run(self, *args: Any) -> Any:
        time.sleep(self._wait_s)
        return self._session.run(*args)


@pytest.mark.parametrize(
    ("device", "threads", "moves"), [("cpu", 1, False), ("cuda:0", 1, True), ("cpu", 2, True)]
)
async def test_inline_budget_counts_wall_time_unless_one_cpu_thread_computes(
    add_model: Path, device: str, threads: int, moves: bool
) -> None:
    # On a GPU the worker can sleep while the device computes, and with several
    # intra-op threads while the others compute; the loop is held for the wall
    # time, so that is what the budget must count there. With one CPU thread, CPU
    # time (a preempted thread is not the model's cost).
    import onnxruntime

    session = _WaitingSession(onnxruntime.InferenceSession(str(add_model)), 0.02)
    worker = await WorkerThread.start("test-inline-clock")
    instance = ort_backend.OnnxRuntimeInstance(
        session, device, worker, "inline", 0.005, threads=threads
    )
    try:
        for _ in range(3):  # the first run seeds the measurement; the next ones decide
            await instance.execute(pair())
        assert instance.dispatch == ("thread" if moves else "inline")
    finally:
        await instance.aclose()


async def test_inline_execution_over_budget_moves_to_the_thread(
    slow_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ModelConfig(
        name="slow", path=slow_model, backend_options={"dispatch": "inline", "inline_budget_us": 1}
    )
    instance = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0, threads=1))
    try:
        with caplog.at_level(logging.WARNING, logger="trioinfer.onnxruntime"):
            # The session's first run only seeds the measurement; the second decides.
            await instance.execute({"x": np.ones((1, 512), np.float32)})
            assert instance.dispatch == "inline"
            await instance.execute({"x": np.ones((1, 512), np.float32)})
        assert instance.dispatch == "thread"
        assert "over inline_budget_us = 1" in caplog.text
        # On the thread again, a long execution can be aborted.
        with trio.move_on_after(0.05):
            await instance.execute({"x": np.ones((256, 512), np.float32)})
        assert instance.aborted == 1
    finally:
        await instance.aclose()


async def test_bad_dispatch_options_are_refused(add_model: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(trioinfer.ConfigError, match="dispatch must be one of 'thread'"):
            await engine.load(
                ModelConfig(name="a", path=add_model, backend_options={"dispatch": "fast"})
            )
        with pytest.raises(
            trioinfer.ConfigError,
            match="inline_budget_us must be a number of microseconds greater than 0",
        ):
            await engine.load(
                ModelConfig(name="a", path=add_model, backend_options={"inline_budget_us": 0})
            )


@pytest.mark.parametrize(
    "budget", [math.inf, -math.inf, math.nan, -250, 0, 0.0, 10_000_001, "250", True, None]
)
async def test_an_inline_budget_that_makes_no_sense_is_refused(
    add_model: Path, budget: object
) -> None:
    """inf held the loop for ever (an inline model never moved to its thread, nor yielded
    for other tasks): a budget must be a positive, finite number, up to 10 s."""
    async with open_engine() as engine:
        with pytest.raises(trioinfer.ConfigError) as caught:
            await engine.load(
                ModelConfig(name="a", path=add_model, backend_options={"inline_budget_us": budget})
            )
    assert str(caught.value) == (
        "model 'a': inline_budget_us must be a number of microseconds greater than 0 and "
        f"at most 10000000 (10 s), got {budget!r}"
    )


@pytest.mark.parametrize("written", ["inf", "+inf", "nan", "-5"])
async def test_a_config_toml_inline_budget_that_makes_no_sense_is_refused(
    tmp_path: Path, add_model: Path, written: str
) -> None:
    (tmp_path / "a" / "1").mkdir(parents=True)
    shutil.copyfile(add_model, tmp_path / "a" / "1" / "model.onnx")
    (tmp_path / "a" / "config.toml").write_text(
        f'[backend_options]\ndispatch = "inline"\ninline_budget_us = {written}\n'
    )
    config = ModelConfig.from_toml(tmp_path / "a" / "config.toml")
    async with open_engine() as engine:
        with pytest.raises(trioinfer.ConfigError, match="inline_budget_us must be a number of"):
            await engine.load(config)


async def test_the_inline_budget_bounds_are_accepted(add_model: Path) -> None:
    for budget in (0.5, 1, 10_000_000, 1e7):
        config = ModelConfig(
            name="a",
            path=add_model,
            backend_options={"dispatch": "inline", "inline_budget_us": budget},
        )
        instance = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0))
        try:
            assert instance.inline_budget_s == budget / 1e6
        finally:
            await instance.aclose()


async def test_pipeline_depth_keeps_two_executions_in_flight(add_model: Path) -> None:
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(name="add", path=add_model, backend_options={"pipeline_depth": 2})
        )
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            a = np.full((1, 4), i, np.float32)
            results[i] = (await engine.infer("add", {"a": a, "b": a}))["sum"]

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(one, i)
        assert all(results[i][0, 0] == 2 * i for i in range(50))
        with pytest.raises(trioinfer.ConfigError, match="pipeline_depth must be an integer"):
            await engine.load(
                ModelConfig(name="b", path=add_model, backend_options={"pipeline_depth": 0})
            )


def tune(
    path: Path, sizes: object, name: str = "t", *, count: int = 1, **options: Any
) -> ModelConfig:
    return ModelConfig(
        name=name,
        path=path,
        batcher="dynamic",
        batcher_options=options,
        backend_options={"tune_batch_sizes": sizes},
        instances=[Instance(count=count)],
    )


def wrap_session_run(monkeypatch: pytest.MonkeyPatch, run: Any) -> None:
    """Have every new session's ``run`` go through ``run(session, *args)``."""
    create = _backend._create_session

    class Wrapped:
        def __init__(self, session: Any) -> None:
            self.session = session

        def __getattr__(self, name: str) -> Any:
            return getattr(self.session, name)

        def run(self, *args: Any) -> Any:
            return run(self.session, *args)

    def wrapped(*args: Any) -> tuple[Any, str]:
        session, device = create(*args)
        return Wrapped(session), device

    monkeypatch.setattr(_backend, "_create_session", wrapped)


@pytest.fixture(autouse=True)
def fresh_tuning_cache() -> None:
    """Each test measures for itself: no figures from an earlier test's loads."""
    _tuning._tuned.clear()


def instance_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"trioinfer-{name}-")]


async def test_tune_batch_sizes_times_each_size_and_advertises_its_choice(
    mlp_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="trioinfer.onnxruntime"):
        instance = await OnnxRuntimeBackend().load(
            tune(mlp_model, [1, 4, 16]), Placement(Device("cpu"), 0, threads=1)
        )
    try:
        rates = instance.batch_rates
        assert list(rates) == [1, 4, 16]
        assert all(rate > 0 for rate in rates.values())
        [preferred] = instance.preferred_batch_sizes
        assert preferred == ort_backend.preferred_batch_size(rates)
        figures = ", ".join(f"{size}: {rate:,.1f}" for size, rate in rates.items())
        assert [m for m in caplog.messages if "rows/s" in m] == [
            f"model 't' instance 0: rows/s by batch size: {figures}; "
            f"preferred batch size {preferred}"
        ]
        out = await instance.execute({"input": np.ones((3, 64), np.float32)})
        assert out["output"].shape == (3, 10)
    finally:
        await instance.aclose()


async def test_the_engine_reports_what_the_first_instance_measured(mlp_model: Path) -> None:
    async with open_engine() as engine:
        info = await engine.load(tune(mlp_model, [2, 8]))
        assert info.preferred_batch_sizes in ((2,), (8,))
        assert engine.model("t") == info
        untuned = await engine.load(ModelConfig(name="plain", path=mlp_model))
        assert untuned.preferred_batch_sizes == ()


async def test_an_instance_that_is_not_tuned_advertises_nothing(mlp_model: Path) -> None:
    instance = await OnnxRuntimeBackend().load(
        ModelConfig(name="a", path=mlp_model), Placement(Device("cpu"), 0, threads=1)
    )
    try:
        assert (instance.preferred_batch_sizes, instance.batch_rates) == ((), {})
    finally:
        await instance.aclose()


@pytest.mark.parametrize(
    ("rates", "overhead_s", "expected"),
    [
        ({1: 100.0, 2: 190.0, 4: 400.0, 8: 390.0, 16: 300.0}, 0.0, 4),
        ({1: 100.0, 2: 190.0, 4: 380.0, 8: 400.0, 16: 300.0}, 0.0, 4),  # exactly 5% slower
        ({1: 100.0, 2: 190.0, 4: 379.0, 8: 400.0, 16: 300.0}, 0.0, 8),
        ({1: 19.7, 2: 19.3, 4: 18.6, 8: 18.8, 16: 18.1, 32: 17.1}, None, 1),  # MiniLM, 1 thread
        ({1: 57_600.0, 8: 217_167.0, 32: 323_841.0}, None, 32),  # the digits MLP
        # 100 us a row at any size: charged 150 us per execution, one row serves
        # 4,000 rows/s, a batch of 32 9,552.
        ({1: 10_000.0, 32: 10_000.0}, None, 32),
        ({1: 10_000.0, 32: 10_000.0}, 0.0, 1),
        ({32: 5.0}, None, 32),
    ],
)
def test_preferred_batch_size_is_the_smallest_that_serves_about_as_much(
    rates: dict[int, float], overhead_s: float | None, expected: int
) -> None:
    assert (ort_backend.TUNE_TOLERANCE, ort_backend.TUNE_OVERHEAD_S) == (0.05, 150e-6)
    if overhead_s is None:
        assert ort_backend.preferred_batch_size(rates) == expected
    else:
        assert ort_backend.preferred_batch_size(rates, overhead_s) == expected


def test_preferred_batch_size_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no batch sizes were timed"):
        ort_backend.preferred_batch_size({})


@pytest.mark.parametrize("sizes", ["8", 8, [0], [4, 2], [2, 2], [True], [2.0], [1, None]])
async def test_bad_tune_batch_sizes_are_refused(add_model: Path, sizes: object) -> None:
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"tune_batch_sizes must be a list of strictly increasing positive integers "
            r".*e\.g\. \[1, 2, 4, 8, 16, 32\]; got ",
        ):
            await engine.load(tune(add_model, sizes))


@pytest.mark.parametrize(
    ("dtype", "shape", "message"),
    [
        (np.float32, (2, 3), r"needs a batch dimension .*; input 'x' is float32\[2, 3\]"),
        (
            np.float32,
            ("batch", "seq"),
            r"after the first to be fixed.*'x' is float32\[batch, seq\]",
        ),
        (np.float32, ("batch", None), r"after the first to be fixed.*'x' is float32\[batch, \?\]"),
        (str, ("batch", 3), "only make sample data for numeric or boolean inputs; input 'x' is"),
    ],
)
async def test_a_model_tune_batch_sizes_cannot_sample_is_refused(
    model_dir: Path, dtype: type, shape: tuple[object, ...], message: str
) -> None:
    path = models.write_identity(
        model_dir / f"untunable-{np.dtype(dtype).kind}-{len(str(shape))}.onnx",
        dtype=dtype,
        shape=shape,  # type: ignore[arg-type]
    )
    async with open_engine() as engine:
        with pytest.raises(trioinfer.ConfigError, match=r"model 'u' instance 0: tune_batch_sizes "):
            await engine.load(tune(path, [1, 2], "u"))
        with pytest.raises(trioinfer.ConfigError, match=message):
            await engine.load(tune(path, [1, 2], "u"))
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"; set the batcher's preferred_batch_sizes yourself instead$",
        ):
            await engine.load(tune(path, [1, 2], "u"))
        assert engine.models() == []
    assert instance_threads("u") == []


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.float16, np.uint8])
async def test_tune_batch_sizes_samples_every_numeric_dtype(model_dir: Path, dtype: type) -> None:
    path = models.write_identity(model_dir / f"tunable-{np.dtype(dtype).name}.onnx", dtype=dtype)
    async with open_engine() as engine:
        info = await engine.load(tune(path, [1, 2]))
    assert info.preferred_batch_sizes in ((1,), (2,))


async def test_a_failing_sample_run_fails_the_load_and_frees_the_thread(
    add_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail_on_four_rows(session: Any, outputs: Any, inputs: dict[str, Any], *args: Any) -> Any:
        if len(inputs["a"]) == 4:
            raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : out of memory")
        return session.run(outputs, inputs, *args)

    wrap_session_run(monkeypatch, fail_on_four_rows)
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.BackendError,
            match=r"^model 'f' instance 0: tune_batch_sizes could not run a batch of 4 rows "
            r"of sample data: out of memory$",
        ):
            await engine.load(tune(add_model, [1, 2, 4, 8], "f"))
        await engine.load(tune(add_model, [1, 2], "f"))  # sizes it can run
    assert instance_threads("f") == []


async def test_a_cancelled_load_stops_the_sample_run_in_progress(
    slow_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = threading.Event()
    ended: list[str] = []

    def watched(session: Any, *args: Any) -> Any:
        # Says when a sample run starts and how each one ended.
        started.set()
        try:
            values = session.run(*args)
        except Exception as exc:
            ended.append(str(exc))
            raise
        ended.append("done")
        return values

    wrap_session_run(monkeypatch, watched)
    async with open_engine() as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                engine.load, tune(slow_model, [1024, 2048], "c", max_batch_size=2048)
            )
            # About four seconds a run at 1024 rows: cancel the load during the first.
            assert await trio.to_thread.run_sync(started.wait, 60)
            nursery.cancel_scope.cancel()
        assert engine.models() == []
    assert len(ended) == 1
    assert "terminate" in ended[0]
    assert instance_threads("c") == []


async def test_the_first_instance_measures_once_per_file_device_threads_and_sizes(
    mlp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[int]] = []
    measure = _tuning._time_batch_sizes

    def counted(
        session: Any, signature: Any, label: str, sizes: list[int], *args: Any
    ) -> dict[int, float]:
        calls.append(sizes)
        return measure(session, signature, label, sizes, *args)

    monkeypatch.setattr(_tuning, "_time_batch_sizes", counted)
    async with open_engine() as engine:
        first = await engine.load(tune(mlp_model, [1, 8], "two", count=2))  # one of two measures
        assert calls == [[1, 8]]
        await engine.unload("two")
        again = await engine.load(tune(mlp_model, [1, 8], "two", count=2))  # the same figures
        assert calls == [[1, 8]]
        assert again.preferred_batch_sizes == first.preferred_batch_sizes
        await engine.load(tune(mlp_model, [2, 8], "other"))  # other sizes: measured
        assert calls == [[1, 8], [2, 8]]


class _FakeArg:
    def __init__(self, name: str, shape: list[object]) -> None:
        self.name, self.shape, self.type = name, shape, "tensor(float)"


class _TimedSession:
    """A session on a fake clock: a run of n rows takes ``costs[n]`` seconds (cycled)."""

    def __init__(self, costs: dict[int, list[float]]) -> None:
        self.costs = {rows: iter(itertools.cycle(c)) for rows, c in costs.items()}
        self.now = 0.0
        self.runs: list[int] = []
        self.inputs: list[np.ndarray] = []

    def get_inputs(self) -> list[_FakeArg]:
        return [_FakeArg("x", ["batch", 3])]

    def get_outputs(self) -> list[_FakeArg]:
        return [_FakeArg("y", ["batch", 3])]

    def clock(self) -> float:
        return self.now

    def run(self, outputs: list[str], inputs: dict[str, np.ndarray], options: Any) -> list[Any]:
        rows = len(inputs["x"])
        self.runs.append(rows)
        self.inputs.append(inputs["x"])
        self.now += next(self.costs[rows])
        return [inputs["x"]]


def test_each_size_is_warmed_then_timed_and_its_fastest_run_counts() -> None:
    session = _TimedSession(
        {
            1: [0.001],  # cheap: timed until three runs and 50 ms, 50 runs
            2: [5.0, 0.5, 0.6, 0.4],  # warm-up slow; 0.5 + 0.6 pass 1 s after two runs
            4: [2.0],  # over a second a run: timed once
        }
    )
    signature = _ort._signature(session)
    rates = _tuning._time_batch_sizes(
        session, signature, "model 'f'", [1, 2, 4], session.clock, None
    )
    assert session.runs == [1] * 51 + [2] * 3 + [4] * 2
    assert rates == pytest.approx({1: 1000.0, 2: 4.0, 4: 2.0})
    assert ort_backend.preferred_batch_size(rates) == 1
    # Normal noise of the input's dtype, a fresh draw per size.
    for x in session.inputs:
        assert x.dtype == np.float32
        assert x.std() > 0.1
    assert not np.array_equal(session.inputs[0], session.inputs[51][:1])


async def test_tune_batch_sizes_must_fit_the_batcher(mlp_model: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"tune_batch_sizes holds 64, more than the batcher's max_batch_size 32; "
            r"list only sizes up to 32",
        ):
            await engine.load(tune(mlp_model, [1, 64]))
        with pytest.raises(trioinfer.ConfigError, match=r"holds 16, more than .* max_batch_size 8"):
            await engine.load(tune(mlp_model, [1, 16], max_batch_size=8))
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"tune_batch_sizes needs a batcher that forms batches \(batcher = 'dynamic'\)",
        ):
            await engine.load(
                ModelConfig(name="n", path=mlp_model, backend_options={"tune_batch_sizes": [1]})
            )
        assert engine.models() == []


async def test_sample_data_too_big_for_memory_is_a_backend_error(mlp_model: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.BackendError,
            match=r"^model 'big' instance 0: tune_batch_sizes could not run a batch of "
            r"1000000000000 rows of sample data: .*float32",
        ):
            await engine.load(tune(mlp_model, [10**12], "big", max_batch_size=10**12))
    assert instance_threads("big") == []


async def test_back_to_back_inline_executions_yield_once_per_budget(
    add_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inline runs must not starve the loop, but a yield before every run made
    # each loop pass carry one request through each model: they yield once the
    # loop has been held for a budget's worth of wall time since the last yield.
    import onnxruntime

    worker = await WorkerThread.start("test-inline-slice")
    instance = ort_backend.OnnxRuntimeInstance(
        onnxruntime.InferenceSession(str(add_model)), "cpu", worker, "inline", 0.001
    )
    other = ort_backend.OnnxRuntimeInstance(
        onnxruntime.InferenceSession(str(add_model)), "cpu", worker, "inline", 0.001
    )
    now = 10.0
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: now)
    monkeypatch.setattr(trioinfer._inline._slice, "start", -math.inf)
    me = trio.lowlevel.current_task()

    class Yields(trio.abc.Instrument):
        # This task starts a new step each time it has yielded to the loop.
        count = 0

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            if task is me:
                self.count += 1

    yields = Yields()
    trio.lowlevel.add_instrument(yields)
    try:
        await instance.execute(pair())  # the first: held since "ever", so it yields
        assert yields.count == 1
        for _ in range(5):  # within the budget: no yield, whichever instance runs
            await instance.execute(pair())
            await other.execute(pair())
        assert yields.count == 1
        now += 0.002  # a budget's worth later: the next run yields
        await instance.execute(pair())
        assert yields.count == 2
    finally:
        trio.lowlevel.remove_instrument(yields)
        await instance.aclose()
        await other.aclose()


async def test_inline_runs_read_the_cpu_clock_only_near_the_budget(add_model: Path) -> None:
    # The CPU clock is a system call (1.7 us a read on a VM): a run far within the
    # budget by the wall is within it by the CPU too and counts its wall time; a run
    # that comes near it by the wall is not counted (it may have been preempted),
    # and the next run reads the CPU.
    import onnxruntime

    worker = await WorkerThread.start("test-inline-cpu-clock")
    instance = ort_backend.OnnxRuntimeInstance(
        onnxruntime.InferenceSession(str(add_model)), "cpu", worker, "inline", 0.001
    )
    reads = 0
    wall = 0.0
    run_s = 0.0  # each wall-clock read moves the clock on by this: a run lasts it

    def cpu() -> float:
        nonlocal reads
        reads += 1
        return 1e-6 * reads  # a microsecond of CPU a run

    def wall_clock() -> float:
        nonlocal wall
        wall += run_s / 2
        return wall

    instance._clock = cpu
    instance._wall = wall_clock  # type: ignore[method-assign]
    try:
        run_s = 1e-5
        for _ in range(5):  # far within the budget: no CPU read
            await instance.execute(pair())
        assert reads == 0
        run_s = 0.1  # a hundred budgets by the wall (preempted, say)
        await instance.execute(pair())
        assert reads == 0  # not counted, and no verdict on the wall time alone
        assert instance.dispatch == "inline"
        await instance.execute(pair())  # the next run reads the CPU: a microsecond
        assert reads == 2
        assert instance.dispatch == "inline"
        run_s = 1e-5
        await instance.execute(pair())  # measured so too (the last came near)
        assert reads == 4
        await instance.execute(pair())  # far within again: the wall
        assert reads == 4
        assert instance.dispatch == "inline"
        run_s = 0.1
        await instance.execute(pair())
        instance._clock = lambda: wall  # the CPU agrees with the wall: a slow model
        await instance.execute(pair())
        assert instance.dispatch == "thread"  # the run after the near one decides
    finally:
        await instance.aclose()


# -- whether a graph proves its outputs (checks_outputs) -----------------------------


def _write_reshape(path: Path, *, declared: list[Any], inferable: bool) -> Path:
    """x float32[N, 4] reshaped to [N, 4], the output declared *declared*.

    Inferable: the target shape is a constant, which ONNX's shape inference reads;
    else it is Shape(x), which inference (without data propagation) leaves open.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, declared)
    if inferable:
        nodes = [helper.make_node("Reshape", ["x", "s"], ["y"])]
        initializers = [numpy_helper.from_array(np.array([0, 4], np.int64), "s")]
    else:
        nodes = [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Reshape", ["x", "s"], ["y"]),
        ]
        initializers = []
    graph = helper.make_graph(nodes, "reshape", [x], [y], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)
    return path


def test_onnx_runtime_does_not_hold_answers_to_a_graphs_declared_output_shape(
    model_dir: Path,
) -> None:
    """The premise: a graph declaring y float32[N, 3] that computes [N, 4] runs, and
    the session reports the declared [N, 3] (ONNX Runtime only logs a warning)."""
    import onnxruntime

    path = _write_reshape(model_dir / "lies.onnx", declared=["N", 3], inferable=False)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # its warning of the misfit, not for the test's output
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].shape == ["N", 3]
    (y,) = session.run(None, {"x": np.zeros((2, 4), np.float32)})
    assert y.shape == (2, 4)


def test_onnx_runtime_strict_inference_does_not_hold_answers_either(model_dir: Path) -> None:
    """Why the proof needs the onnx package: ONNX Runtime's strict shape inference fails
    a graph whose declaration contradicts what it infers, but one where it infers
    nothing loads, reports the declared [N, 3] and answers [N, 4], as without it."""
    import onnxruntime

    path = _write_reshape(model_dir / "lies_strict.onnx", declared=["N", 3], inferable=False)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.strict_shape_type_inference", "1")
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].shape == ["N", 3]
    (y,) = session.run(None, {"x": np.zeros((2, 4), np.float32)})
    assert y.shape == (2, 4)


async def test_the_load_log_says_which_output_check_a_model_gets(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once per model (its first instance), at INFO: proved (names and rows checked),
    or not and why; without the onnx package, the extra that installs it."""
    from trioinfer_onnxruntime import _proof

    path = _write_reshape(model_dir / "said.onnx", declared=["N", 4], inferable=True)
    caplog.set_level(logging.INFO, "trioinfer.onnxruntime")

    async def load(index: int) -> bool:
        instance = await OnnxRuntimeBackend().load(
            ModelConfig(name="said", path=path, backend_options={"log_severity": 4}),
            Placement(Device("cpu"), index),
        )
        await instance.aclose()
        return bool(instance.checks_outputs)

    _proof._proved.clear()
    assert await load(0) is True
    assert await load(1) is True
    said = [r.getMessage() for r in caplog.records if "output" in r.getMessage()]
    assert said == [
        "model 'said' instance 0: ONNX shape inference proves its outputs' shapes; the "
        "engine checks each answer's output names and rows only"
    ]
    caplog.clear()
    # As in a plain [cpu] install: import onnx fails.
    monkeypatch.setitem(sys.modules, "onnx", None)
    monkeypatch.setitem(sys.modules, "onnx.shape_inference", None)
    _proof._proved.clear()
    try:
        assert await load(0) is False
    finally:
        _proof._proved.clear()
    (record,) = [r for r in caplog.records if "output" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert "the onnx package, which infers the graph's shapes, is not installed" in (
        record.getMessage()
    )
    assert "the 'onnx' extra" in record.getMessage()
    assert "the engine checks each answer against the declared signature" in (record.getMessage())


async def test_the_digits_graph_proves_its_outputs_so_the_engine_checks_names_and_rows() -> None:
    """The hot path: the bundled model's outputs are derived by shape inference, so its
    instances say checks_outputs and the engine's check is the cheap one."""
    config = ModelConfig.from_toml(trioinfer.example_repository() / "digits" / "config.toml")
    async with open_engine() as engine:
        await engine.load(config)
        runner = engine._runners["digits"]
        assert [r._backend_instance.checks_outputs for r in runner.replicas] == [True]
        assert runner._output_check is not None
        assert runner._output_check.full is False
        images, _ = trioinfer.digits_samples()
        out = await engine.infer("digits", {"input": images[:4]})
    assert out["probabilities"].shape == (4, 10)


async def test_a_graph_whose_declared_shape_lies_gets_the_full_check_and_a_refused_answer(
    model_dir: Path,
) -> None:
    """A graph declaring y [N, 3] that computes [N, 4], which shape inference cannot
    prove: the engine checks each answer, and this one fails (a 500), not reaching a
    client that metadata told [-1, 3]."""
    path = _write_reshape(model_dir / "lies.onnx", declared=["N", 3], inferable=False)
    async with open_engine() as engine:
        info = await engine.load(
            ModelConfig(name="lies", path=path, backend_options={"log_severity": 4})
        )
        assert info.signature.outputs[0].shape == ("N", 3)
        runner = engine._runners["lies"]
        assert [r._backend_instance.checks_outputs for r in runner.replicas] == [False]
        assert runner._output_check is not None
        assert runner._output_check.full is True
        with pytest.raises(
            trioinfer.BackendError,
            match=r"output 'y' with shape \[2, 4\]; its signature declares float32\[N, 3\]",
        ):
            await engine.infer("lies", {"x": np.zeros((2, 4), np.float32)})


async def test_a_graph_declared_like_its_inference_says_checks_outputs(model_dir: Path) -> None:
    """The same Reshape to a constant shape, declared [N, 4]: proved, the cheap check.
    Declared [N, 3] against the constant, ONNX Runtime itself reports [N, ?] (its
    lenient merge), which the answer fits: proved too, and clients are told -1."""
    for declared, shape in ((["N", 4], ("N", 4)), (["N", 3], ("N", None))):
        path = _write_reshape(model_dir / "const.onnx", declared=declared, inferable=True)
        instance = await OnnxRuntimeBackend().load(
            ModelConfig(name="c", path=path, backend_options={"log_severity": 4}),
            Placement(Device("cpu"), 0),
        )
        try:
            assert instance.signature.outputs[0].shape == shape
            assert instance.checks_outputs is True
        finally:
            await instance.aclose()


def test_why_a_graph_does_not_prove_its_outputs(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each reason the proof gives: a size inference leaves open; one it computes
    otherwise (a contradiction, warned of at load); no onnx package; a big file."""
    from trioinfer_onnxruntime import _proof

    def spec(*shape: Any) -> trioinfer.ModelSignature:
        x = trioinfer.TensorSpec("x", np.dtype(np.float32), ("N", 4))
        return trioinfer.ModelSignature((x,), (trioinfer.TensorSpec("y", x.dtype, shape),))

    computed = _write_reshape(model_dir / "computed.onnx", declared=["N", 3], inferable=False)
    constant = _write_reshape(model_dir / "constant.onnx", declared=["N", 4], inferable=True)
    open_size = _proof.outputs_unproved(computed, spec("N", 3))
    assert open_size == _proof.Unproved(
        "shape inference leaves size 1 of output 'y' open, which the signature declares 3"
    )
    assert _proof.outputs_unproved(computed, spec("N", None)) is None
    assert _proof.outputs_unproved(constant, spec("N", 4)) is None
    assert _proof.outputs_unproved(constant, spec("N", 3)) == _proof.Unproved(
        "the signature declares output 'y' float32[N, 3], but its operators compute [N, 4]", True
    )
    assert _proof.outputs_unproved(constant, spec("N", 4, 1)) == _proof.Unproved(
        "the signature declares output 'y' float32[N, 4, 1], but its operators compute [N, 4]", True
    )
    _proof._proved.clear()
    monkeypatch.setitem(sys.modules, "onnx", None)
    unproved = _proof.outputs_unproved(constant, spec("N", 4))
    assert unproved is not None
    assert "the onnx package" in unproved.reason
    monkeypatch.undo()
    _proof._proved.clear()
    monkeypatch.setattr(_proof, "PROOF_MAX_BYTES", 10)
    unproved = _proof.outputs_unproved(constant, spec("N", 4))
    assert unproved is not None
    assert "over the 0 MiB parsed" in unproved.reason
    _proof._proved.clear()


async def test_the_proof_cache_stays_bounded_as_models_load_and_unload(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file proved (a path, its stamp, a signature) was kept for the process's life:
    a server loading and unloading models, or a repository whose files are replaced,
    grew it without end. The last PROOF_CACHE_ENTRIES answers are kept, the first
    forgotten (a model loaded again is proved again, at load)."""
    import shutil

    from trioinfer_onnxruntime import _proof

    monkeypatch.setattr(_proof, "PROOF_CACHE_ENTRIES", 4)
    _proof._proved.clear()
    first = _write_reshape(model_dir / "cached.onnx", declared=["N", 4], inferable=True)
    try:
        async with open_engine() as engine:
            for n in range(12):
                path = model_dir / f"cached{n}.onnx"
                shutil.copy(first, path)
                await engine.load(
                    ModelConfig(name="c", path=path, backend_options={"log_severity": 4})
                )
                runner = engine._runners["c"]
                assert [r._backend_instance.checks_outputs for r in runner.replicas] == [True]
                await engine.unload("c")
                assert len(_proof._proved) == min(n + 1, 4)
        # The newest are those kept.
        assert [key[0] for key in _proof._proved] == [
            str(model_dir / f"cached{n}.onnx") for n in range(8, 12)
        ]
    finally:
        _proof._proved.clear()


def test_instances_loading_together_parse_the_file_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's instances load side by side, each on its own thread: the proof parses
    its file (up to PROOF_MAX_BYTES, a copy of the weights each) for the first, and the
    others wait for its answer, rather than each parse at once."""
    from trioinfer_onnxruntime import _proof

    path = _write_reshape(model_dir / "once.onnx", declared=["N", 4], inferable=True)
    x = trioinfer.TensorSpec("x", np.dtype(np.float32), ("N", 4))
    signature = trioinfer.ModelSignature((x,), (trioinfer.TensorSpec("y", x.dtype, ("N", 4)),))
    parse = _proof._unproved
    calls: list[int] = []
    second = threading.Event()

    def counted(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            # The second instance asks meanwhile; it must not parse too (bounded wait:
            # with one parse at a time it never arrives here while this one runs).
            other.start()
            second.wait(timeout=1.0)
        else:
            second.set()
        return parse(*args)

    monkeypatch.setattr(_proof, "_unproved", counted)
    other = threading.Thread(target=_proof.outputs_unproved, args=(path, signature))
    assert _proof.outputs_unproved(path, signature) is None
    other.join()
    assert len(calls) == 1
    _proof._proved.clear()


async def test_a_graph_that_contradicts_its_declaration_is_warned_of_at_load(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ONNX Runtime's inference and ONNX's may differ; where ONNX's computes a size other
    than the session reports, the operator is told at load, naming the model."""
    from trioinfer_onnxruntime import _proof

    path = _write_reshape(model_dir / "computed.onnx", declared=["N", 3], inferable=False)
    monkeypatch.setattr(
        _backend,
        "outputs_unproved",
        lambda path, signature, read=None: _proof.Unproved("the graph declares ... [N, 4]", True),
    )
    caplog.set_level(logging.WARNING, "trioinfer.onnxruntime")
    instance = await OnnxRuntimeBackend().load(
        ModelConfig(name="c", path=path, backend_options={"log_severity": 4}),
        Placement(Device("cpu"), 0),
    )
    await instance.aclose()
    assert instance.checks_outputs is False
    assert [r.getMessage() for r in caplog.records] == [
        "model 'c' instance 0: its graph does not prove its outputs' shapes (the graph declares "
        "... [N, 4]); the engine checks each answer against the declared signature"
    ]


def _write_hidden_lie(path: Path, where: str) -> Path:
    """x float32[N, 4] -> y declared [N, 3], computed [N, 4] (a Reshape to Shape(x)),
    with the lie told again where ONNX's inference starts from: an intermediate's
    value_info, or the declared outputs of an If's branches."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    inputs = [x]
    if where == "value_info":
        nodes = [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Reshape", ["x", "s"], ["t"]),
            helper.make_node("Identity", ["t"], ["y"]),
        ]
        value_info = [helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N", 3])]
    else:

        def branch(name: str) -> Any:
            return helper.make_graph(
                [
                    helper.make_node("Shape", ["x"], [f"{name}_s"]),
                    helper.make_node("Reshape", ["x", f"{name}_s"], [f"{name}_y"]),
                ],
                name,
                [],
                [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, ["N", 3])],
            )

        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
        nodes = [
            helper.make_node(
                "If", ["c"], ["y"], then_branch=branch("then"), else_branch=branch("else")
            )
        ]
        value_info = []
    graph = helper.make_graph(nodes, "hidden", inputs, [y], value_info=value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("where", ["value_info", "if_branches"])
async def test_a_lie_repeated_inside_the_graph_proves_nothing(model_dir: Path, where: str) -> None:
    """Inference merges what it computes with the shapes a graph declares on the way
    (value_info, a subgraph's outputs): a declaration repeated there is no proof, and
    the [N, 4] answer to a signature of [N, 3] must fail, not reach the client."""
    path = _write_hidden_lie(model_dir / f"hidden_{where}.onnx", where)
    inputs: dict[str, Any] = {"x": np.zeros((2, 4), np.float32)}
    if where == "if_branches":
        inputs["c"] = np.array(True)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="h", path=path, backend_options={"log_severity": 4}))
        runner = engine._runners["h"]
        assert [r._backend_instance.checks_outputs for r in runner.replicas] == [False]
        with pytest.raises(trioinfer.BackendError, match=r"output 'y' with shape \[2, 4\]"):
            await engine.infer("h", inputs)


def _write_x_to_y(path: Path, *, lying: bool) -> None:
    """x float32[N, 4] -> y declared float32[N, 4]: Identity(x), which inference proves,
    or (lying) Reshape(Concat(x, x), Shape(...)), which computes [N, 8] unproved."""
    import onnx
    from onnx import TensorProto, helper

    nodes = (
        [
            helper.make_node("Concat", ["x", "x"], ["t"], axis=1),
            helper.make_node("Shape", ["t"], ["s"]),
            helper.make_node("Reshape", ["t", "s"], ["y"]),
        ]
        if lying
        else [helper.make_node("Identity", ["x"], ["y"])]
    )
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)


async def test_a_file_replaced_after_its_session_was_made_proves_nothing(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proof reads the file again: one replaced after ONNX Runtime read it (a
    repository updated during the load) is not the graph the session runs. Here the
    session runs the lying graph ([N, 8] declared [N, 4]) and the file becomes the
    honest one, which inference proves: the session's answers must still be checked."""
    path = model_dir / "replaced.onnx"
    _write_x_to_y(path, lying=True)
    create = _backend._create_session

    def create_then_replace(*args: Any) -> tuple[Any, str]:
        made = create(*args)
        _write_x_to_y(model_dir / "honest.onnx", lying=False)
        os.replace(model_dir / "honest.onnx", path)
        return made

    monkeypatch.setattr(_backend, "_create_session", create_then_replace)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="r", path=path, backend_options={"log_severity": 4}))
        runner = engine._runners["r"]
        assert [r._backend_instance.checks_outputs for r in runner.replicas] == [False]
        with pytest.raises(trioinfer.BackendError, match=r"output 'y' with shape \[2, 8\]"):
            await engine.infer("r", {"x": np.zeros((2, 4), np.float32)})


async def test_an_instance_recreated_from_an_unproved_graph_gets_the_full_check(
    model_dir: Path,
) -> None:
    """A dead instance is re-created from the file as it is then: a graph put there
    since with the same signature, which does not prove its outputs, must not be
    spared the full check the model's first instances were."""
    path = model_dir / "recreated.onnx"
    _write_x_to_y(path, lying=False)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="r", path=path, backend_options={"log_severity": 4}))
        runner = engine._runners["r"]
        assert runner._output_check is not None
        assert runner._output_check.full is False
        _write_x_to_y(model_dir / "lying.onnx", lying=True)
        os.replace(model_dir / "lying.onnx", path)
        await runner.recreate(runner.replicas[0])
        assert runner.replicas[0]._backend_instance.checks_outputs is False
        with pytest.raises(trioinfer.BackendError, match=r"output 'y' with shape \[2, 8\]"):
            await engine.infer("r", {"x": np.zeros((2, 4), np.float32)})


async def test_a_state_shape_at_odds_with_the_narrowed_input_is_refused(
    model_dir: Path,
) -> None:
    """A sequence's state input is filled by the batcher, in the state's shape, not
    checked as a request's input is. A state shape other than the size the config
    fixes for that input fails the load, rather than feed the model a state of
    another size (and an answer of another size reach a client: the proof of the
    outputs starts from the input's fixed sizes)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x"], ["y"]),
            helper.make_node("Identity", ["s_in"], ["s_out"]),
        ],
        "state",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "k"]),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, ["N", "m"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "p"]),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, ["N", "q"]),
        ],
    )
    path = model_dir / "state.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path
    )
    config = ModelConfig(
        name="d",
        path=path,
        batcher="sequence",
        sequence={"state": [{"input": "s_in", "output": "s_out", "shape": [3]}]},
        backend_options={
            "log_severity": 4,
            "inputs": [{"name": "x", "shape": [-1, 1]}, {"name": "s_in", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "shape": [-1, 4]}],
        },
    )
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"state input 's_in' the shape \[3\], but the input is float32\[N, 4\]",
        ):
            await engine.load(config)


# -- sizes the config fixes (the inputs and outputs options) ------------------------


async def test_the_outputs_option_narrows_the_signature_that_is_proved(model_dir: Path) -> None:
    """The constant Reshape declared [N, 3]: ONNX Runtime reports [N, ?]; outputs fixing
    size 1 at 4 make it [N, 4], which inference proves (the cheap check). The computed
    Reshape fixed at 4 is not proved: the engine checks its answers in full."""
    const = _write_reshape(model_dir / "narrow_const.onnx", declared=["N", 3], inferable=True)
    computed = _write_reshape(model_dir / "narrow_comp.onnx", declared=["N", "k"], inferable=False)
    options = {"log_severity": 4, "outputs": [{"name": "y", "shape": [-1, 4]}]}
    for path, proved in ((const, True), (computed, False)):
        instance = await OnnxRuntimeBackend().load(
            ModelConfig(name="n", path=path, backend_options=options),
            Placement(Device("cpu"), 0),
        )
        try:
            assert instance.signature.outputs[0].shape == ("N", 4)
            assert instance.signature.inputs[0].shape == ("N", 4)
            assert instance.checks_outputs is proved
        finally:
            await instance.aclose()


async def test_the_inputs_option_narrows_what_requests_must_send(model_dir: Path) -> None:
    """x float32[N, k] fixed at [N, 4]: a request of width 3 is the caller's error."""
    path = _write_reshape(model_dir / "narrow_in.onnx", declared=["N", "k"], inferable=False)
    _save_symbolic_input(path)
    config = ModelConfig(
        name="m",
        path=path,
        backend_options={
            "log_severity": 4,
            "inputs": [{"name": "x", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "shape": ["N", -1]}],
        },
    )
    async with open_engine() as engine:
        info = await engine.load(config)
        assert info.signature.inputs[0].shape == ("N", 4)
        assert info.signature.outputs[0].shape == ("N", "k")  # a name fills only an open size
        out = await engine.infer("m", {"x": np.ones((2, 4), np.float32)})
        assert out["y"].shape == (2, 4)
        with pytest.raises(trioinfer.InvalidInput, match="'x'"):
            await engine.infer("m", {"x": np.ones((2, 3), np.float32)})


def _save_symbolic_input(path: Path) -> None:
    # The Reshape graph with x's width symbolic too: x float32[N, k].
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "k"]))
    onnx.save(model, str(path))


async def test_a_config_that_repeats_the_digits_sizes_keeps_the_cheap_check() -> None:
    """The bundled model with options that fix what its graph fixes: unchanged."""
    config = ModelConfig.from_toml(trioinfer.example_repository() / "digits" / "config.toml")
    plain = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0))
    try:
        specs = plain.signature
    finally:
        await plain.aclose()
    options = {
        **config.backend_options,
        "inputs": [{"name": s.name, "shape": [-1, *s.shape[1:]]} for s in specs.inputs],
        "outputs": [{"name": s.name, "shape": [-1, *s.shape[1:]]} for s in specs.outputs],
    }
    same = ModelConfig(name="digits", path=config.path, backend_options=options)
    async with open_engine() as engine:
        info = await engine.load(same)
        assert info.signature == specs
        runner = engine._runners["digits"]
        assert runner._output_check is not None
        assert runner._output_check.full is False


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"inputs": {"x": [1]}}, r"backend option inputs must be a list of tables"),
        ({"inputs": [{"name": "x"}]}, r"each entry must be a table of name and shape"),
        ({"outputs": [{"name": "", "shape": []}]}, r"a tensor name must be a non-empty"),
        (
            {"outputs": [{"name": "y", "shape": [-1]}, {"name": "y", "shape": [-1]}]},
            r"'y' is declared twice",
        ),
        ({"inputs": [{"name": "x", "shape": [-2, 4]}]}, r"sizes >= 0, names or -1"),
        ({"inputs": [{"name": "z", "shape": [-1]}]}, r"input 'z', which the graph does not have"),
        ({"outputs": [{"name": "y", "shape": [-1]}]}, r"output 'y' with shape \[-1\]"),
        ({"inputs": [{"name": "x", "shape": [-1, 5]}]}, r"the graph's is \[N, 4\]"),
        (
            {"inputs": [{"name": "x", "shape": [-1, 3], "reshape": [-1, 4]}]},
            r"'x' has shape \[-1, 3\] and reshape \[-1, 4\]: they must hold the same",
        ),
        (
            {"inputs": [{"name": "x", "shape": [-1, 2, 2], "reshape": [4]}]},
            r"-1 first in both, or in neither",
        ),
        (
            {"outputs": [{"name": "y", "shape": [-1, "k"], "reshape": [-1, 4]}]},
            r"the shape of reshaped 'y' must be a list of fixed sizes",
        ),
        ({"outputs": [{"name": "y", "shape": [-1], "optional": True}]}, r"each entry must be"),
        ({"inputs": [{"name": "x", "shape": [-1, 4], "optional": 1}]}, r"optional of 'x' must"),
        (
            {"inputs": [{"name": "x", "shape": [-1, 4], "optional": True}]},
            r"declares input 'x' optional, but the graph needs it",
        ),
        (
            {"inputs": [{"name": "w", "shape": [4], "optional": True}]},
            r"declares input 'w' optional, which the graph does not have",
        ),
    ],
)
async def test_bad_inputs_and_outputs_options_are_refused(
    model_dir: Path, options: dict[str, Any], message: str
) -> None:
    path = _write_reshape(model_dir / "bad_opts.onnx", declared=["N", 4], inferable=True)
    with pytest.raises(trioinfer.ConfigError, match=message):
        await OnnxRuntimeBackend().load(
            ModelConfig(name="b", path=path, backend_options=options),
            Placement(Device("cpu"), 0),
        )


async def test_inputs_the_config_fixes_feed_the_proof(model_dir: Path) -> None:
    """y = Concat(x, x): x float32[N, k], y float32[N, m]. With x fixed at [N, 2] and y
    at [N, 4], inference from the fixed input proves y (the cheap check); y fixed at 3
    contradicts it: the full check, which refuses every answer."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=1)],
        "doubled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "k"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "m"])],
    )
    path = model_dir / "doubled.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path
    )
    for width, proved in ((4, True), (3, False)):
        options = {
            "inputs": [{"name": "x", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "shape": [-1, width]}],
        }
        instance = await OnnxRuntimeBackend().load(
            ModelConfig(name="d", path=path, backend_options=options), Placement(Device("cpu"), 0)
        )
        try:
            assert instance.signature.outputs[0].shape == ("N", width)
            assert instance.checks_outputs is proved
        finally:
            await instance.aclose()


# == optional inputs: sent, or left to the graph's initializer =================================


def _write_biased(path: Path) -> Path:
    """y = x + b, float32[N, 4]; b has an initializer (one row of ones) that Add broadcasts."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["y"])],
        "biased",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(np.ones((1, 4), np.float32), "b")],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path
    )
    return path


def _biased(path: Path, **settings: Any) -> ModelConfig:
    options = {"inputs": [{"name": "b", "shape": [-1, 4], "optional": True}]}
    return ModelConfig(name="biased", path=path, backend_options=options, **settings)


async def test_an_optional_input_may_be_sent_or_left_to_the_graph(model_dir: Path) -> None:
    path = _write_biased(model_dir / "biased.onnx")
    async with open_engine() as engine:
        info = await engine.load(_biased(path))
        x_spec, b_spec = info.signature.inputs
        assert (x_spec.name, x_spec.optional, b_spec.name, b_spec.optional) == (
            "x",
            False,
            "b",
            True,
        )
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        left_out = await engine.infer("biased", {"x": x})
        np.testing.assert_array_equal(left_out["y"], x + 1)  # the graph's b
        sent = await engine.infer("biased", {"x": x, "b": np.full_like(x, 10)})
        np.testing.assert_array_equal(sent["y"], x + 10)
        # Only the optional input may be left out, and one sent is checked as any other.
        with pytest.raises(trioinfer.InvalidInput, match=r"needs input 'x'; its inputs are "):
            await engine.infer("biased", {"b": x})
        with pytest.raises(trioinfer.InvalidInput, match=r"disagree on dimension 'N'"):
            await engine.infer("biased", {"x": x, "b": x[:1]})
        with pytest.raises(trioinfer.InvalidInput, match=r"no input named 'c'.*'b' .*\(optional\)"):
            await engine.infer("biased", {"x": x, "c": x})


async def test_an_input_with_an_initializer_declared_required_is_refused(
    model_dir: Path,
) -> None:
    # The graph gives b a value of its own, which ONNX Runtime lists apart from its
    # inputs: declared without optional, the load fails saying what to declare.
    path = _write_biased(model_dir / "biased_required.onnx")
    options = {"inputs": [{"name": "b", "shape": [-1, 4]}]}
    async with open_engine() as engine:
        with pytest.raises(
            trioinfer.ConfigError,
            match=r"declares input 'b' required, but the graph gives it a value of its own "
            r"\(an initializer\).*declare it optional",
        ):
            await engine.load(ModelConfig(name="biased", path=path, backend_options=options))


async def test_requests_that_send_different_inputs_batch_apart(model_dir: Path) -> None:
    """In flight together, requests that send b and requests that leave it out each get
    their own answer: a batch holds requests that send the same inputs. Queued in
    order, the four that leave b out make one batch, the four that send it the next."""
    path = _write_biased(model_dir / "biased_batched.onnx")
    config = _biased(
        path,
        batcher="dynamic",
        batcher_options={"max_batch_size": 4, "max_queue_delay": 30.0},
    )
    results: dict[int, np.ndarray] = {}
    async with open_engine() as engine:
        await engine.load(config)

        async def one(i: int) -> None:
            x = np.full((1, 4), i, dtype=np.float32)
            inputs = {"x": x} if i < 4 else {"x": x, "b": np.full_like(x, 100 * i)}
            results[i] = (await engine.infer("biased", inputs))["y"]

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
                await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics().models["biased"]
    for i in range(8):
        np.testing.assert_array_equal(results[i], np.full((1, 4), i + (1 if i < 4 else 100 * i)))
    assert stats.executions == 2


async def test_the_response_cache_tells_an_optional_input_sent_from_one_left_out(
    model_dir: Path,
) -> None:
    # b sent with the graph's own value still has a key of its own: what was sent differs.
    path = _write_biased(model_dir / "biased_cached.onnx")
    x = np.zeros((1, 4), dtype=np.float32)
    async with open_engine(cache_size=1 << 20) as engine:
        await engine.load(_biased(path, response_cache=True))
        sent = await engine.infer("biased", {"x": x, "b": np.full_like(x, 10)})
        left_out = await engine.infer("biased", {"x": x})
        ones = await engine.infer("biased", {"x": x, "b": np.ones_like(x)})
        again = await engine.infer("biased", {"x": x})
        cache = engine.statistics().models["biased"].cache
    np.testing.assert_array_equal(sent["y"], x + 10)
    np.testing.assert_array_equal(left_out["y"], x + 1)
    np.testing.assert_array_equal(ones["y"], x + 1)
    np.testing.assert_array_equal(again["y"], x + 1)
    assert cache is not None
    assert (cache.misses, cache.hits, cache.entries) == (3, 1, 3)
