"""Decoupled Triton Python models: how their responses stream, and who owns their executes.

The models are written as for Triton (``request.get_response_sender()``,
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``); a module the test puts in
``sys.modules`` (`GATE`) is how a model and its test meet.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import trioinfer
import trioinfer._runner
from test_triton_python import REPEAT_PBTXT
from trioinfer import BackendError
from trioinfer._stream import STREAM_AHEAD
from trioinfer.server._repository import ModelRepository
from trioinfer_python import _triton

pytestmark = [pytest.mark.python_model, pytest.mark.triton_config]

#: Bounds against hangs only.
WAIT_S = 60.0
#: The module a model imports to meet its test.
GATE = "triton_stream_gate"

#: A decoupled model's config: IN, a list of int32, and one OUT per response.
PBTXT = REPEAT_PBTXT

# Sends IN[0] responses from a thread of its own, as fast as it can, counting them.
FLOOD = """\
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
import triton_stream_gate as gate


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            threading.Thread(target=self.send, args=(sender, count)).start()

    def send(self, sender, count):
        for i in range(count):
            gate.attempts += 1
            out = pb_utils.Tensor("OUT", np.array([i], np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
            if not sender.is_cancelled():
                gate.sent += 1
        gate.cancelled = sender.is_cancelled()
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        gate.done.set()
"""

# Sends one response from execute itself, then waits for the test before the last.
HOLD = """\
import numpy as np
import triton_python_backend_utils as pb_utils
import triton_stream_gate as gate


class TritonPythonModel:
    def execute(self, requests):
        (request,) = requests
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
        gate.waiting.set()
        gate.release.wait()
        gate.cancelled = request.is_cancelled()
        sender.send(
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([2], np.int32))]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
        gate.finished.set()

    def finalize(self):
        gate.finalized_after_execute = gate.finished.is_set()
"""

# The same from an async def execute: its second response waits for the test's event.
ASYNC_HOLD = """\
import numpy as np
import triton_python_backend_utils as pb_utils
import triton_stream_gate as gate


class TritonPythonModel:
    async def execute(self, requests):
        (request,) = requests
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
        try:
            await gate.go.wait()
        finally:
            gate.cancelled = request.is_cancelled()
            gate.ended.set()
        sender.send(
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([2], np.int32))]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
        if int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0]) < 0:
            raise pb_utils.TritonModelException("after the final flag")
"""

# An async def execute that sends IN[0] responses without awaiting in between.
ASYNC_BURST = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        (request,) = requests
        sender = request.get_response_sender()
        count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        for i in range(count):
            out = pb_utils.Tensor("OUT", np.array([i], np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# An async def execute that tells its test which task runs it.
ASYNC_OWNER = """\
import numpy as np
import trio
import triton_python_backend_utils as pb_utils
import triton_stream_gate as gate


class TritonPythonModel:
    async def execute(self, requests):
        (request,) = requests
        gate.task = trio.lowlevel.current_task()
        sender = request.get_response_sender()
        out = pb_utils.Tensor("OUT", np.array([1], np.int32))
        sender.send(
            pb_utils.InferenceResponse([out]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )
"""

MODELS = {
    "flood": FLOOD,
    "hold": HOLD,
    "async_hold": ASYNC_HOLD,
    "async_burst": ASYNC_BURST,
    "async_owner": ASYNC_OWNER,
}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for name, code in MODELS.items():
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(PBTXT)
        (tmp_path / name / "1" / "model.py").write_text(code)
    return tmp_path


@pytest.fixture
def gate() -> Iterator[Any]:
    module = types.SimpleNamespace(
        attempts=0,
        sent=0,
        cancelled=None,
        finalized_after_execute=None,
        done=threading.Event(),
        waiting=threading.Event(),
        release=threading.Event(),
        finished=threading.Event(),
        go=trio.Event(),
        ended=trio.Event(),
    )
    sys.modules[GATE] = module  # type: ignore[assignment]
    try:
        yield module
    finally:
        module.release.set()  # a model's thread still waiting must not outlive the test
        del sys.modules[GATE]


async def load(engine: trioinfer.Engine, repository: Path, name: str) -> None:
    await engine.load(ModelRepository(repository).entry(name).config(1))


def one(n: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"IN": np.array([n], np.int32)}


async def test_a_slow_reader_slows_a_decoupled_models_sender(repository: Path, gate: Any) -> None:
    """At most STREAM_BUFFER responses wait: the sender blocks until the caller leaves."""
    count = 20 * _triton.STREAM_BUFFER
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "flood")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("flood", one(count)) as responses:
                async for _ in responses:
                    break
                # Until the sender blocks on a full buffer, or has sent everything.
                while not (gate.sent >= _triton.STREAM_BUFFER and gate.attempts > gate.sent):
                    if gate.sent == count:
                        break
                    await trio.sleep(0.01)
            await trio.to_thread.run_sync(gate.done.wait)
    assert gate.cancelled is True
    # The buffer, the responses the engine's stream holds ahead, the one read, the one
    # blocked.
    assert gate.sent <= _triton.STREAM_BUFFER + STREAM_AHEAD + 2


async def test_unload_waits_for_a_decoupled_execute_still_running(
    repository: Path, gate: Any
) -> None:
    """A plain def execute whose caller left is the instance's: unload waits, then finalize."""
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "hold")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("hold", one(0)) as responses:
                async for out in responses:
                    assert out["OUT"].tolist() == [1]
                    break
            await trio.to_thread.run_sync(gate.waiting.wait)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.unload, "hold")
                await trio.sleep(0.05)  # (unload is under way: it waits for execute)
                assert not gate.finished.is_set()
                gate.release.set()
    assert gate.finished.is_set()
    assert gate.cancelled is True  # request.is_cancelled(): its caller had left
    assert gate.finalized_after_execute is True


