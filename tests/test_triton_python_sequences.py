"""Triton Python models with ``sequence_batching``, and ``auto_complete_config``.

The models are written as for Triton, in a repository each test writes:
a stateful accumulator that keeps its own state per ``correlation_id()``
and reads the control inputs config.pbtxt declares, and models whose
``config.pbtxt`` leaves their tensors (and batching) to ``model.py``'s
``auto_complete_config``. Run through the engine (the server's model
manager, which reads the repository) and through ``trioinfer serve`` with
``tritonclient``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import trioinfer
from trioinfer import ConfigError, SequenceError, SequenceFlags
from trioinfer.server._repository import ModelRepository

pytestmark = [pytest.mark.python_model, pytest.mark.triton_config]

SEQUENCE_PBTXT = """\
backend: "python"
max_batch_size: {batch}
sequence_batching {{
  {strategy} {{ }}
  max_sequence_idle_microseconds: 60000000
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }} ] }},
    {{
      name: "READY"
      control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ]
    }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "SEEN" data_type: TYPE_INT64 dims: [ 5 ] }}
]
instance_group [ {{ kind: KIND_CPU count: 2 }} ]
"""

# Triton's simple_sequence, kept by the model: each sequence's running sum, in the
# instance the sequence is bound to. SEEN says what the request carried: START, END,
# READY, CORRID and flags(), as the model received them.
ACCUMULATOR = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            end = pb_utils.get_input_tensor_by_name(request, "END").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()
            assert start.dtype == np.int32 and end.dtype == np.float32, (start, end)
            assert ready.dtype == np.bool_ and corrid.dtype == np.uint64, (ready, corrid)
            sequence = request.correlation_id()
            flags = request.flags()
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.sums[sequence] = 0
            if sequence not in self.sums:
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("unknown sequence"))
                )
                continue
            self.sums[sequence] += int(value.sum())
            total = np.full(value.shape, self.sums[sequence], np.int32)
            seen = [start.item(), end.item(), ready.item(), corrid.item(), flags]
            seen = np.array([seen], np.int64).reshape((*value.shape[:-1], 5))
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sums[sequence]
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("SEEN", seen)]
                )
            )
        return responses
"""

START, END = 1, 2  # pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, _END


def write_model(root: Path, name: str, pbtxt: str, code: str) -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "config.pbtxt").write_text(pbtxt)
    (root / name / "1" / "model.py").write_text(code)
    return root


def sequence_pbtxt(batch: int = 4, strategy: str = "oldest") -> str:
    return SEQUENCE_PBTXT.format(batch=batch, strategy=strategy)


def value(x: int, batched: bool = True) -> dict[str, np.ndarray[Any, Any]]:
    return {"INPUT": np.full((1, 1) if batched else (1,), x, np.int32)}


def flags(sequence_id: int, index: int, count: int) -> SequenceFlags:
    return SequenceFlags(sequence_id, start=index == 0, end=index == count - 1)


async def load(engine: trioinfer.Engine, root: Path, name: str) -> None:
    await engine.load(ModelRepository(root).entry(name).config(1))


# -- sequence_batching, through the engine ---------------------------------------------------


@pytest.mark.parametrize(("batch", "strategy"), [(4, "oldest"), (2, "direct"), (0, "direct")])
async def test_a_sequence_reaches_one_instance_in_order_with_its_controls(
    tmp_path: Path, batch: int, strategy: str
) -> None:
    root = write_model(tmp_path, "acc", sequence_pbtxt(batch, strategy), ACCUMULATOR)
    batched = batch > 0
    async with trioinfer.open_engine() as engine:
        await load(engine, root, "acc")
        # The callers send INPUT alone: the controls are the batcher's to feed.
        assert [spec.name for spec in engine.model("acc").signature.inputs] == ["INPUT"]
        results: dict[int, list[tuple[int, list[int]]]] = {}

        async def run(sequence_id: int, values: list[int]) -> None:
            got = results.setdefault(sequence_id, [])
            for i, x in enumerate(values):
                out = await engine.infer(
                    "acc", value(x, batched), sequence=flags(sequence_id, i, len(values))
                )
                got.append((int(out["OUTPUT"].sum()), out["SEEN"].reshape(-1).tolist()))

        async with trio.open_nursery() as nursery:
            for sequence_id in (11, 12, 13):
                nursery.start_soon(run, sequence_id, [sequence_id, 1, 2])
    for sequence_id in (11, 12, 13):
        sums = [total for total, _ in results[sequence_id]]
        assert sums == [sequence_id, sequence_id + 1, sequence_id + 3]
        seen = [s for _, s in results[sequence_id]]
        assert seen == [
            [1, 0, 1, sequence_id, START],
            [0, 0, 1, sequence_id, 0],
            [0, 1, 1, sequence_id, END],
        ]


