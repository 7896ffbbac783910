"""Triton parity over a served repository: config.pbtxt sequences, one model config, log settings.

A Triton-style repository written here (``config.pbtxt`` beside ONNX models
built with ``onnx.helper``) is served by a real ``trioinfer serve``, and
tritonclient (HTTP and gRPC) makes the calls of Triton's
``simple_http_sequence_sync_infer_client.py`` and
``simple_grpc_sequence_stream_infer_client.py`` against it; then the model
configuration both protocols answer, and Triton's log settings.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

import test_sequence
import test_triton
import trioinfer
from test_grpc import TOKEN, WAIT_S, Server, run_server

pytestmark = [pytest.mark.grpc, pytest.mark.triton_config]

SEQUENCE_PBTXT = """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ENDED" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ID" data_type: TYPE_UINT64 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  STRATEGY
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ {
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zeros" }
  } ]
}
instance_group [ { kind: KIND_CPU count: 2 } ]
"""
STRATEGIES = {
    "seq_oldest": "oldest { max_candidate_sequences: 4 }",
    "seq_direct": "direct { }",
}
VALUES = [11, 7, 5, 3, 2, 0, 1]


def write_sequence_model(path: Path) -> None:
    """Triton's simple_sequence with every control: OUTPUT is the running sum while READY.

    OUTPUT = STATE_OUT = (STATE_IN * (1 - START) + INPUT) * READY; ENDED = END;
    ID = CORRID. START is int32, END bool, READY fp32, CORRID uint64: each
    control in its own type, as Triton feeds them.
    """
    shape: list[str | int] = ["batch", 1]

    def tensor(name: str, kind: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, kind, shape)

    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["keep"]),
            helper.make_node("Mul", ["STATE_IN", "keep"], ["carried"]),
            helper.make_node("Add", ["carried", "INPUT"], ["sum"]),
            helper.make_node("Cast", ["READY"], ["ready"], to=TensorProto.INT32),
            helper.make_node("Mul", ["sum", "ready"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
            helper.make_node("Cast", ["END"], ["ENDED"], to=TensorProto.INT32),
            helper.make_node("Identity", ["CORRID"], ["ID"]),
        ],
        "simple_sequence",
        inputs=[
            tensor("INPUT", TensorProto.INT32),
            tensor("START", TensorProto.INT32),
            tensor("END", TensorProto.BOOL),
            tensor("READY", TensorProto.FLOAT),
            tensor("CORRID", TensorProto.UINT64),
            tensor("STATE_IN", TensorProto.INT32),
        ],
        outputs=[
            tensor("OUTPUT", TensorProto.INT32),
            tensor("STATE_OUT", TensorProto.INT32),
            tensor("ENDED", TensorProto.INT32),
            tensor("ID", TensorProto.UINT64),
        ],
        initializer=[helper.make_tensor("one", TensorProto.INT32, [], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, path)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parity") / "repository"
    for name, strategy in STRATEGIES.items():
        write_sequence_model(root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(SEQUENCE_PBTXT.replace("STRATEGY", strategy))
    # Two whose sequence_batching does not match the model: refused at load, saying why.
    write_sequence_model(root / "seq_badtype" / "1" / "model.onnx")
    (root / "seq_badtype" / "config.pbtxt").write_text(
        SEQUENCE_PBTXT.replace("STRATEGY", "").replace(
            "CONTROL_SEQUENCE_READY fp32_false_true", "CONTROL_SEQUENCE_READY int32_false_true"
        )
    )
    write_sequence_model(root / "seq_baddims" / "1" / "model.onnx")
    (root / "seq_baddims" / "config.pbtxt").write_text(
        SEQUENCE_PBTXT.replace("STRATEGY", "").replace(
            "dims: [ 1 ]\n    initial_state { data_type: TYPE_INT32 dims: [ 1 ]",
            "dims: [ 3 ]\n    initial_state { data_type: TYPE_INT32 dims: [ 3 ]",
        )
    )
    # A config.toml model that is stateful, the bundled decoupled model, and one cached.
    (root / "toml_sequence" / "1").mkdir(parents=True)
    (root / "toml_sequence" / "1" / "model.py").write_text(test_sequence.MODEL_PY)
    (root / "toml_sequence" / "config.toml").write_text(test_sequence.CONFIG_TOML)
    shutil.copytree(
        Path(trioinfer.__file__).parent / "examples/repository/repeat_int32", root / "repeat_int32"
    )
    test_triton.write_simple(root / "cached" / "1" / "model.onnx")
    (root / "cached" / "config.toml").write_text(
        "response_cache = true\nversion_policy = { specific = [1] }\n"
    )
    # config.pbtxt with queue policies, a version policy and parameters; an ensemble over it.
    test_triton.write_simple(root / "simple" / "1" / "model.onnx")
    (root / "simple" / "config.pbtxt").write_text(SIMPLE_PBTXT)
    (root / "ensemble" / "1").mkdir(parents=True)
    (root / "ensemble" / "config.pbtxt").write_text(test_triton.ENSEMBLE_PBTXT)
    # The bundled pipeline, declared in config.toml, and the models of its steps.
    examples = Path(trioinfer.__file__).parent / "examples/repository"
    for name in ("read_digit", "scale_image", "digits", "digit_names", "accumulator"):
        shutil.copytree(examples / name, root / name)
    return root


SIMPLE_PBTXT = """
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy { latest { num_versions: 2 } }
dynamic_batching {
  preferred_batch_size: [ 4 ]
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy { max_queue_size: 64 default_timeout_microseconds: 5000000 }
  priority_queue_policy { key: 2 value { max_queue_size: 8 } }
}
parameters { key: "inter_op_threads" value { string_value: "1" } }
response_cache { enable: false }
"""


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(repository, "--admin-token", TOKEN, "--cache-size", "1MB", log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def _http(server: Server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


# -- sequences from config.pbtxt -----------------------------------------------------------


@pytest.mark.sequence
@pytest.mark.parametrize("model", sorted(STRATEGIES))
def test_simple_http_sequence_sync_infer_client(server: Server, model: str) -> None:
    """The calls of simple_http_sequence_sync_infer_client.py: two sequences, interleaved."""
    client = _http(server)
    sequences = {1000: [0, *VALUES], 1001: [100, *[-v for v in VALUES]]}
    got: dict[int, list[tuple[int, int, int]]] = {key: [] for key in sequences}
    for step in range(len(VALUES) + 1):
        for sequence_id, values in sequences.items():
            data = np.full((1, 1), values[step], dtype=np.int32)
            infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
            infer_input.set_data_from_numpy(data)
            result = client.infer(
                model,
                [infer_input],
                outputs=[httpclient.InferRequestedOutput(n) for n in ("OUTPUT", "ENDED", "ID")],
                sequence_id=sequence_id,
                sequence_start=step == 0,
                sequence_end=step == len(values) - 1,
            )
            got[sequence_id].append(
                (
                    int(result.as_numpy("OUTPUT")[0][0]),
                    int(result.as_numpy("ENDED")[0][0]),
                    int(result.as_numpy("ID")[0][0]),
                )
            )
    for sequence_id, values in sequences.items():
        last = len(values) - 1
        expected = [
            (int(total), int(i == last), sequence_id) for i, total in enumerate(np.cumsum(values))
        ]
        assert got[sequence_id] == expected
    with pytest.raises(InferenceServerException, match="ended with its last request"):
        client.infer(model, [infer_input], sequence_id=1000)
    with pytest.raises(InferenceServerException, match="integer sequence ids"):
        client.infer(model, [infer_input], sequence_id="a-string", sequence_start=True)
    client.close()


@pytest.mark.sequence
@pytest.mark.parametrize("model", sorted(STRATEGIES))
def test_simple_grpc_sequence_stream_infer_client(server: Server, model: str) -> None:
    """The calls of simple_grpc_sequence_stream_infer_client.py: two sequences on one stream."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    values = {2001: [0, *VALUES], 2002: [100, *[-v for v in VALUES]]}
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for step in range(len(VALUES) + 1):
            for sequence_id, sent in values.items():
                infer_input = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                infer_input.set_data_from_numpy(np.full((1, 1), sent[step], dtype=np.int32))
                client.async_stream_infer(
                    model,
                    [infer_input],
                    request_id=f"{sequence_id}_{step}",
                    outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                    sequence_id=sequence_id,
                    sequence_start=step == 0,
                    sequence_end=step == len(sent) - 1,
                )
        got: dict[int, list[int]] = {2001: [], 2002: []}
        for _ in range(2 * (len(VALUES) + 1)):
            result, error = answers.get(timeout=WAIT_S)
            assert error is None, error
            sequence_id = int(result.get_response().id.split("_")[0])
            got[sequence_id].append(int(result.as_numpy("OUTPUT")[0][0]))
        client.stop_stream()
    for sequence_id, sent in values.items():
        assert got[sequence_id] == list(np.cumsum(sent))


