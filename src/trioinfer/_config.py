"""Model configuration: one attrs class for Python, config.toml, the server and the CLI.

A model repository is laid out as ``<repo>/<model>/config.toml`` and
``<repo>/<model>/<version>/model.onnx``;
[`ModelConfig.from_toml()`][trioinfer.ModelConfig.from_toml] reads
the former and finds the latter. Validators check each field's invariants when
the object is built, so a bad configuration fails at once with a
[`ConfigError`][trioinfer.ConfigError] that names the field.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Self, TypeVar

import attrs

from ._bounds import check_priority_level, check_seconds
from ._exceptions import ConfigError
from ._sequence import SequenceConfig, to_sequence_config
from ._tensors import Casting, InputLimits
from ._warmup import Warmup

DeviceKind = Literal["cpu", "cuda", "tensorrt"]
_DEVICE_RE = re.compile(r"^(cpu|cuda|tensorrt)(?::(\d+))?$")
_T = TypeVar("_T")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
# Versions go over the V2 protocol as strings and into Triton clients as int64,
# so anything larger could not be addressed.
_MAX_VERSION = (1 << 63) - 1
# A version directory's name: ASCII only (str.isdigit() accepts '²' and other digits
# int() reads) and no leading zero, so that "01" and "1" cannot both claim version 1.
_VERSION_RE = re.compile(r"[1-9][0-9]{0,18}")


def _is_version_name(name: str) -> bool:
    # A version directory's name, as the server's repository reads it too.
    return _VERSION_RE.fullmatch(name) is not None and int(name) <= _MAX_VERSION


#: Most instances one model may have, over all its groups. Each is a session
#: with its own memory and threads; a count far past the devices' cores and GPUs
#: is a typo, or a client's load override trying to exhaust the server.
MAX_INSTANCES = 256


@attrs.frozen
class Device:
    """Where an instance runs: ``cpu``, ``cuda``/``cuda:N`` or ``tensorrt``/``tensorrt:N``.

    Attributes:
        kind: ``"cpu"``, ``"cuda"`` or ``"tensorrt"``.
        index: The GPU ordinal (always 0 for ``cpu``).
    """

    kind: DeviceKind
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> Device:
        """Parse ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"tensorrt:0"`` ...

        Raises:
            ConfigError: For anything else, saying what is accepted.
        """
        match = _DEVICE_RE.match(text.strip().lower()) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(
                f"device {text!r} is not one of 'cpu', 'cuda', 'cuda:N', 'tensorrt', 'tensorrt:N'"
            )
        kind: Any = match.group(1)
        index = int(match.group(2) or 0)
        if kind == "cpu" and index:
            raise ConfigError(f"device {text!r}: the CPU has no index; write 'cpu'")
        return cls(kind, index)

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


def _to_device(value: Device | str) -> Device:
    return value if isinstance(value, Device) else Device.parse(value)


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{attribute.name} must be a positive integer, got {value!r}")


def _non_negative(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name} must be an integer >= 0, got {value!r}")


def _instance_count(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    _positive(_inst, attribute, value)
    if value > MAX_INSTANCES:
        raise ConfigError(
            f"instances count {value} is more than a model may have: at most {MAX_INSTANCES}"
        )


def _positive_number(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(f"{attribute.name} must be a positive number, got {value!r}")


def _to_affinity(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value
    ):
        raise ConfigError(f"cpu_affinity must be a list of CPU numbers >= 0, got {value!r}")
    if not value:
        raise ConfigError("cpu_affinity must name at least one CPU, or be left out")
    return tuple(value)


def _to_needs(what: str, value: object) -> Mapping[str, int]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a table of resource name = count, got {value!r}")
    for name, count in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{what}: a resource's name must be a non-empty string, got {name!r}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"{what}[{name!r}] must be a positive integer, got {count!r}")
    return MappingProxyType(dict(value))


def _no_needs() -> Mapping[str, int]:
    return MappingProxyType({})


def _to_local_needs(value: object) -> Mapping[str, int]:
    return _to_needs("resources", value)


def _to_global_needs(value: object) -> Mapping[str, int]:
    return _to_needs("global_resources", value)


@attrs.frozen
class Instance:
    """A group of identical model instances on one device.

    Attributes:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"tensorrt"`` or ``"tensorrt:N"``.
        count: How many instances (each with its own session) to run there:
            1 to 256 (a model has at most 256 instances over all its groups).
        threads: Compute threads per instance (ONNX Runtime's intra-op threads);
            0 lets the backend choose.
        cpu_affinity: CPUs the instance's threads may run on (Linux), or ``None``.
        capacity: Relative throughput of one of these instances (say 8 for a GPU
            beside CPU instances of 1): when several instances are free, the
            one with the highest capacity takes the next batch.
        resources: What one execution of one of these instances needs of each named
            resource on its device (``{"R1": 4}``), taken all at once from the
            engine's pools before it starts and given back when it ends (Triton's
            rate limiter; see ``open_engine(resources=...)``). Each device has
            its own pool of a per-device resource.
        global_resources: The same, from pools that every device shares.
        resource_priority: How often these instances get resources while
            others wait too (Triton's ``rate_limiter.priority``): one of priority
            2 is granted half as often as one of priority 1. 1 or more.
    """

    device: Device = attrs.field(default=Device("cpu"), converter=_to_device)
    count: int = attrs.field(default=1, validator=_instance_count)
    threads: int = attrs.field(default=0, validator=_non_negative)
    cpu_affinity: tuple[int, ...] | None = attrs.field(default=None, converter=_to_affinity)
    capacity: float = attrs.field(default=1.0, validator=_positive_number)
    resources: Mapping[str, int] = attrs.field(factory=_no_needs, converter=_to_local_needs)
    global_resources: Mapping[str, int] = attrs.field(factory=_no_needs, converter=_to_global_needs)
    resource_priority: int = attrs.field(default=1, validator=_positive)


@attrs.frozen
class Placement:
    """Where one backend instance runs.

    The engine hands one to [`Backend.load()`][trioinfer.abc.Backend.load] per instance.

    Attributes:
        device: The device asked for.
        index: The instance's number within its model (0, 1, ...).
        threads: Compute threads for this instance (0: the backend chooses).
        cpu_affinity: CPUs to pin the instance's threads to, or ``None``.
        cpu_fallback: Whether the backend may run on the CPU when *device* is not usable.
        capacity: The instance's relative throughput (see [`Instance`][trioinfer.Instance]).
    """

    device: Device
    index: int
    threads: int = 0
    cpu_affinity: tuple[int, ...] | None = None
    cpu_fallback: bool = True
    capacity: float = 1.0


def _check_name(_inst: object, _attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ConfigError(
            f"model name {value!r} must be 1-128 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )


def _to_instances(value: object) -> tuple[Instance, ...]:
    if isinstance(value, Instance):
        return (value,)
    if not isinstance(value, (list, tuple)) or not value:
        # Both spellings, since either file or code may have written it.
        raise ConfigError(
            f"instances must be a non-empty list of Instance (in config.toml, [[instances]] "
            f'tables, e.g. instances = [{{ device = "cpu", count = 2 }}]), got {value!r}'
        )
    out = _build_each(Instance, value, "instances")
    total = sum(group.count for group in out)
    if total > MAX_INSTANCES:
        raise ConfigError(
            f"instances: {total} instances in all is more than a model may have: "
            f"at most {MAX_INSTANCES}"
        )
    return tuple(out)


def _to_options(value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"plugin options must be a table of name = value, got {value!r}")
    return MappingProxyType(dict(value))


#: The ``path`` that says "no file" as well as None does: what code passed before
#: ``path`` became optional, so it keeps meaning the same.
NO_FILE = "-"


def _to_path(value: str | os.PathLike[str] | None) -> Path | None:
    if value is None or value == NO_FILE:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"path must be a file path (a string), got {value!r}")
    return Path(value)


def _per_level(name: str, what: str, value: object, valid: Any) -> dict[int, Any]:
    # A table keyed by priority level (TOML keys are strings: "0", "-1").
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a table of priority level = {what}, got {value!r}")
    out: dict[int, Any] = {}
    for level, item in value.items():
        try:
            key = int(level)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: {level!r} is not an integer priority level") from None
        check_priority_level(name, key)
        if isinstance(item, bool) or not valid(item):
            raise ConfigError(f"{name}: level {key} needs {what}, got {item!r}")
        if key in out:
            # "0" and "00" (or " 0") are one level: which value won was the table's order.
            raise ConfigError(f"{name}: level {key} is given twice, as {level!r} and another key")
        out[key] = item
    return out


def _to_timeouts(value: object) -> Mapping[int, float]:
    levels = _per_level("queue_timeouts", "a number of seconds", value, lambda v: True)
    return MappingProxyType(
        {
            level: check_seconds(f"queue_timeouts: level {level}", seconds)
            for level, seconds in levels.items()
        }
    )


def _to_queue_sizes(value: object) -> Mapping[int, int]:
    return MappingProxyType(
        _per_level(
            "queue_sizes", "a positive integer", value, lambda v: isinstance(v, int) and v > 0
        )
    )


def _to_warmups(value: object) -> tuple[Warmup, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"warmup must be a list of samples (in config.toml, [[warmup]] tables), got {value!r}"
        )
    return tuple(_build_each(Warmup, value, "warmup"))


def _warmup_files(value: object, base: Path) -> object:
    # [[warmup]] tables as config.toml holds them, each input's relative file under base.
    if not isinstance(value, list):
        return value  # refused, saying why, by _to_warmups
    out: list[object] = []
    for sample in value:
        inputs = sample.get("inputs") if isinstance(sample, Mapping) else None
        if isinstance(inputs, Mapping):
            inputs = {
                name: (
                    {**item, "file": _warmup_file(item["file"], base)}
                    if isinstance(item, Mapping) and isinstance(item.get("file"), str)
                    else item
                )
                for name, item in inputs.items()
            }
            sample = {**sample, "inputs": inputs}
        out.append(sample)
    return out


def _warmup_file(name: str, base: Path) -> Path:
    # A config's file may not lead out of the model's warmup directory (a load override
    # comes over the network).
    path = base / name
    if not path.resolve().is_relative_to(base.resolve()):
        raise ConfigError(
            f"warm-up file {name!r} leads outside the model's warmup directory; give a "
            f"file name within {base}"
        )
    return path


def _plugin_name(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{attribute.name} must be a plugin name, got {value!r}")


@attrs.frozen
class ModelConfig:
    """Everything the engine needs to load and serve one model.

    Attributes:
        name: The name requests use. Letters, digits, ``_ . -``; at most 128.
        path: The model file (for the ONNX Runtime backend, a ``.onnx`` file),
            or None (the default) for a model that reads none: a pipeline, or a
            ``python`` model whose class is given in code. A backend that needs
            a file reads it through [`model_file()`][trioinfer.ModelConfig.model_file],
            which says so when there is none. (``"-"`` means None too.)
        instances: Where the model runs and how many instances of it (at
            most 256 in all).
        backend: The backend plugin's name (group ``trioinfer.backends``).
        scheduler: The scheduler plugin's name (group ``trioinfer.schedulers``).
        batcher: The batcher plugin's name (group ``trioinfer.batchers``). A
            pipeline with one batches whole requests, each batch taking one
            pass of its steps (see the pipelines reference).
        fallback: The fallback plugin's name (group ``trioinfer.fallbacks``).
        backend_options: Options for the backend; it refuses those it does not know.
        scheduler_options: Keyword arguments for the scheduler.
        batcher_options: Keyword arguments for the batcher.
        fallback_options: Keyword arguments for the fallback.
        max_queue_size: Requests that may wait for this model; more are refused with
            [`QueueFull`][trioinfer.QueueFull].
        queue_timeouts: Seconds a request of a given priority level may wait in
            the queue when its caller set no deadline (Triton's per-priority
            default timeout); past it, the request is rejected with
            [`DeadlineExceeded`][trioinfer.DeadlineExceeded], never computed.
            A caller's own deadline always wins. In config.toml, a table keyed by
            the level, e.g. ``queue_timeouts = { "0" = 0.5 }``.
        queue_sizes: Most requests of a given priority level that may wait
            (Triton's per-priority ``max_queue_size``); a level not listed is
            bounded by *max_queue_size* alone. Bounding the low levels keeps
            room for the high ones under overload: with ``max_queue_size =
            1024`` and ``queue_sizes = {0: 768}``, level-0 requests never take
            the last 256 places. Past its bound a request is refused with
            [`QueueFull`][trioinfer.QueueFull]. In config.toml, e.g.
            ``queue_sizes = { "0" = 768 }``.
        cpu_fallback: Whether an instance may run on the CPU when its GPU device is not usable.
        response_cache: Whether answers are kept in the engine's response cache
            (see [`open_engine()`][trioinfer.open_engine]'s *cache_size*): a
            request identical to one answered before is answered from it,
            without queueing, and identical requests in flight together are
            computed once. Only for models whose answer depends on their
            inputs alone.
        max_elements_per_input: Cap on one input tensor's element count.
        max_elements_per_request: Cap on a request's element count over all inputs.
        casting: Input dtype conversions allowed (numpy casting rule); ``"no"`` means
            inputs must have the model's dtypes exactly.
        sequence: Makes the model stateful: its requests come in sequences
            (see [`SequenceConfig`][trioinfer.SequenceConfig]); needs a sequence
            batcher (``batcher = "sequence"``). In config.toml, a ``[sequence]`` table.
        warmup: Request samples every instance runs at load, before the model
            serves (see [`Warmup`][trioinfer.Warmup]; Triton's ``model_warmup``).
            In config.toml, ``[[warmup]]`` tables. Not for a pipeline: its step
            models warm up themselves.
    """

    name: str = attrs.field(validator=_check_name)
    path: Path | None = attrs.field(default=None, converter=_to_path)
    instances: tuple[Instance, ...] = attrs.field(default=(Instance(),), converter=_to_instances)
    backend: str = attrs.field(default="onnxruntime", validator=_plugin_name)
    scheduler: str = attrs.field(default="fifo", validator=_plugin_name)
    batcher: str = attrs.field(default="none", validator=_plugin_name)
    fallback: str = attrs.field(default="none", validator=_plugin_name)
    backend_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_to_options)
    scheduler_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_to_options)
    batcher_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_to_options)
    fallback_options: Mapping[str, Any] = attrs.field(factory=dict, converter=_to_options)
    max_queue_size: int = attrs.field(default=1024, validator=_positive)
    queue_timeouts: Mapping[int, float] = attrs.field(factory=dict, converter=_to_timeouts)
    queue_sizes: Mapping[int, int] = attrs.field(factory=dict, converter=_to_queue_sizes)
    cpu_fallback: bool = attrs.field(default=True)
    response_cache: bool = attrs.field(default=False)
    max_elements_per_input: int = attrs.field(default=1 << 26, validator=_positive)
    max_elements_per_request: int = attrs.field(default=1 << 27, validator=_positive)
    casting: Casting = attrs.field(default="no")
    sequence: SequenceConfig | None = attrs.field(default=None, converter=to_sequence_config)
    warmup: tuple[Warmup, ...] = attrs.field(default=(), converter=_to_warmups)

    @instances.validator
    def _check_needs(self, _attribute: attrs.Attribute[Any], value: tuple[Instance, ...]) -> None:
        if self.backend == PIPELINE and any(g.resources or g.global_resources for g in value):
            raise ConfigError(
                f"model {self.name!r}: a pipeline takes no resources (it computes nothing "
                "itself); give its step models' instances theirs"
            )

    @warmup.validator
    def _check_warmup(self, _attribute: attrs.Attribute[Any], value: tuple[Warmup, ...]) -> None:
        if value and self.backend == PIPELINE:
            raise ConfigError(
                f"model {self.name!r}: a pipeline takes no warmup (as a Triton ensemble "
                "takes no model_warmup); give its step models theirs"
            )
        if value and self.sequence is not None:
            # A sample runs on the instances, outside the sequence batcher, as Triton's
            # does (whose model_warmup names "every model input, including control
            # tensors"): nothing feeds its controls and states but the sample itself.
            fed = (*self.sequence.control.values(), *(s.input for s in self.sequence.state))
            for sample in value:
                if missing := [name for name in fed if name not in sample.inputs]:
                    raise ConfigError(
                        f"model {self.name!r}: warm-up sample {sample.name!r} gives no "
                        f"{', '.join(map(repr, missing))}, which the sequence batcher feeds "
                        "each request (control and state inputs); a warm-up sample runs "
                        "outside it, as in Triton, so it gives them itself (zero_data, or a "
                        "file holding a start flag's 1, in each input's dtype)"
                    )

    @sequence.validator
    def _check_sequence(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None:
            return
        if self.backend == "pipeline":
            raise ConfigError(
                f"model {self.name!r}: a pipeline cannot be stateful ([sequence]); make the "
                "step model that keeps state stateful instead"
            )
        if self.response_cache:
            raise ConfigError(
                f"model {self.name!r}: a stateful model ([sequence]) cannot use response_cache: "
                "its answers depend on the sequence's state, not on the inputs alone"
            )
        if self.fallback != "none":
            raise ConfigError(
                f"model {self.name!r}: a stateful model ([sequence]) needs fallback = 'none', "
                f"got {self.fallback!r}: a sequence stays on its instance, and a retry or "
                "failover would run a request twice or elsewhere"
            )

    @cpu_fallback.validator
    def _check_cpu_fallback(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        # cpu_fallback = "no" in a config.toml is a non-empty string, so truthy: refused
        # rather than silently taken as true.
        if not isinstance(value, bool):
            raise ConfigError(f"cpu_fallback must be true or false, got {value!r}")

    @response_cache.validator
    def _check_response_cache(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"response_cache must be true or false, got {value!r}")

    @casting.validator
    def _check_casting(self, _attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in ("no", "safe", "same_kind"):
            raise ConfigError(f"casting must be 'no', 'safe' or 'same_kind', got {value!r}")

    def model_file(self, what: str) -> Path:
        """The model file, for a backend that reads one: the one place ``path`` is checked.

        Args:
            what: What the backend needs the file to be, for the message
                (``"the .onnx file to load"``).

        Raises:
            ConfigError: If ``path`` is None: the message names the model, the
                backend and *what*.
        """
        if self.path is None:
            raise ConfigError(
                f"model {self.name!r} has no path: the {self.backend} backend needs {what}; "
                "give it as ModelConfig(path=...) (in config.toml, path = '<file>', or the "
                "file in a version directory)"
            )
        return self.path

    @property
    def input_limits(self) -> InputLimits:
        """The caps and casting rule the engine checks inputs against."""
        return InputLimits(self.max_elements_per_input, self.max_elements_per_request, self.casting)

    def placements(self) -> list[Placement]:
        """One [`Placement`][trioinfer.lowlevel.Placement] per instance, in listed order."""
        out: list[Placement] = []
        for group in self.instances:
            for _ in range(group.count):
                out.append(
                    Placement(
                        group.device,
                        len(out),
                        group.threads,
                        group.cpu_affinity,
                        self.cpu_fallback,
                        group.capacity,
                    )
                )
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base: Path | None = None) -> Self:
        """Build a config from a table such as a parsed ``config.toml``.

        A relative ``path`` is taken relative to *base*, and a warm-up input's
        relative ``file`` relative to ``<base>/warmup`` (as Triton's
        ``input_data_file``). Unknown keys are refused.

        Raises:
            ConfigError: Naming the key or field that is wrong.
        """
        data = dict(data)
        if (
            base is not None
            and isinstance(data.get("path"), (str, os.PathLike))
            and data["path"] != NO_FILE
        ):
            data["path"] = base / Path(data["path"])
        if base is not None and "warmup" in data:
            data["warmup"] = _warmup_files(data["warmup"], base / "warmup")
        return _build(cls, data, "model config")

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *, version: int | None = None) -> Self:
        """Read ``<repo>/<model>/config.toml`` and find the model file beside it.

        Without a ``path`` key, the model file is ``<version>/model.onnx`` next to
        the config (``model.py`` with ``backend = "python"``), for the highest
        numeric version directory (or *version*);
        a relative ``path`` is taken relative to the config's directory.
        Without a ``name`` key, the directory's name is used. A relative
        *path* is taken relative to the working directory now, and the
        config holds an absolute model path, so that a later ``chdir`` does
        not change which file loads.

        Raises:
            ConfigError: If the file is missing, not TOML, or describes an invalid model.
        """
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"no model config at {path}") from None
        except IsADirectoryError:
            raise ConfigError(
                f"{path} is a directory; ModelConfig.from_toml reads a model's config file, "
                f"e.g. {path / 'config.toml'}"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot read model config {path}: {exc.strerror or exc}") from None
        data = parse_toml(raw, str(path))
        # A misspelt key says so before a model file is looked for (its absence would hide it).
        fields = {f.name for f in attrs.fields(cls)}
        if set(data) - fields:
            raise unknown_keys_error(f"{path}: model config", set(data) - fields, fields)
        model_dir = path.absolute().parent
        data.setdefault("name", model_dir.name)
        # A pipeline has no model file (it is its config): its path stays None.
        if "path" not in data and data.get("backend") != PIPELINE:
            backend = data.get("backend", "onnxruntime")
            try:
                data["path"] = find_model_file(model_dir, version, model_file_name(backend))
            except ConfigError as exc:
                raise ConfigError(f"{exc}{model_file_hint(backend)}") from None
        return cls.from_dict(data, base=model_dir)


def parse_toml(raw: bytes, shown: str) -> dict[str, Any]:
    """The TOML document *raw*, the file *shown* names (a path, as its reader knows it).

    The one place a config file's bytes become a table: `ModelConfig.from_toml`,
    ``trioinfer serve --config`` and the model repository read theirs here.

    Raises:
        ConfigError: Naming *shown*, for bytes that are not UTF-8 (tomllib
            decodes them itself, with a bare ``UnicodeDecodeError``), nested too
            deeply for its parser (a ``RecursionError``), or not TOML.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{shown} is not valid TOML: it is not UTF-8 ({exc.reason})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{shown} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{shown} is not valid TOML: it nests too deeply") from None


#: The backend name that makes a model a pipeline of other models (it has no file).
PIPELINE = "pipeline"

#: The model file a repository's version directory holds, by backend (others: model.onnx).
MODEL_FILES: Mapping[str, str] = MappingProxyType({"python": "model.py"})


def model_file_name(backend: object) -> str:
    """The file name of a model in ``<model>/<version>/`` for *backend*: ``model.onnx`` mostly."""
    return MODEL_FILES.get(backend, "model.onnx") if isinstance(backend, str) else "model.onnx"


def model_file_hint(backend: object) -> str:
    """What to say when a version directory lacks *backend*'s file: empty for the first-party ones.

    A plugin backend's file is ``model.onnx`` too, whatever its format, which its
    author does not expect: the message says so, and names the way out (``path``).
    """
    if not isinstance(backend, str) or backend in MODEL_FILES or backend == "onnxruntime":
        return ""
    # backend = "pyhton": a typo, not a plugin of its own; say so rather than name its file.
    first_party = ("onnxruntime", PIPELINE, "ray", *MODEL_FILES)
    if close := difflib.get_close_matches(backend, first_party, n=1):
        return f"; is backend = {backend!r} a typo? did you mean {close[0]!r}?"
    return (
        f"; on the {backend!r} backend too, the model file in a version directory is "
        "named model.onnx, whatever its format, unless config.toml names it with "
        "path = '<file>' (then served as version 1)"
    )


def find_model_file(model_dir: Path, version: int | None = None, file: str = "model.onnx") -> Path:
    """Return ``<model_dir>/<version>/<file>``, by default for the highest version.

    Raises:
        ConfigError: If there is no numeric version directory holding *file*.
    """
    # The repository's rule (ASCII digits, no leading zero): str.isdigit() accepts '²',
    # which int() refuses, and a folder "01" would be read as 1 then looked for as "1".
    versions = (
        sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and _is_version_name(p.name))
        if model_dir.is_dir()
        else []
    )
    if version is not None:
        versions = [v for v in versions if v == version]
    for v in reversed(versions):
        candidate = model_dir / str(v) / file
        if candidate.is_file():
            return candidate
    wanted = f"version {version}" if version is not None else "version directory"
    raise ConfigError(
        f"{model_dir} has no {wanted} holding {file}: expected {model_dir}/<N>/{file}, "
        "N a version number (1, 2, ... without leading zeros)"
    )


#: Keys people bring from Triton's config.pbtxt or a server's config.toml, and where they go.
_KEY_HINTS: Mapping[str, str] = MappingProxyType(
    {
        "max_batch_size": "max_batch_size is a batcher option: write batcher = 'dynamic' and "
        "max_batch_size in [batcher_options]",
        "dynamic_batching": "write batcher = 'dynamic', with its options in [batcher_options]",
        "preferred_batch_size": "preferred_batch_sizes is a batcher option, in [batcher_options]",
        "max_queue_delay": "max_queue_delay is a batcher option, in [batcher_options]",
        "instance_group": "write [[instances]] tables, each with device and count",
        "model_warmup": "write [[warmup]] tables, each with name, inputs, batch_size and count",
        "platform": "write backend = 'onnxruntime' (the default) instead of platform",
        "device": "device goes in an [[instances]] table",
        "count": "count goes in an [[instances]] table",
        "threads": "threads goes in an [[instances]] table",
        "version_policy": "version_policy is read by trioinfer serve's model repository, not by "
        "ModelConfig: leave it out here, and pass version=N to ModelConfig.from_toml",
        "traffic": "traffic is read by trioinfer serve's model repository, not by ModelConfig",
        "labels": "labels is read by trioinfer serve's model repository, not by ModelConfig",
        **{
            key: f"{key} is a backend option: put it in [backend_options]"
            for key in ("inputs", "outputs", "parameters", "decoupled", "steps", "dispatch")
        },
    }
)


def unknown_keys_error(where: str, unknown: Iterable[str], known: Iterable[str]) -> ConfigError:
    """The error for keys of a table that nothing reads: each named, with what to write instead.

    Lists every known key, then, per unknown key, where it belongs (a Triton
    field, a batcher option) or the known key it is closest to (a typo).
    """
    unknown, known = sorted(unknown), sorted(known)
    hints = []
    for key in unknown:
        if key in _KEY_HINTS:
            hints.append(_KEY_HINTS[key])
        elif close := difflib.get_close_matches(key, known, n=1):
            hints.append(f"did you mean {close[0]!r} for {key!r}?")
    return ConfigError(
        f"{where}: unknown key {', '.join(map(repr, unknown))}; "
        f"known keys are {', '.join(known)}" + "".join(f"; {hint}" for hint in hints)
    )


def _build_each(cls: type[_T], items: Iterable[object], where: str) -> list[_T]:
    # A config's list of *cls* (instances, warm-up samples): each one, or a table of its fields.
    out: list[_T] = []
    for item in items:
        if isinstance(item, cls):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(_build(cls, item, where))
        else:
            article = "an" if cls.__name__[0] in "AEIOU" else "a"
            raise ConfigError(
                f"each of {where} must be {article} {cls.__name__} or a table, got {item!r}"
            )
    return out


def _build(cls: type[_T], data: Mapping[str, Any], where: str) -> _T:
    fields = {f.name for f in attrs.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - fields
    if unknown:
        raise unknown_keys_error(where, unknown, fields)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