# A string CORRID on a model without a batch dimension: the id as bytes, as Triton's.
STRING_ID_PBTXT = """\
backend: "python"
sequence_batching {
  control_input [
    { name: "ID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ID_OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

STRING_ID = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "ID_OUT", pb_utils.get_input_tensor_by_name(r, "ID").as_numpy()
                    )
                ]
            )
            for r in requests
        ]
"""


async def test_a_string_corrid_is_the_sequence_id_as_bytes(tmp_path: Path) -> None:
    root = write_model(tmp_path, "ids", STRING_ID_PBTXT, STRING_ID)
    async with trioinfer.open_engine() as engine:
        await load(engine, root, "ids")
        out = await engine.infer(
            "ids", value(1, batched=False), sequence=SequenceFlags("abc", start=True)
        )
        assert out["ID_OUT"].tolist() == [b"abc"]
        out = await engine.infer(
            "ids", value(2, batched=False), sequence=SequenceFlags(77, start=True)
        )
        assert out["ID_OUT"].tolist() == [b"77"]


async def test_a_request_outside_a_sequence_is_refused(tmp_path: Path) -> None:
    root = write_model(tmp_path, "acc", sequence_pbtxt(), ACCUMULATOR)
    async with trioinfer.open_engine() as engine:
        await load(engine, root, "acc")
        with pytest.raises(SequenceError, match="needs a sequence_id"):
            await engine.infer("acc", value(1))
        with pytest.raises(SequenceError, match="no sequence 5 in progress"):
            await engine.infer("acc", value(1), sequence=SequenceFlags(5))
        # A one-request sequence: both flags.
        out = await engine.infer("acc", value(4), sequence=SequenceFlags(6, start=True, end=True))
        assert out["SEEN"].reshape(-1).tolist() == [1, 1, 1, 6, START | END]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            'sequence_batching { state [ { input_name: "S" output_name: "S_OUT" '
            "data_type: TYPE_INT32 dims: [ 1 ] } ] }\n",
            "implicit state.*not supported for a Triton Python model",
        ),
        (
            "sequence_batching { }\nmodel_transaction_policy { decoupled: true }\n",
            "sequence_batching with model_transaction_policy decoupled",
        ),
        (
            'sequence_batching { control_input [ { name: "C" control [ '
            "{ kind: CONTROL_SEQUENCE_CORRID } ] } ] }\n",
            "CORRID.*needs a data_type",
        ),
    ],
)
def test_sequence_configs_it_cannot_serve_are_refused(
    tmp_path: Path, extra: str, said: str
) -> None:
    pbtxt = (
        'backend: "python"\n'
        'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n' + extra
    )
    write_model(tmp_path, "m", pbtxt, ACCUMULATOR)
    with pytest.raises(ConfigError, match=said):
        ModelRepository(tmp_path).entry("m").config(1)


# -- through trioinfer serve, with tritonclient ----------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_grpc import run_server

    root = tmp_path_factory.mktemp("triton_python_sequences") / "models"
    write_model(root, "acc", sequence_pbtxt(), ACCUMULATOR)
    write_model(root, "auto", 'backend: "python"\n', AUTO)
    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(root, log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def _input(x: int) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full((1, 1), x, np.int32))
    return [tensor]