def test_controls_and_state_are_not_the_callers_tensors(server: Server) -> None:
    client = _http(server)
    metadata = client.get_model_metadata("seq_oldest")
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT", "ENDED", "ID"]
    client.close()


# -- one model config, two protocols -------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ("seq_oldest", "sequence_batching"),
        ("seq_direct", "sequence_batching"),
        ("toml_sequence", "sequence_batching"),
        ("repeat_int32", "model_transaction_policy"),
        ("cached", "response_cache"),
        ("simple", "dynamic_batching"),
        ("ensemble", "ensemble_scheduling"),
    ],
)
def test_http_and_grpc_answer_the_same_model_config(server: Server, model: str, field: str) -> None:
    """GET /v2/models/{m}/config and gRPC ModelConfig: one Triton-shaped config, every field."""
    client = _http(server)
    http = client.get_model_config(model)
    client.close()
    with grpcclient.InferenceServerClient(server.grpc) as grpc_client:
        answer = grpc_client.get_model_config(model).config
    # What HTTP answers, read strictly as Triton's ModelConfig ...
    expected = json_format.ParseDict(http, model_config_pb2.ModelConfig())
    # ... is what gRPC answers, field for field.
    assert answer == expected
    assert answer.HasField(field)


def test_every_models_config_parses_strictly_as_tritons(server: Server) -> None:
    """Triton's Model Analyzer reads /config with ParseDict, no unknown field allowed."""
    client = _http(server)
    ready = sorted(
        row["name"] for row in client.get_model_repository_index() if row["state"] == "READY"
    )
    # Every kind served: ONNX and Python, config.pbtxt and config.toml, a pipeline and an
    # ensemble, stateful, decoupled, cached, batched and not; the bundled models among them.
    assert {*os.listdir(trioinfer.example_repository()), "ensemble", "seq_oldest"} <= set(ready)
    with grpcclient.InferenceServerClient(server.grpc) as grpc_client:
        for model in ready:
            http = client.get_model_config(model)
            strict = json_format.ParseDict(http, model_config_pb2.ModelConfig())
            assert grpc_client.get_model_config(model).config == strict, model
            # trioinfer's own settings are parameters, with its prefix.
            own = [key for key in http["parameters"] if key.startswith("trioinfer.")]
            assert "trioinfer.batcher" in own, model
    client.close()


