"""Stateful sequences: the flags a request carries, and a model's ``[sequence]`` config.

A stateful model serves *sequences*: requests that share a correlation id
(Triton's ``sequence_id``), the first with ``sequence_start`` and the last
with ``sequence_end``. The engine hands them to the model's sequence batcher
(a [`SequenceBatcher`][trioinfer.abc.SequenceBatcher] plugin, ``sequence``
first-party), which keeps each sequence on one instance, runs its requests in
order, feeds the model its control inputs and implicit state, and releases a
sequence left idle. This module holds only values: the parsing of the flags
(shared by the HTTP and gRPC endpoints) and the configuration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import attrs

from ._bounds import check_seconds
from ._exceptions import ConfigError, InvalidInput

#: The control inputs a model may declare, by kind (Triton's ``CONTROL_SEQUENCE_*``).
CONTROL_KINDS: tuple[str, ...] = ("start", "end", "ready", "corrid")
SequenceStrategy = Literal["direct", "oldest"]
_MAX_ID = 2**64


def _check_id(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidInput(
            f"sequence_id must be an unsigned 64-bit integer or a string, got {value!r}"
        )
    if isinstance(value, int) and not 0 < value < _MAX_ID:
        raise InvalidInput(
            f"sequence_id must be between 1 and 2**64-1 (0 means no sequence), got {value}"
        )
    if isinstance(value, str) and not value:
        raise InvalidInput("sequence_id must not be empty (an empty string means no sequence)")


def _check_flag(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInput(f"sequence_{attribute.name} must be true or false, got {value!r}")


@attrs.frozen
class SequenceFlags:
    """Which sequence a request belongs to, and whether it starts or ends it.

    Pass one to [`Engine.infer()`][trioinfer.Engine.infer] as ``sequence=``;
    over HTTP and gRPC they are the request parameters ``sequence_id``,
    ``sequence_start`` and ``sequence_end``, as Triton names them (see
    [`from_parameters()`][trioinfer.SequenceFlags.from_parameters]).

    Attributes:
        id: The correlation id: an integer from 1 to 2**64-1, or a non-empty
            string. Integers and strings never name the same sequence.
        start: This request begins the sequence (the model sees START = 1).
        end: This request is the sequence's last (END = 1); its state is
            released once it ran.

    Raises:
        InvalidInput: An id or flag of the wrong type or range.
    """

    id: int | str = attrs.field(validator=_check_id)
    start: bool = attrs.field(default=False, validator=_check_flag, kw_only=True)
    end: bool = attrs.field(default=False, validator=_check_flag, kw_only=True)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> SequenceFlags | None:
        """Read Triton's ``sequence_id``, ``sequence_start``, ``sequence_end`` request parameters.

        The one parser of these parameters, for every endpoint: HTTP passes
        the JSON ``parameters`` object; gRPC passes its ``InferParameter``
        values as Python values (``int64_param``/``uint64_param`` as ``int``,
        ``string_param`` as ``str``, ``bool_param`` as ``bool``). Other
        parameters are ignored. A missing id, ``0`` or ``""`` means the
        request is not part of a sequence (Triton reserves them for that).

        Returns:
            The flags, or ``None`` when the request names no sequence.

        Raises:
            InvalidInput: A malformed id or flag, or a start/end flag without an id.
        """
        sequence_id = parameters.get("sequence_id")
        start = parameters.get("sequence_start", False)
        end = parameters.get("sequence_end", False)
        for key, flag in (("sequence_start", start), ("sequence_end", end)):
            if not isinstance(flag, bool):
                raise InvalidInput(f"parameter {key} must be true or false, got {flag!r}")
        if sequence_id is None or (not isinstance(sequence_id, bool) and sequence_id in (0, "")):
            if start or end:
                raise InvalidInput(
                    "sequence_start and sequence_end need a sequence_id (a non-zero integer "
                    f"or a non-empty string), got sequence_id={sequence_id!r}"
                )
            return None
        return cls(sequence_id, start=start, end=end)


def _to_control(value: object) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"sequence.control must be a table of kind = input name (kinds: "
            f"{', '.join(CONTROL_KINDS)}), got {value!r}"
        )
    out: dict[str, str] = {}
    for kind, name in value.items():
        if kind not in CONTROL_KINDS:
            raise ConfigError(
                f"sequence.control: unknown kind {kind!r}; the kinds are {', '.join(CONTROL_KINDS)}"
            )
        if not isinstance(name, str) or not name:
            raise ConfigError(f"sequence.control.{kind} must be an input name, got {name!r}")
        out[kind] = name
    names = list(out.values())
    if len(set(names)) != len(names):
        raise ConfigError(f"sequence.control names one input for two kinds: {out!r}")
    return MappingProxyType(out)


def _to_shape(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise ConfigError(
            f"sequence.state shape must be a list of sizes >= 0 (without the batch "
            f"dimension), got {value!r}"
        )
    return tuple(value)


def _check_initial(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(f"sequence.state initial must be a number, got {value!r}")


def _check_tensor_name(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"sequence.state {attribute.name} must be a tensor name, got {value!r}")


@attrs.frozen
class SequenceState:
    """One implicit state tensor: an output fed back as an input on the sequence's next request.

    Attributes:
        input: The model input that receives the state.
        output: The model output whose value becomes the state after each request:
            declared with the input's dtype and the state's shape.
        initial: The value every element of the state has on a sequence's
            first request (0 by default).
        shape: The state's shape without the batch dimension; by default the
            input's, which then must have fixed sizes.
    """

    input: str = attrs.field(validator=_check_tensor_name)
    output: str = attrs.field(validator=_check_tensor_name)
    initial: float = attrs.field(default=0, validator=_check_initial)
    shape: tuple[int, ...] | None = attrs.field(default=None, converter=_to_shape)


def _to_states(value: object) -> tuple[SequenceState, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(
            f"sequence.state must be a list of tables {{input, output, initial, shape}}, "
            f"got {value!r}"
        )
    out = []
    for item in value:
        if isinstance(item, SequenceState):
            out.append(item)
            continue
        if not isinstance(item, Mapping):
            raise ConfigError(f"each sequence.state must be a table, got {item!r}")
        unknown = sorted(set(item) - {"input", "output", "initial", "shape"})
        if unknown or "input" not in item or "output" not in item:
            raise ConfigError(
                f"sequence.state {dict(item)!r}: needs input and output (and optional "
                f"initial, shape)"
                + (f"; unknown key {', '.join(map(repr, unknown))}" if unknown else "")
            )
        out.append(SequenceState(**item))
    inputs = [s.input for s in out]
    if len(set(inputs)) != len(inputs):
        raise ConfigError("sequence.state names one input twice")
    return tuple(out)


def _check_strategy(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("direct", "oldest"):
        raise ConfigError(f"sequence.strategy must be 'direct' or 'oldest', got {value!r}")


def _check_idle(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    check_seconds("sequence.max_sequence_idle", value)


def _check_size(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"sequence.max_batch_size must be a positive integer, got {value!r}")


def _check_candidates(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"sequence.max_candidate_sequences must be a positive integer, got {value!r}"
        )
    if getattr(_inst, "strategy", "oldest") != "oldest":
        raise ConfigError(
            "sequence.max_candidate_sequences applies to the 'oldest' strategy only (under "
            "'direct', max_batch_size slots bound the sequences of an instance)"
        )


@attrs.frozen
class SequenceConfig:
    """A stateful model's ``[sequence]`` table: how its sequences are batched and fed.

    Attributes:
        strategy: ``"oldest"`` (the default): each batch takes the next request
            of up to *max_batch_size* sequences, oldest request first, at most
            one per sequence; ``"direct"``: each sequence holds one of
            *max_batch_size* batch slots of its instance until it ends, and a
            batch has one row per slot (rows of slots with no request have
            READY = 0). Either way a sequence stays on one instance.
        max_sequence_idle: Seconds a sequence may go without a request before it
            is released with its state (Triton's ``max_sequence_idle_microseconds``,
            default 1 s); its next request is refused with
            [`SequenceError`][trioinfer.SequenceError].
        max_batch_size: ``direct``: slots per instance (sequences in progress
            on it at once; more wait for a slot); ``oldest``: most requests per
            batch. 1 for a model without a batch dimension.
        control: The model inputs that receive control signals, by kind:
            ``start`` (1 on a sequence's first request), ``end`` (1 on its
            last), ``ready`` (1 on a row that holds a request, 0 on a padding
            row) and ``corrid`` (the sequence id). Each in the input's own
            dtype (int, float or bool; ``corrid`` an integer or string type).
        state: Implicit state tensors (see [`SequenceState`][trioinfer.SequenceState]).
        max_candidate_sequences: ``oldest`` only: at most this many sequences
            in progress on each instance (Triton's ``max_candidate_sequences``);
            a sequence started past it waits, in order of arrival, until one
            of them ends or is released. ``None`` (the default): no bound but
            ``max_queue_size``.
    """

    strategy: SequenceStrategy = attrs.field(default="oldest", validator=_check_strategy)
    max_sequence_idle: float = attrs.field(default=1.0, validator=_check_idle)
    max_batch_size: int = attrs.field(default=1, validator=_check_size)
    control: Mapping[str, str] = attrs.field(factory=dict, converter=_to_control)
    state: tuple[SequenceState, ...] = attrs.field(default=(), converter=_to_states)
    max_candidate_sequences: int | None = attrs.field(default=None, validator=_check_candidates)

    @property
    def hidden_inputs(self) -> frozenset[str]:
        """The inputs the batcher fills (controls and states): callers do not send them."""
        return frozenset(self.control.values()) | {s.input for s in self.state}

    @property
    def hidden_outputs(self) -> frozenset[str]:
        """The outputs that only feed the state back: callers do not receive them."""
        return frozenset(s.output for s in self.state)


def to_sequence_config(value: object) -> SequenceConfig | None:
    """Convert a ``[sequence]`` table (or a `SequenceConfig`, or ``None``) for `ModelConfig`."""
    if value is None or isinstance(value, SequenceConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"sequence must be a table, got {value!r}")
    fields = {f.name for f in attrs.fields(SequenceConfig)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ConfigError(
            f"sequence: unknown key {', '.join(map(repr, unknown))}; known keys are "
            f"{', '.join(sorted(fields))}"
        )
    return SequenceConfig(**value)