def test_tritonclient_sequences(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        meta = client.get_model_metadata("acc")
        assert [i["name"] for i in meta["inputs"]] == ["INPUT"]
        for sequence_id, values in ((21, [3, 4, 5]), (22, [10, 20, 30])):
            sums = []
            for i, x in enumerate(values):
                result = client.infer(
                    "acc",
                    _input(x),
                    sequence_id=sequence_id,
                    sequence_start=i == 0,
                    sequence_end=i == len(values) - 1,
                )
                sums.append(int(result.as_numpy("OUTPUT").sum()))
            assert sums == [values[0], sum(values[:2]), sum(values)]
        with pytest.raises(InferenceServerException, match="needs a sequence_id") as refused:
            client.infer("acc", _input(1))
        assert refused.value.status() == "400"
        config = client.get_model_config("acc")
        controls = config["sequence_batching"]["control_input"]
        assert [c["name"] for c in controls] == ["START", "END", "READY", "CORRID"]


# -- auto_complete_config ----------------------------------------------------------------------

# As Triton's auto_complete example: config.pbtxt says only the backend; the model says
# its tensors, its batch size and dynamic batching. SEEN: what initialize's config said.
AUTO = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        # What config.pbtxt declares must agree: add_input completes it, or refuses.
        for name in ("INPUT0", "INPUT1"):
            auto_complete_model_config.add_input(
                {"name": name, "data_type": "TYPE_FP32", "dims": [4]}
            )
        auto_complete_model_config.add_output(
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}
        )
        auto_complete_model_config.add_output(
            {"name": "BATCH", "data_type": "TYPE_INT32", "dims": [1]}
        )
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            batch = np.full((len(a), 1), self.config["max_batch_size"], np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", a + b),
                        pb_utils.Tensor("BATCH", batch),
                    ]
                )
            )
        return responses
"""

# Decoupled by its auto_complete_config: one response per element of IN.
AUTO_STREAM = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [-1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]})
        config.set_model_transaction_policy({"decoupled": True})
        return config

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for x in pb_utils.get_input_tensor_by_name(request, "IN").as_numpy():
                out = pb_utils.Tensor("OUT", np.array([x], np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

NO_AUTO = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
"""


def complete(backend: str, config: Any, path: Path) -> Any:
    # The server's completer (server/_models.py), without a server: the python backend's.
    from trioinfer_python import PythonBackend

    assert backend == "python"
    return PythonBackend().complete_triton_config(config, path)


def pair(a: float, b: float) -> dict[str, np.ndarray[Any, Any]]:
    return {"INPUT0": np.full((1, 4), a, np.float32), "INPUT1": np.full((1, 4), b, np.float32)}


async def test_auto_complete_config_gives_tensors_batching_and_decoupled(tmp_path: Path) -> None:
    write_model(tmp_path, "auto", 'backend: "python"\n', AUTO)
    write_model(tmp_path, "stream", 'backend: "python"\nmax_batch_size: 0\n', AUTO_STREAM)
    # What the file declares, the model may say again: completed, not refused.
    declared = 'backend: "python"\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    write_model(tmp_path, "declared", declared, AUTO)
    repository = ModelRepository(tmp_path)
    config = repository.entry("auto").config(1, complete=complete)
    # What it returned is the model's configuration: batched by the dynamic batcher.
    assert (config.batcher, config.batcher_options["max_batch_size"]) == ("dynamic", 8)
    async with trioinfer.open_engine() as engine:
        await engine.load(config)
        signature = engine.model("auto").signature
        assert [(s.name, s.shape) for s in signature.inputs] == [
            ("INPUT0", ("batch", 4)),
            ("INPUT1", ("batch", 4)),
        ]
        out = await engine.infer("auto", pair(1, 2))
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 4), 3, np.float32))
        assert out["BATCH"].tolist() == [[8]]  # initialize's model_config is the completed one
        await engine.load(repository.entry("declared").config(1, complete=complete))
        out = await engine.infer("declared", pair(2, 2))
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 4), 4, np.float32))
        await engine.load(repository.entry("stream").config(1, complete=complete))
        async with engine.infer_stream("stream", {"IN": np.array([4, 5], np.int32)}) as stream:
            got = [int(answer["OUT"][0]) async for answer in stream]
        assert got == [4, 5]


@pytest.mark.parametrize(
    ("pbtxt", "code", "said"),
    [
        (  # config.pbtxt's type wins over the model's: a conflict fails the load
            'backend: "python"\ninput [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 4 ] } ]\n',
            AUTO,
            r"auto_complete_config raised ValueError: .*input 'INPUT0' is TYPE_INT32, the model "
            "says TYPE_FP32",
        ),
        (
            'backend: "python"\nmax_batch_size: 16\n',
            AUTO,
            "says max_batch_size 16, more than the 8 it sets",
        ),
        (
            'backend: "python"\nsequence_batching { }\n',
            AUTO,
            "sets sequence_batching, and dynamic_batching cannot be set beside it",
        ),
        (
            'backend: "python"\nmodel_transaction_policy { decoupled: false }\n',
            AUTO_STREAM,
            "says decoupled False; it cannot be changed to True",
        ),
        (
            'backend: "python"\n',
            NO_AUTO,
            "must declare its input and output: in config.pbtxt, or by "
            "TritonPythonModel.auto_complete_config",
        ),
        (
            'backend: "python"\n',
            AUTO.replace("return auto_complete_model_config", "return None"),
            "auto_complete_config returned NoneType; it must return the pb_utils.ModelConfig",
        ),
    ],
)
def test_auto_complete_config_that_conflicts_fails_the_load(
    tmp_path: Path, pbtxt: str, code: str, said: str
) -> None:
    write_model(tmp_path, "m", pbtxt, code)
    with pytest.raises(ConfigError, match=said):
        ModelRepository(tmp_path).entry("m").config(1, complete=complete)
    # Nothing of the import stays: the model's module was dropped.
    assert not [name for name in sys.modules if name.startswith("trioinfer_python_model_")]