@pytest.mark.pipeline
@pytest.mark.parametrize(
    ("model", "platform", "configured"),
    [
        ("ensemble", "ensemble", "ensemble"),  # config.pbtxt's platform: "ensemble"
        ("read_digit", "ensemble", "ensemble"),  # a config.toml pipeline: Triton's ensemble
        ("simple", "onnxruntime_onnx", "onnxruntime_onnx"),
        ("digits", "onnxruntime_onnx", "onnxruntime_onnx"),  # config.toml, ONNX Runtime
        # A Python model: as Triton's python backend models, no platform in the config,
        # and the backend's name in the metadata (Triton's "platform, else backend").
        ("scale_image", "python", ""),
    ],
)
def test_platform_is_tritons_over_http_and_grpc(
    server: Server, model: str, platform: str, configured: str
) -> None:
    """Model metadata and config name the platform as Triton does: pipelines are ensembles."""
    client = _http(server)
    try:
        assert client.get_model_metadata(model)["platform"] == platform
        assert client.get_model_config(model)["platform"] == configured
    finally:
        client.close()
    with grpcclient.InferenceServerClient(server.grpc) as grpc_client:
        assert grpc_client.get_model_metadata(model).platform == platform
        assert grpc_client.get_model_config(model).config.platform == configured


def test_the_grpc_model_config_holds_what_triton_configures(server: Server) -> None:
    with grpcclient.InferenceServerClient(server.grpc) as client:
        simple = client.get_model_config("simple").config
        sequence = client.get_model_config("seq_oldest").config
        cached = client.get_model_config("cached").config
        decoupled = client.get_model_config("repeat_int32").config
        toml = client.get_model_config("toml_sequence").config
    batching = simple.dynamic_batching
    assert batching.default_queue_policy.max_queue_size == 64
    assert batching.default_queue_policy.default_timeout_microseconds == 5_000_000
    assert batching.priority_queue_policy[2].max_queue_size == 8
    assert simple.version_policy.latest.num_versions == 2
    assert simple.parameters["inter_op_threads"].string_value == "1"
    assert simple.HasField("response_cache")
    assert not simple.response_cache.enable
    kinds = {c.name: c.control[0] for c in sequence.sequence_batching.control_input}
    assert list(kinds["READY"].fp32_false_true) == [0.0, 1.0]
    assert list(kinds["END"].bool_false_true) == [False, True]
    assert kinds["CORRID"].data_type == model_config_pb2.TYPE_UINT64
    assert sequence.sequence_batching.oldest.max_candidate_sequences == 4
    assert sequence.sequence_batching.state[0].initial_state[0].zero_data
    assert cached.response_cache.enable
    assert list(cached.version_policy.specific.versions) == [1]
    assert decoupled.model_transaction_policy.decoupled
    assert toml.sequence_batching.max_sequence_idle_microseconds == 60_000_000
    assert toml.sequence_batching.state[0].initial_state[0].zero_data
    # A config.toml model's controls and state, in Triton's terms, from the model's types.
    toml_sequence = json_format.MessageToDict(
        toml.sequence_batching, preserving_proto_field_name=True
    )
    toml_sequence["state"][0].pop("initial_state")
    assert toml_sequence == {
        "max_sequence_idle_microseconds": "60000000",
        "oldest": {},
        "control_input": [
            {
                "name": "START",
                # kind START is the enum's zero, which proto3 leaves unsaid
                "control": [{"int32_false_true": [0, 1]}],
            }
        ],
        "state": [
            {
                "input_name": "STATE_IN",
                "output_name": "STATE_OUT",
                "data_type": "TYPE_INT32",
                "dims": ["1"],
            }
        ],
    }