async def test_unload_names_a_decoupled_execute_running_past_the_bound(
    repository: Path, gate: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(trioinfer._runner, "CLEANUP_S", 0.0)  # the engine's bound on closing
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "hold")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("hold", one(0)) as responses:
                async for _ in responses:
                    break
            await trio.to_thread.run_sync(gate.waiting.wait)
            await engine.unload("hold")
    assert not gate.finished.is_set()
    assert "model 'hold': unload stopped waiting for 1 execute(s)" in caplog.text
    gate.release.set()
    await trio.to_thread.run_sync(gate.finished.wait, WAIT_S)


async def test_an_async_decoupled_execute_streams_as_it_sends(repository: Path, gate: Any) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "async_hold")
        got = []
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("async_hold", one(0)) as responses:
                async for out in responses:
                    got.append(out["OUT"].tolist())
                    gate.go.set()  # the second response waits for the first one read
        assert got == [[1], [2]]
        assert gate.cancelled is False


async def test_an_async_decoupled_execute_is_a_task_under_the_engine(
    repository: Path, gate: Any
) -> None:
    """A task of the model's task group, in the engine's nursery: no system task of Trio's."""
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "async_owner")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("async_owner", one(0)) as responses:
                assert [out["OUT"].tolist() async for out in responses] == [[1]]
    ancestors = []
    task: trio.lowlevel.Task | None = gate.task
    while task is not None:
        ancestors.append(task)
        task = task.parent_nursery.parent_task if task.parent_nursery is not None else None
    assert trio.lowlevel.current_task() in ancestors


async def test_an_async_decoupled_execute_is_cancelled_when_its_caller_leaves(
    repository: Path, gate: Any
) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "async_hold")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("async_hold", one(0)) as responses:
                async for _ in responses:
                    break
            await gate.ended.wait()
        assert gate.cancelled is True


async def test_an_async_decoupled_execute_raising_after_its_final_response(
    repository: Path, gate: Any
) -> None:
    gate.go.set()
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "async_hold")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("async_hold", one(-1)) as responses:
                got = [out["OUT"].tolist() async for out in responses]
        assert got == [[1], [2]]


async def test_an_async_execute_sending_more_than_the_buffer_at_once_is_told(
    repository: Path,
) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "async_burst")
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("async_burst", one(3)) as responses:
                assert [out["OUT"].tolist() async for out in responses] == [[0], [1], [2]]
            with pytest.raises(BackendError, match="await between sends"):
                await read_all(engine, "async_burst", one(_triton.STREAM_BUFFER + 10))


async def read_all(engine: trioinfer.Engine, model: str, inputs: dict[str, Any]) -> None:
    async with engine.infer_stream(model, inputs) as responses:
        async for _ in responses:
            pass


# -- as Triton loads model.py -------------------------------------------------------------

HELPER_PBTXT = """\
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Imports a module and a package of its version folder, as Triton lets it (the folder is
# on sys.path there).
HELPER = """\
import numpy as np
import triton_python_backend_utils as pb_utils

import helper
from tools.add import add


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "Y", add(pb_utils.get_input_tensor_by_name(r, "X").as_numpy(), helper.K))])
            for r in requests
        ]