def test_tritonclient_auto_complete_config(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        assert client.is_model_ready("auto")
        inputs = []
        for name, x in (("INPUT0", 1.0), ("INPUT1", 2.5)):
            tensor = httpclient.InferInput(name, [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), x, np.float32))
            inputs.append(tensor)
        result = client.infer("auto", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 3.5))
        # GET .../config answers what auto_complete_config returned.
        config = client.get_model_config("auto")
        assert config["max_batch_size"] == 8
        assert "dynamic_batching" in config
        assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
            ("INPUT0", "TYPE_FP32", [4]),
            ("INPUT1", "TYPE_FP32", [4]),
        ]
        assert [o["name"] for o in config["output"]] == ["OUTPUT0", "BATCH"]
        meta = client.get_model_metadata("auto")
        assert [(i["name"], i["shape"]) for i in meta["inputs"]] == [
            ("INPUT0", [-1, 4]),
            ("INPUT1", [-1, 4]),
        ]


# -- --disable-auto-complete-config ------------------------------------------------------------

DECLARED_AUTO = """\
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""

ADD_PBTXT = """\
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "a" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "b" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "sum" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "diff" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""


def write_add(root: Path, name: str, pbtxt: str | None) -> None:
    from trioinfer.testing import models

    models.write_add(root / name / "1" / "model.onnx")
    if pbtxt is not None:
        (root / name / "config.pbtxt").write_text(pbtxt)


async def test_disable_auto_complete_config_serves_config_pbtxt_as_written(
    tmp_path: Path,
) -> None:
    write_model(tmp_path, "auto", 'backend: "python"\n', AUTO)
    write_model(tmp_path, "declared", DECLARED_AUTO, AUTO)
    write_add(tmp_path, "onnx_bare", 'platform: "onnxruntime_onnx"\n')
    write_add(tmp_path, "onnx_declared", ADD_PBTXT)
    write_add(tmp_path, "onnx_no_file", None)
    repository = ModelRepository(tmp_path)
    called: list[str] = []

    def completing(backend: str, config: Any, path: Path) -> Any:
        called.append(path.parent.parent.name)
        return complete(backend, config, path)

    def config(name: str) -> trioinfer.ModelConfig:
        return repository.entry(name).config(1, complete=completing, auto_complete=False)

    said = (
        "--disable-auto-complete-config: config.pbtxt must declare the model's input and "
        "output, which nothing completes"
    )
    # Triton's behaviour: auto_complete_config is not run, and nothing else completes.
    with pytest.raises(ConfigError, match=said):
        config("auto")
    # An ONNX model's tensors are not read from its graph for its config.pbtxt either...
    with pytest.raises(ConfigError, match=said):
        config("onnx_bare")
    assert repository.entry("onnx_bare").config(1).name == "onnx_bare"  # (without the flag)
    async with trioinfer.open_engine() as engine:
        # ...and a file that declares them serves as it says (max_batch_size 8 its own).
        await engine.load(config("declared"))
        out = await engine.infer("declared", pair(1, 2))
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 4), 3, np.float32))
        assert out["BATCH"].tolist() == [[8]]
        await engine.load(config("onnx_declared"))
        # A model with no config file is trioinfer's own: read from the file, as ever.
        await engine.load(config("onnx_no_file"))
        for name in ("onnx_declared", "onnx_no_file"):
            out = await engine.infer(
                name, {"a": np.ones((1, 4), np.float32), "b": np.ones((1, 4), np.float32)}
            )
            np.testing.assert_array_equal(out["sum"], np.full((1, 4), 2, np.float32))
    assert called == []
    # Without the flag the model's auto_complete_config runs (it is the completer's).
    repository.entry("declared").config(1, complete=completing)
    assert called == ["declared"]


