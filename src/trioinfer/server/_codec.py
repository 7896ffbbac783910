"""The KServe V2 (Open Inference Protocol) wire format: request bodies in, response bodies out.

Pure functions, no HTTP framework: the app hands over bytes and headers and gets
numpy arrays, or hands over arrays and gets bytes. `encode_infer_request` is the
client's side (``trioinfer bench`` sends what it makes). An infer request is a JSON
object, optionally followed by raw tensor bytes (Triton's binary tensor data
extension): the ``Inference-Header-Content-Length`` header then says where the
JSON ends, and each input with ``parameters.binary_data_size`` takes its bytes,
in order, from what follows.

Choices this module makes where the protocol leaves room:

- ``data`` is either flat (row-major, as many values as the shape holds) or
  nested exactly as deep as the shape, with every level matching it; anything
  in between is refused.
- JSON numbers must fit the datatype: ``300`` for ``UINT8``, ``1.5`` or
  ``true`` for ``INT32``, ``1e6`` for ``FP16`` are refused, never wrapped or cast.
  ``BOOL`` data is ``true``/``false`` only.
- ``BYTES`` inputs become ``object`` arrays: of `str` when sent as JSON
  strings, of `bytes`, exactly as sent, when sent as binary (or gRPC
  contents, or shared memory). The engine then gives the model one type
  whatever the transport (`TensorSpec.utf8`): ``str`` for a UTF-8 text input
  such as an ONNX string tensor (refusing bytes that are not UTF-8, naming
  the element), ``bytes`` for any other (a Python model's, as Triton's
  Python backend gives them). Nothing here decodes: an image sent as
  ``BYTES`` reaches a model that takes bytes byte for byte.
- A ``BYTES`` output with an element that is not valid UTF-8 cannot be written
  as a JSON string without loss. When the request shows that its client
  speaks the binary extension (it says ``binary_data_output`` or an output's
  ``binary_data``, as ``tritonclient`` always does), the output is sent as
  binary data (with ``binary_data_size``) even though JSON was asked for,
  and the client reads it as any binary output; a plain JSON client, which
  could not parse such a body, gets a `RequestError` (400) telling it to
  ask for binary output.
- JSON has no NaN or infinity: a float output holding them is written with
  ``null`` in their place; ask for binary output to keep them.
- An empty ``outputs`` list means the same as none: return every output.

Every problem with a request raises [`RequestError`][trioinfer.server._codec.RequestError]
(or a subclass), whose message names the input and says what was expected.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import orjson

from .._bounds import check_seconds
from .._exceptions import ConfigError, InvalidInput
from .._tensors import TensorSpec, numpy_dtype

if TYPE_CHECKING:
    from ._shm import ShmLease

#: V2 datatype names and the numpy dtype each becomes (``BYTES`` is ``object``).
DATATYPES: Final[Mapping[str, np.dtype[Any]]] = MappingProxyType(
    {
        "BOOL": np.dtype(np.bool_),
        "UINT8": np.dtype(np.uint8),
        "UINT16": np.dtype(np.uint16),
        "UINT32": np.dtype(np.uint32),
        "UINT64": np.dtype(np.uint64),
        "INT8": np.dtype(np.int8),
        "INT16": np.dtype(np.int16),
        "INT32": np.dtype(np.int32),
        "INT64": np.dtype(np.int64),
        "FP16": np.dtype(np.float16),
        "FP32": np.dtype(np.float32),
        "FP64": np.dtype(np.float64),
        "BYTES": np.dtype(np.object_),
    }
)

# The largest finite value of each float datatype, for the overflow check.
_FLOAT_MAX: Final = {
    dtype: float(np.finfo(dtype).max) for dtype in DATATYPES.values() if dtype.kind == "f"
}

# Keyed by (kind, itemsize) so that any byte order maps to the same name.
_NAME_BY_KIND: Final = {
    (dtype.kind, dtype.itemsize): name for name, dtype in DATATYPES.items() if name != "BYTES"
}
# The binary extension is little-endian whatever the host is.
_WIRE: Final = {
    name: dtype.newbyteorder("<") for name, dtype in DATATYPES.items() if name != "BYTES"
}
# V2 names ONNX types that numpy cannot hold; model metadata still needs to say them.
_ONNX_ONLY: Final = {"tensor(bfloat16)": "BF16"}
_NAMES: Final = ", ".join(DATATYPES)
# numpy 1.x allows 32 dimensions (2.x allows 64); refuse more before numpy can fail.
_MAX_RANK: Final = 32
_U32: Final = struct.Struct("<I")
_GZIP_WBITS: Final = 16 + zlib.MAX_WBITS
_ENCODINGS: Final = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
# The infer document is an object holding `inputs`, a list of input objects, which
# hold `data`: a data list sits this many containers deep before its own nesting.
_DATA_DEPTH: Final = 3
_HEADER_DIGITS: Final = 20
# Past this many candidate first letters, one bytes.count pass is cheaper than stepping.
_FIND_STEPS: Final = 2048
# Below this many bytes `_count` uses bytes.count (0.3 us for 350 bytes, 1.8 us by finds).
_COUNT_AT_ONCE: Final = 2048


class RequestError(InvalidInput):
    """A request body that is malformed or refused; the HTTP layer answers 400."""


class PayloadTooLarge(RequestError):
    """A body over ``max_body_bytes``, as sent or once decompressed; HTTP 413."""


class UnsupportedEncoding(RequestError):
    """A ``Content-Encoding`` other than identity, gzip, x-gzip or deflate; HTTP 415."""


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{attribute.name} must be a positive integer, got {value!r}")


def _positive_seconds(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    check_seconds(attribute.name, value)


@attrs.frozen
class Limits:
    """What the server accepts in one request; everything over is refused before allocating.

    The first group bounds the HTTP exchange itself (the head, and how long a
    client may keep the server waiting); the rest bound the body and what it
    decodes to.

    Attributes:
        max_head_bytes: The most bytes of request line and header fields (and
            of trailers); a bigger head is answered 431.
        max_headers: The most header fields one request may carry (431 over it).
        head_timeout: Seconds a connection may wait for a request's head to be
            complete, from when it opened or answered its last request: idle
            keep-alive connections, silent clients and slow-header ones are
            closed then.
        body_timeout: Seconds a request body may pause (no bytes arriving)
            while the server waits for it; the request is then dropped.
        send_timeout: Seconds a response may wait for the client to read any of
            it; a client that reads nothing for that long is dropped.
        max_body_bytes: The largest body, in bytes, both as received and after
            decompression (so a small gzip body cannot inflate past it).
        max_elements_per_tensor: The most elements one input may declare in its shape.
        max_elements_per_request: The most elements all inputs of a request may
            declare together.
        max_json_depth: How deeply containers (objects and lists) may nest in a
            JSON document; the infer request object counts as 1, and nested
            ``data`` counts in full, so at the default 32 nested ``data`` may
            have up to 29 dimensions (flat ``data`` any rank up to 32).
        max_inputs: The most inputs one infer request may carry.
        max_outputs: The most outputs one infer request may name.
    """

    max_head_bytes: int = attrs.field(default=64 * 1024, validator=_positive)
    max_headers: int = attrs.field(default=100, validator=_positive)
    head_timeout: float = attrs.field(default=5.0, validator=_positive_seconds)
    body_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    send_timeout: float = attrs.field(default=30.0, validator=_positive_seconds)
    max_body_bytes: int = attrs.field(default=64 * 2**20, validator=_positive)
    max_elements_per_tensor: int = attrs.field(default=1 << 26, validator=_positive)
    max_elements_per_request: int = attrs.field(default=1 << 27, validator=_positive)
    max_json_depth: int = attrs.field(default=32, validator=_positive)
    max_inputs: int = attrs.field(default=256, validator=_positive)
    max_outputs: int = attrs.field(default=256, validator=_positive)


@attrs.frozen
class RequestedOutput:
    """One entry of a request's ``outputs`` list.

    Attributes:
        name: The output's name.
        binary: The output's own ``parameters.binary_data``, or ``None`` when the
            request did not say (the request-level ``binary_data_output`` then decides).
        shm: ``(region, offset, byte_size)`` when the output is to be written into
            a registered shared-memory region instead of the response body.
        classification: ``k`` of Triton's classification extension (the top *k*
            classes as ``"score:index:label"`` strings), or 0 for the tensor itself.
    """

    name: str
    binary: bool | None = None
    shm: tuple[str, int, int] | None = None
    classification: int = 0


# eq=False: the inputs are numpy arrays, which have no single truth value for ==.
@attrs.frozen(eq=False)
class InferRequest:
    """A decoded V2 infer request.

    Attributes:
        id: The request's ``id``, echoed in the response, or ``None``.
        inputs: Input name to array, in the order sent. Arrays from binary data
            are read-only views of the request body; ``BYTES`` arrays hold `str`
            (JSON ``data``) or `bytes` (binary, gRPC contents, shared memory).
        outputs: The outputs asked for, in order, or ``None`` when the request named
            none (or sent an empty list): then every output is returned.
        binary_output: The request-level ``parameters.binary_data_output`` (default
            ``False``): whether outputs that say nothing themselves go as binary.
        parameters: The request-level ``parameters`` as sent (e.g. ``priority``,
            ``timeout``), read-only.
    """

    id: str | None
    inputs: dict[str, npt.NDArray[Any]]
    outputs: tuple[RequestedOutput, ...] | None
    binary_output: bool
    parameters: Mapping[str, Any]


@attrs.frozen
class _Input:
    """One input as declared in the JSON, checked but not yet converted."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    count: int
    data: list[Any] | None  # None: the values come as binary data
    binary_size: int
    spine: tuple[int, ...]  # the lengths of `data`'s levels, following first elements
    shm: tuple[str, int, int] | None = None  # (region, offset, byte_size)

    @property
    def where(self) -> str:
        return f"input {_quote(self.name)}"