# -- log settings ----------------------------------------------------------------------------

AUTH = {"authorization": f"Bearer {TOKEN}"}


def _grpc_settings(message: Any) -> dict[str, Any]:
    return {
        key: getattr(value, value.WhichOneof("parameter_choice"))
        for key, value in message.settings.items()
    }


def _log_lines(server: Server, fragment: str) -> list[str]:
    return [line for line in server.log_text().splitlines() if fragment in line]


def test_log_settings_over_http_and_grpc_set_trioinfers_loggers(server: Server) -> None:
    """Triton's logging extension: the calls tritonclient makes, and what they change."""
    client = _http(server)
    assert client.get_log_settings() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
        "access_log": False,  # trioinfer's key: the request log
    }
    # Info off: loading a model says nothing any more.
    after = client.update_log_settings({"log_info": False}, headers=AUTH)
    assert (after["log_info"], after["log_warning"]) == (False, True)
    client.unload_model("repeat_int32", headers=AUTH)
    assert not _log_lines(server, "unloaded model 'repeat_int32'")
    with grpcclient.InferenceServerClient(server.grpc) as grpc_client:
        assert not _grpc_settings(grpc_client.get_log_settings())["log_info"]
        # Info back on, with ISO 8601 times (UTC), over gRPC; HTTP sees the same.
        answer = grpc_client.update_log_settings(
            {"log_info": True, "log_format": "ISO8601"}, headers=AUTH
        )
        assert _grpc_settings(answer)["log_format"] == "ISO8601"
        assert client.get_log_settings()["log_format"] == "ISO8601"
        grpc_client.load_model("repeat_int32", headers=AUTH)
        [line] = _log_lines(server, "loaded model 'repeat_int32'")[-1:]
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ trioinfer\.server INFO ", line), line
        # Verbose: debug records pass too.
        answer = grpc_client.update_log_settings({"log_verbose_level": 1}, headers=AUTH)
        assert _grpc_settings(answer)["log_verbose_level"] == 1
    assert (
        client.update_log_settings({"log_verbose_level": 0, "log_format": "default"}, headers=AUTH)
        == client.get_log_settings()
    )
    client.close()


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"log_file": "/tmp/server.log"}, "log_file is not supported"),
        ({"log_warning": False}, "log_info needs log_warning"),
        ({"log_verbose_level": 1, "log_info": False}, "log_verbose_level needs log_info"),
        ({"log_format": "syslog"}, "log_format must be 'default', 'ISO8601' or 'json'"),
        ({"log_rotation": True}, "unknown log setting 'log_rotation'"),
    ],
)
def test_log_settings_the_server_cannot_honour_are_refused(
    server: Server, settings: dict[str, Any], fragment: str
) -> None:
    client = _http(server)
    before = client.get_log_settings()
    with pytest.raises(InferenceServerException, match=fragment) as failed:
        client.update_log_settings(settings, headers=AUTH)
    assert failed.value.status() == "400"
    with grpcclient.InferenceServerClient(server.grpc) as grpc_client:
        with pytest.raises(InferenceServerException, match=fragment) as refused:
            grpc_client.update_log_settings(settings, headers=AUTH)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.get_log_settings() == before
    client.close()