@pytest.mark.workers
def test_disable_auto_complete_config_reaches_every_worker(tmp_path: Path) -> None:
    from test_grpc import run_server

    root = tmp_path / "models"
    write_model(root, "auto", 'backend: "python"\n', AUTO)
    write_model(root, "declared", DECLARED_AUTO, AUTO)
    settings = tmp_path / "serve.toml"
    settings.write_text("disable_auto_complete_config = true\nworkers = 2\n")
    log = tmp_path / "server.log"
    with (
        run_server(
            root, "--config", str(settings), "--no-grpc", log=log, want_grpc=False
        ) as running,
        httpclient.InferenceServerClient(running.url.removeprefix("http://")) as client,
    ):
        # The workers load the models, each with the setting: "auto" failed, saying
        # why; "declared" serves.
        for _ in range(4):
            index = {row["name"]: row for row in client.get_model_repository_index()}
            assert index["auto"]["state"] == "UNAVAILABLE"
            assert "--disable-auto-complete-config" in index["auto"]["reason"]
            assert client.is_model_ready("declared")


# -- BLS: a call within a sequence ---------------------------------------------------------------

BLS_PBTXT = """\
backend: "python"
input [
  { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ID" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "FLAGS" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Calls the accumulator with the sequence its inputs name, as Triton's BLS passes
# correlation_id and flags on.
BLS = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            ident = pb_utils.get_input_tensor_by_name(request, "ID").as_numpy().item()
            flags = pb_utils.get_input_tensor_by_name(request, "FLAGS").as_numpy().item()
            call = pb_utils.InferenceRequest(
                model_name="acc",
                inputs=[pb_utils.Tensor("INPUT", value.reshape(1, 1))],
                requested_output_names=["OUTPUT"],
                correlation_id=int(ident),
                flags=int(flags),
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out[0])])
            )
        return responses
"""

BLS_VARIANTS = {
    "exec": BLS,
    "async_exec": BLS.replace("def execute", "async def execute").replace(
        "call.exec()", "await call.async_exec()"
    ),
    # A stateful model is never decoupled: it answers once, as Triton's.
    "exec_decoupled": BLS.replace("call.exec()", "next(iter(call.exec(decoupled=True)))"),
}


@pytest.mark.parametrize("variant", sorted(BLS_VARIANTS))
async def test_bls_passes_correlation_id_and_flags_on(tmp_path: Path, variant: str) -> None:
    write_model(tmp_path, "acc", sequence_pbtxt(), ACCUMULATOR)
    write_model(tmp_path, "bls", BLS_PBTXT, BLS_VARIANTS[variant])

    def call(x: int, sequence_id: int, flags: int) -> dict[str, np.ndarray[Any, Any]]:
        return {
            "INPUT": np.array([x], np.int32),
            "ID": np.array([sequence_id], np.uint64),
            "FLAGS": np.array([flags], np.int32),
        }

    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "acc")
        await load(engine, tmp_path, "bls")
        sums: dict[int, list[int]] = {}

        async def run(sequence_id: int, values: list[int]) -> None:
            for i, x in enumerate(values):
                flags = (START if i == 0 else 0) | (END if i == len(values) - 1 else 0)
                out = await engine.infer("bls", call(x, sequence_id, flags))
                sums.setdefault(sequence_id, []).append(int(out["OUTPUT"][0]))

        async with trio.open_nursery() as nursery:
            for sequence_id in (41, 42):
                nursery.start_soon(run, sequence_id, [sequence_id, 1, 2])
        assert sums == {41: [41, 42, 44], 42: [42, 43, 45]}
        # The sequence ended with its END flag: a request after it is refused.
        with pytest.raises(trioinfer.TrioInferError, match="sequence 41 of model 'acc' ended"):
            await engine.infer("bls", call(1, 41, 0))
        # A flag without an id is the call's error, as a client's would be.
        with pytest.raises(trioinfer.TrioInferError, match="need a sequence_id"):
            await engine.infer("bls", call(1, 0, START))


# -- model_warmup of a sequence model ------------------------------------------------------------


