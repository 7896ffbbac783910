"""Triton model configurations: ``config.pbtxt`` read with protobuf, mapped onto trioinfer's config.

A Triton model repository is served as it is: a model directory holding
``config.pbtxt`` (and no ``config.toml``) is read here. The message
definitions are the project's own subset of Triton's ``model_config.proto``,
with Triton's field numbers, built once with protobuf's descriptor API (the
table below is the one place they are written); a field outside the subset
is refused by the parser with its name and line, and a field inside it that
trioinfer cannot honour is refused by `TritonModel.parse` with its name.
Nothing is ignored silently: what is accepted but has no effect is logged as
a note (``preserve_ordering``, ``allow_timeout_override``, ``oldest``'s
``preferred_batch_size``, ``optimization``'s ``priority``, ``cuda`` and pinned
memory). ``optimization``'s graph level and GPU accelerators, and the
parameters Triton's ONNX Runtime backend reads, become the ONNX Runtime
backend's options (`_optimization`, `_onnxruntime_parameters`); an input's or
output's ``reshape`` and an input's ``optional`` reach its ``inputs`` and
``outputs`` options (`_declared_shapes`). ``sequence_batching`` becomes the ``[sequence]``
table of the sequence batcher (`_sequence`); the types and dims it names are
checked against the model's inputs once it loads (``server/_models.py``).

The same keys arrive as JSON in repository load overrides
(``{"max_batch_size": 16}``): `TritonModel.parse` reads either form.
``GET .../config`` answers trioinfer's own settings as ``parameters`` named
``trioinfer.<setting>`` (`own_parameters`); read back, they fill what
Triton's fields leave unsaid, and are not backend options.
Protobuf is the ``triton`` extra; without it, meeting a ``config.pbtxt``
is a `ConfigError` that names the extra.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Collection, Mapping
from typing import Any, Final, cast

import attrs

from .._config import MAX_INSTANCES, PIPELINE, ModelConfig
from .._exceptions import ConfigError

__all__ = ["OWN_PREFIX", "TRITON_FIELDS", "TritonModel", "own_parameters", "with_defaults"]

_EXTRA: Final = (
    "reading a Triton config.pbtxt needs protobuf: install the 'triton' extra "
    "(pip install 'trioinfer[triton]')"
)

# -- the message definitions: a subset of Triton's model_config.proto -------------------------
# (name, number, type, label, type name). Types are descriptor_pb2.FieldDescriptorProto's:
# 9 string, 5 int32, 3 int64, 13 uint32, 4 uint64, 2 float, 8 bool, 11 message, 14 enum;
# label 1 optional, 3 repeated. A map is a repeated nested *Entry message (key 1, value 2).
_S, _I32, _I64, _U32, _U64, _F, _B, _M, _E = 9, 5, 3, 13, 4, 2, 8, 11, 14
_ONE, _MANY = 1, 3

_ENUMS: Final[dict[str, list[tuple[str, int]]]] = {
    "DataType": [
        (name, number)
        for number, name in enumerate(
            [
                *("TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32"),
                *("TYPE_UINT64", "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64"),
                *("TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16"),
            ]
        )
    ],
}
_NESTED_ENUMS: Final[dict[str, dict[str, list[tuple[str, int]]]]] = {
    "ModelInstanceGroup": {
        "Kind": [("KIND_AUTO", 0), ("KIND_GPU", 1), ("KIND_CPU", 2), ("KIND_MODEL", 3)]
    },
    "ModelInput": {"Format": [("FORMAT_NONE", 0), ("FORMAT_NHWC", 1), ("FORMAT_NCHW", 2)]},
    "ModelQueuePolicy": {"TimeoutAction": [("REJECT", 0), ("DELAY", 1)]},
    "ModelOptimizationPolicy": {
        "ModelPriority": [("PRIORITY_DEFAULT", 0), ("PRIORITY_MAX", 1), ("PRIORITY_MIN", 2)]
    },
    "ModelSequenceBatching.Control": {
        "Kind": [
            ("CONTROL_SEQUENCE_START", 0),
            ("CONTROL_SEQUENCE_READY", 1),
            ("CONTROL_SEQUENCE_END", 2),
            ("CONTROL_SEQUENCE_CORRID", 3),
        ]
    },
}
_ACCELERATOR: Final = "ModelOptimizationPolicy.ExecutionAccelerators.Accelerator"
#: message -> fields; a field is (name, number, type, label, type name or "", oneof or "").
_MESSAGES: Final[dict[str, list[tuple[str, int, int, int, str, str]]]] = {
    "ModelTensorReshape": [("shape", 1, _I64, _MANY, "", "")],
    "ModelInput": [
        ("name", 1, _S, _ONE, "", ""),
        ("data_type", 2, _E, _ONE, "DataType", ""),
        ("format", 3, _E, _ONE, "ModelInput.Format", ""),
        ("dims", 4, _I64, _MANY, "", ""),
        ("reshape", 5, _M, _ONE, "ModelTensorReshape", ""),
        ("is_shape_tensor", 6, _B, _ONE, "", ""),
        ("allow_ragged_batch", 7, _B, _ONE, "", ""),
        ("optional", 8, _B, _ONE, "", ""),
    ],
    "ModelOutput": [
        ("name", 1, _S, _ONE, "", ""),
        ("data_type", 2, _E, _ONE, "DataType", ""),
        ("dims", 3, _I64, _MANY, "", ""),
        ("label_filename", 4, _S, _ONE, "", ""),
        ("reshape", 5, _M, _ONE, "ModelTensorReshape", ""),
        ("is_shape_tensor", 6, _B, _ONE, "", ""),
    ],
    "ModelVersionPolicy.Latest": [("num_versions", 1, _U32, _ONE, "", "")],
    "ModelVersionPolicy.All": [],
    "ModelVersionPolicy.Specific": [("versions", 1, _I64, _MANY, "", "")],
    "ModelVersionPolicy": [
        ("latest", 1, _M, _ONE, "ModelVersionPolicy.Latest", "policy_choice"),
        ("all", 2, _M, _ONE, "ModelVersionPolicy.All", "policy_choice"),
        ("specific", 3, _M, _ONE, "ModelVersionPolicy.Specific", "policy_choice"),
    ],
    "ModelInstanceGroup": [
        ("name", 1, _S, _ONE, "", ""),
        ("count", 2, _I32, _ONE, "", ""),
        ("gpus", 3, _I32, _MANY, "", ""),
        ("kind", 4, _E, _ONE, "ModelInstanceGroup.Kind", ""),
        ("profile", 5, _S, _MANY, "", ""),
        ("passive", 7, _B, _ONE, "", ""),
        ("host_policy", 9, _S, _ONE, "", ""),
        ("rate_limiter", 6, _M, _ONE, "ModelRateLimiter", ""),
    ],
    "ModelRateLimiter": [
        ("resources", 1, _M, _MANY, "ModelRateLimiter.Resource", ""),
        ("priority", 2, _U32, _ONE, "", ""),
    ],
    "ModelRateLimiter.Resource": [
        ("name", 1, _S, _ONE, "", ""),
        ("global", 2, _B, _ONE, "", ""),
        ("count", 3, _U32, _ONE, "", ""),
    ],
    "ModelQueuePolicy": [
        ("timeout_action", 1, _E, _ONE, "ModelQueuePolicy.TimeoutAction", ""),
        ("default_timeout_microseconds", 2, _U64, _ONE, "", ""),
        ("allow_timeout_override", 3, _B, _ONE, "", ""),
        ("max_queue_size", 4, _U32, _ONE, "", ""),
    ],
    "ModelDynamicBatching.PriorityQueuePolicyEntry": [
        ("key", 1, _U64, _ONE, "", ""),
        ("value", 2, _M, _ONE, "ModelQueuePolicy", ""),
    ],
    "ModelDynamicBatching": [
        ("preferred_batch_size", 1, _I32, _MANY, "", ""),
        ("max_queue_delay_microseconds", 2, _U64, _ONE, "", ""),
        ("preserve_ordering", 3, _B, _ONE, "", ""),
        ("priority_levels", 4, _U64, _ONE, "", ""),
        ("default_priority_level", 5, _U64, _ONE, "", ""),
        ("default_queue_policy", 6, _M, _ONE, "ModelQueuePolicy", ""),
        (
            "priority_queue_policy",
            7,
            _M,
            _MANY,
            "ModelDynamicBatching.PriorityQueuePolicyEntry",
            "",
        ),
    ],
    "ModelEnsembling.Step.InputMapEntry": [
        ("key", 1, _S, _ONE, "", ""),
        ("value", 2, _S, _ONE, "", ""),
    ],
    "ModelEnsembling.Step.OutputMapEntry": [
        ("key", 1, _S, _ONE, "", ""),
        ("value", 2, _S, _ONE, "", ""),
    ],
    "ModelEnsembling.Step": [
        ("model_name", 1, _S, _ONE, "", ""),
        ("model_version", 2, _I64, _ONE, "", ""),
        ("input_map", 3, _M, _MANY, "ModelEnsembling.Step.InputMapEntry", ""),
        ("output_map", 4, _M, _MANY, "ModelEnsembling.Step.OutputMapEntry", ""),
    ],
    "ModelEnsembling": [("step", 1, _M, _MANY, "ModelEnsembling.Step", "")],
    "ModelSequenceBatching.Control": [
        ("kind", 1, _E, _ONE, "ModelSequenceBatching.Control.Kind", ""),
        ("int32_false_true", 2, _I32, _MANY, "", ""),
        ("fp32_false_true", 3, _F, _MANY, "", ""),
        ("data_type", 4, _E, _ONE, "DataType", ""),
        ("bool_false_true", 5, _B, _MANY, "", ""),
    ],
    "ModelSequenceBatching.ControlInput": [
        ("name", 1, _S, _ONE, "", ""),
        ("control", 2, _M, _MANY, "ModelSequenceBatching.Control", ""),
    ],
    "ModelSequenceBatching.InitialState": [
        ("data_type", 1, _E, _ONE, "DataType", ""),
        ("dims", 2, _I64, _MANY, "", ""),
        ("zero_data", 3, _B, _ONE, "", "state_data"),
        ("data_file", 4, _S, _ONE, "", "state_data"),
        ("name", 5, _S, _ONE, "", ""),
    ],
    "ModelSequenceBatching.State": [
        ("input_name", 1, _S, _ONE, "", ""),
        ("output_name", 2, _S, _ONE, "", ""),
        ("data_type", 3, _E, _ONE, "DataType", ""),
        ("dims", 4, _I64, _MANY, "", ""),
        ("initial_state", 5, _M, _MANY, "ModelSequenceBatching.InitialState", ""),
        ("use_same_buffer_for_input_output", 6, _B, _ONE, "", ""),
        ("use_growable_memory", 7, _B, _ONE, "", ""),
    ],
    "ModelSequenceBatching.StrategyDirect": [
        ("max_queue_delay_microseconds", 1, _U64, _ONE, "", ""),
        ("minimum_slot_utilization", 2, _F, _ONE, "", ""),
    ],
    "ModelSequenceBatching.StrategyOldest": [
        ("max_candidate_sequences", 1, _I32, _ONE, "", ""),
        ("preferred_batch_size", 2, _I32, _MANY, "", ""),
        ("max_queue_delay_microseconds", 3, _U64, _ONE, "", ""),
        ("preserve_ordering", 4, _B, _ONE, "", ""),
    ],
    "ModelSequenceBatching": [
        ("max_sequence_idle_microseconds", 1, _U64, _ONE, "", ""),
        ("control_input", 2, _M, _MANY, "ModelSequenceBatching.ControlInput", ""),
        (
            "direct",
            3,
            _M,
            _ONE,
            "ModelSequenceBatching.StrategyDirect",
            "strategy_choice",
        ),
        (
            "oldest",
            4,
            _M,
            _ONE,
            "ModelSequenceBatching.StrategyOldest",
            "strategy_choice",
        ),
        ("state", 5, _M, _MANY, "ModelSequenceBatching.State", ""),
        ("iterative_sequence", 6, _B, _ONE, "", ""),
    ],
    "ModelParameter": [("string_value", 1, _S, _ONE, "", "")],
    "ModelOptimizationPolicy.Graph": [("level", 1, _I32, _ONE, "", "")],
    "ModelOptimizationPolicy.Cuda": [
        ("graphs", 1, _B, _ONE, "", ""),
        ("busy_wait_events", 2, _B, _ONE, "", ""),
        ("output_copy_stream", 4, _B, _ONE, "", ""),
    ],
    "ModelOptimizationPolicy.ExecutionAccelerators.Accelerator.ParametersEntry": [
        ("key", 1, _S, _ONE, "", ""),
        ("value", 2, _S, _ONE, "", ""),
    ],
    "ModelOptimizationPolicy.ExecutionAccelerators.Accelerator": [
        ("name", 1, _S, _ONE, "", ""),
        ("parameters", 2, _M, _MANY, f"{_ACCELERATOR}.ParametersEntry", ""),
    ],
    "ModelOptimizationPolicy.ExecutionAccelerators": [
        ("gpu_execution_accelerator", 1, _M, _MANY, _ACCELERATOR, ""),
        ("cpu_execution_accelerator", 2, _M, _MANY, _ACCELERATOR, ""),
    ],
    "ModelOptimizationPolicy.PinnedMemoryBuffer": [("enable", 1, _B, _ONE, "", "")],
    "ModelOptimizationPolicy": [
        ("graph", 1, _M, _ONE, "ModelOptimizationPolicy.Graph", ""),
        ("priority", 2, _E, _ONE, "ModelOptimizationPolicy.ModelPriority", ""),
        ("cuda", 3, _M, _ONE, "ModelOptimizationPolicy.Cuda", ""),
        (
            "execution_accelerators",
            4,
            _M,
            _ONE,
            "ModelOptimizationPolicy.ExecutionAccelerators",
            "",
        ),
        ("input_pinned_memory", 5, _M, _ONE, "ModelOptimizationPolicy.PinnedMemoryBuffer", ""),
        ("output_pinned_memory", 6, _M, _ONE, "ModelOptimizationPolicy.PinnedMemoryBuffer", ""),
    ],
    "ModelResponseCache": [("enable", 1, _B, _ONE, "", "")],
    "ModelWarmup.Input": [
        ("data_type", 1, _E, _ONE, "DataType", ""),
        ("dims", 2, _I64, _MANY, "", ""),
        ("zero_data", 3, _B, _ONE, "", "input_data_type"),
        ("random_data", 4, _B, _ONE, "", "input_data_type"),
        ("input_data_file", 5, _S, _ONE, "", "input_data_type"),
    ],
    "ModelWarmup.InputsEntry": [
        ("key", 1, _S, _ONE, "", ""),
        ("value", 2, _M, _ONE, "ModelWarmup.Input", ""),
    ],
    "ModelWarmup": [
        ("name", 1, _S, _ONE, "", ""),
        ("batch_size", 2, _U32, _ONE, "", ""),
        ("inputs", 3, _M, _MANY, "ModelWarmup.InputsEntry", ""),
        ("count", 4, _U32, _ONE, "", ""),
    ],
    "ModelTransactionPolicy": [("decoupled", 1, _B, _ONE, "", "")],
    "ModelConfig.ParametersEntry": [
        ("key", 1, _S, _ONE, "", ""),
        ("value", 2, _M, _ONE, "ModelParameter", ""),
    ],
    "ModelConfig": [
        ("name", 1, _S, _ONE, "", ""),
        ("platform", 2, _S, _ONE, "", ""),
        ("version_policy", 3, _M, _ONE, "ModelVersionPolicy", ""),
        ("max_batch_size", 4, _I32, _ONE, "", ""),
        ("input", 5, _M, _MANY, "ModelInput", ""),
        ("output", 6, _M, _MANY, "ModelOutput", ""),
        ("instance_group", 7, _M, _MANY, "ModelInstanceGroup", ""),
        ("default_model_filename", 8, _S, _ONE, "", ""),
        ("dynamic_batching", 11, _M, _ONE, "ModelDynamicBatching", "scheduling_choice"),
        ("optimization", 12, _M, _ONE, "ModelOptimizationPolicy", ""),
        ("sequence_batching", 13, _M, _ONE, "ModelSequenceBatching", "scheduling_choice"),
        ("parameters", 14, _M, _MANY, "ModelConfig.ParametersEntry", ""),
        ("ensemble_scheduling", 15, _M, _ONE, "ModelEnsembling", "scheduling_choice"),
        ("model_warmup", 16, _M, _MANY, "ModelWarmup", ""),
        ("backend", 17, _S, _ONE, "", ""),
        ("model_transaction_policy", 19, _M, _ONE, "ModelTransactionPolicy", ""),
        ("response_cache", 24, _M, _ONE, "ModelResponseCache", ""),
    ],
}

#: ModelConfig's max_queue_size when nothing sets one.
_DEFAULT_QUEUE_SIZE: Final = cast(int, attrs.fields(ModelConfig).max_queue_size.default)

#: The most ``dynamic_batching.priority_levels`` a model may have (Triton sets no bound).
MAX_PRIORITY_LEVELS: Final = 1 << 16

#: The top-level ``config.pbtxt`` fields trioinfer reads (also the JSON keys of load overrides).
TRITON_FIELDS: Final = frozenset(f[0] for f in _MESSAGES["ModelConfig"])


@functools.cache
def _model_config_class() -> Any:
    """Build the ``inference.ModelConfig`` message class from the table above (once)."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError:
        raise ConfigError(_EXTRA) from None
    file = descriptor_pb2.FileDescriptorProto(
        name="trioinfer/model_config.proto", package="inference", syntax="proto3"
    )
    for enum_name, values in _ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    made: dict[str, Any] = {}
    # Parents before children: "A" before "A.B" before "A.B.C".
    for path in sorted(_MESSAGES, key=lambda p: p.count(".")):
        parent, _, leaf = path.rpartition(".")
        container = made[parent].nested_type if parent else file.message_type
        message = container.add(name=leaf)
        if leaf.endswith("Entry"):
            message.options.map_entry = True
        for enum_name, values in _NESTED_ENUMS.get(path, {}).items():
            enum = message.enum_type.add(name=enum_name)
            for value_name, number in values:
                enum.value.add(name=value_name, number=number)
        oneofs: list[str] = []
        for name, number, kind, label, type_name, oneof in _MESSAGES[path]:
            field = message.field.add(name=name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".inference.{type_name}"
            if oneof:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    message.oneof_decl.add(name=oneof)
                field.oneof_index = oneofs.index(oneof)
        made[path] = message
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelConfig"))


def _protobuf() -> tuple[Any, Any]:
    try:
        from google.protobuf import json_format, text_format
    except ImportError:
        raise ConfigError(_EXTRA) from None
    return text_format, json_format


#: The prefix of the ``parameters`` that carry trioinfer's own settings (``trioinfer.batcher``).
OWN_PREFIX: Final = "trioinfer."
#: trioinfer's settings that Triton's ModelConfig has no field for, answered by
#: ``GET .../config`` as ``parameters`` and read back from a load override's.
OWN_SETTINGS: Final = (
    "scheduler",
    "scheduler_options",
    "batcher",
    "batcher_options",
    "fallback",
    "fallback_options",
    "max_queue_size",
    "queue_timeouts",
    "queue_sizes",
    "instances",
    "sequence",
)
# The settings whose value is a plugin's name: the parameter's string as it is.
_OWN_NAMES: Final = frozenset({"scheduler", "batcher", "fallback"})


def own_parameters(settings: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Return trioinfer's own *settings* as Triton's ``parameters``: ``trioinfer.<key>``.

    A plugin's name is written as it is, anything else as JSON
    (``"trioinfer.max_queue_size": {"string_value": "1024"}``).
    """
    return {
        OWN_PREFIX + key: {
            "string_value": value if key in _OWN_NAMES else json.dumps(value, sort_keys=True)
        }
        for key, value in settings.items()
    }


def _own_settings(parameters: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``trioinfer.<key>`` *parameters* (Triton's, strings) as ModelConfig keys."""
    out: dict[str, Any] = {}
    for name, parameter in parameters.items():
        if not name.startswith(OWN_PREFIX):
            continue
        key = name.removeprefix(OWN_PREFIX)
        if key not in OWN_SETTINGS:
            raise ConfigError(
                f"{where}: parameters {name!r} is not a trioinfer setting; the "
                f"{OWN_PREFIX}* parameters are " + ", ".join(OWN_PREFIX + k for k in OWN_SETTINGS)
            )
        text = parameter.string_value
        if key in _OWN_NAMES:
            out[key] = text
            continue
        try:
            out[key] = json.loads(text)
        except ValueError:
            raise ConfigError(
                f"{where}: parameters {name!r} must hold JSON (as GET .../config answers "
                f"it), got {text[:64]!r}"
            ) from None
    return out


#: Triton's DataType enum by number.
_DATA_TYPES: Final = {number: name for name, number in _ENUMS["DataType"]}


# Triton's data types as trioinfer's dtype names (V2 names; STRING is BYTES there).
def _dtype(data_type: str) -> str:
    return data_type.removeprefix("TYPE_").replace("STRING", "BYTES")


@attrs.frozen
class TritonModel:
    """A Triton model configuration and what it means for trioinfer.

    Attributes:
        doc: The configuration as Triton's JSON form (protobuf's JSON mapping
            with Triton's field names): what ``GET .../config`` starts from and
            what load overrides replace keys of.
        settings: The [`ModelConfig`][trioinfer.ModelConfig] keys it maps to.
        version_policy: Its ``version_policy`` in ``config.toml``'s form, or ``None``.
        labels: Output name to its ``label_filename`` (relative to the model's directory).
        priority_levels: ``dynamic_batching.priority_levels`` (0: none).
        default_priority_level: The level of requests that name none (1 is the highest).
        notes: Fields accepted without effect, said once in the log.
        declared: The shapes its ``input`` and ``output`` give, for the ONNX Runtime
            backend's ``inputs`` and ``outputs`` options (see `with_declared_shapes`):
            each dims list with the batch dimension first (-1) when max_batch_size > 0.
        model_filename: The model file's name in each version directory:
            ``default_model_filename``, or ``None`` for the backend's own
            (``model.onnx``).
    """

    doc: Mapping[str, Any]
    settings: Mapping[str, Any]
    version_policy: Any = None
    labels: Mapping[str, str] = attrs.field(factory=dict)
    priority_levels: int = 0
    default_priority_level: int = 0
    notes: tuple[str, ...] = ()
    model_filename: str | None = None
    declared: Mapping[str, tuple[Mapping[str, Any], ...]] = attrs.field(factory=dict)

    @classmethod
    def parse(
        cls,
        source: str | Mapping[str, Any],
        *,
        name: str,
        where: str,
        override: Mapping[str, Any] | None = None,
    ) -> TritonModel:
        """Read ``config.pbtxt`` text, or the same configuration as a JSON object.

        Args:
            source: The text of a ``config.pbtxt``, or a mapping of its fields
                (as a load override sends them: ``{"max_batch_size": 16}``).
            name: The model's name (its directory's).
            where: How messages name the source (``"digits/config.pbtxt"``).
            override: Top-level fields (JSON) that replace *source*'s, whole,
                before anything is checked: what *source* says of a field the
                override sets is never judged.

        Raises:
            ConfigError: Not valid protobuf text or JSON for a model config, a
                field trioinfer does not read (named), or values it cannot serve.
        """
        text_format, json_format = _protobuf()
        message = _model_config_class()()
        try:
            if isinstance(source, str):
                text_format.Parse(source, message)
            else:
                json_format.ParseDict(dict(source), message)
        except (text_format.ParseError, json_format.ParseError) as exc:
            raise ConfigError(
                f"{where}: {exc} (trioinfer reads these Triton fields: "
                f"{', '.join(sorted(TRITON_FIELDS))})"
            ) from None
        doc = json_format.MessageToDict(message, preserving_proto_field_name=True)
        if override is not None:
            return cls.parse({**doc, **override}, name=name, where=where)
        return _translate(message, doc, name, where)

    def merged(self, override: Mapping[str, Any], *, name: str, where: str) -> TritonModel:
        """This configuration with the top-level fields of *override* replaced, whole."""
        return TritonModel.parse({**self.doc, **override}, name=name, where=where)

    def json(self) -> dict[str, Any]:
        """*doc* as Triton's ``GET .../config`` answers it: 64-bit integers as numbers."""
        out: dict[str, Any] = _numbers(self.doc)
        return out

    def json_with_defaults(self, name: str) -> dict[str, Any]:
        """`json()` named *name*, every field at its default printed (as Python models read it)."""
        return with_defaults(_numbers({**self.doc, "name": name}))

    def check_complete(self, where: str, *, auto_complete: bool = True) -> None:
        """Refuse a model that declares no input or output where nothing completes them.

        A Triton Python model's come from config.pbtxt or its
        ``auto_complete_config``; an ONNX model's from its graph, unless
        *auto_complete* is False (Triton's ``--disable-auto-complete-config``),
        when every model but an ensemble (checked at parse) must declare them.

        Raises:
            ConfigError: It is such a model.
        """
        backend = self.settings.get("backend", "onnxruntime")
        if backend == PIPELINE or (backend != "python" and auto_complete):
            return
        missing = [field for field in ("input", "output") if not self.doc.get(field)]
        if not missing:
            return
        what = " and ".join(missing)
        if not auto_complete:
            # As Triton with the flag: neither the model's code nor its file is asked.
            raise ConfigError(
                f"{where}: --disable-auto-complete-config: config.pbtxt must declare the "
                f"model's {what}, which nothing completes (neither "
                "TritonPythonModel.auto_complete_config nor the model file is read for "
                "them); declare them, or serve without --disable-auto-complete-config"
            )
        raise ConfigError(
            f"{where}: a Triton Python model must declare its {what}: in "
            "config.pbtxt, or by TritonPythonModel.auto_complete_config in model.py "
            "(add_input, add_output), which the server runs at load (in Python, "
            "ModelRepository's entry(...).config(..., complete=...) runs it)"
        )

    def engine_priority(self, level: int) -> int:
        """The engine priority of a Triton priority level (1 is the highest; 0 the default).

        As in Triton, a level that is not one of the model's (0, past
        ``priority_levels``, or below 1) is its default level: a client that
        sends the same priority to models with different numbers of levels is
        served by each, not refused by some. Without ``priority_levels`` the
        level is passed on as it is.
        """
        if not self.priority_levels:
            return level
        if not 1 <= level <= self.priority_levels:
            level = self.default_priority_level
        # The engine runs higher numbers sooner; Triton runs lower levels sooner.
        return self.priority_levels - level


# Triton's 64-bit integer fields, which protobuf's JSON mapping writes as strings.
_INT64_KEYS: Final = frozenset(
    {
        "dims",
        "shape",
        "versions",
        "model_version",
        "max_queue_delay_microseconds",
        "priority_levels",
        "default_priority_level",
        "default_timeout_microseconds",
        "max_sequence_idle_microseconds",
    }
)


def _numbers(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _numbers(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v, key) for v in value]
    if key in _INT64_KEYS and isinstance(value, str):
        return int(value)
    return value


def with_defaults(doc: Mapping[str, Any], message: str = "ModelConfig") -> dict[str, Any]:
    """*doc* (a ``ModelConfig`` in Triton's JSON form) with every field at its default printed.

    As Triton answers ``GET .../config``: protobuf's JSON with
    ``always_print_primitive_fields``, so every scalar, list and map of a
    message that is there appears, at its default when unset (``"format":
    "FORMAT_NONE"``, ``"gpus": []``, ``"parameters": {}``); a message field
    that is unset stays out, and so does an unset member of a oneof. Clients
    made for Triton read such fields without checking for them (its
    image_client reads an input's ``format``). Only the fields trioinfer
    reads are known here (the table above); a key it does not know
    (``model_transaction_policy``) is kept as it is. Needs no protobuf.
    """
    out = dict(doc)
    for name, _number, kind, label, type_name, oneof in _MESSAGES[message]:
        value = out.get(name)
        entry = _MESSAGES.get(type_name) if type_name.endswith("Entry") else None
        if value is None:
            if oneof or (kind == _M and label == _ONE):
                continue  # unset messages and oneof members are not printed
            out[name] = (
                {} if entry is not None else [] if label == _MANY else _default(kind, type_name)
            )
        elif kind == _M and entry is not None:
            value_type = entry[1][4]  # the map's value: a message, or a scalar
            if value_type in _MESSAGES and isinstance(value, Mapping):
                out[name] = {k: with_defaults(v, value_type) for k, v in value.items()}
        elif kind == _M and label == _MANY and isinstance(value, list):
            out[name] = [
                with_defaults(v, type_name) if isinstance(v, Mapping) else v for v in value
            ]
        elif kind == _M and isinstance(value, Mapping):
            out[name] = with_defaults(value, type_name)
    return out


def _default(kind: int, type_name: str) -> Any:
    # A scalar field's default as protobuf's JSON prints it (64-bit integers as numbers).
    if kind == _S:
        return ""
    if kind == _B:
        return False
    if kind == _F:
        return 0.0
    if kind == _E:
        enum = _ENUMS.get(type_name)
        if enum is None:
            outer, _, inner = type_name.rpartition(".")
            enum = _NESTED_ENUMS[outer][inner]
        return next(name for name, number in enum if number == 0)
    return 0


def _refuse(message: Any, allowed: set[str], where: str, what: str) -> None:
    unsupported = sorted(f.name for f, _ in message.ListFields() if f.name not in allowed)
    if unsupported:
        raise ConfigError(
            f"{where}: {what} sets {', '.join(unsupported)}, which trioinfer does not support; "
            "remove it (see 'Coming from Triton' in the docs for what maps)"
        )


def _translate(message: Any, doc: dict[str, Any], name: str, where: str) -> TritonModel:
    present = {f.name for f, _ in message.ListFields()}
    settings: dict[str, Any] = {}
    notes: list[str] = []
    if message.name and message.name != name:
        raise ConfigError(
            f"{where}: name {message.name!r} differs from the directory's name {name!r}; "
            "leave name out or make the two equal"
        )
    ensemble = message.platform == "ensemble"
    # A Triton Python model: model.py's TritonPythonModel, run by the python backend.
    python = message.backend == "python" and not message.platform
    decoupled = message.model_transaction_policy.decoupled
    if decoupled and not python:
        raise ConfigError(
            f"{where}: model_transaction_policy decoupled: true is for a Triton Python model "
            '(backend: "python"), whose execute sends its responses; this model answers '
            "each request once: remove model_transaction_policy"
        )
    if ensemble:
        if message.backend:
            raise ConfigError(f"{where}: an ensemble has no backend; remove backend")
        settings["backend"] = "pipeline"
    elif python:
        # Without input and output, model.py's auto_complete_config may add them when
        # the model loads (TritonModel.check_complete says when nothing did).
        settings["backend"] = "python"
        if "optimization" in present:
            raise ConfigError(
                f"{where}: optimization is not supported for a Triton Python model "
                '(backend: "python") here; remove it (see "Python models as they are" '
                "in docs/how-to/from-triton.md)"
            )
    elif message.platform not in ("", "onnxruntime_onnx") or message.backend not in (
        "",
        "onnxruntime",
    ):
        raise ConfigError(
            f"{where}: platform {message.platform!r} / backend {message.backend!r} is not "
            "served by trioinfer; it serves ONNX models (platform 'onnxruntime_onnx' or "
            "backend 'onnxruntime'), Triton Python models (backend 'python') and ensembles "
            "(platform 'ensemble')"
        )
    elif present & {"platform", "backend"}:
        settings["backend"] = "onnxruntime"
    model_filename = _model_filename(message.default_model_filename, ensemble, where, notes)
    max_batch = message.max_batch_size
    if max_batch < 0:
        raise ConfigError(f"{where}: max_batch_size must be >= 0, got {max_batch}")
    batching = message.dynamic_batching
    has_dynamic = message.HasField("dynamic_batching")
    if has_dynamic and max_batch == 0:
        raise ConfigError(f"{where}: dynamic_batching needs max_batch_size > 0")
    levels = default_level = 0
    if has_dynamic:
        _refuse(
            batching,
            {
                "preferred_batch_size",
                "max_queue_delay_microseconds",
                "preserve_ordering",
                "priority_levels",
                "default_priority_level",
                "default_queue_policy",
                "priority_queue_policy",
            },
            where,
            "dynamic_batching",
        )
        if batching.preserve_ordering:
            notes.append(
                "dynamic_batching.preserve_ordering has no effect: each request gets its own "
                "answer as soon as it is ready"
            )
        levels = batching.priority_levels
        default_level = batching.default_priority_level
        if levels > MAX_PRIORITY_LEVELS:
            # Each level gets its own queue policy below: an unbounded count (a uint64 here)
            # would keep the server busy building them instead of answering.
            raise ConfigError(
                f"{where}: dynamic_batching.priority_levels {levels} is more than trioinfer "
                f"serves: at most {MAX_PRIORITY_LEVELS}"
            )
        if levels and not 1 <= default_level <= levels:
            raise ConfigError(
                f"{where}: dynamic_batching.default_priority_level must be from 1 to "
                f"priority_levels ({levels}), got {default_level}"
            )
        if not levels and (default_level or batching.priority_queue_policy):
            raise ConfigError(
                f"{where}: default_priority_level and priority_queue_policy need priority_levels"
            )
        if levels:
            settings["scheduler"] = "priority"
    own = _own_settings(message.parameters, where)
    if message.HasField("sequence_batching"):
        if ensemble:
            raise ConfigError(
                f"{where}: an ensemble has no sequence_batching; its steps' models do"
            )
        settings["batcher"] = "sequence"
        settings["sequence"] = _sequence(message.sequence_batching, max_batch, where, notes)
        if python:
            _python_sequence(message.sequence_batching, decoupled, where)
    elif max_batch > 0 and not ensemble:
        options: dict[str, Any] = {"max_batch_size": max_batch, "max_queue_delay": 0.0}
        if has_dynamic:
            options["max_queue_delay"] = batching.max_queue_delay_microseconds / 1e6
            if batching.preferred_batch_size:
                options["preferred_batch_sizes"] = list(batching.preferred_batch_size)
        if own.get("batcher") == "dynamic" and isinstance(own.get("batcher_options"), dict):
            # The dynamic batcher's other options, which Triton's fields cannot say.
            said = {"max_batch_size", "max_queue_delay", "preferred_batch_sizes"}
            options = {
                **{k: v for k, v in own["batcher_options"].items() if k not in said},
                **options,
            }
        settings["batcher"] = "dynamic"
        settings["batcher_options"] = options
    elif ensemble and max_batch > 0 and own.get("batcher", "none") != "none":
        # A pipeline that batches whole requests (GET .../config answered it so): its
        # batcher as it was, its batch size as max_batch_size says.
        settings["batcher"] = own["batcher"]
        options = own.get("batcher_options", {})
        settings["batcher_options"] = {
            **(options if isinstance(options, dict) else {}),
            "max_batch_size": max_batch,
        }
    elif "max_batch_size" in present or ensemble:
        settings["batcher"] = "none"

    def engine_level(level: int) -> int:
        return levels - level if levels else 0

    if has_dynamic:
        timeouts: dict[str, float] = {}
        sizes: dict[str, int] = {}
        given = dict(batching.priority_queue_policy.items())
        strays = sorted(level for level in given if not 1 <= level <= levels)
        if strays:
            raise ConfigError(
                f"{where}: priority_queue_policy names level {strays[0]}; levels are 1 to {levels}"
            )
        # The default policy holds for every level the per-level policies leave out.
        default = (
            batching.default_queue_policy if batching.HasField("default_queue_policy") else None
        )
        policies = []
        for level in range(1, levels + 1) if levels else [0]:
            policy = given.get(level, default)
            if policy is not None:
                policies.append((level, policy))
        for level, policy in policies:
            what = f"priority_queue_policy[{level}]" if level in given else "default_queue_policy"
            if policy.timeout_action != 0:
                raise ConfigError(
                    f"{where}: {what}.timeout_action DELAY is not supported; a request past its "
                    "queue timeout is rejected (REJECT)"
                )
            if policy.allow_timeout_override:
                notes.append(
                    f"{what}.allow_timeout_override: a request's own deadline always wins here"
                )
            key = str(engine_level(level))
            if policy.default_timeout_microseconds:
                timeouts[key] = policy.default_timeout_microseconds / 1e6
            if policy.max_queue_size:
                if level == 0 and not levels:
                    settings["max_queue_size"] = policy.max_queue_size
                else:
                    sizes[key] = policy.max_queue_size
        if timeouts:
            settings["queue_timeouts"] = timeouts
        if sizes:
            settings["queue_sizes"] = sizes
            total = sum(sizes.values())
            if levels and len(sizes) == levels and total > _DEFAULT_QUEUE_SIZE:
                # Triton bounds each level's queue and nothing else: with every level
                # bounded, the whole queue may hold their sum, which trioinfer's default
                # bound would cut short (trioinfer's own max_queue_size still wins).
                settings["max_queue_size"] = own.get("max_queue_size", total)

    if message.instance_group:
        if ensemble:
            raise ConfigError(f"{where}: an ensemble has no instance_group; its steps' models do")
        settings["instances"] = [
            instance
            for group in message.instance_group
            for instance in _instances(group, where, auto_cpu=python)
        ]
    backend_parameters = {
        key: value for key, value in message.parameters.items() if not key.startswith(OWN_PREFIX)
    }
    cuda_options: dict[str, Any] = {}
    if python:
        # Its parameters are the model's to read, from args["model_config"].
        settings["backend_options"] = {
            "triton": with_defaults(_numbers({**doc, "name": name})),
            **_python_tensors(message, max_batch),
        }
    elif backend_parameters:
        if ensemble:
            raise ConfigError(
                f"{where}: an ensemble takes no parameters (but trioinfer's own, "
                f"{OWN_PREFIX}*); got {', '.join(sorted(backend_parameters))}"
            )
        options = {key: _parameter(value.string_value) for key, value in backend_parameters.items()}
        cuda_options = _onnxruntime_parameters(options, settings, where, notes)
        settings["backend_options"] = options
    if message.HasField("optimization"):
        if ensemble:
            raise ConfigError(f"{where}: an ensemble has no optimization; its steps' models do")
        _optimization(message.optimization, settings, cuda_options, where, notes)
    elif cuda_options:
        settings.setdefault("backend_options", {})["provider_options"] = cuda_options
    if message.HasField("response_cache"):
        settings["response_cache"] = message.response_cache.enable
    if message.model_warmup:
        settings["warmup"] = [_warmup(sample, where) for sample in message.model_warmup]

    labels: dict[str, str] = {}
    # An ensemble's tensors are its steps' models': reshape and optional are theirs.
    onnx = set() if ensemble or python else {"reshape"}
    for tensor in message.input:
        allowed = {"name", "data_type", "dims", *onnx, *(("optional",) if not ensemble else ())}
        _refuse(tensor, allowed, where, f"input {tensor.name!r}")
        _check_reshape(tensor, "input", where)
        if tensor.optional and tensor.HasField("reshape"):
            raise ConfigError(
                f"{where}: input {tensor.name!r} is optional and reshaped; trioinfer serves "
                "an optional input as the graph's own value, which it does not reshape: "
                "remove one of them"
            )
    for tensor in message.output:
        allowed = {"name", "data_type", "dims", "label_filename", *onnx}
        _refuse(tensor, allowed, where, f"output {tensor.name!r}")
        _check_reshape(tensor, "output", where)
        if tensor.label_filename:
            labels[tensor.name] = tensor.label_filename
    if ensemble:
        settings["backend_options"] = _ensemble(message, where)
    # trioinfer's own settings fill what Triton's fields leave unsaid; where both say
    # something, Triton's win (a client changes those, not the parameters).
    for key, value in own.items():
        if key == "sequence" and isinstance(settings.get(key), dict) and isinstance(value, dict):
            settings[key] = _with_initial_values(settings[key], value, where)
        elif key == "instances" and isinstance(settings.get(key), list):
            # An optimization that says which accelerators run says the GPU groups'
            # provider (tensorrt:N or cuda:N); without one, the device that ran stays.
            said = message.HasField("optimization") and message.optimization.HasField(
                "execution_accelerators"
            )
            settings[key] = _with_own_instances(settings[key], value, devices_said=said)
        settings.setdefault(key, value)

    versions: Any = None
    if message.HasField("version_policy"):
        choice = message.version_policy.WhichOneof("policy_choice")
        if choice == "latest":
            versions = {"latest": message.version_policy.latest.num_versions or 1}
        elif choice == "specific":
            versions = {"specific": list(message.version_policy.specific.versions)}
        else:
            versions = "all"
    return TritonModel(
        doc,
        settings,
        versions,
        labels,
        levels,
        default_level,
        tuple(notes),
        model_filename,
        declared=_declared_shapes(message, max_batch) if not ensemble and not python else {},
    )


def _python_sequence(batching: Any, decoupled: bool, where: str) -> None:
    # What a Triton Python model's sequence_batching cannot have here: the model
    # answers each request on its own (execute's list), so the batcher has no batch
    # outputs to carry implicit state from, and a stream is not run by the batcher.
    what = "sequence_batching"
    if batching.state:
        raise ConfigError(
            f"{where}: {what}.state (implicit state) is not supported for a Triton Python "
            "model here: its execute answers each request on its own; keep the state in the "
            "model, by request.correlation_id(), and remove state"
        )
    if decoupled:
        raise ConfigError(
            f"{where}: {what} with model_transaction_policy decoupled: true is not supported "
            "for a Triton Python model here; remove one of them"
        )
    for item in batching.control_input:
        for control in item.control:
            if _CONTROL_KINDS[control.kind] == "corrid" and not control.data_type:
                raise ConfigError(
                    f"{where}: {what}.control_input {item.name!r} (CORRID) needs a data_type "
                    "(TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING)"
                )


#: The data type of a control input that gives its false and true values in a field.
_FALSE_TRUE_TYPES: Final = {
    "int32_false_true": "TYPE_INT32",
    "fp32_false_true": "TYPE_FP32",
    "bool_false_true": "TYPE_BOOL",
}


def _control_inputs(message: Any, max_batch: int) -> list[dict[str, Any]]:
    # A Triton Python model's sequence_batching control inputs, as inputs it receives
    # (Triton's: one element per request, [1]) beside those config.pbtxt declares.
    if not message.HasField("sequence_batching"):
        return []
    declared = {tensor.name for tensor in message.input}
    out = []
    for item in message.sequence_batching.control_input:
        if item.name in declared or len(item.control) != 1:
            continue  # declared: as it is; more than one control: refused by _sequence
        (control,) = item.control
        data_type = (
            next(
                (name for field, name in _FALSE_TRUE_TYPES.items() if getattr(control, field)),
                None,
            )
            or _DATA_TYPES[control.data_type]
        )
        out.append(
            {
                "name": item.name,
                "dtype": _dtype(data_type),
                "shape": ["batch", 1] if max_batch > 0 else [1],
            }
        )
    return out


def _python_tensors(message: Any, max_batch: int) -> dict[str, list[dict[str, Any]]]:
    # A Triton Python model's inputs and outputs, for the python backend's options. With
    # max_batch_size 0 a first dimension of -1 is no batch: each tensor's gets a name of
    # its own, so that the engine neither batches the model nor holds an output to its
    # input's rows (Triton's model answers [-1] with any length).
    def entry(tensor: Any) -> dict[str, Any]:
        dims: list[int | str] = list(tensor.dims)
        if max_batch > 0:
            dims = ["batch", *dims]
        elif dims and dims[0] == -1:
            dims[0] = f"{tensor.name}[0]"
        out: dict[str, Any] = {
            "name": tensor.name,
            "dtype": _dtype(_DATA_TYPES[tensor.data_type]),
            "shape": dims,
        }
        if getattr(tensor, "optional", False):
            out["optional"] = True
        return out

    tensors = {
        kind: [entry(t) for t in tensors]
        for kind, tensors in (("inputs", message.input), ("outputs", message.output))
    }
    tensors["inputs"] += _control_inputs(message, max_batch)
    return tensors


def _declared_shapes(message: Any, max_batch: int) -> dict[str, tuple[Mapping[str, Any], ...]]:
    batch = [-1] if max_batch > 0 else []

    def entry(tensor: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"name": tensor.name, "shape": [*batch, *tensor.dims]}
        if tensor.HasField("reshape"):
            out["reshape"] = [*batch, *tensor.reshape.shape]
        if getattr(tensor, "optional", False):
            out["optional"] = True
        return out

    return {
        kind: tuple(entry(t) for t in tensors)
        for kind, tensors in (("inputs", message.input), ("outputs", message.output))
        if tensors
    }


def _check_reshape(tensor: Any, kind: str, where: str) -> None:
    # Triton's reshape: clients see dims, the model has reshape.shape, the same elements.
    # Fixed sizes only: with -1 on both sides which size goes where is a guess.
    if not tensor.HasField("reshape"):
        return
    dims, shape = list(tensor.dims), list(tensor.reshape.shape)
    if min(dims + shape, default=0) < 0:
        raise ConfigError(
            f"{where}: {kind} {tensor.name!r}: reshape needs fixed dims and a fixed "
            f"reshape.shape (no -1; the batch dimension is neither's), got dims {dims} and "
            f"reshape {shape}"
        )
    if math.prod(dims) != math.prod(shape):
        raise ConfigError(
            f"{where}: {kind} {tensor.name!r} reshape {shape} holds {math.prod(shape)} "
            f"elements; its dims {dims} hold {math.prod(dims)}: they must hold the same"
        )


#: The backends whose signature a config's dims narrow (their ONNX Runtime options
#: ``inputs`` and ``outputs``); any other declares its shapes itself, and a config whose
#: dims fix a size it leaves open is refused (`_check_tensors` in _models.py).
NARROWING_BACKENDS: Final = frozenset({"onnxruntime", "ray"})


def with_declared_shapes(
    settings: Mapping[str, Any],
    triton: TritonModel,
    *,
    where: str,
    dims_overridden: Collection[str] = (),
    options_overridden: bool = False,
) -> dict[str, Any]:
    """*settings* (a ModelConfig's, as a table) with the sizes *triton*'s dims fix.

    Triton takes the dims a config gives as the model's own: for an ONNX model they
    become the backend's ``inputs`` and ``outputs`` options (on the ray backend, its
    ``onnxruntime`` table's), which narrow the graph's symbolic sizes in its signature
    (a size the graph fixes otherwise fails the load); other backends keep their
    options (their own declaration is checked against the dims after the load).

    Where the settings' own ``backend_options`` give ``inputs`` (or ``outputs``) too,
    the later instruction wins: a load override's dims replace what ``config.toml``
    says, and an override's ``backend_options`` replace what ``config.pbtxt``'s dims
    say. Both given by one source (the file, or the override) must agree.

    Args:
        settings: The ModelConfig table, the override applied.
        triton: The Triton configuration the dims come from.
        where: How a message names the model (``model 'm'``).
        dims_overridden: The kinds (``"inputs"``, ``"outputs"``) whose dims the load
            override gave (its ``input``, ``output``), not the file.
        options_overridden: Whether the settings' ``backend_options`` are the load
            override's, not the file's.

    Raises:
        ConfigError: One source gives both a kind's dims and its option, and they
            declare different shapes.
    """
    out = dict(settings)
    backend = out.get("backend", "onnxruntime")
    if not triton.declared or backend not in NARROWING_BACKENDS:
        return out
    given = out.get("backend_options", {})
    if backend == "ray":
        # The ray backend's actors run ONNX Runtime with its "onnxruntime" table.
        given = given.get("onnxruntime", {}) if isinstance(given, Mapping) else None
    if not isinstance(given, Mapping):
        return out  # refused with its reason when the config is built
    options = dict(given)
    for kind, tensors in triton.declared.items():
        declared = [dict(t) for t in tensors]
        if kind not in options:
            options[kind] = declared
            continue
        dims_later = kind in dims_overridden
        if dims_later and not options_overridden:
            options[kind] = declared  # the override's dims replace config.toml's option
        elif dims_later == options_overridden:
            _check_agree(kind, declared, options[kind], where, overridden=dims_later)
        # else: the override's option replaces config.pbtxt's dims
    if backend == "ray":
        options = {**out.get("backend_options", {}), "onnxruntime": options}
    out["backend_options"] = options
    return out


def _check_agree(
    kind: str, declared: list[dict[str, Any]], option: object, where: str, *, overridden: bool
) -> None:
    # One source said a kind's shapes twice, as Triton's dims and as the backend option.
    def shapes(entries: object) -> dict[Any, Any] | None:
        if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
            return None  # malformed: the backend refuses it with its reason
        return {e.get("name"): list(e.get("shape", [])) for e in entries}

    mine, theirs = shapes(declared), shapes(option)
    if theirs is None or mine == theirs:
        return
    triton_key = kind.removesuffix("s")
    source = "the load override" if overridden else "the model's config"
    raise ConfigError(
        f"{where}: {source} gives {kind}' shapes twice, and they differ: its {triton_key} "
        f"dims say {_shapes_text(mine)}, its backend_options {kind} say "
        f"{_shapes_text(theirs)}; give one of them (a load override's replaces "
        "config.toml's)"
    )


def _shapes_text(shapes: Mapping[Any, Any] | None) -> str:
    return ", ".join(
        f"{name} [{', '.join(map(str, dims))}]" for name, dims in (shapes or {}).items()
    )


def _with_initial_values(
    table: dict[str, Any], own: Mapping[str, Any], where: str
) -> dict[str, Any]:
    # sequence_batching says a state starts at zero or says nothing: a state's other
    # initial value is in trioinfer.sequence only.
    states = own.get("state", [])
    # A load override's parameters are the client's: malformed, a ConfigError (a 400),
    # not a TypeError here (a 500).
    if not isinstance(states, list) or not all(
        isinstance(state, dict) and isinstance(state.get("input", ""), str) for state in states
    ):
        raise ConfigError(
            f"{where}: parameters '{OWN_PREFIX}sequence': its state must be a list of tables "
            f"with a string input (as GET .../config answers it), got {str(states)[:64]}"
        )
    given = {state.get("input"): state["initial"] for state in states if "initial" in state}
    states = [
        {**state, "initial": given[state["input"]]}
        if state.get("input") in given and "initial" not in state
        else state
        for state in table.get("state", [])
    ]
    return {**table, "state": states}


def _with_own_instances(
    groups: list[dict[str, Any]], own: object, *, devices_said: bool
) -> list[dict[str, Any]]:
    # instance_group says kind, GPU and count: when trioinfer.instances lists the same
    # groups, its capacity, threads, CPUs and device (tensorrt:N, which Triton calls a
    # GPU) are kept; threads that Triton's parameters set (intra_op_thread_count) win,
    # and so do the groups' devices where optimization's accelerators say them
    # (*devices_said*): an answer whose accelerators a client edited ran the old ones.
    def shape(device: object, count: object) -> tuple[str, object]:
        return str(device).replace("tensorrt", "cuda"), count

    if not isinstance(own, list) or not all(isinstance(g, dict) for g in own):
        return groups
    if [shape(g.get("device"), g.get("count")) for g in own] != [
        shape(g["device"], g["count"]) for g in groups
    ]:
        return groups
    return [
        {**mine, **group, "device": group["device"] if devices_said else mine["device"]}
        for group, mine in zip(groups, own, strict=True)
    ]


def _model_filename(value: str, ensemble: bool, where: str, notes: list[str]) -> str | None:
    # Triton's default_model_filename: the model file's name in each version directory
    # (model.onnx unless it says otherwise). A plain name: it must not lead elsewhere.
    if not value or value == "model.onnx":
        return None
    if ensemble:
        notes.append("default_model_filename has no effect: an ensemble has no model file")
        return None
    if (
        len(value) > 255
        or value in (".", "..")
        or any(c in value for c in "/\\\0")
        or not value.isprintable()
    ):
        raise ConfigError(
            f"{where}: default_model_filename must be a file name in the version "
            f"directory, e.g. 'model.onnx' (no directories); got {value[:64]!r}"
        )
    return value


#: Triton's control kinds as the ``[sequence]`` table's ``control`` keys.
_CONTROL_KINDS: Final = {0: "start", 1: "ready", 2: "end", 3: "corrid"}


def _sequence(batching: Any, max_batch: int, where: str, notes: list[str]) -> dict[str, Any]:
    """``sequence_batching`` as a ``[sequence]`` table (see `SequenceConfig`)."""
    what = "sequence_batching"
    _refuse(
        batching,
        {"max_sequence_idle_microseconds", "control_input", "direct", "oldest", "state"},
        where,
        what,
    )
    table: dict[str, Any] = {"max_batch_size": max(max_batch, 1)}
    if batching.max_sequence_idle_microseconds:
        table["max_sequence_idle"] = batching.max_sequence_idle_microseconds / 1e6
    # Triton's default strategy is direct (trioinfer's own default is oldest).
    strategy = batching.WhichOneof("strategy_choice") or "direct"
    table["strategy"] = strategy
    chosen = batching.direct if strategy == "direct" else batching.oldest
    if chosen.max_queue_delay_microseconds:
        raise ConfigError(
            f"{where}: {what}.{strategy}.max_queue_delay_microseconds is not supported: a "
            "sequence batch leaves as soon as an instance is free; remove it"
        )
    if strategy == "direct":
        _refuse(batching.direct, {"max_queue_delay_microseconds"}, where, f"{what}.direct")
    else:
        oldest = batching.oldest
        _refuse(
            oldest,
            {
                "max_candidate_sequences",
                "preferred_batch_size",
                "max_queue_delay_microseconds",
                "preserve_ordering",
            },
            where,
            f"{what}.oldest",
        )
        if oldest.max_candidate_sequences < 0:
            raise ConfigError(
                f"{where}: {what}.oldest.max_candidate_sequences must be >= 0, "
                f"got {oldest.max_candidate_sequences}"
            )
        if oldest.max_candidate_sequences:
            table["max_candidate_sequences"] = oldest.max_candidate_sequences
        if oldest.preferred_batch_size:
            notes.append(
                f"{what}.oldest.preferred_batch_size has no effect: without a queue delay a "
                "batch takes the requests ready when an instance is free"
            )
        if oldest.preserve_ordering:
            notes.append(
                f"{what}.oldest.preserve_ordering has no effect: each request gets its own "
                "answer as soon as it is ready, and a sequence's requests run in order anyway"
            )
    control: dict[str, str] = {}
    for item in batching.control_input:
        _refuse(item, {"name", "control"}, where, f"{what}.control_input {item.name!r}")
        if len(item.control) != 1:
            raise ConfigError(
                f"{where}: {what}.control_input {item.name!r} must hold exactly one control, "
                f"got {len(item.control)}"
            )
        (one,) = item.control
        kind = _CONTROL_KINDS[one.kind]
        given = [
            (field, list(getattr(one, field)))
            for field in ("int32_false_true", "fp32_false_true", "bool_false_true")
            if getattr(one, field)
        ]
        label = f"{what}.control_input {item.name!r} ({kind.upper()})"
        if kind == "corrid":
            if given:
                raise ConfigError(f"{where}: {label} takes a data_type, not {given[0][0]}")
        else:
            if len(given) != 1:
                raise ConfigError(
                    f"{where}: {label} needs one of int32_false_true, fp32_false_true or "
                    "bool_false_true"
                )
            field, values = given[0]
            if values != [0, 1]:  # [False, True] compares equal too
                raise ConfigError(
                    f"{where}: {label}: {field} must be "
                    + ("[false, true]" if field == "bool_false_true" else "[0, 1]")
                    + f", got {values}; trioinfer feeds 0 and 1 (false and true) in the "
                    "input's own type"
                )
        if kind in control:
            raise ConfigError(f"{where}: {what} has two {kind.upper()} control inputs")
        control[kind] = item.name
    table["control"] = control
    states = []
    for state in batching.state:
        label = f"{what}.state {state.input_name!r}"
        _refuse(
            state,
            {"input_name", "output_name", "data_type", "dims", "initial_state"},
            where,
            label,
        )
        entry: dict[str, Any] = {"input": state.input_name, "output": state.output_name}
        if state.dims:
            if min(state.dims) < 0:
                raise ConfigError(
                    f"{where}: {label} dims must be fixed sizes >= 0 (growable state is not "
                    f"supported), got {list(state.dims)}"
                )
            entry["shape"] = list(state.dims)
        if len(state.initial_state) > 1:
            raise ConfigError(f"{where}: {label} takes at most one initial_state")
        for initial in state.initial_state:
            if initial.WhichOneof("state_data") != "zero_data" or not initial.zero_data:
                raise ConfigError(
                    f"{where}: {label}: initial_state must be zero_data: true (data_file is "
                    "not supported)"
                )
            if initial.dims and list(initial.dims) != list(state.dims):
                raise ConfigError(
                    f"{where}: {label}: initial_state dims {list(initial.dims)} differ from "
                    f"the state's {list(state.dims)}"
                )
        states.append(entry)
    table["state"] = states
    return table


def _rate_limiter(group: Any, where: str) -> dict[str, Any]:
    # Triton's rate_limiter as an instance group's resource needs: per device unless
    # global, and its priority (0 is 1, as Triton reads it). A count of 0 needs nothing.
    if not group.HasField("rate_limiter"):
        return {}
    limiter = group.rate_limiter
    what = f"instance_group {group.name!r} rate_limiter"
    local: dict[str, int] = {}
    shared: dict[str, int] = {}
    for resource in limiter.resources:
        if not resource.name:
            raise ConfigError(f"{where}: {what} has a resource without a name")
        if resource.name in local or resource.name in shared:
            raise ConfigError(
                f"{where}: {what} names resource {resource.name!r} twice; expected each once"
            )
        if resource.count:
            (shared if getattr(resource, "global") else local)[resource.name] = resource.count
    table: dict[str, Any] = {}
    if local:
        table["resources"] = local
    if shared:
        table["global_resources"] = shared
    if limiter.priority > 1:
        table["resource_priority"] = limiter.priority
    return table


def rate_limiter_json(
    resources: Mapping[str, int], global_resources: Mapping[str, int], priority: int
) -> dict[str, Any] | None:
    """An instance group's resource needs as Triton's ``rate_limiter`` (JSON), or None.

    The inverse of reading config.pbtxt's: what ``GET .../config`` answers for a
    group that a ``config.toml`` (or a ``ModelConfig``) declared, so that its needs
    read as a config.pbtxt model's do, and load back the same.
    """
    if not resources and not global_resources and priority == 1:
        return None
    return {
        "resources": [
            {"name": name, "global": shared, "count": count}
            for needs, shared in ((resources, False), (global_resources, True))
            for name, count in needs.items()
        ],
        "priority": priority,
    }


def _instances(group: Any, where: str, *, auto_cpu: bool = False) -> list[dict[str, Any]]:
    # *auto_cpu*: KIND_AUTO without gpus is the CPU (a Python model's, which runs where
    # its code puts its work), else the first GPU.
    _refuse(
        group,
        {"name", "count", "gpus", "kind", "rate_limiter"},
        where,
        f"instance_group {group.name!r}",
    )
    needs = _rate_limiter(group, where)
    count = group.count or 1
    if count < 0:
        raise ConfigError(f"{where}: instance_group count must be >= 1, got {group.count}")
    if count > MAX_INSTANCES:
        raise ConfigError(
            f"{where}: instance_group count {count} is more than a model may have: "
            f"at most {MAX_INSTANCES}"
        )
    kind = group.kind  # 0 AUTO, 1 GPU, 2 CPU, 3 MODEL
    if kind == 3:
        raise ConfigError(f"{where}: instance_group kind KIND_MODEL is not supported")
    if kind == 0 and auto_cpu and not group.gpus:
        kind = 2
    if kind == 2:
        if group.gpus:
            raise ConfigError(f"{where}: a KIND_CPU instance_group takes no gpus")
        return [{"device": "cpu", "count": count, **needs}]
    gpus = list(group.gpus) or [0]
    if len(gpus) != len(set(gpus)) or min(gpus) < 0:
        raise ConfigError(f"{where}: instance_group gpus must be distinct GPU numbers >= 0")
    # Triton puts `count` instances on each listed GPU; trioinfer's groups are per device.
    return [{"device": f"cuda:{gpu}", "count": count, **needs} for gpu in gpus]


def _onnxruntime_parameters(
    options: dict[str, Any], settings: dict[str, Any], where: str, notes: list[str]
) -> dict[str, Any]:
    """Rename, in place, Triton's onnxruntime backend parameters that trioinfer spells otherwise.

    Triton's ONNX configs often set ``intra_op_thread_count``, ``inter_op_thread_count`` and
    ``execution_mode`` (0 sequential, 1 parallel); refusing them as unknown options would make
    such a repository fail to load although each has a trioinfer equivalent: ``threads`` on
    every instance group, the ``inter_op_threads`` option, and ``execution_mode`` by name.
    ``enable_mem_arena`` and ``enable_mem_pattern`` are 0 or 1 there, true or false here.

    Returns:
        The CUDA execution provider's options that Triton's backend reads from the
        parameters (deprecated there, for its ``cuda`` accelerator's), taken out of
        *options*: the caller decides where they go (`_optimization`).
    """
    for key in ("enable_mem_arena", "enable_mem_pattern"):
        if key in options:
            options[key] = _flag(options[key], f"parameters {key}", where, "0 or 1")
    if "share_session_between_instances" in options:
        options.pop("share_session_between_instances")
        notes.append(
            "parameters share_session_between_instances has no effect: each instance has "
            "its own ONNX Runtime session here"
        )
    cuda: dict[str, Any] = {}
    for key, names in _CUDA_CHOICES.items():
        if key in options:
            value = options.pop(key)
            if type(value) is not int or not 0 <= value < len(names):
                *most, last = [f"{n} ({name})" for n, name in enumerate(names)]
                raise ConfigError(
                    f"{where}: parameters {key} must be {', '.join(most)} or {last}, got {value!r}"
                )
            cuda[key] = names[value]
    if "gpu_mem_limit" in options:
        cuda["gpu_mem_limit"] = _integer(options.pop("gpu_mem_limit"), "gpu_mem_limit", where)
    if "do_copy_in_default_stream" in options:
        cuda["do_copy_in_default_stream"] = _flag(
            options.pop("do_copy_in_default_stream"), "parameters do_copy_in_default_stream", where
        )
    if "intra_op_thread_count" in options:
        threads = options.pop("intra_op_thread_count")
        if type(threads) is not int or threads < 0:
            raise ConfigError(
                f"{where}: parameters intra_op_thread_count must be an integer >= 0 "
                f"(0: ONNX Runtime's default), got {threads!r}"
            )
        # Without instance_group, the one CPU instance that ModelConfig would make.
        for group in settings.setdefault("instances", [{"device": "cpu", "count": 1}]):
            group["threads"] = threads
    if "inter_op_thread_count" in options:
        if "inter_op_threads" in options:
            raise ConfigError(
                f"{where}: parameters set both inter_op_thread_count and inter_op_threads; keep one"
            )
        options["inter_op_threads"] = options.pop("inter_op_thread_count")
    mode = options.get("execution_mode")
    if type(mode) is int and mode in (0, 1):
        options["execution_mode"] = ("sequential", "parallel")[mode]
    return cuda


#: Triton's deprecated CUDA parameters that choose by number: the CUDA provider's names.
_CUDA_CHOICES: Final = {
    "cudnn_conv_algo_search": ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
    "arena_extend_strategy": ("kNextPowerOfTwo", "kSameAsRequested"),
}
#: The CUDA provider's options that are flags: Triton writes them "0"/"1", ONNX Runtime's
#: Python API takes True/False (the backend passes its options to the provider as they are).
_CUDA_FLAGS: Final = frozenset(
    {
        "do_copy_in_default_stream",
        "use_ep_level_unified_stream",
        "cudnn_conv_use_max_workspace",
        "cudnn_conv1d_pad_to_nc1d",
        "enable_cuda_graph",
        "enable_skip_layer_norm_strict_mode",
        "prefer_nhwc",
        "use_tf32",
        "tunable_op_enable",
        "tunable_op_tuning_enable",
    }
)
#: Triton's ONNX Runtime graph levels (optimization.graph.level) as the backend's
#: graph_optimization_level: -1 basic, 1 extended, 2 none, and 0 (unset) everything.
_GRAPH_LEVELS: Final = {-1: "basic", 0: "all", 1: "extended", 2: "disable"}
#: The tensorrt accelerator's precision_mode values: the TensorRT provider's flag for each.
_PRECISIONS: Final = {
    "FP32": None,
    "FP16": "trt_fp16_enable",
    "BF16": "trt_bf16_enable",
    "INT8": "trt_int8_enable",
}
#: The tensorrt accelerator's other parameters, as Triton's backend maps them onto the
#: TensorRT provider's options: Triton's name -> (the provider's, its type).
_TRT_PARAMETERS: Final[dict[str, tuple[str, type]]] = {
    "max_workspace_size_bytes": ("trt_max_workspace_size", int),
    "int8_calibration_table_name": ("trt_int8_calibration_table_name", str),
    "int8_use_native_calibration_table": ("trt_int8_use_native_calibration_table", bool),
    **{
        name: (name, kind)
        for kind, names in (
            (
                int,
                (
                    "trt_max_partition_iterations",
                    "trt_min_subgraph_size",
                    "trt_dla_core",
                    "trt_builder_optimization_level",
                    "trt_auxiliary_streams",
                    "trt_ep_context_embed_mode",
                ),
            ),
            (
                bool,
                (
                    "trt_dla_enable",
                    "trt_engine_cache_enable",
                    "trt_dump_subgraphs",
                    "trt_force_sequential_engine_build",
                    "trt_context_memory_sharing_enable",
                    "trt_layer_norm_fp32_fallback",
                    "trt_timing_cache_enable",
                    "trt_force_timing_cache",
                    "trt_detailed_build_log",
                    "trt_build_heuristics_enable",
                    "trt_sparsity_enable",
                    "trt_cuda_graph_enable",
                    "trt_dump_ep_context_model",
                ),
            ),
            (
                str,
                (
                    "trt_engine_cache_path",
                    "trt_engine_cache_prefix",
                    "trt_timing_cache_path",
                    "trt_tactic_sources",
                    "trt_extra_plugin_lib_paths",
                    "trt_profile_min_shapes",
                    "trt_profile_max_shapes",
                    "trt_profile_opt_shapes",
                    "trt_ep_context_file_path",
                ),
            ),
        )
        for name in names
    },
}


def _flag(value: object, what: str, where: str, spelled: str = "true or false (or 1 or 0)") -> bool:
    # Triton's backend reads a flag as 0/1 or false/true (_parameter made them int or bool).
    if isinstance(value, str):
        value = _parameter(value)
    if value in (0, 1):  # True and False too
        return bool(value)
    raise ConfigError(f"{where}: {what} must be {spelled}, got {value!r}")


def _integer(value: object, what: str, where: str) -> int:
    if isinstance(value, str):
        value = _parameter(value)
    if type(value) is not int:
        raise ConfigError(f"{where}: {what} must be an integer, got {value!r}")
    return value


def _optimization(
    policy: Any, settings: dict[str, Any], cuda: dict[str, Any], where: str, notes: list[str]
) -> None:
    """Map ``optimization`` onto *settings* (its backend options and instance devices).

    As Triton's ONNX Runtime backend reads it: ``graph.level`` is the graph
    optimization level; a ``gpu_execution_accelerator`` named ``tensorrt`` puts
    the GPU instance groups on ONNX Runtime's TensorRT provider (``tensorrt:N``)
    with its parameters as that provider's options, one named ``cuda`` gives the
    CUDA provider options (as *cuda*, Triton's deprecated parameters, do). What
    has no effect here (priority, CUDA graphs, pinned memory) is a note; a CPU
    accelerator (OpenVINO) or an unknown one is refused.
    """
    what = "optimization"
    options: dict[str, Any] = dict(settings.get("backend_options", {}))
    if policy.HasField("graph"):
        level = policy.graph.level
        if level not in _GRAPH_LEVELS:
            raise ConfigError(
                f"{where}: {what}.graph.level must be -1 (basic), 0 (all, the default), "
                f"1 (extended) or 2 (disable), as Triton's ONNX Runtime backend reads it; "
                f"got {level}"
            )
        given = options.get("graph_optimization_level")
        if given is not None and given != _GRAPH_LEVELS[level]:
            raise ConfigError(
                f"{where}: {what}.graph.level {level} ({_GRAPH_LEVELS[level]}) and parameters "
                f"graph_optimization_level {given!r} disagree; give one of them"
            )
        options["graph_optimization_level"] = _GRAPH_LEVELS[level]
    if policy.priority:
        notes.append(
            f"{what}.priority has no effect: trioinfer gives ONNX Runtime sessions no "
            "priority (requests have theirs)"
        )
    if set_fields := [field.name for field, _ in policy.cuda.ListFields()]:
        notes.append(
            f"{what}.cuda {', '.join(set_fields)} has no effect: Triton's ONNX Runtime backend "
            "does not read it either (ONNX Runtime's own CUDA graphs are the cuda "
            "accelerator's enable_cuda_graph parameter)"
        )
    for field in ("input_pinned_memory", "output_pinned_memory"):
        if policy.HasField(field):
            notes.append(
                f"{what}.{field} has no effect: tensors reach ONNX Runtime as host arrays, "
                "with no staging buffer to pin"
            )
    accelerators = policy.execution_accelerators
    for accelerator in accelerators.cpu_execution_accelerator:
        raise ConfigError(
            f"{where}: {what}.execution_accelerators.cpu_execution_accelerator "
            f"{accelerator.name!r} is not supported: trioinfer's ONNX Runtime backend runs CPU "
            "instances on ONNX Runtime's CPU provider, and has no OpenVINO provider; remove it"
        )
    trt: dict[str, Any] | None = None
    seen: set[str] = set()
    for accelerator in accelerators.gpu_execution_accelerator:
        name = accelerator.name
        label = f"{what}.execution_accelerators.gpu_execution_accelerator {name!r}"
        if name not in ("tensorrt", "cuda"):
            raise ConfigError(
                f"{where}: {label} is not one trioinfer knows: 'tensorrt' (ONNX Runtime's "
                "TensorRT provider) or 'cuda' (its CUDA provider)"
            )
        if name in seen:
            raise ConfigError(f"{where}: {what}.execution_accelerators names {name!r} twice")
        seen.add(name)
        if name == "cuda":
            for key, value in accelerator.parameters.items():
                cuda[key] = (
                    _flag(value, f"{label} parameter {key}", where)
                    if key in _CUDA_FLAGS
                    else _parameter(value)
                )
        else:
            trt = _tensorrt_options(accelerator.parameters, label, where)
    if trt is not None and cuda:
        raise ConfigError(
            f"{where}: CUDA provider options ({', '.join(sorted(cuda))}) with 'tensorrt': a "
            "TensorRT instance's provider options are the TensorRT provider's (its CUDA "
            "provider, for what TensorRT cannot run, keeps its defaults); remove them or "
            "the tensorrt accelerator"
        )
    groups = settings.get("instances", [])
    gpus = [group for group in groups if str(group.get("device", "")).startswith("cuda")]
    if seen and not gpus:
        notes.append(
            f"{what}.execution_accelerators gpu_execution_accelerator "
            f"{', '.join(map(repr, sorted(seen)))} has no effect: no instance_group runs on "
            "a GPU (KIND_GPU)"
        )
    elif trt is not None:
        for group in gpus:
            group["device"] = group["device"].replace("cuda", "tensorrt", 1)
    provider = trt if trt is not None and gpus else cuda
    if provider:
        options["provider_options"] = provider
    if options:
        settings["backend_options"] = options


def _tensorrt_options(parameters: Mapping[str, str], label: str, where: str) -> dict[str, Any]:
    # The tensorrt accelerator's parameters as the TensorRT provider's options.
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        if key == "precision_mode":
            if value not in _PRECISIONS:
                raise ConfigError(
                    f"{where}: {label}: precision_mode must be FP32, FP16, BF16 or INT8, "
                    f"got {value!r}"
                )
            flag = _PRECISIONS[value]
            if flag is not None:
                out[flag] = True
            continue
        if key not in _TRT_PARAMETERS:
            raise ConfigError(
                f"{where}: {label} has no parameter {key!r}; it takes precision_mode, "
                f"{', '.join(sorted(_TRT_PARAMETERS))}"
            )
        name, kind = _TRT_PARAMETERS[key]
        what = f"{label} parameter {key}"
        out[name] = (
            _flag(value, what, where)
            if kind is bool
            else _integer(value, what, where)
            if kind is int
            else value
        )
    return out


def _warmup(sample: Any, where: str) -> dict[str, Any]:
    # A model_warmup sample as a [[warmup]] table (its file read from <model>/warmup/, as
    # Triton reads input_data_file). Triton's batch_size and count of 0 mean 1 and once.
    inputs: dict[str, dict[str, Any]] = {}
    for name, item in sample.inputs.items():
        table: dict[str, Any] = {"dims": list(item.dims)}
        if item.data_type:
            table["dtype"] = _dtype(_DATA_TYPES[item.data_type])
        choice = item.WhichOneof("input_data_type")
        if choice is None:
            raise ConfigError(
                f"{where}: model_warmup {sample.name!r}, input {name!r}: set zero_data, "
                "random_data or input_data_file"
            )
        if choice == "input_data_file":
            table["file"] = item.input_data_file
        else:
            table["data"] = "zero" if choice == "zero_data" else "random"
        inputs[name] = table
    return {
        "name": sample.name,
        "inputs": inputs,
        "batch_size": sample.batch_size or 1,
        "count": sample.count or 1,
    }


def _parameter(text: str) -> Any:
    # Triton's parameters are strings; trioinfer's backend options are typed.
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _ensemble(message: Any, where: str) -> dict[str, Any]:
    if not message.HasField("ensemble_scheduling") or not message.ensemble_scheduling.step:
        raise ConfigError(f"{where}: platform 'ensemble' needs ensemble_scheduling with steps")
    if not message.input or not message.output:
        raise ConfigError(f"{where}: an ensemble must declare its input and output tensors")
    batch = ["batch"] if message.max_batch_size > 0 else []

    def tensor(item: Any) -> dict[str, Any]:
        data_type = (
            item.DESCRIPTOR.fields_by_name["data_type"]
            .enum_type.values_by_number[item.data_type]
            .name
        )
        if data_type == "TYPE_INVALID":
            raise ConfigError(f"{where}: tensor {item.name!r} needs a data_type")
        return {"name": item.name, "dtype": _dtype(data_type), "shape": [*batch, *item.dims]}

    steps = []
    for index, step in enumerate(message.ensemble_scheduling.step):
        if not step.model_name:
            raise ConfigError(f"{where}: ensemble step {index} needs a model_name")
        version = step.model_version
        model = step.model_name if version in (-1, 0) else f"{step.model_name}:{version}"
        steps.append(
            {"model": model, "input_map": dict(step.input_map), "output_map": dict(step.output_map)}
        )
    return {
        "inputs": [tensor(t) for t in message.input],
        "outputs": [tensor(t) for t in message.output],
        "steps": steps,
    }