def test_changing_log_settings_needs_the_admin_token(server: Server) -> None:
    client = _http(server)
    with pytest.raises(InferenceServerException) as failed:
        client.update_log_settings({"log_info": False})
    assert failed.value.status() == "401"
    client.close()
    with grpcclient.InferenceServerClient(server.grpc) as grpc_client:
        with pytest.raises(InferenceServerException) as refused:
            grpc_client.update_log_settings({"log_info": False})
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        assert _grpc_settings(grpc_client.get_log_settings())["log_info"]


def test_log_settings_map_onto_one_level_and_leave_a_foreign_handler_alone() -> None:
    """In process (pytest owns logging here): the level mapping, and log_format refused."""
    from trioinfer.server._logging import log_settings, update_log_settings

    logger = logging.getLogger("trioinfer")
    before = logger.level
    off = {"log_info": False, "log_warning": False, "log_error": False, "log_verbose_level": 0}
    try:
        for settings, level in [
            ({**off, "log_error": True}, logging.ERROR),
            ({"log_warning": True}, logging.WARNING),
            ({"log_info": True}, logging.INFO),
            ({"log_verbose_level": 2}, logging.DEBUG),
            (off, logging.CRITICAL),
        ]:
            update_log_settings(settings)
            assert logger.level == level, settings
        assert log_settings() == {
            **off,
            "log_file": "",
            "log_format": "default",
            "access_log": False,
        }
        with pytest.raises(trioinfer.ConfigError, match="does not own the log handler"):
            update_log_settings({"log_format": "ISO8601"})
        update_log_settings({"log_format": "default", "log_file": ""})  # what it is: fine
        with pytest.raises(trioinfer.ConfigError, match="access_log must be true or false"):
            update_log_settings({"access_log": "yes"})
    finally:
        logger.setLevel(before)


def test_sequence_batching_that_does_not_fit_the_model_is_refused_at_load(server: Server) -> None:
    client = _http(server)
    reasons = {
        entry["name"]: entry.get("reason", "")
        for entry in client.get_model_repository_index()
        if entry.get("state") == "UNAVAILABLE"
    }
    client.close()
    assert (
        "sequence_batching control (int32_false_true) 'READY' is TYPE_INT32; the model's input "
        "is TYPE_FP32" in reasons["seq_badtype"]
    )
    # (The sequence batcher refuses it, for any config: the state is fed unchecked.)
    assert (
        "sequence.state gives state input 'STATE_IN' the shape [3], but the input is "
        "int32[batch, 1]" in reasons["seq_baddims"]
    )


@pytest.mark.pipeline
def test_a_pipeline_round_trips_through_its_config(server: Server, repository: Path) -> None:
    """read_digit's config, loaded under another name as Triton loads an ensemble, answers alike."""
    client = _http(server)
    config = client.get_model_config("read_digit")
    assert config["platform"] == "ensemble"
    assert config["max_batch_size"] == 32
    assert config["ensemble_scheduling"]["step"][1] == {
        "model_name": "digits",
        "model_version": -1,
        "input_map": {"input": "ROW"},
        "output_map": {"probabilities": "PROBABILITIES"},
    }
    # As Triton loads an ensemble: a directory holding only a version directory, and the
    # configuration in the load request.
    (repository / "read_digit_again" / "1").mkdir(parents=True)
    copy = {**config, "name": "read_digit_again"}
    try:
        client.load_model("read_digit_again", config=json.dumps(copy), headers=AUTH)
        assert client.get_model_config("read_digit_again") == copy
        images, _ = trioinfer.digits_samples()
        image = httpclient.InferInput("IMAGE", [4, 8, 8], "UINT8")
        image.set_data_from_numpy(images[:4].reshape(4, 8, 8).astype(np.uint8))
        answers = [
            client.infer(model, [image]).as_numpy("NAME").tolist()
            for model in ("read_digit", "read_digit_again")
        ]
        assert answers[0] == answers[1]
        assert len(answers[0]) == 4
        # A step's model loaded again reloads the pipelines over it, this one with the
        # override that configures it (there is no file to read it from).
        client.load_model("digits", headers=AUTH)
        assert client.is_model_ready("read_digit_again")
        assert client.get_model_config("read_digit_again") == copy
        again = client.infer("read_digit_again", [image]).as_numpy("NAME").tolist()
        assert again == answers[0]
        assert "could not reload pipeline" not in server.log_text()
    finally:
        client.unload_model("read_digit_again", headers=AUTH)
        shutil.rmtree(repository / "read_digit_again")
        client.close()