def warmup_pbtxt(start: str) -> str:
    # Triton's model_warmup names "every model input, including control tensors": a
    # sample runs on the instances, outside the sequence batcher.
    controls = [
        ("START", "TYPE_INT32", start),
        ("END", "TYPE_FP32", "zero_data: true"),
        ("READY", "TYPE_BOOL", "zero_data: true"),
        ("CORRID", "TYPE_UINT64", "zero_data: true"),
    ]
    entries = [
        f'{{ key: "{name}" value: {{ data_type: {dtype} dims: [ 1 ] {data} }} }}'
        for name, dtype, data in [("INPUT", "TYPE_INT32", "zero_data: true"), *controls]
    ]
    return f'model_warmup [ {{ name: "s" batch_size: 1 inputs [ {", ".join(entries)} ] }} ]\n'


# The accumulator, starting a sequence on its START control (a warm-up request has no
# flags, as Triton's: it is no request of a sequence).
BY_CONTROL = ACCUMULATOR.replace(
    "if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:", "if start.item():"
)


async def test_warm_up_of_a_sequence_model_gives_its_controls(tmp_path: Path) -> None:
    no_controls = (
        'model_warmup [ { name: "s" batch_size: 1 inputs [ { key: "INPUT" value: '
        "{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ] } ]\n"
    )
    write_model(tmp_path, "gives_none", sequence_pbtxt() + no_controls, ACCUMULATOR)
    repository = ModelRepository(tmp_path)
    # Refused at load, saying what a sample of a sequence model gives.
    with pytest.raises(
        ConfigError,
        match="warm-up sample 's' gives no 'START', 'END', 'READY', 'CORRID', which the "
        "sequence batcher feeds each request",
    ):
        repository.entry("gives_none").config(1)
    # A sample that gives them warms the model up with them: a start flag of 1 from a file.
    (tmp_path / "warm" / "warmup").mkdir(parents=True)
    (tmp_path / "warm" / "warmup" / "one").write_bytes(np.int32(1).tobytes())
    write_model(
        tmp_path, "warm", sequence_pbtxt() + warmup_pbtxt('input_data_file: "one"'), BY_CONTROL
    )
    write_model(tmp_path, "cold", sequence_pbtxt() + warmup_pbtxt("zero_data: true"), BY_CONTROL)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "warm")
        out = await engine.infer("warm", value(5), sequence=SequenceFlags(3, start=True))
        assert int(out["OUTPUT"].sum()) == 5
        # A START of 0 starts nothing: the model's own error fails the load.
        with pytest.raises(trioinfer.BackendError, match=r"warm-up sample 's' failed.*unknown"):
            await load(engine, tmp_path, "cold")


# -- BLS: a correlation id to a model that is not stateful -----------------------------------------

PLAIN_PBTXT = """\
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Doubles its input; the decoupled one answers twice.
DOUBLE = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            out = pb_utils.Tensor("OUTPUT", value * 2)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
"""

DOUBLE_TWICE = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            sender = request.get_response_sender()
            for _ in range(2):
                out = pb_utils.Tensor("OUTPUT", value * 2)
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

BLS_PLAIN_VARIANTS = {
    "exec": (DOUBLE, BLS),
    "async_exec": (DOUBLE, BLS_VARIANTS["async_exec"]),
    "exec_decoupled": (DOUBLE_TWICE, BLS_VARIANTS["exec_decoupled"]),
}


@pytest.mark.parametrize("variant", sorted(BLS_PLAIN_VARIANTS))
async def test_bls_to_a_model_that_is_not_stateful_ignores_the_correlation_id(
    tmp_path: Path, variant: str
) -> None:
    # Triton passes correlation_id and flags to a stateful model's sequence batcher and
    # ignores them for any other; here the call was refused ("model 'acc' is not
    # stateful"), and a decoupled one was sent as a non-streaming call.
    target, bls = BLS_PLAIN_VARIANTS[variant]
    decoupled = "model_transaction_policy { decoupled: true }\n" if target is DOUBLE_TWICE else ""
    write_model(tmp_path, "acc", PLAIN_PBTXT + decoupled, target)
    write_model(tmp_path, "bls", BLS_PBTXT, bls)
    async with trioinfer.open_engine() as engine:
        await load(engine, tmp_path, "acc")
        await load(engine, tmp_path, "bls")
        for sequence_id, flags in ((41, START), (41, 0), (0, START | END), (7, END)):
            out = await engine.infer(
                "bls",
                {
                    "INPUT": np.array([5], np.int32),
                    "ID": np.array([sequence_id], np.uint64),
                    "FLAGS": np.array([flags], np.int32),
                },
            )
            assert out["OUTPUT"].tolist() == [10], (sequence_id, flags)