def v2_datatype(dtype: np.dtype[Any] | None, type_name: str = "") -> str:
    """Return the V2 datatype name for a numpy dtype or, failing that, an ONNX type string.

    ``object``, ``str`` and ``bytes`` dtypes are ``"BYTES"``; byte order does not
    matter. With *dtype* ``None``, *type_name* (e.g. ``"tensor(float)"``) decides,
    which lets model metadata name types numpy lacks (``tensor(bfloat16)`` is ``"BF16"``).

    Raises:
        ValueError: When neither has a V2 name, naming what was given.
    """
    if dtype is not None:
        if dtype.kind in "OUS":
            return "BYTES"
        name = _NAME_BY_KIND.get((dtype.kind, dtype.itemsize))
        if name is not None:
            return name
        raise ValueError(f"numpy dtype {dtype.str!r} has no V2 datatype; V2 has {_NAMES}")
    if type_name in _ONNX_ONLY:
        return _ONNX_ONLY[type_name]
    mapped = numpy_dtype(type_name)
    if mapped is None:
        raise ValueError(
            f"element type {type_name!r} has no V2 datatype; expected an ONNX tensor type such "
            "as 'tensor(float)', or a numpy dtype"
        )
    return v2_datatype(mapped)


def config_datatype(spec: TensorSpec) -> str:
    """*spec*'s data type as ``config.pbtxt`` names it, less ``TYPE_``: ``BYTES`` is ``STRING``.

    Raises:
        ValueError: As `v2_datatype`.
    """
    return v2_datatype(spec.dtype, spec.type_name).replace("BYTES", "STRING")


def v2_numpy_dtype(datatype: str) -> np.dtype[Any] | None:
    """Return the numpy dtype a V2 datatype's values take: the inverse of `v2_datatype`.

    ``"FP32"`` is float32, ``"BYTES"`` is ``object`` (elements of `str` or `bytes`). Returns
    ``None`` for a name that numpy cannot hold (``"BF16"``) or V2 does not have.
    """
    return DATATYPES.get(datatype)