"""


def write_helper_model(root: Path, name: str, k: int) -> None:
    (root / name / "1" / "tools").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(HELPER_PBTXT)
    (root / name / "1" / "model.py").write_text(HELPER)
    (root / name / "1" / "helper.py").write_text(f"K = {k}\n")
    (root / name / "1" / "tools" / "__init__.py").write_text("")
    (root / name / "1" / "tools" / "add.py").write_text("def add(a, b):\n    return a + b\n")


async def test_two_models_import_their_own_sibling_modules(tmp_path: Path) -> None:
    write_helper_model(tmp_path, "plus_one", 1)
    write_helper_model(tmp_path, "plus_ten", 10)
    before = set(sys.modules)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "plus_one")
        await load(engine, tmp_path, "plus_ten")
        x = {"X": np.array([5], np.int32)}
        assert (await engine.infer("plus_one", x))["Y"].tolist() == [6]
        assert (await engine.infer("plus_ten", x))["Y"].tolist() == [15]
        # The folder's modules are the model's: not left where another import finds them.
        assert {"helper", "tools", "tools.add"}.isdisjoint(sys.modules)
        assert str(tmp_path / "plus_one" / "1") not in sys.path
        (tmp_path / "plus_one" / "1" / "helper.py").write_text("K = 2\n")
        await engine.unload("plus_one")
        await load(engine, tmp_path, "plus_one")  # a reload reads the folder afresh
        assert (await engine.infer("plus_one", x))["Y"].tolist() == [7]
    assert not {m for m in set(sys.modules) - before if m.startswith(("helper", "tools"))}


# -- through trioinfer serve, with tritonclient ------------------------------------------

WORDS_PBTXT = """\
backend: "python"
max_batch_size: 4
dynamic_batching { }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "WORDS" data_type: TYPE_STRING dims: [ 2 ] },
  { name: "TWICE" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""

# BYTES from a list of str, as Triton's examples make them, and a strided view; every
# output, whatever the client asked for (the server answers with the ones it asked for).
WORDS = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
            words = [[f"w{int(v)}", "\u00e9t\u00e9"] for v in n[:, 0]]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("WORDS", np.array(words, dtype=np.object_)),
                # A view that is not contiguous (every other column).
                pb_utils.Tensor("TWICE", np.repeat(n * 2, 2, axis=1)[:, ::2]),
            ]))
        return responses
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_grpc import run_server

    root = tmp_path_factory.mktemp("served")
    (root / "words" / "1").mkdir(parents=True)
    (root / "words" / "config.pbtxt").write_text(WORDS_PBTXT)
    (root / "words" / "1" / "model.py").write_text(WORDS)
    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(root, log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def test_http_requested_outputs_and_bytes_from_str(server: Any) -> None:
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        n = httpclient.InferInput("N", [2, 1], "INT32")
        n.set_data_from_numpy(np.array([[3], [4]], np.int32))
        for binary in (True, False):
            asked = [httpclient.InferRequestedOutput("WORDS", binary_data=binary)]
            result = client.infer("words", [n], outputs=asked)
            assert result.as_numpy("TWICE") is None
            words = result.as_numpy("WORDS").tolist()
            if not binary:  # (tritonclient gives a JSON string as str)
                words = [[w.encode() for w in row] for row in words]
            assert words == [[b"w3", "\u00e9t\u00e9".encode()], [b"w4", "\u00e9t\u00e9".encode()]]
        result = client.infer("words", [n], outputs=[httpclient.InferRequestedOutput("TWICE")])
        assert result.as_numpy("WORDS") is None
        assert result.as_numpy("TWICE").tolist() == [[6], [8]]


@pytest.mark.grpc
def test_grpc_requested_outputs_and_bytes_from_str(server: Any) -> None:
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc) as client:
        n = grpcclient.InferInput("N", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[5]], np.int32))
        result = client.infer("words", [n], outputs=[grpcclient.InferRequestedOutput("WORDS")])
        assert result.as_numpy("TWICE") is None
        assert result.as_numpy("WORDS").tolist() == [[b"w5", "\u00e9t\u00e9".encode()]]
        result = client.infer("words", [n], outputs=[grpcclient.InferRequestedOutput("TWICE")])
        assert result.as_numpy("WORDS") is None
        assert result.as_numpy("TWICE").tolist() == [[10]]


# -- what execute answers with --------------------------------------------------------------