@pytest.mark.sequence
@pytest.mark.parametrize("model", ["toml_sequence", "seq_oldest"])
def test_a_sequence_models_config_round_trips_as_it_is(
    server: Server, repository: Path, model: str
) -> None:
    """GET config, load it under another name as the override, GET again: the same answer,
    the first time too (a state's dims, worked out from the model, are not read back as a
    shape the model's own table did not set)."""
    client = _http(server)
    config = client.get_model_config(model)
    again = f"{model}_again"
    shutil.copytree(repository / model, repository / again)
    copy = {**config, "name": again}
    try:
        client.load_model(again, config=json.dumps(copy), headers=AUTH)
        assert client.get_model_config(again) == copy
        client.load_model(again, config=json.dumps(copy), headers=AUTH)
        assert client.get_model_config(again) == copy
    finally:
        client.unload_model(again, headers=AUTH)
        shutil.rmtree(repository / again)
        client.close()


def test_trioinfer_settings_show_and_load_back(server: Server) -> None:
    """A config.toml model's own settings show as trioinfer.* parameters, and load back."""
    client = _http(server)
    try:
        override = {
            "max_queue_size": 7,
            "scheduler": "priority",
            "queue_timeouts": {"0": 0.5},
            "instances": [{"device": "cpu", "count": 2, "capacity": 3.0, "threads": 1}],
        }
        client.load_model("cached", config=json.dumps(override), headers=AUTH)
        config = client.get_model_config("cached")
        own = {
            key: json.loads(value["string_value"])
            for key, value in config["parameters"].items()
            if key not in ("trioinfer.scheduler", "trioinfer.batcher", "trioinfer.fallback")
        }
        assert config["parameters"]["trioinfer.scheduler"] == {"string_value": "priority"}
        assert own["trioinfer.max_queue_size"] == 7
        assert own["trioinfer.queue_timeouts"] == {"0": 0.5}
        assert own["trioinfer.instances"] == override["instances"]
        # The whole answer sent back (as Triton's clients do, a field changed) keeps them.
        changed = {**config, "response_cache": {"enable": False}}
        client.load_model("cached", config=json.dumps(changed), headers=AUTH)
        assert client.get_model_config("cached") == changed
        # A trioinfer.* parameter that is not one of its settings is named.
        wrong = {"parameters": {"trioinfer.shceduler": {"string_value": "fifo"}}}
        with pytest.raises(InferenceServerException, match=r"'trioinfer.shceduler' is not a"):
            client.load_model("cached", config=json.dumps(wrong), headers=AUTH)
    finally:
        client.load_model("cached", headers=AUTH)
        client.close()


def test_the_grpc_proto_holds_every_config_field_trioinfer_reads() -> None:
    """gRPC parses /config's answer strictly: its ModelConfig must have every field answered.

    The answer holds what config.pbtxt may set (the fields trioinfer reads), printed
    at their defaults when unset, and model_transaction_policy.
    """
    from trioinfer.server import _grpc_proto
    from trioinfer.server._triton import _model_config_class

    def walk(read: Any, served: Any, where: str) -> None:
        for field in read.fields:
            other = served.fields_by_name.get(field.name)
            assert other is not None, f"{where}.{field.name} is not in grpc_service.proto"
            assert (field.number, field.type) == (other.number, other.type), where
            if field.message_type is not None:
                walk(field.message_type, other.message_type, f"{where}.{field.name}")

    served = _grpc_proto.POOL.FindMessageTypeByName("inference.ModelConfig")
    walk(_model_config_class().DESCRIPTOR, served, "ModelConfig")
    assert "model_transaction_policy" in served.fields_by_name