def dumps(obj: Any) -> bytes:
    """Serialise *obj* as JSON with orjson (numpy arrays and scalars included)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def loads_json(body: bytes, limits: Limits, what: str) -> Any:
    """Parse a small JSON body (a repository load request, say), enforcing the limits.

    Args:
        body: The (decompressed) body.
        limits: Its ``max_body_bytes`` and ``max_json_depth`` apply.
        what: What the body is, for messages, e.g. ``"the load request"``.

    Raises:
        PayloadTooLarge: Over ``max_body_bytes``.
        RequestError: Empty, not JSON, or nested past ``max_json_depth``.
    """
    _check_size(len(body), limits, what)
    value = _parse(body, what)
    _walk([(value, 0)], limits.max_json_depth, what)
    return value


def decompress(body: bytes, content_encoding: str | None, limits: Limits) -> bytes:
    """Undo a request's ``Content-Encoding``, never producing more than ``max_body_bytes``.

    Accepts identity (``None``, ``""``, ``"identity"``), ``gzip``/``x-gzip``
    (several members are joined) and ``deflate``, which real clients send both
    zlib-wrapped, as RFC 9110 says, and raw: both are accepted. Decompression
    stops as soon as the output passes the limit, so a zip bomb costs at most
    ``max_body_bytes`` of memory. An empty body is returned as is.

    Raises:
        UnsupportedEncoding: Any other coding, or more than one.
        PayloadTooLarge: The body, or what it inflates to, is over ``max_body_bytes``.
        RequestError: The compressed data is corrupt, truncated or followed by junk.
    """
    coding = _coding(content_encoding)
    _check_size(len(body), limits, "the request body")
    if coding is None or not body:
        return body
    try:
        if coding == "gzip":
            return _gunzip(body, limits.max_body_bytes)
        return _inflate_deflate(body, limits.max_body_bytes)
    except zlib.error as exc:
        raise RequestError(
            f"the {coding}-encoded request body is corrupt ({exc}); send valid {coding} data "
            "or no Content-Encoding"
        ) from None


def parse_header_length(value: str | None, body_length: int) -> int | None:
    """Check an ``Inference-Header-Content-Length`` header against the body it came with.

    Returns:
        The JSON header's length in bytes, or ``None`` when the header is absent
        (the whole body is then JSON).

    Raises:
        RequestError: Not a non-negative decimal integer, or longer than the body.
    """
    if value is None:
        return None
    text = value.strip()
    if not text or len(text) > _HEADER_DIGITS or not (text.isascii() and text.isdigit()):
        raise RequestError(
            f"Inference-Header-Content-Length must be a non-negative integer, got {value[:40]!r}"
        )
    length = int(text)
    if length > body_length:
        raise RequestError(
            f"Inference-Header-Content-Length is {length} but the body holds only "
            f"{body_length} bytes; it must be the length of the JSON part of the body"
        )
    return length


def decode_infer_request(
    body: bytes, header_length: int | None, limits: Limits, shm: ShmLease | None = None
) -> InferRequest:
    """Turn an infer request body into arrays, checking it against *limits* before allocating.

    Args:
        body: The (decompressed) request body.
        header_length: The ``Inference-Header-Content-Length`` header's value, as
            an integer (the server's ``parse_header_length`` reads it from the
            header), or ``None`` when the request had none: the whole body is then JSON.
        limits: What to accept.
        shm: The request's lease on the server's shared-memory regions, which
            inputs and outputs with ``parameters.shared_memory_region`` use;
            ``None`` refuses such requests. Inputs read from a region are
            read-only views of it (no copy), valid while the lease is held.

    An empty body, or one without a non-empty ``inputs`` list, is an error: an
    infer request always needs inputs.

    Raises:
        PayloadTooLarge: The body is over ``max_body_bytes``.
        RequestError: Anything else wrong with the body; the message names the
            input or field and says what was expected.
    """
    _check_size(len(body), limits, "the request body")
    cut: _Cut | None = None
    if header_length is None:
        header = body
        binary = memoryview(b"")
    else:
        if (
            not isinstance(header_length, int)
            or isinstance(header_length, bool)
            or not 0 <= header_length <= len(body)
        ):
            raise RequestError(
                f"the JSON header length must be an integer from 0 to the body's "
                f"{len(body)} bytes, got {header_length!r}"
            )
        header = bytes(body[:header_length])
        binary = memoryview(body)[header_length:]
        # Longer headers are never kept: spare hashing and scanning them.
        if len(header) <= _PLAN_BYTES:
            # The same header (and id) as before; else the same but for the id.
            plan = _PLANS.get(header)
            if plan is not None and plan.limits is limits:
                request = plan.apply(binary, plan.id)
                if request is not None:
                    return request
            cut = _cut(header, data=False)
            plan = None if cut is None else _CUT_PLANS.get(cut[0])
            if plan is not None and plan.limits is limits:
                request = plan.apply(binary, _cut_id(header, cut))  # type: ignore[arg-type]
                if request is not None:
                    return request
    if not header:
        raise RequestError(
            "the infer request is empty; expected a JSON object with a non-empty 'inputs' list"
        )
    doc = _parse(header, "the infer request")
    if not isinstance(doc, dict):
        raise RequestError(
            f"the infer request must be a JSON object with an 'inputs' list, got {_kind(doc)}"
        )
    json_key = None
    if header_length is None:
        # The plan the last such request used, if this one is laid out alike
        # (no search for its id and data: just a check that they are where they were).
        json_plan = _LAST_JSON[0]
        if json_plan is not None and json_plan.limits is limits:
            spans = json_plan.match(header)
            if spans is not None:
                request = json_plan.apply(header, doc, spans)
                if request is not None:
                    return request
        cut = _cut(header, data=True)
        if cut is not None:
            json_plan = _JSON_PLANS.get(cut[0])
            if json_plan is not None and json_plan.limits is limits:
                _LAST_JSON[0] = json_plan
                request = json_plan.apply(header, doc, cut[2])
                if request is not None:
                    return request
        # Requests the raw cut does not fit (nested data, escapes) have the long key.
        json_key = _json_plan_key(doc)
        if json_key is not None:
            json_plan = _JSON_PLANS.get(json_key)
            if json_plan is not None and json_plan.limits is limits:
                request = json_plan.apply(header, doc, None)
                if request is not None:
                    return request
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"the request's 'id' must be a string, got {_show(request_id)}")
    parameters = _object(doc.get("parameters"), "the request's 'parameters'")
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise RequestError(
            "the request's parameters.binary_data_output must be true or false, "
            f"got {_show(binary_output)}"
        )

    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise RequestError(
            "the infer request needs 'inputs': a non-empty list of "
            f"{{name, shape, datatype, data}} objects; got {_show(raw_inputs)}"
        )
    if len(raw_inputs) > limits.max_inputs:
        raise RequestError(
            f"the request has {len(raw_inputs)} inputs; at most {limits.max_inputs} are accepted"
        )
    declared: dict[str, _Input] = {}
    for index, item in enumerate(raw_inputs):
        spec = _parse_input(index, item, limits)
        if spec.name in declared:
            raise RequestError(f"{spec.where} appears more than once in 'inputs'")
        declared[spec.name] = spec
    requested = _parse_outputs(doc.get("outputs"), limits)

    # Depth is checked on everything but the `data` lists, whose nesting _parse_input
    # measured along their first elements; numpy refuses data that nests unevenly.
    # A header with no more brackets and braces than the limit cannot nest past it
    # (a container's depth takes one opening bracket per level): walking it would
    # only count its booleans, which only _refuse_hidden_bools may need.
    known_bools: _Counts | None = None
    if not _shallow(header, limits.max_json_depth):
        known_bools = _walk_request(doc, raw_inputs, limits)

    total = sum(spec.count for spec in declared.values())
    if total > limits.max_elements_per_request:
        raise RequestError(
            f"the request's inputs hold {total} elements in all; at most "
            f"{limits.max_elements_per_request} are accepted per request"
        )

    inputs: dict[str, npt.NDArray[Any]] = {}
    offset = 0
    for spec in declared.values():
        if spec.data is not None:
            inputs[spec.name] = _from_json(spec, spec.data)
            continue
        if spec.shm is not None:
            if shm is None:
                raise RequestError(_NO_SHM.format(where=spec.where))
            region, start, size = spec.shm
            inputs[spec.name] = _from_binary(spec, shm.read(region, start, size, what=spec.where))
            continue
        if header_length is None:
            raise RequestError(
                f"{spec.where} has parameters.binary_data_size but the request has no "
                "Inference-Header-Content-Length header to say where the JSON ends"
            )
        end = offset + spec.binary_size
        if end > len(binary):
            raise RequestError(
                f"{spec.where} has binary_data_size {spec.binary_size} but only "
                f"{len(binary) - offset} bytes of binary data are left after the JSON header "
                "and the inputs before it"
            )
        inputs[spec.name] = _from_binary(spec, binary[offset:end])
        offset = end
    if offset != len(binary):
        raise RequestError(
            f"{len(binary) - offset} bytes follow the JSON header beyond what the inputs' "
            f"binary_data_size values account for ({offset} bytes)"
        )
    _refuse_hidden_bools(header, declared, inputs, known_bools, doc, raw_inputs, limits)
    plain = True  # every input binary, nothing in shared memory: a plan may be kept
    for output in requested or ():
        if output.shm is not None:
            plain = False
            if shm is None:
                raise RequestError(_NO_SHM.format(where=f"output {_quote(output.name)}"))
            shm.check(*output.shm, what=f"output {_quote(output.name)}")
    request = InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=requested,
        binary_output=binary_output,
        parameters=MappingProxyType(parameters),
    )
    # A plan is made the second time a key is seen: a client that sends a new
    # one each time would otherwise make one per request for nothing. A `_cut`
    # key is used only where the cut took out exactly the top-level id (when it
    # is a string) and, for JSON, every input's data: then two requests with
    # the same key differ in nothing else.
    fits = cut is not None and (cut[1] is not None) == (type(request_id) is str)
    if (
        plain
        and header_length is not None
        and len(header) <= _PLAN_BYTES
        and all(spec.data is None and spec.shm is None for spec in declared.values())
    ):
        specs = tuple(declared.values())
        if _seen_again(_PLANS, header):
            _PLANS[header] = _BinaryPlan(limits, _without_inputs(request), specs, offset)
        if fits and _seen_again(_CUT_PLANS, cut[0]):  # type: ignore[index]
            _CUT_PLANS[cut[0]] = _BinaryPlan(  # type: ignore[index]
                limits, _without_inputs(request), specs, offset
            )
    elif plain and header_length is None and all(spec.shm is None for spec in declared.values()):
        # Every input is JSON data here (no header length: a binary one was refused above).
        fast = (
            fits
            and len(cut[2]) == len(declared)  # type: ignore[index]
            and len(cut[0]) <= _PLAN_BYTES  # type: ignore[index]
        )
        if fast:
            json_key = cut[0]  # type: ignore[index]
        if json_key is not None and _seen_again(_JSON_PLANS, json_key):
            known = known_bools or _walk_request(doc, raw_inputs, limits)
            # The plan keeps no data: it may outlive this request by far.
            specs = tuple(
                _Input(spec.name, spec.datatype, spec.shape, spec.count, None, 0, ())
                for spec in declared.values()
            )
            json_plan = _JsonPlan(limits, _without_inputs(request), specs, known)
            if fast:
                json_plan.cut_from(header, cut[3])  # type: ignore[index]
            _JSON_PLANS[json_key] = json_plan
    return request


def _seen_again(plans: dict[bytes, Any], key: bytes) -> bool:
    """Whether *key* was seen before without a plan made (a plan is due); else mark it seen.

    *plans* is emptied when full. No closure in `decode_infer_request` makes
    the plans: a function with one pays for its cells on every call.
    """
    if key not in plans:
        if len(plans) >= _PLAN_COUNT:
            plans.clear()
        plans[key] = None
        return False
    return plans[key] is None


def _without_inputs(request: InferRequest) -> InferRequest:
    # What a plan keeps of a request: binary inputs are views of its body, which
    # a plan would otherwise keep alive.
    return InferRequest(request.id, {}, request.outputs, request.binary_output, request.parameters)


class _BinaryPlan:
    """What a binary request's JSON header decoded to, for the next request with that header.

    A client sends the same header again and again (the same inputs, shapes
    and outputs; only the binary data differ), and checking it cost most of
    a small request's decoding. A header already decoded under the same
    limits is not checked again: its inputs' bytes are cut from the binary
    part as before (`_from_binary` checks BOOL and BYTES data each time).
    Only headers whose inputs are all binary data, with nothing in shared
    memory (a region may go away), are kept: by the whole header, and by
    its `_cut` (all but the id's characters), for clients that send a new id
    with each request; each request's id is then read from its own header.
    """

    __slots__ = ("binary_size", "id", "limits", "request", "specs")

    def __init__(
        self, limits: Limits, request: InferRequest, specs: tuple[_Input, ...], binary_size: int
    ) -> None:
        self.limits = limits
        self.request = request  # without inputs (each request has its own)
        self.id = request.id  # the id of the header it was made from
        self.specs = specs
        self.binary_size = binary_size

    def apply(self, binary: memoryview, request_id: str | bool | None) -> InferRequest | None:
        """The request with *binary* as its data and that id; None if anything is off.

        *request_id* False (`_cut_id`: not a JSON string) or sizes that do
        not add up send the request the long way, which says what is wrong.
        """
        if len(binary) != self.binary_size or request_id is False:
            return None
        inputs: dict[str, npt.NDArray[Any]] = {}
        offset = 0
        for spec in self.specs:
            end = offset + spec.binary_size
            inputs[spec.name] = _from_binary(spec, binary[offset:end])
            offset = end
        r = self.request
        return InferRequest(
            request_id,  # type: ignore[arg-type]
            inputs,
            r.outputs,
            r.binary_output,
            r.parameters,
        )


def _cut_id(header: bytes, cut: _Cut) -> str | bool | None:
    """The id `_cut` cut from *header* (None: it had none); False if not a valid JSON string."""
    if cut[1] is None:
        return None
    start, end = cut[1]
    try:
        # The quoted id, parsed as the long way parses the whole header.
        request_id: str = orjson.loads(header[start - 1 : end + 1])
    except orjson.JSONDecodeError:
        return False
    return request_id


def _json_plan_key(doc: dict[str, Any]) -> bytes | None:
    """An all-JSON request's document without its ``id`` and inputs' ``data``, as JSON.

    Everything `decode_infer_request` checks but those is in it: two requests
    with the same key differ only in their id and data. None if unfit.
    """
    items = doc.get("inputs")
    if type(items) is not list or not items:
        return None
    stripped = []
    for item in items:
        if type(item) is not dict or "data" not in item:
            return None
        stripped.append({k: v for k, v in item.items() if k != "data"})
    rest = {k: v for k, v in doc.items() if k != "id"}  # an id per request is common
    rest["inputs"] = stripped
    try:
        key = orjson.dumps(rest)
    except TypeError:  # pragma: no cover - a safety net: the values came from orjson
        return None
    return key if len(key) <= _PLAN_BYTES else None


#: `_cut`'s answer: what is left of a header after a NUL (no JSON document
#: starts with one), where the id's characters are (between its quotes), and
#: each data list's contents (without the brackets), in order, and where each
#: cut (id or data) starts and ends, in order. A plain tuple:
#: a NamedTuple's constructor costs more than the rest of a small request's cut.
_Cut = tuple[bytes, "tuple[int, int] | None", list[bytes], list[tuple[int, int]]]


_JSON_SPACE: Final = b" \t\n\r"
_QUOTE: Final = ord('"')
_OPEN: Final = ord("[")
_COLON: Final = ord(":")


def _value_at(header: bytes, pos: int) -> int:
    """Where the value after the key that ends at *pos* starts; -1 if no colon follows."""
    end = len(header)
    while pos < end and header[pos] in _JSON_SPACE:
        pos += 1
    if pos >= end or header[pos] != _COLON:
        return -1
    pos += 1
    while pos < end and header[pos] in _JSON_SPACE:
        pos += 1
    return pos if pos < end else -1


def _cut(header: bytes, *, data: bool) -> _Cut | None:
    """*header* without its id's characters and (with *data*) its data lists' contents.

    The gRPC plans' `_wire_split`, for JSON text, and as exact: the key of a
    request is every byte of its header but the cut ones, so two requests with
    the same key decode alike but for those. With no backslash in the header
    no string holds an escape, so each key ``"data"`` and ``"id"`` appears
    literally, and a quote is always a string's end or start: the one
    ``"id"`` followed by a colon and a string, and every ``"data"`` followed
    by a colon and a flat list without strings (no ``[``, ``{`` or ``"``
    before its ``]``) are cut. The caller checks, once, on the request that
    makes a plan, that these were its top-level id and its inputs' data.
    None for anything else (an escape anywhere, ``"id"`` twice, a ``"data"``
    that is not a flat list): the long way decides.
    """
    if b"\\" in header:
        return None
    holes: list[tuple[int, int]] = []
    id_span = None
    find = header.find
    at = find(b'"id"')
    if at >= 0:
        if find(b'"id"', at + 4) >= 0:
            return None
        start = at + 6 if header.startswith(b':"', at + 4) else _value_at(header, at + 4) + 1
        if start > 0 and header[start - 1] == _QUOTE:
            end = find(b'"', start)
            if end < 0:
                return None
            id_span = (start, end)
            holes.append(id_span)
    spans: list[bytes] = []
    if data:
        at = find(b'"data"')
        while at >= 0:
            start = at + 8 if header.startswith(b":[", at + 6) else _value_at(header, at + 6) + 1
            end = find(b"]", start)
            if start <= 0 or header[start - 1] != _OPEN or end < 0:
                return None
            span = header[start:end]
            if b"[" in span or b"{" in span or b'"' in span:
                return None
            holes.append((start, end))
            spans.append(span)
            at = find(b'"data"', end)
    if not holes:
        return b"\0" + header, id_span, spans, holes
    if id_span is not None and len(holes) > 1:
        holes.sort()
    pieces = [b"\0"]
    pos = 0
    for start, end in holes:
        pieces.append(header[pos:start])
        pos = end
    pieces.append(header[pos:])
    return b"".join(pieces), id_span, spans, holes


#: What the text of a list of JSON numbers is made of (and nothing else is).
_NUMBER_TEXT: Final = b"0123456789.eE+-," + _JSON_SPACE
# Digits and points as 0, exponents as e: a run of `_LONG_NUMBER` is a number of
# 38 digits or more, which alone (with no exponent) could pass FP32's range.
_DIGITS: Final = bytes.maketrans(b"0123456789.E", b"00000000000e")
_LONG_NUMBER: Final = b"0" * 38
# Floats within this magnitude convert to any float datatype as the long way
# converts them (integers included: up to 2**53 they are exact as float64).
_EXACT: Final = float(2**53)


class _JsonPlan:
    """What an all-JSON request decoded to, but for its data, for the next one like it.

    A client sends the same inputs, shapes and outputs again and again with
    other values (and often another ``id``): everything but the ``data``
    lists and the id (names, datatypes, shapes, limits, outputs, parameters,
    depth, the booleans outside data) was checked once, under the same
    limits. Each request's id and data are still
    checked and converted as the long way does (`_from_json`,
    `_refuse_hidden_bools`), or, for float inputs sent as flat lists of
    numbers, on the whole list at once (`_floats`); where it fails, the long
    way decodes the request again to say why. Its key is the request's
    `_cut` (the raw text but the id and data), or, where that does not fit
    (nested data, escapes), `_json_plan_key`.
    """

    __slots__ = ("floats", "known", "limits", "pieces", "request", "specs")

    def __init__(
        self, limits: Limits, request: InferRequest, specs: tuple[_Input, ...], known: _Counts
    ) -> None:
        self.limits = limits
        self.request = request  # without inputs or id (each request has its own)
        self.specs = specs  # without data
        self.known = known
        # For a plan of `_cut` keys (`cut_from`): each input's float dtype and the
        # bound on its values' magnitude, if every input is a float one.
        self.floats: tuple[tuple[np.dtype[Any], float], ...] | None = None
        # And the text between the cuts, each with the byte that ends the cut after it.
        self.pieces: list[tuple[bytes, int]] = []

    def cut_from(self, header: bytes, holes: list[tuple[int, int]]) -> None:
        """Make this a plan of `_cut` keys, from the header that made it and its cuts."""
        dtypes = [DATATYPES[spec.datatype] for spec in self.specs]
        if all(dtype.kind == "f" for dtype in dtypes):
            self.floats = tuple((d, min(_FLOAT_MAX[d], _EXACT)) for d in dtypes)
        pos = 0
        for start, end in holes:
            self.pieces.append((header[pos:start], header[end]))
            pos = end
        self.pieces.append((header[pos:], -1))

    def match(self, header: bytes) -> list[bytes] | None:
        """*header*'s data lists' text if its `_cut` key is this plan's, else None.

        Its text must be this plan's between the cuts, and each cut what
        `_cut` would cut: up to the first quote (the id: no backslash) or the
        first ``]`` (data: no ``[``, ``{`` or quote; a backslash outside a
        string is not JSON, and the header parsed). Then `_cut` would find
        the same keys at the same places: none of the cut text holds a quote.
        """
        if not self.pieces:
            return None
        spans: list[bytes] = []
        pos = 0
        for piece, stop in self.pieces:
            if not header.startswith(piece, pos):
                return None
            pos += len(piece)
            if stop < 0:
                return spans if pos == len(header) else None
            end = header.find(_STOPS[stop], pos)
            if end < 0:
                return None
            text = header[pos:end]
            if stop == _QUOTE:
                if b"\\" in text:
                    return None
            elif b"[" in text or b"{" in text or b'"' in text:
                return None
            else:
                spans.append(text)
            pos = end
        return None  # pragma: no cover - the last piece has no cut after it

    def apply(
        self, header: bytes, doc: dict[str, Any], spans: list[bytes] | None
    ) -> InferRequest | None:
        """The request with *doc*'s data; None if the data are not right (the long way says why).

        *spans* are the data lists' text (`_cut`), for plans of `_cut` keys.
        """
        limits = self.limits
        request_id = doc.get("id")
        if request_id is not None and type(request_id) is not str:
            return None
        raw_inputs = doc["inputs"]
        if self.floats is not None and spans is not None:
            request = self._floats(request_id, raw_inputs, spans)
            if request is not None:
                return request
        declared: dict[str, _Input] = {}
        inputs: dict[str, npt.NDArray[Any]] = {}
        try:
            for spec, item in zip(self.specs, raw_inputs, strict=True):
                data = item["data"]
                if type(data) is not list:
                    return None
                declared[spec.name] = _Input(
                    spec.name,
                    spec.datatype,
                    spec.shape,
                    spec.count,
                    data,
                    0,
                    _spine(data, limits),
                )
            for spec in declared.values():
                inputs[spec.name] = _from_json(spec, spec.data)  # type: ignore[arg-type]
            _refuse_hidden_bools(header, declared, inputs, self.known, doc, raw_inputs, limits)
        except RequestError:
            return None
        r = self.request
        return InferRequest(request_id, inputs, r.outputs, r.binary_output, r.parameters)

    def _floats(
        self, request_id: str | None, raw_inputs: list[Any], spans: list[bytes]
    ) -> InferRequest | None:
        """Every input float data whose text holds numbers only: converted in one step each.

        What the long way checks of each value, done on the whole list: a text
        of digits, signs, points, exponents and commas alone (the document
        parsed) is a list of numbers, so no value is a boolean, null, string
        or list; the largest magnitude must be within the datatype's range and
        where float64 holds integers exactly (2**53). None
        for anything else: the values are then looked at one by one.
        """
        inputs: dict[str, npt.NDArray[Any]] = {}
        for spec, (dtype, bound), item, span in zip(
            self.specs,
            self.floats,  # type: ignore[arg-type]
            raw_inputs,
            spans,
            strict=True,
        ):
            data = item["data"]
            if span.translate(None, _NUMBER_TEXT) or len(data) != spec.count:
                return None
            if dtype.itemsize >= 4:
                # Without an exponent, a number of under 38 digits is within
                # FP32's (and FP64's) range: numpy converts it as the long way does.
                digits = span.translate(_DIGITS)
                if b"e" not in digits and _LONG_NUMBER not in digits:
                    inputs[spec.name] = np.array(data, dtype=dtype).reshape(spec.shape)
                    continue
            values = np.array(data, dtype=np.float64)
            if values.size and not np.abs(values).max() <= bound:
                return None
            inputs[spec.name] = values.astype(dtype, copy=False).reshape(spec.shape)
        r = self.request
        return InferRequest(request_id, inputs, r.outputs, r.binary_output, r.parameters)


#: Recent binary requests' JSON headers (at most `_PLAN_BYTES` each) and their
#: plans (None: seen once); emptied when `_PLAN_COUNT` are kept.
_PLANS: Final[dict[bytes, _BinaryPlan | None]] = {}
#: The same by `_cut` key (the header but the id), for clients with an id per request.
_CUT_PLANS: Final[dict[bytes, _BinaryPlan | None]] = {}
#: The same for all-JSON requests, by `_cut` key or `_json_plan_key`.
_JSON_PLANS: Final[dict[bytes, _JsonPlan | None]] = {}
#: The `_cut` plan the last all-JSON request used.
_LAST_JSON: Final[list[_JsonPlan | None]] = [None]
_STOPS: Final = {ord('"'): b'"', ord("]"): b"]"}
_PLAN_BYTES: Final = 4096
_PLAN_COUNT: Final = 256


def _json_response(
    model_name: str,
    model_version: str | None,
    request: InferRequest,
    outputs: Mapping[str, npt.NDArray[Any]],
    output_order: Sequence[str],
) -> bytes | None:
    """`encode_infer_response`'s usual all-JSON body, from a memo of all but the id and data.

    The same bytes as the long way's (a test compares them): the memo holds
    the document's head and each output's ``{name, datatype, shape, "data":``;
    each request adds its id and each output's flat values. Only for
    requests that name no outputs and ask for no binary ones (the usual JSON
    request; `encode_infer_response` asks for no other: those would pay for
    the question more often than the memo saves). None for anything else (an
    output missing, BYTES, a dtype or layout to convert): the long way answers.
    """
    names = output_order
    arrays = []
    # The key is built flat, appended to as the outputs are checked: a tuple per
    # output and a comprehension cost more than the whole lookup (1.1 against 0.4 µs).
    parts: list[Any] = [model_name, model_version, *names]
    for name in names:
        array = outputs.get(name)
        if type(array) is not np.ndarray or not array.flags.c_contiguous:
            return None
        arrays.append(array)
        parts += (array.dtype, array.shape)
    key = tuple(parts)
    memo = _RESPONSE_HEADS.get(key)
    if memo is None:
        if any(a.dtype.kind not in "biuf" or a.dtype not in _NATIVE for a in arrays):
            return None
        start: dict[str, Any] = {"model_name": model_name}
        if model_version is not None:
            start["model_version"] = model_version
        head = dumps(start)[:-1]  # without its closing brace
        entries = [
            dumps({"name": n, "datatype": v2_datatype(a.dtype), "shape": list(a.shape)})[:-1]
            + b',"data":'
            for n, a in zip(names, arrays, strict=True)
        ]
        memo = (head, entries)
        if len(_RESPONSE_HEADS) >= _PLAN_COUNT:
            _RESPONSE_HEADS.clear()
        _RESPONSE_HEADS[key] = memo
    head, entries = memo
    pieces = [head]
    if request.id is not None:
        pieces += (b',"id":', dumps(request.id))
    pieces.append(b',"outputs":[')
    for index, (entry, array) in enumerate(zip(entries, arrays, strict=True)):
        if index:
            pieces.append(b"},")
        pieces += (entry, dumps(array.reshape(-1)))
    pieces.append(b"}]}")
    return b"".join(pieces)


def _json_strings(name: str, items: list[Any]) -> list[str]:
    texts = _texts(items)
    if texts is None:
        index = next(i for i, v in enumerate(items) if not _json_text(v))
        raise ValueError(
            f"input {name!r} holds bytes that are not UTF-8 (element {index}), which JSON "
            "cannot carry; encode the request with binary=True"
        )
    return texts


#: The numpy dtypes orjson writes as the long way would (native byte order).
_NATIVE: Final = frozenset(DATATYPES.values()) - {np.dtype(np.object_)}
#: `_json_response`'s memo: the head and each output's entry but its data.
_RESPONSE_HEADS: Final[dict[tuple[Any, ...], tuple[bytes, list[bytes]]]] = {}


def encode_infer_request(
    inputs: Mapping[str, npt.NDArray[Any]], *, binary: bool = False
) -> tuple[bytes, int | None]:
    """Build a V2 infer request body: the client's side of `decode_infer_request`.

    Each input goes with its name, shape and datatype (what `v2_datatype` names
    its dtype), in the order of *inputs*. As JSON its values are flat row-major
    ``data`` (``BYTES`` elements as strings). With *binary* (Triton's binary
    tensor data extension) they are instead raw little-endian bytes after the
    JSON, each input's size in its ``parameters.binary_data_size``, and the
    request asks for its outputs as binary too (``binary_data_output``).

    Returns:
        The body, and the JSON part's length for the
        ``Inference-Header-Content-Length`` header, or ``None`` without *binary*
        (the body is then all JSON).

    Raises:
        ValueError: An input's dtype has no V2 datatype, or (without *binary*) a
            ``BYTES`` input holds bytes that are not UTF-8, which JSON cannot carry.
    """
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, values in inputs.items():
        array = np.asarray(values)
        datatype = v2_datatype(array.dtype)
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
        items = array.ravel()
        if binary:
            if datatype == "BYTES":
                blob = _pack_bytes(items.tolist())
            else:
                blob = np.ascontiguousarray(items, dtype=_WIRE[datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = _json_strings(name, items.tolist())
        else:
            entry["data"] = np.ascontiguousarray(items, dtype=DATATYPES[datatype])
        entries.append(entry)
    doc: dict[str, Any] = {"inputs": entries}
    if not binary:
        return dumps(doc), None
    doc["parameters"] = {"binary_data_output": True}
    header = dumps(doc)
    return b"".join([header, *blobs]), len(header)


def encode_infer_response(
    *,
    model_name: str,
    model_version: str | None,
    request: InferRequest,
    outputs: Mapping[str, npt.NDArray[Any]],
    output_order: Sequence[str],
    parameters: Mapping[str, Any] | None = None,
    shm: ShmLease | None = None,
) -> tuple[bytes, int | None]:
    """Build a V2 infer response body.

    Returns the outputs the request named, in its order, or every output in
    *output_order* when it named none. An output goes as binary when its own
    ``binary_data`` says so, else when the request's ``binary_data_output`` does
    (and a ``BYTES`` output that is not all UTF-8, when the request shows its
    client reads binary outputs; else that is a `RequestError`). Binary
    outputs carry ``parameters.binary_data_size`` and no ``data``; their bytes
    follow the JSON in the same order. JSON outputs carry flat row-major ``data``.
    Outputs requested in shared memory are written into their region (through
    *shm*, the lease `decode_infer_request` checked them with) and carry only
    their name, datatype, shape and ``parameters.shared_memory_*``.

    Returns:
        The body, and the JSON part's length for the
        ``Inference-Header-Content-Length`` header, or ``None`` when no output is
        binary (the body is then all JSON).

    Raises:
        RequestError: The request named an output that *outputs* lacks, or a plain
            JSON request's ``BYTES`` output holds bytes that are not UTF-8.
        ValueError: An output in *output_order* is missing from *outputs*, or an
            output's dtype has no V2 datatype (a server-side problem).
    """
    if parameters is None and request.outputs is None and not request.binary_output:
        body = _json_response(model_name, model_version, request, outputs, output_order)
        if body is not None:
            return body, None
    places: dict[str, tuple[str, int, int]] = {}
    if request.outputs is not None:
        places = {item.name: item.shm for item in request.outputs if item.shm is not None}
    entries: list[dict[str, Any]] = []
    blobs: list[Any] = []
    for name, binary, array in _chosen_outputs(request, outputs, output_order):
        place = places.get(name)
        if place is not None and shm is not None:
            entries.append(_output_to_shm(name, array, place, shm))
            continue
        entry, blob = _encode_output(name, array, binary, request)
        entries.append(entry)
        if blob is not None:
            blobs.append(blob)
    doc: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    if request.id is not None:
        doc["id"] = request.id
    if parameters is not None:
        doc["parameters"] = dict(parameters)
    doc["outputs"] = entries
    header = dumps(doc)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def decode_infer_parts(
    *,
    request_id: str | None,
    parameters: Mapping[str, Any],
    inputs: Sequence[Mapping[str, Any]],
    raw: Sequence[bytes],
    outputs: Sequence[Mapping[str, Any]] | None,
    limits: Limits,
    shm: ShmLease | None = None,
) -> InferRequest:
    """An infer request whose parts arrived parsed (gRPC), checked as `decode_infer_request` checks.

    *inputs* are ``{name, datatype, shape, data}`` objects as in the JSON
    form (``data`` flat; absent for an input whose values are in *raw*),
    *outputs* ``{name, parameters}`` objects. *raw* holds each input's values
    as little-endian bytes, in order (Triton's ``raw_input_contents``): either
    one entry per input not in shared memory, or none at all. An input whose
    parameters name a ``shared_memory_region`` is read through *shm*, the
    request's lease, as `decode_infer_request` reads it.

    Raises:
        RequestError: What is wrong, naming the input and what was expected.
    """
    if not inputs:
        raise RequestError("the infer request has no inputs; it needs at least one")
    if len(inputs) > limits.max_inputs:
        raise RequestError(
            f"the request has {len(inputs)} inputs; at most {limits.max_inputs} are accepted"
        )
    in_shm = [_in_shared_memory(item) for item in inputs]
    if raw and len(raw) != in_shm.count(False):
        raise RequestError(
            f"the request has {in_shm.count(False)} inputs outside shared memory but "
            f"{len(raw)} raw_input_contents; send one raw_input_contents per such input, in "
            "the order of the inputs, or none"
        )
    declared: dict[str, _Input] = {}
    raw_index = 0
    for index, item in enumerate(inputs):
        if raw and not in_shm[index]:
            if "data" in item:
                raise RequestError(
                    f"input {_quote(str(item.get('name')))} has contents, but the request "
                    "sends raw_input_contents: send every input one way or the other"
                )
            item = {**item, "parameters": {"binary_data_size": len(raw[raw_index])}}
            spec = _parse_input(index, item, limits, f"raw_input_contents[{raw_index}]")
            raw_index += 1
        else:
            spec = _parse_input(index, item, limits)
        if spec.name in declared:
            raise RequestError(f"{spec.where} appears more than once in the inputs")
        declared[spec.name] = spec
    total = sum(spec.count for spec in declared.values())
    if total > limits.max_elements_per_request:
        raise RequestError(
            f"the request's inputs hold {total} elements in all; at most "
            f"{limits.max_elements_per_request} are accepted per request"
        )
    arrays: dict[str, npt.NDArray[Any]] = {}
    raw_index = 0
    for spec in declared.values():
        if spec.shm is not None:
            if shm is None:
                raise RequestError(_NO_SHM.format(where=spec.where))
            region, start, size = spec.shm
            arrays[spec.name] = _from_binary(spec, shm.read(region, start, size, what=spec.where))
        elif spec.data is None:
            arrays[spec.name] = _from_binary(spec, memoryview(raw[raw_index]))
            raw_index += 1
        else:
            arrays[spec.name] = _from_json(spec, spec.data)
    return InferRequest(
        id=request_id,
        inputs=arrays,
        outputs=_parse_outputs(None if outputs is None else list(outputs), limits),
        binary_output=True,
        parameters=MappingProxyType(dict(parameters)),
    )


def _in_shared_memory(item: Mapping[str, Any]) -> bool:
    parameters = item.get("parameters")
    return isinstance(parameters, Mapping) and any(
        str(key).startswith("shared_memory") for key in parameters
    )


#: An output as `encode_raw_outputs` gives it: (name, datatype, shape, data, parameters).
RawOutput = tuple[str, str, tuple[int, ...], bytes | memoryview, dict[str, Any] | None]


def encode_raw_outputs(
    request: InferRequest,
    outputs: Mapping[str, npt.NDArray[Any]],
    output_order: Sequence[str],
    shm: ShmLease | None = None,
    *,
    copy: bool = True,
) -> list[RawOutput]:
    """The outputs a request asked for (all, in *output_order*, if it named none) as raw bytes.

    Each is ``(name, datatype, shape, data, parameters)``, the data
    little-endian (``BYTES``: each element's 4-byte length, then its bytes),
    as Triton's ``raw_output_contents`` carries them. An output the request
    placed in shared memory is written there through *shm* (the lease
    `decode_infer_parts` read with); its data is empty and its parameters
    name the region, offset and bytes written, as Triton answers.

    With *copy* false, an output that is not ``BYTES`` is given as a byte view
    of its array (as sent: contiguous, little-endian; converted first if it is
    not) instead of a copy, for a caller that copies it into its answer at once,
    before the array may change: the answer's bytes are then copied once, not
    twice.

    Raises:
        RequestError: The request named an output that *outputs* lacks.
    """
    return raw_output_encoder(request, output_order, shm, copy=copy)(outputs)


def raw_output_encoder(
    request: InferRequest,
    output_order: Sequence[str],
    shm: ShmLease | None = None,
    *,
    copy: bool = True,
) -> Callable[[Mapping[str, npt.NDArray[Any]]], list[RawOutput]]:
    """`encode_raw_outputs` for one request's responses (a stream's many): its choices made once.

    The returned function takes a response's outputs and raises as
    `encode_raw_outputs` does.
    """
    places = {item.name: item.shm for item in request.outputs or () if item.shm is not None}
    chosen = [name for name, _binary in _chosen_names(request, output_order)]

    def encode(outputs: Mapping[str, npt.NDArray[Any]]) -> list[RawOutput]:
        encoded: list[RawOutput] = []
        for name in chosen:
            array = outputs.get(name)
            if array is None:
                raise _missing_output(request, name, output_order)
            if array.__class__ is not np.ndarray:
                array = np.asarray(array)
            place = places.get(name) if places else None
            if place is not None:
                if shm is None:
                    raise RequestError(_NO_SHM.format(where=f"output {_quote(name)}"))
                entry = _output_to_shm(name, array, place, shm)
                encoded.append((name, entry["datatype"], array.shape, b"", entry["parameters"]))
                continue
            kind = kinds.get(array.dtype)
            if kind is None:
                datatype = v2_datatype(array.dtype)
                kind = kinds[array.dtype] = (datatype, _WIRE.get(datatype))
            datatype, wire_dtype = kind
            data: bytes | memoryview
            if wire_dtype is None:  # BYTES
                data = _pack_bytes(array.ravel().tolist())
            else:
                wire = np.ascontiguousarray(array, dtype=wire_dtype)
                # A view's length is its bytes ("B"); an empty array cannot be cast so.
                data = wire.tobytes() if copy or not wire.size else wire.data.cast("B")
            encoded.append((name, datatype, array.shape, data, None))
        return encoded

    # Each dtype met: its datatype and wire dtype (None: BYTES), for the next responses.
    kinds: dict[np.dtype[Any], tuple[str, np.dtype[Any] | None]] = {}
    return encode


def _chosen_outputs(
    request: InferRequest,
    outputs: Mapping[str, npt.NDArray[Any]],
    output_order: Sequence[str],
) -> Iterator[tuple[str, bool, npt.NDArray[Any]]]:
    # The outputs to answer with, each with whether it goes as binary.
    for name, binary in _chosen_names(request, output_order):
        array = outputs.get(name)
        if array is None:
            raise _missing_output(request, name, output_order)
        yield name, binary, np.asarray(array)


def _chosen_names(request: InferRequest, output_order: Sequence[str]) -> list[tuple[str, bool]]:
    # The names of the outputs to answer with, each with whether it goes as binary.
    if request.outputs is None:
        return [(name, request.binary_output) for name in output_order]
    return [
        (item.name, request.binary_output if item.binary is None else item.binary)
        for item in request.outputs
    ]


def _missing_output(request: InferRequest, name: str, output_order: Sequence[str]) -> Exception:
    # The error for an output to answer with that the model's outputs lack.
    if request.outputs is not None:
        return RequestError(
            f"output {name!r} was requested but the model has no such output; "
            f"it has {', '.join(map(repr, output_order)) or 'none'}"
        )
    return ValueError(f"output {name!r} is in output_order but not in outputs")


# -- decoding helpers ---------------------------------------------------------------------------


def _check_size(size: int, limits: Limits, what: str) -> None:
    if size > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"{what} is {size} bytes; at most {limits.max_body_bytes} are accepted"
        )


def _parse(text: bytes, what: str) -> Any:
    if not text:
        raise RequestError(f"{what} is empty; expected a JSON document")
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        # orjson also refuses, at 1024 levels, nesting that it cannot parse safely.
        hint = ""
        if "UTF-8" in str(exc):
            hint = (
                " (binary tensor data must follow a JSON header whose length the "
                "Inference-Header-Content-Length header gives)"
            )
        raise RequestError(f"{what} is not valid JSON: {exc}{hint}") from None


@attrs.frozen
class _Counts:
    """How many JSON ``true`` and ``false`` values were seen."""

    trues: int = 0
    falses: int = 0


def _walk(roots: Iterable[tuple[Any, int]], limit: int, what: str, start: int = 0) -> _Counts:
    """Check nesting depth without recursion; count the booleans met on the way.

    Each root is a value and the depth of the container holding it, at most *start*.
    """
    if start > limit:
        raise _too_deep(limit, what)
    trues = falses = 0
    # Each entry: values, and the depth of the container holding them. Scalars
    # are counted where they are met rather than stacked (most values are
    # scalars); orjson makes exactly dicts and lists, never subclasses.
    stack: list[tuple[Iterable[Any], int]] = [((value,), outer) for value, outer in roots]
    while stack:
        items, depth = stack.pop()
        if depth > limit:
            raise _too_deep(limit, what)
        for value in items:
            kind = type(value)
            if kind is dict:
                stack.append((value.values(), depth + 1))
            elif kind is list:
                stack.append((value, depth + 1))
            elif value is True:
                trues += 1
            elif value is False:
                falses += 1
    return _Counts(trues, falses)


#: Headers up to this size are scanned for brackets (`_shallow`) rather than walked.
_SCAN_AT_MOST: Final = 16 * 1024


def _shallow(header: bytes, limit: int) -> bool:
    """Whether *header* holds too few brackets and braces to nest past *limit*.

    Two ``count`` scans of a small header cost a fraction of walking its
    parsed objects; a long one (big JSON ``data``) is walked instead, since
    the walk leaves ``data`` out.
    """
    return len(header) <= _SCAN_AT_MOST and header.count(b"[") + header.count(b"{") <= limit


def _walk_request(doc: dict[str, Any], raw_inputs: list[Any], limits: Limits) -> _Counts:
    """`_walk` an infer request's header, leaving out the ``data`` lists."""
    roots: list[tuple[Any, int]] = [(v, 1) for k, v in doc.items() if k != "inputs"]
    for item in raw_inputs:
        roots.extend((v, _DATA_DEPTH) for k, v in item.items() if k != "data")
    return _walk(roots, limits.max_json_depth, "the infer request", start=_DATA_DEPTH)


def _too_deep(limit: int, what: str) -> RequestError:
    return RequestError(
        f"{what} nests objects and lists more than {limit} deep; at most {limit} levels "
        "are accepted"
    )


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object, got {_show(value)}")
    return value


def _parse_input(
    index: int, item: Any, limits: Limits, size_name: str = "binary_data_size"
) -> _Input:
    if not isinstance(item, dict):
        raise RequestError(
            f"inputs[{index}] must be an object with name, shape, datatype and data; "
            f"got {_show(item)}"
        )
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"inputs[{index}] needs a 'name' string, got {_show(name)}")
    where = f"input {_quote(name)}"

    datatype = item.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        hint = ""
        if isinstance(datatype, str) and datatype.upper() in DATATYPES:
            hint = " (the names are upper-case)"
        elif datatype == "BF16":
            hint = " (BF16 is not supported by this server)"
        raise RequestError(
            f"{where}: 'datatype' must be one of {_NAMES}{hint}; got {_show(datatype)}"
        )

    raw_shape = item.get("shape")
    if (
        not isinstance(raw_shape, list)
        or len(raw_shape) > _MAX_RANK
        or not all(type(dim) is int and dim >= 0 for dim in raw_shape)
    ):
        raise RequestError(
            f"{where}: 'shape' must be a list of at most {_MAX_RANK} non-negative integers, "
            f"got {_show(raw_shape)}"
        )
    shape = tuple(raw_shape)
    # Zero dims are left out: numpy refuses shapes like [2**62, 2**62, 0] too.
    extent = math.prod(dim for dim in shape if dim)
    count = math.prod(shape)
    if extent > limits.max_elements_per_tensor:
        size = f"holds {count}" if count else f"spans {extent} (leaving out its zero dimensions)"
        raise RequestError(
            f"{where}: shape {list(shape)} {size} elements; at most "
            f"{limits.max_elements_per_tensor} are accepted per tensor"
        )

    parameters = _object(item.get("parameters"), f"{where}: 'parameters'")
    shm = _shm_parameters(parameters, where)
    if shm is not None:
        if "data" in item or "binary_data_size" in parameters:
            raise RequestError(
                f"{where} has parameters.shared_memory_region and also 'data' or "
                "binary_data_size; send the values one way"
            )
        _, _, byte_size = shm
        if datatype == "BYTES":
            if byte_size < 4 * count:
                raise RequestError(
                    f"{where}: shared_memory_byte_size is {byte_size} bytes, too few for "
                    f"{count} BYTES elements of at least 4 bytes (the length prefix) each"
                )
        elif byte_size != count * DATATYPES[datatype].itemsize:
            raise RequestError(
                f"{where}: shared_memory_byte_size is {byte_size} bytes but shape "
                f"{list(shape)} of {datatype} needs {count * DATATYPES[datatype].itemsize}"
            )
        return _Input(name, datatype, shape, count, None, byte_size, (), shm)
    binary_size = parameters.get("binary_data_size")
    if binary_size is not None:
        if "data" in item:
            raise RequestError(
                f"{where} has both 'data' and parameters.binary_data_size; send exactly one"
            )
        if type(binary_size) is not int or binary_size < 0:
            raise RequestError(
                f"{where}: parameters.binary_data_size must be a non-negative integer, "
                f"got {_show(binary_size)}"
            )
        if datatype == "BYTES":
            if binary_size < 4 * count:
                raise RequestError(
                    f"{where}: {size_name} is {binary_size} bytes, too few for {count} "
                    "BYTES elements of at least 4 bytes (the length prefix) each"
                )
        elif binary_size != count * DATATYPES[datatype].itemsize:
            raise RequestError(
                f"{where}: {size_name} is {binary_size} bytes but shape {list(shape)} of "
                f"{datatype} needs {count * DATATYPES[datatype].itemsize}"
            )
        return _Input(name, datatype, shape, count, None, binary_size, ())

    if "data" not in item:
        raise RequestError(
            f"{where} has neither 'data' nor parameters.binary_data_size; send one of them"
        )
    data = item["data"]
    if not isinstance(data, list):
        raise RequestError(
            f"{where}: 'data' must be a list of {datatype} values, got {_show(data)}"
        )
    return _Input(name, datatype, shape, count, data, 0, _spine(data, limits))


def _spine(data: list[Any], limits: Limits) -> tuple[int, ...]:
    """The lengths of *data*'s levels, following first elements; refused past the depth limit."""
    spine: list[int] = []
    level: Any = data
    # Bounded by the depth limit, so a client cannot make this loop long.
    while isinstance(level, list):
        spine.append(len(level))
        if len(spine) + _DATA_DEPTH > limits.max_json_depth:
            raise _too_deep(limits.max_json_depth, "the infer request")
        if not level:
            break
        level = level[0]
    return tuple(spine)


def _parse_outputs(raw: Any, limits: Limits) -> tuple[RequestedOutput, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError(
            f"the request's 'outputs' must be a list of {{name, parameters}} objects, "
            f"got {_show(raw)}"
        )
    if len(raw) > limits.max_outputs:
        raise RequestError(
            f"the request names {len(raw)} outputs; at most {limits.max_outputs} are accepted"
        )
    seen: dict[str, RequestedOutput] = {}
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RequestError(f"outputs[{index}] must be an object, got {_show(item)}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"outputs[{index}] needs a 'name' string, got {_show(name)}")
        where = f"output {_quote(name)}"
        if name in seen:
            raise RequestError(f"{where} appears more than once in 'outputs'")
        parameters = _object(item.get("parameters"), f"{where}: 'parameters'")
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise RequestError(
                f"{where}: parameters.binary_data must be true or false, got {_show(binary)}"
            )
        classes = parameters.get("classification", 0)
        if isinstance(classes, bool) or not isinstance(classes, int) or classes < 0:
            raise RequestError(
                f"{where}: parameters.classification must be a number of classes >= 0, "
                f"got {_show(classes)}"
            )
        shm = _shm_parameters(parameters, where)
        if shm is not None and classes:
            raise RequestError(
                f"{where}: a classification output cannot go to shared memory; ask for one "
                "or the other"
            )
        seen[name] = RequestedOutput(name, binary, shm, classes)
    return tuple(seen.values()) or None


_NO_SHM: Final = (
    "{where}: shared memory is not available on this endpoint; send the values as 'data' "
    "or as binary data"
)


def _shm_parameters(parameters: dict[str, Any], where: str) -> tuple[str, int, int] | None:
    """``(region, offset, byte_size)`` from ``parameters.shared_memory_*``, or ``None``."""
    # A loop rather than a set first: most parameters have no shared memory at all.
    for key in parameters:
        if key.startswith("shared_memory"):
            break
    else:
        return None
    keys = {k for k in parameters if k.startswith("shared_memory")}
    unknown = sorted(keys - _SHM_KEYS)
    if unknown:
        raise RequestError(
            f"{where}: unknown parameter {unknown[0]!r}; shared memory takes "
            "shared_memory_region, shared_memory_offset and shared_memory_byte_size"
        )
    region = parameters.get("shared_memory_region")
    if not isinstance(region, str) or not region:
        raise RequestError(
            f"{where}: parameters.shared_memory_region must name a registered region, "
            f"got {_show(region)}"
        )
    offset = parameters.get("shared_memory_offset", 0)
    size = parameters.get("shared_memory_byte_size")
    for key, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", size)):
        if type(value) is not int or value < 0:
            raise RequestError(
                f"{where}: parameters.{key} must be a non-negative integer, got {_show(value)}"
            )
    return region, offset, size  # type: ignore[return-value]  # both checked as int above


_SHM_KEYS: Final = frozenset(
    {"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"}
)


def _from_json(spec: _Input, data: list[Any]) -> npt.NDArray[Any]:
    nested = len(spec.spine) > 1
    if nested and spec.spine != spec.shape:
        raise RequestError(
            f"{spec.where}: 'data' nests as {list(spec.spine)} but the shape is "
            f"{list(spec.shape)}; send a flat list of {spec.count} values or lists nested "
            "to match the shape"
        )
    if not nested and len(data) != spec.count:
        raise RequestError(
            f"{spec.where}: 'data' has {len(data)} values but shape {list(spec.shape)} "
            f"holds {spec.count}"
        )
    # The outer lengths now fit the shape, so what numpy builds below is no bigger
    # than the shape allows, or numpy refuses uneven nesting first.
    expected = spec.shape if nested else (spec.count,)
    if spec.datatype == "BYTES":
        return _bytes_from_json(spec, data, expected)
    target = DATATYPES[spec.datatype]
    if not nested and target.kind == "f" and data:
        floats = _plain_floats(data, target)
        if floats is not None:
            return floats.reshape(spec.shape)
    try:
        # Let numpy infer a dtype first: given the target dtype directly, it would
        # quietly parse strings and turn None into NaN.
        array = np.array(data)
    except (ValueError, TypeError, OverflowError):
        raise RequestError(_uneven(spec)) from None
    if array.shape != expected:  # pragma: no cover - numpy refuses uneven nesting above
        raise RequestError(_uneven(spec))
    if array.size == 0:
        return np.zeros(spec.shape, dtype=target)
    kind = array.dtype.kind
    if target.kind == "b":
        if kind != "b":
            raise _bad_value(spec, _first(spec, lambda v: type(v) is not bool), "true or false")
        return array.reshape(spec.shape)
    if kind not in "iuf":
        raise _bad_value(spec, _first(spec, _not_number), "numbers")
    if target.kind in "iu":
        info = np.iinfo(target)
        span = f"integers from {info.min} to {info.max}"
        in_range: Callable[[Any], bool] = lambda v: not info.min <= v <= info.max  # noqa: E731
        if kind == "f":
            # numpy also infers float64 for ints that need both int64 and uint64
            # (say 0 and 2**63); those are checked and converted exactly here.
            if set(map(type, _flat(spec))) != {int}:
                culprit = _first(spec, lambda v: type(v) is not int)
                if type(culprit) is float and not _INT_LOW < culprit < _INT_HIGH:
                    # orjson reads an integer past 64 bits as the nearest float: the
                    # client sent digits, not this float, so say what was wrong with them.
                    raise RequestError(
                        f"{spec.where}: {spec.datatype} data must be {span}; got a number "
                        f"past the 64-bit range (about {culprit:.6g})"
                    )
                raise _bad_value(spec, culprit, span)
            if min(_flat(spec)) < info.min or max(_flat(spec)) > info.max:
                raise _bad_value(spec, _first(spec, in_range), span)
            return np.array(data, dtype=target).reshape(spec.shape)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise _bad_value(spec, _first(spec, in_range), span)
        return array.astype(target, copy=False).reshape(spec.shape)
    limit = _FLOAT_MAX[target]
    # JSON holds no infinities, so only values beyond the target's range can
    # overflow; looking for them first spares most requests the errstate, which
    # cost more than the cast.
    if array.max() <= limit and array.min() >= -limit:
        return array.astype(target, copy=False).reshape(spec.shape)
    with np.errstate(over="ignore"):
        converted = array.astype(target, copy=False)
    overflow = np.flatnonzero(np.isinf(converted))
    if overflow.size:
        culprit = array.reshape(-1)[overflow[0]].item()
        raise _bad_value(spec, culprit, f"numbers within +-{limit:g}")
    return converted.reshape(spec.shape)


_NUMBER_TYPES: Final = (int, float)
#: The integers orjson reads as ints; past these, it reads the nearest float.
_INT_LOW: Final = -(2**63)
_INT_HIGH: Final = 2**64


def _plain_floats(data: list[Any], target: np.dtype[Any]) -> npt.NDArray[Any] | None:
    """A flat list of numbers within *target*'s range as an array; None for anything else.

    The common JSON request, converted in one step: Python's ``min`` and
    ``max`` of the list (about half the cost of numpy inferring a dtype and
    reducing it twice) bound the values, and refuse what is not a number: a
    string, ``null``, object or list beside a number cannot be compared with
    it, so values that all compare are of one kind, which the least one's type
    tells. A boolean compares as a number: `_refuse_hidden_bools` finds those.
    None sends the caller the long way, which says what was wrong.
    """
    try:
        low = min(data)
        high = max(data)
    except TypeError:
        return None
    limit = _FLOAT_MAX[target]
    if type(low) not in _NUMBER_TYPES or low < -limit or high > limit:
        return None
    try:
        return np.array(data, dtype=target)
    except (OverflowError, TypeError, ValueError):  # pragma: no cover - a safety net
        return None


#: What a BYTES element may be in ``data``: str from JSON, bytes from gRPC's bytes_contents.
_STRINGS: Final = frozenset({str, bytes})


def _bytes_from_json(spec: _Input, data: list[Any], expected: tuple[int, ...]) -> npt.NDArray[Any]:
    try:
        # dtype=object keeps strings whole; uneven nesting shows up as a wrong shape.
        array = np.array(data, dtype=object)
    except (ValueError, TypeError):  # pragma: no cover - a safety net: numpy gives a shape
        raise RequestError(_uneven(spec)) from None
    if array.shape != expected:
        raise RequestError(_uneven(spec))
    flat = array.ravel().tolist()
    if set(map(type, flat)) - _STRINGS:
        # Which element, as the engine says it of an object array from Python.
        index = next(i for i, value in enumerate(flat) if type(value) not in _STRINGS)
        raise RequestError(
            f"{spec.where}: BYTES data must be strings; got {_show(flat[index])} at index "
            f"{index} of the flattened data"
        )
    return array.reshape(spec.shape)


def _from_binary(spec: _Input, chunk: memoryview) -> npt.NDArray[Any]:
    if spec.datatype == "BYTES":
        return _unpack_bytes(spec, chunk)
    if spec.datatype == "BOOL" and (np.frombuffer(chunk, dtype=np.uint8) > 1).any():
        raise RequestError(
            f"{spec.where}: BOOL binary data must be bytes 0 or 1, one per element; "
            "it holds other values"
        )
    return np.frombuffer(chunk, dtype=_WIRE[spec.datatype]).reshape(spec.shape)


def _unpack_bytes(spec: _Input, chunk: memoryview) -> npt.NDArray[Any]:
    items: list[bytes] = []
    pos = 0
    end = len(chunk)
    for index in range(spec.count):
        if pos + 4 > end:
            raise RequestError(
                f"{spec.where}: BYTES binary data ends inside element {index}'s 4-byte length; "
                f"shape {list(spec.shape)} needs {spec.count} elements"
            )
        (length,) = _U32.unpack_from(chunk, pos)
        pos += 4
        if pos + length > end:
            raise RequestError(
                f"{spec.where}: BYTES element {index} says it is {length} bytes long but only "
                f"{end - pos} bytes of its binary data are left"
            )
        # As sent: the engine decodes for a model that takes text (TensorSpec.utf8).
        items.append(bytes(chunk[pos : pos + length]))
        pos += length
    if pos != end:
        raise RequestError(
            f"{spec.where}: {end - pos} bytes follow the last of its {spec.count} BYTES "
            f"elements; binary_data_size must be exactly {pos}"
        )
    result = np.empty(spec.count, dtype=object)
    result[:] = items
    return result.reshape(spec.shape)


def _refuse_hidden_bools(
    header: bytes,
    declared: Mapping[str, _Input],
    inputs: Mapping[str, npt.NDArray[Any]],
    known: _Counts | None,
    doc: dict[str, Any],
    raw_inputs: list[Any],
    limits: Limits,
) -> None:
    """Refuse ``true``/``false`` inside numeric ``data``, which numpy reads as 1 and 0.

    Looking at each value's type costs about as much as converting it, so this
    first counts the literals in the raw JSON: when every one is accounted for by
    booleans seen elsewhere (parameters, ``BOOL`` data), numeric data cannot hold
    any. Only otherwise (say, a string contains "true") are the numeric inputs'
    values looked at one by one. *known* is None when the header was not walked
    (`_shallow`): it is walked here only if JSON data could hide a boolean.
    """
    numeric = []
    bool_data = []
    for spec in declared.values():
        if spec.data is None or spec.datatype == "BYTES":
            continue
        if spec.datatype == "BOOL":
            bool_data.append(spec)
        else:
            numeric.append(spec)
    if not numeric:
        return
    text_trues = _count(header, b"true")
    text_falses = _count(header, b"false")
    if not (text_trues or text_falses):
        return
    if known is None:
        known = _walk_request(doc, raw_inputs, limits)
    trues, falses = known.trues, known.falses
    for spec in bool_data:
        set_count = int(np.count_nonzero(inputs[spec.name]))
        trues += set_count
        falses += spec.count - set_count
    if text_trues == trues and text_falses == falses:
        return
    for spec in numeric:
        if bool in set(map(type, _flat(spec))):
            raise _bad_value(spec, _first(spec, lambda v: type(v) is bool), "numbers")


def _count(text: bytes, word: bytes) -> int:
    """Count *word* in *text*, fast when its first letter is rare (as in JSON of numbers).

    ``bytes.find`` of one byte runs at memchr speed, many times faster than
    ``bytes.count``, and no JSON number holds a ``t`` or an ``f``. Short texts
    (a small request's header, whose keys hold several) are counted at once:
    the loop's Python steps would cost more than the scan.
    """
    if len(text) < _COUNT_AT_ONCE:
        return text.count(word)
    first = word[:1]
    count = 0
    at = text.find(first)
    for _ in range(_FIND_STEPS):
        if at < 0:
            return count
        count += text.startswith(word, at)
        at = text.find(first, at + 1)
    return count if at < 0 else text.count(word)


def _not_number(value: Any) -> bool:
    return type(value) not in (int, float)


def _flat(spec: _Input) -> Iterator[Any]:
    items: Iterator[Any] = iter(spec.data or ())
    for _ in range(len(spec.spine) - 1):
        items = itertools.chain.from_iterable(items)
    return items


def _first(spec: _Input, bad: Callable[[Any], bool]) -> Any:
    # Only called on the error path, so a walk over the values is affordable here.
    return next((value for value in _flat(spec) if bad(value)), None)


def _bad_value(spec: _Input, culprit: Any, expected: str) -> RequestError:
    return RequestError(
        f"{spec.where}: {spec.datatype} data must be {expected}; got {_show(culprit)}"
    )


def _uneven(spec: _Input) -> str:
    return (
        f"{spec.where}: 'data' must be a flat list of {spec.count} {spec.datatype} values, or "
        f"lists nested to match shape {list(spec.shape)} exactly; its nesting does not fit"
    )


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def _quote(name: str, limit: int = 64) -> str:
    return repr(name if len(name) <= limit else name[: limit - 3] + "...")


def _show(value: Any, limit: int = 60) -> str:
    """Render a JSON value for a message, cut short so that a huge value cannot flood it."""
    try:
        text = dumps(value).decode("utf-8")
    except TypeError:  # pragma: no cover - a safety net: the values came from orjson
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- decompression ------------------------------------------------------------------------------


def _coding(content_encoding: str | None) -> str | None:
    if not content_encoding:
        return None  # nearly every request: spares the list below (0.4 µs)
    codings = [
        token.strip().lower()
        for token in (content_encoding or "").split(",")
        if token.strip().lower() not in ("", "identity")
    ]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in _ENCODINGS:
        raise UnsupportedEncoding(
            f"Content-Encoding {(content_encoding or '')[:60]!r} is not supported; send one of "
            "identity, gzip, x-gzip or deflate"
        )
    return _ENCODINGS[codings[0]]


def _gunzip(data: bytes, budget: int) -> bytes:
    parts = []
    rest: bytes = data
    while rest:
        # A gzip file may hold several members back to back; each is inflated in turn.
        out, rest = _inflate(rest, _GZIP_WBITS, budget)
        parts.append(out)
        budget -= len(out)
    return b"".join(parts)


def _inflate_deflate(data: bytes, budget: int) -> bytes:
    try:
        out, rest = _inflate(data, zlib.MAX_WBITS, budget)
    except zlib.error:
        # Not zlib-wrapped: many clients send raw deflate under this name.
        out, rest = _inflate(data, -zlib.MAX_WBITS, budget)
    if rest:
        raise RequestError(
            f"{len(rest)} bytes follow the end of the deflate-encoded body; send only the "
            "compressed stream"
        )
    return out


def _inflate(data: bytes, wbits: int, budget: int) -> tuple[bytes, bytes]:
    """Inflate one stream, refusing output past *budget*; return it and the bytes after it."""
    inflater = zlib.decompressobj(wbits)
    parts = []
    size = 0
    pending = data
    while not inflater.eof:
        # Asking for one byte past the budget tells "exactly at the limit" from "over it".
        chunk = inflater.decompress(pending, budget + 1 - size)
        size += len(chunk)
        if size > budget:
            raise PayloadTooLarge(
                f"the request body inflates to more than {budget} bytes; at most that many "
                "are accepted after decompression"
            )
        parts.append(chunk)
        pending = inflater.unconsumed_tail
        if not chunk and not pending:
            break
    if not inflater.eof:
        raise RequestError("the compressed request body is truncated; send the whole stream")
    return b"".join(parts), inflater.unused_data


# -- encoding helpers ---------------------------------------------------------------------------


def _encode_output(
    name: str, array: npt.NDArray[Any], binary: bool, request: InferRequest
) -> tuple[dict[str, Any], Any | None]:
    datatype = v2_datatype(array.dtype)
    entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    blob: Any
    if datatype == "BYTES":
        items = array.ravel().tolist()
        if not binary:
            texts = _texts(items)
            if texts is not None:
                entry["data"] = texts
                return entry, None
            if not _speaks_binary(request):
                raise _not_json(name, items)
        blob = _pack_bytes(items)
    else:
        # orjson writes numpy arrays natively, but only C-contiguous, native-order ones.
        wanted = _WIRE[datatype] if binary else DATATYPES[datatype]
        if array.dtype == wanted and array.flags.c_contiguous:
            flat = array.reshape(-1)  # a view, as ascontiguousarray would give, for less
        else:
            flat = np.ascontiguousarray(array, dtype=wanted).reshape(-1)
        if not binary:
            entry["data"] = flat
            return entry, None
        blob = flat
    entry["parameters"] = {"binary_data_size": len(blob) if datatype == "BYTES" else blob.nbytes}
    return entry, blob


def classify(
    array: npt.NDArray[Any],
    k: int,
    labels: Sequence[str] = (),
    *,
    batched: bool,
    what: str = "the output",
) -> npt.NDArray[Any]:
    """Triton's classification extension: the top *k* classes of a numeric output.

    Each row (each batch entry when *batched*, else the whole tensor) is read
    as one score per class, flattened; the answer holds, per row, the *k*
    highest as ``"score:index"`` strings, or ``"score:index:label"`` when
    *labels* has a line for that index, highest first (ties: lower index
    first). *k* larger than the number of classes gives every class. The
    shape is ``[batch, k]`` when batched, else ``[k]``.

    Raises:
        RequestError: The output is not numeric.
    """
    values = np.asarray(array)
    if values.dtype.kind not in "iufb":
        raise RequestError(
            f"{what}: classification needs a numeric output, got {v2_datatype(values.dtype)}"
        )
    rows = values.reshape(values.shape[0] if batched and values.ndim else 1, -1)
    count = min(k, rows.shape[1])
    # A stable sort of the negated scores: highest first, ties in index order.
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
    integer = values.dtype.kind in "iub"
    out = np.empty(order.shape, dtype=object)
    for r, row in enumerate(order):
        for c, index in enumerate(row.tolist()):
            score = rows[r, index].item()
            text = f"{int(score)}" if integer else f"{score:f}"
            label = labels[index] if index < len(labels) else None
            out[r, c] = f"{text}:{index}:{label}" if label is not None else f"{text}:{index}"
    return out if batched and values.ndim else out.reshape(count)


def _output_to_shm(
    name: str, array: npt.NDArray[Any], place: tuple[str, int, int], shm: ShmLease
) -> dict[str, Any]:
    datatype = v2_datatype(array.dtype)
    if datatype == "BYTES":
        blob: Any = _pack_bytes(array.ravel().tolist())
    else:
        blob = np.ascontiguousarray(array, dtype=_WIRE[datatype]).reshape(-1)
    region, offset, byte_size = place
    written = shm.write(region, offset, byte_size, [blob], what=f"output {_quote(name)}")
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape),
        "parameters": {
            "shared_memory_region": region,
            "shared_memory_offset": offset,
            "shared_memory_byte_size": written,
        },
    }


def _speaks_binary(request: InferRequest) -> bool:
    """Whether the request shows that its client reads binary outputs (the binary extension).

    It does when it says ``binary_data_output`` or an output's ``binary_data``,
    either way: ``tritonclient`` always sends one of them. A plain JSON client
    (curl, a KServe client without the extension) sends neither.
    """
    if "binary_data_output" in request.parameters:
        return True
    return any(item.binary is not None for item in request.outputs or ())


def _not_json(name: str, items: list[Any]) -> RequestError:
    index = next(i for i, item in enumerate(items) if not _json_text(item))
    return RequestError(
        f"output {_quote(name)} holds bytes that are not UTF-8 (element {index} of the "
        "flattened output), which a JSON response cannot carry; ask for it as binary data "
        "(parameters.binary_data = true on the output, or binary_data_output = true on the "
        "request: Triton's binary tensor extension, which tritonclient reads), or use gRPC"
    )


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _json_text(item: object) -> bool:
    """Whether a JSON string can carry *item*.

    Not bytes that are not UTF-8, nor a str with lone surrogates (a model's
    ``decode(errors="surrogateescape")``), which no UTF-8, so no JSON encoder, takes.
    """
    if isinstance(item, bytes):
        return _is_utf8(item)
    return not isinstance(item, str) or item.isascii() or _encodes(item)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _texts(items: list[Any]) -> list[str] | None:
    """Return the elements as strings, or ``None`` when one is no JSON string (`_json_text`)."""
    texts = []
    for item in items:
        if isinstance(item, str):
            if not (item.isascii() or _encodes(item)):
                return None
            texts.append(item)
        elif isinstance(item, bytes):
            try:
                texts.append(item.decode("utf-8"))
            except UnicodeDecodeError:
                return None
        else:
            texts.append(str(item))
    return texts


def _pack_bytes(items: list[Any]) -> bytes:
    parts = []
    for item in items:
        if isinstance(item, bytes):
            raw = item
        else:
            # surrogatepass: a str holding lone surrogates still goes out, byte for byte.
            raw = (item if isinstance(item, str) else str(item)).encode("utf-8", "surrogatepass")
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)