def test_a_response_of_something_else_than_tensors_is_refused_where_it_is_made() -> None:
    from trioinfer_python import triton_python_backend_utils as pb_utils

    y = np.zeros(2, np.float32)
    with pytest.raises(TypeError, match=r"list of pb_utils.Tensor, got ndarray"):
        pb_utils.InferenceResponse([y])
    with pytest.raises(TypeError, match=r"list of pb_utils.Tensor, got Tensor"):
        pb_utils.InferenceResponse(pb_utils.Tensor("Y", y))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"output 'Y' twice"):
        pb_utils.InferenceResponse([pb_utils.Tensor("Y", y), pb_utils.Tensor("Y", y)])
    assert pb_utils.InferenceResponse((pb_utils.Tensor("Y", y),)).output_tensors()[0].name() == "Y"


# Waits until its caller leaves (request.is_cancelled()), as a long Triton execute checks.
PATIENT = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils
import triton_stream_gate as gate


class TritonPythonModel:
    def execute(self, requests):
        (request,) = requests
        gate.cancelled = request.is_cancelled()
        gate.waiting.set()
        while not request.is_cancelled() and not gate.release.is_set():
            time.sleep(0.001)
        gate.cancelled = request.is_cancelled()
        gate.finished.set()
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "cancelled", pb_utils.TritonError.CANCELLED))]
"""


async def test_a_request_whose_caller_left_says_it_is_cancelled(tmp_path: Path, gate: Any) -> None:
    (tmp_path / "patient" / "1").mkdir(parents=True)
    (tmp_path / "patient" / "config.pbtxt").write_text(HELPER_PBTXT)
    (tmp_path / "patient" / "1" / "model.py").write_text(PATIENT)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "patient")
        with trio.move_on_after(WAIT_S) as scope:
            async with trio.open_nursery() as nursery:

                async def leave() -> None:
                    await trio.to_thread.run_sync(gate.waiting.wait)
                    assert gate.cancelled is False
                    nursery.cancel_scope.cancel()  # the caller leaves mid-execute

                nursery.start_soon(leave)
                await engine.infer("patient", {"X": np.array([1], np.int32)})
        assert not scope.cancelled_caught
        await trio.to_thread.run_sync(gate.finished.wait, 10.0)
        gate.release.set()  # (had it not seen its caller leave, the unload would wait)
    assert gate.cancelled is True


async def test_a_request_past_its_deadline_says_it_is_cancelled(tmp_path: Path, gate: Any) -> None:
    (tmp_path / "patient" / "1").mkdir(parents=True)
    (tmp_path / "patient" / "config.pbtxt").write_text(HELPER_PBTXT)
    (tmp_path / "patient" / "1" / "model.py").write_text(PATIENT)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "patient")
        with trio.move_on_after(0.2):  # (a deadline shorter than execute)
            await engine.infer("patient", {"X": np.array([1], np.int32)})
        await trio.to_thread.run_sync(gate.finished.wait, 10.0)
        gate.release.set()  # (had it not seen its deadline pass, the unload would wait)
    assert gate.cancelled is True


FINALIZE_BROKEN = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "X")])
                for r in requests]

    def finalize(self):
        raise RuntimeError("finalize broke")
"""


async def test_a_finalize_that_raises_is_logged_naming_the_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(HELPER_PBTXT.replace('"Y"', '"X"', 1))
    (tmp_path / "m" / "1" / "model.py").write_text(FINALIZE_BROKEN)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "m")
        await engine.unload("m")
        assert "closing backend instance <model 'm' instance 0> failed" in caplog.text
        assert "finalize() raised RuntimeError: finalize broke" in caplog.text
        await load(engine, tmp_path, "m")  # and it loads again
        assert (await engine.infer("m", {"X": np.array([3], np.int32)}))["X"].tolist() == [3]


TWO_PBTXT = HELPER_PBTXT + "instance_group [ { kind: KIND_CPU count: 2 } ]\n"

# Each instance says who it is at initialize.
TWO = """\
import triton_python_backend_utils as pb_utils
import triton_stream_gate as gate


class TritonPythonModel:
    def initialize(self, args):
        gate.instances.append((id(self), type(self), args["model_instance_name"]))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
"""


async def test_two_instances_are_two_objects(tmp_path: Path, gate: Any) -> None:
    gate.instances = []
    (tmp_path / "two" / "1").mkdir(parents=True)
    (tmp_path / "two" / "config.pbtxt").write_text(TWO_PBTXT)
    (tmp_path / "two" / "1" / "model.py").write_text(TWO)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "two")
        assert (await engine.infer("two", {"X": np.array([4], np.int32)}))["Y"].tolist() == [4]
    objects, classes, names = zip(*gate.instances, strict=True)
    assert len(set(objects)) == 2
    assert len(set(classes)) == 2  # (each its own import of model.py, as Triton's processes)
    assert sorted(names) == ["two_0_0", "two_0_1"]
