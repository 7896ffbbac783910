"""The V2 wire codec: request decoding, response encoding, decompression, limits."""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import struct
import tracemalloc
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.utils import np_to_triton_dtype

from trioinfer import ConfigError, InvalidInput
from trioinfer.server import _codec, encode_infer_request, v2_numpy_dtype
from trioinfer.server._codec import (
    _CUT_PLANS,
    _JSON_PLANS,
    _PLANS,
    DATATYPES,
    InferRequest,
    Limits,
    PayloadTooLarge,
    RequestedOutput,
    RequestError,
    UnsupportedEncoding,
    decode_infer_request,
    decompress,
    dumps,
    encode_infer_response,
    loads_json,
    parse_header_length,
    v2_datatype,
)

LIMITS = Limits()
FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])

# One 1x3 sample per datatype, reaching for each type's extremes.
SAMPLES: dict[str, np.ndarray[Any, Any]] = {
    "BOOL": np.array([[True, False, True]]),
    "BYTES": np.array([["", "héllo wörld", "x" * 300]], dtype=object),
}
for _name in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"):
    _info = np.iinfo(DATATYPES[_name])
    SAMPLES[_name] = np.array([[_info.min, 7, _info.max]], dtype=DATATYPES[_name])
for _name in ("FP16", "FP32", "FP64"):
    _finfo = np.finfo(DATATYPES[_name])
    SAMPLES[_name] = np.array([[-_finfo.max, 0.5, _finfo.tiny]], dtype=DATATYPES[_name])


def json_input(name: str, array: np.ndarray[Any, Any], *, nested: bool = False) -> dict[str, Any]:
    data = array.tolist() if nested else array.reshape(-1).tolist()
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": v2_datatype(array.dtype),
        "data": data,
    }


def pack_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def raw(array: np.ndarray[Any, Any]) -> bytes:
    if array.dtype == object:
        return pack_bytes([str(item).encode() for item in array.reshape(-1)])
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


def binary_body(arrays: Mapping[str, np.ndarray[Any, Any]], **extra: Any) -> tuple[bytes, int]:
    """Build a binary-extension request the way the spec describes it."""
    blobs = [raw(array) for array in arrays.values()]
    inputs = [
        {
            "name": name,
            "shape": list(array.shape),
            "datatype": v2_datatype(array.dtype),
            "parameters": {"binary_data_size": len(blob)},
        }
        for (name, array), blob in zip(arrays.items(), blobs, strict=True)
    ]
    header = orjson.dumps({"inputs": inputs, **extra})
    return header + b"".join(blobs), len(header)


def forget_plans() -> None:
    """Empty every plan cache: the next request goes the long way."""
    _PLANS.clear()
    _CUT_PLANS.clear()
    _JSON_PLANS.clear()
    _codec._LAST_JSON[0] = None


@pytest.fixture(autouse=True)
def _no_plans_from_other_tests() -> None:
    forget_plans()


def decode(doc: Any, header_length: int | None = None, limits: Limits = LIMITS) -> InferRequest:
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return decode_infer_request(body, header_length, limits)


def refused(
    doc: Any,
    *fragments: str,
    header_length: int | None = None,
    limits: Limits = LIMITS,
    error: type[RequestError] = RequestError,
) -> RequestError:
    with pytest.raises(error) as info:
        decode(doc, header_length, limits)
    for fragment in fragments:
        assert fragment in str(info.value)
    return info.value


def one(**fields: Any) -> dict[str, Any]:
    """A request with one input: a valid FP32 [2] input, with *fields* replaced."""
    item = {"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0], **fields}
    return {"inputs": [{k: v for k, v in item.items() if v is not ...}]}


def assert_same(
    got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], *, binary: bool = False
) -> None:
    """*got* holds *want*'s values; BYTES sent as *binary* data decode to bytes, as sent."""
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.dtype == object
        kind = bytes if binary else str
        assert {type(v) for v in got.ravel()} <= {kind}
        if binary:
            want = np.vectorize(lambda v: v.encode(), otypes=[object])(want)
        assert got.tolist() == want.tolist()
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def triton_body(
    arrays: Mapping[str, np.ndarray[Any, Any]], *, binary: bool, **kwargs: Any
) -> tuple[bytes, int | None]:
    inputs = []
    for name, array in arrays.items():
        item = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    body, length = httpclient.InferenceServerClient.generate_request_body(inputs, **kwargs)
    return bytes(body), length


def response(
    request: InferRequest,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    **kwargs: Any,
) -> tuple[bytes, int | None]:
    return encode_infer_response(
        model_name="m",
        model_version=kwargs.pop("model_version", "1"),
        request=request,
        outputs=outputs,
        output_order=kwargs.pop("output_order", list(outputs)),
        **kwargs,
    )


def plain_request(
    outputs: tuple[RequestedOutput, ...] | None = None,
    *,
    binary_output: bool = False,
    request_id: str | None = None,
) -> InferRequest:
    return InferRequest(
        id=request_id, inputs={}, outputs=outputs, binary_output=binary_output, parameters={}
    )


def header_of(body: bytes, length: int | None) -> Any:
    return orjson.loads(body if length is None else body[:length])


# -- datatypes ----------------------------------------------------------------------------------


def test_datatypes_cover_v2_and_map_back() -> None:
    assert set(DATATYPES) == {
        "BOOL",
        *(f"UINT{n}" for n in (8, 16, 32, 64)),
        *(f"INT{n}" for n in (8, 16, 32, 64)),
        "FP16",
        "FP32",
        "FP64",
        "BYTES",
    }
    for name, dtype in DATATYPES.items():
        assert v2_datatype(dtype) == name


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (np.dtype(">f4"), "FP32"),
        (np.dtype(">i8"), "INT64"),
        (np.dtype("<U5"), "BYTES"),
        (np.dtype("S3"), "BYTES"),
        (np.dtype(object), "BYTES"),
    ],
)
def test_v2_datatype_of_numpy_dtypes(dtype: np.dtype[Any], name: str) -> None:
    assert v2_datatype(dtype) == name


@pytest.mark.parametrize(
    ("type_name", "name"),
    [
        ("tensor(float)", "FP32"),
        ("tensor(float16)", "FP16"),
        ("tensor(bool)", "BOOL"),
        ("tensor(string)", "BYTES"),
        ("tensor(uint64)", "UINT64"),
        ("tensor(bfloat16)", "BF16"),
    ],
)
def test_v2_datatype_of_onnx_types(type_name: str, name: str) -> None:
    assert v2_datatype(None, type_name) == name


def test_v2_numpy_dtype_is_the_inverse_of_v2_datatype() -> None:
    for name, dtype in DATATYPES.items():
        assert v2_numpy_dtype(name) == dtype
        assert v2_datatype(v2_numpy_dtype(name)) == name
    assert v2_numpy_dtype("BF16") is None
    assert v2_numpy_dtype("FLOAT") is None


def test_v2_datatype_refuses_unknown_types_by_name() -> None:
    with pytest.raises(ValueError, match="c16"):
        v2_datatype(np.dtype(np.complex128))
    with pytest.raises(ValueError, match=r"tensor\(float8e4m3fn\)"):
        v2_datatype(None, "tensor(float8e4m3fn)")
    with pytest.raises(ValueError, match="''"):
        v2_datatype(None)


# -- limits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "max_body_bytes",
        "max_elements_per_tensor",
        "max_elements_per_request",
        "max_json_depth",
        "max_inputs",
        "max_outputs",
    ],
)
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8"])
def test_limits_must_be_positive_integers(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        Limits(**{field: value})


def test_errors_are_invalid_input() -> None:
    assert issubclass(RequestError, InvalidInput)
    assert issubclass(PayloadTooLarge, RequestError)
    assert issubclass(UnsupportedEncoding, RequestError)


# -- decoding: round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@pytest.mark.parametrize("nested", [False, True])
def test_json_inputs_round_trip(datatype: str, nested: bool) -> None:
    want = SAMPLES[datatype]
    request = decode({"inputs": [json_input("x", want, nested=nested)]})
    assert_same(request.inputs["x"], want)


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_binary_inputs_round_trip_as_views_of_the_body(datatype: str) -> None:
    want = SAMPLES[datatype]
    body, length = binary_body({"x": want, "y": want[:, ::-1].copy()})
    request = decode(body, length)
    assert_same(request.inputs["x"], want, binary=True)
    assert_same(request.inputs["y"], want[:, ::-1], binary=True)
    if datatype != "BYTES":
        got = request.inputs["x"]
        assert np.shares_memory(got, np.frombuffer(body, dtype=np.uint8))
        assert not got.flags.writeable


def test_binary_and_json_inputs_mix_in_order() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    c = np.array([1, -2], dtype=np.int64)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "a",
                    "shape": [2, 3],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 24},
                },
                {"name": "b", "shape": [1], "datatype": "INT8", "data": [5]},
                {
                    "name": "c",
                    "shape": [2],
                    "datatype": "INT64",
                    "parameters": {"binary_data_size": 16},
                },
            ]
        }
    )
    request = decode(header + a.tobytes() + c.tobytes(), len(header))
    assert list(request.inputs) == ["a", "b", "c"]
    assert_same(request.inputs["a"], a)
    assert_same(request.inputs["b"], np.array([5], dtype=np.int8))
    assert_same(request.inputs["c"], c)


def test_fp16_binary_is_little_endian_half() -> None:
    header = orjson.dumps(one(datatype="FP16", data=..., parameters={"binary_data_size": 4}))
    request = decode(header + bytes([0x00, 0x3C, 0x00, 0xC0]), len(header))
    assert_same(request.inputs["x"], np.array([1.0, -2.0], dtype=np.float16))


@pytest.mark.parametrize(
    ("shape", "data"),
    [
        ([0], []),
        ([2, 0], []),
        ([2, 0], [[], []]),
        ([0, 3], []),
        ([], [4.5]),
        ([1, 1, 1], [[[4.5]]]),
    ],
)
def test_empty_and_scalar_shapes(shape: list[int], data: list[Any]) -> None:
    got = decode(one(shape=shape, data=data)).inputs["x"]
    assert got.shape == tuple(shape)
    assert got.dtype == np.float32
    assert got.reshape(-1).tolist() == np.array(data, dtype=np.float32).reshape(-1).tolist()


def test_integers_are_fine_in_float_data_and_large_unsigned_values_fit() -> None:
    assert_same(decode(one(data=[1, 2.5])).inputs["x"], np.array([1.0, 2.5], dtype=np.float32))
    big = decode(one(datatype="UINT64", data=[0, 2**64 - 1])).inputs["x"]
    assert big.tolist() == [0, 2**64 - 1]
    edges = decode(one(datatype="INT64", data=[-(2**63), 2**63 - 1])).inputs["x"]
    assert edges.dtype == np.int64
    assert edges.tolist() == [-(2**63), 2**63 - 1]


def test_float_values_at_the_edge_of_the_range_round_rather_than_overflow() -> None:
    # Just past FP32's largest value, but nearer to it than to infinity: it rounds.
    top = float(np.finfo(np.float32).max)
    got = decode(one(data=[3.4028235e38, -top])).inputs["x"]
    assert got.tolist() == [top, -top]
    half = decode(one(datatype="FP16", data=[65504, -65519])).inputs["x"]
    assert half.tolist() == [65504.0, -65504.0]


def test_request_fields_are_decoded() -> None:
    request = decode(
        {
            "id": "req-1",
            "parameters": {"priority": 2, "timeout": 5000, "binary_data_output": True},
            "inputs": one()["inputs"],
            "outputs": [
                {"name": "b", "parameters": {"binary_data": False}},
                {"name": "a"},
                {"name": "c", "parameters": {"binary_data": True}},
            ],
        }
    )
    assert request.id == "req-1"
    assert request.binary_output is True
    assert request.parameters["priority"] == 2
    assert request.outputs == (
        RequestedOutput("b", False),
        RequestedOutput("a", None),
        RequestedOutput("c", True),
    )
    with pytest.raises(TypeError):
        request.parameters["priority"] = 1  # type: ignore[index]


def test_request_without_outputs_or_parameters() -> None:
    for outputs in ({}, {"outputs": None}, {"outputs": []}):
        request = decode({**one(), **outputs, "parameters": None})
        assert request.outputs is None
        assert request.binary_output is False
        assert request.id is None
        assert dict(request.parameters) == {}


@pytest.mark.parametrize("note", ["true false", "tf" * 3000, "true" * 3000])
def test_strings_that_say_true_do_not_hide_booleans(note: str) -> None:
    # Letters and words in strings defeat the fast literal count, so values are looked at.
    doc = one(data=[1, True])
    doc["parameters"] = {"note": note}
    refused(doc, "input 'x'", "FP32 data must be numbers", "got true")
    doc = one(data=[1, 2])
    doc["parameters"] = {"note": note, "flag": True}
    assert decode(doc).inputs["x"].tolist() == [1.0, 2.0]


def test_bool_inputs_and_flags_elsewhere_are_counted() -> None:
    doc = {
        "parameters": {"binary_data_output": True},
        "inputs": [
            {"name": "m", "shape": [3], "datatype": "BOOL", "data": [True, False, True]},
            {"name": "x", "shape": [2], "datatype": "INT64", "data": [1, 0]},
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
    }
    assert decode(doc).inputs["x"].tolist() == [1, 0]
    doc["inputs"][1]["data"] = [1, False]
    refused(doc, "input 'x'", "got false")


# -- decoding: a binary header seen before ------------------------------------------------------


def test_a_repeated_binary_header_decodes_each_requests_own_data() -> None:
    first = np.arange(6, dtype=np.float32).reshape(2, 3)
    second = -first
    body, length = binary_body({"x": first}, id="r", parameters={"priority": 2})
    again, again_length = binary_body({"x": second}, id="r", parameters={"priority": 2})
    assert body[:length] == again[:again_length]
    decode(body, length)
    assert _PLANS[body[:length]] is None  # seen once: no plan yet
    decode(body, length)
    plan = _PLANS[body[:length]]  # seen twice: the next request with this header uses it
    assert plan is not None
    assert plan.request.inputs == {}  # a plan keeps no request's body alive
    request = decode(again, again_length)
    assert_same(request.inputs["x"], second)
    assert np.shares_memory(request.inputs["x"], np.frombuffer(again, dtype=np.uint8))
    assert (request.id, dict(request.parameters)) == ("r", {"priority": 2})
    assert request.outputs is None
    assert not request.binary_output


def test_a_repeated_binary_header_still_checks_the_data() -> None:
    flags = np.array([True, False])
    body, length = binary_body({"b": flags})
    decode(body, length)
    decode(body, length)
    header = body[:length]
    refused(header + b"\x02\x00", "BOOL binary data must be bytes 0 or 1", header_length=length)
    refused(header + b"\x01", "binary_data_size 2 but only 1 bytes", header_length=length)
    refused(header + b"\x01\x00\x00", "1 bytes follow the JSON header", header_length=length)


def test_a_repeated_binary_header_is_checked_again_under_other_limits() -> None:
    body, length = binary_body({"x": np.zeros((1, 4), dtype=np.float32)})
    decode(body, length)
    decode(body, length)
    refused(
        body,
        "at most 2 are accepted",
        header_length=length,
        limits=Limits(max_elements_per_tensor=2),
    )


def test_only_all_binary_headers_without_shared_memory_are_kept() -> None:
    _PLANS.clear()
    mixed = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "a",
                    "shape": [1],
                    "datatype": "INT8",
                    "parameters": {"binary_data_size": 1},
                },
                {"name": "b", "shape": [1], "datatype": "INT8", "data": [5]},
            ]
        }
    )
    decode(mixed + b"\x07", len(mixed))
    assert not _PLANS  # JSON data varies from request to request

    class Region:  # a lease on one shared-memory region whose content changes
        content = b""

        def read(self, name: str, offset: int, byte_size: int, *, what: str = "") -> memoryview:
            return memoryview(self.content)[offset : offset + byte_size]

    region = Region()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "s",
                    "shape": [2],
                    "datatype": "INT8",
                    "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 2},
                }
            ]
        }
    )
    for content in (b"\x01\x02", b"\x03\x04"):
        region.content = content
        request = decode_infer_request(header, len(header), LIMITS, region)  # type: ignore[arg-type]
        assert request.inputs["s"].tolist() == list(content)
    assert not _PLANS  # a region's content (and the region) may change
    for i in range(300):
        body, length = binary_body({f"x{i}": np.zeros(2, dtype=np.int8)})
        decode(body, length)
    assert 0 < len(_PLANS) <= 256


def test_a_binary_request_with_a_new_id_each_time_uses_a_plan_and_keeps_its_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _PLANS.clear()
    _CUT_PLANS.clear()
    row = np.arange(4, dtype=np.float32)
    for request_id in ("1", "2"):
        body, length = binary_body({"x": row}, id=request_id, parameters={"priority": 2})
        decode(body, length)
    assert len([plan for plan in _CUT_PLANS.values() if plan is not None]) == 1

    def long_way(*args: Any) -> Any:
        raise AssertionError("the long way parsed a request that a plan should have decoded")

    monkeypatch.setattr(_codec, "_parse", long_way)
    for request_id in ("3", "héllo", "a b", ""):
        body, length = binary_body({"x": -row}, id=request_id, parameters={"priority": 2})
        request = decode(body, length)
        assert request.id == request_id
        assert_same(request.inputs["x"], -row)
        assert dict(request.parameters) == {"priority": 2}
    monkeypatch.undo()
    # Anything but a plain JSON string where the id goes is the long way's to judge.
    body, length = binary_body({"x": row}, id=5, parameters={"priority": 2})
    refused(body, "the request's 'id' must be a string, got 5", header_length=length)
    body, length = binary_body({"x": row}, id="\x01", parameters={"priority": 2})
    bad = body.replace(b"\\u0001", b"\x01")  # a raw control character in the string
    refused(bad, "not valid JSON", header_length=length - 5)


def test_a_binary_header_cut_only_where_it_is_the_top_level_id() -> None:
    # An "id" elsewhere (a parameter, an output's name) is part of the key.
    _CUT_PLANS.clear()
    row = np.arange(2, dtype=np.int8)
    for value in ("a", "b", "a", "b"):
        body, length = binary_body({"x": row}, parameters={"id": value})
        assert decode(body, length).parameters["id"] == value
    assert _codec._cut(body[:length], data=False)[1] is not None  # cut, but not a plan key
    assert not [plan for plan in _CUT_PLANS.values() if plan is not None]
    for name in ("id", "id"):
        body, length = binary_body({"x": row}, id="r", outputs=[{"name": name}])
        request = decode(body, length)
    assert request.id == "r"
    assert request.outputs == (RequestedOutput("id"),)


# -- decoding: an all-JSON request like one seen before -------------------------------------------


def like(data: Any, **fields: Any) -> dict[str, Any]:
    """A request with one FP32 [2, 2] input holding *data*, its outputs and parameters fixed."""
    return {
        "id": "r",
        "inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": data, **fields}],
        "outputs": [{"name": "y"}],
        "parameters": {"priority": 1},
    }


def test_a_json_request_like_one_seen_before_decodes_its_own_data() -> None:
    forget_plans()
    decode(like([1, 2, 3, 4]))
    decode(like([1, 2, 3, 4]))
    assert len(_JSON_PLANS) == 1  # kept: the next request with this shape of document uses it
    for data in ([5.5, 6, 7, 8], [[1, 2], [3, 4.25]]):
        request = decode(like(data))
        assert_same(request.inputs["x"], np.array(data, dtype=np.float32).reshape(2, 2))
        assert request.id == "r"
        assert request.outputs == (RequestedOutput("y"),)
        assert dict(request.parameters) == {"priority": 1}
    # Nested data is not cut from the raw text: that request has the long key, seen once.
    (plan,) = [plan for plan in _JSON_PLANS.values() if plan is not None]
    assert plan.request.inputs == {}  # a plan keeps no request's data alive
    assert all(spec.data is None for spec in plan.specs)


def test_a_json_request_like_one_seen_before_has_its_own_id() -> None:
    forget_plans()
    for request_id in ("a", "b", "c", None):
        doc = like([1, 2, 3, 4])
        if request_id is None:
            del doc["id"]
        else:
            doc["id"] = request_id
        assert decode(doc).id == request_id
    # One plan for the requests with an id ("c" used it); none yet for the one without.
    assert len([plan for plan in _JSON_PLANS.values() if plan is not None]) == 1
    doc = like([1, 2, 3, 4])
    doc["id"] = 5
    refused(doc, "the request's 'id' must be a string, got 5")


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([1, 2, 3], "'data' has 3 values but shape [2, 2] holds 4"),
        ([1, "2", 3, 4], "FP32 data must be numbers"),
        ([1, None, 3, 4], "FP32 data must be numbers"),
        ([1, True, 3, 4], "FP32 data must be numbers; got true"),
        ([[1, 2, 3], [4, 5, 6]], "'data' nests as [2, 3] but the shape is [2, 2]"),
        ([[1, 2], [3]], "its nesting does not fit"),
        ([1, 2, 3, 1e39], "numbers within +-3.40282e+38"),
        ({"a": 1}, "'data' must be a list of FP32 values"),
        ([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], "more than 32 deep"),
    ],
)
def test_a_json_request_like_one_seen_before_has_its_data_checked(data: Any, fragment: str) -> None:
    decode(like([1, 2, 3, 4]))
    decode(like([1, 2, 3, 4]))
    refused(like(data), fragment)


@pytest.mark.parametrize(
    ("datatype", "good", "bad", "fragment"),
    [
        ("FP32", [1.5, 2], [1.5, "2"], 'FP32 data must be numbers; got "2"'),
        ("FP32", [1.5, 2], [1.5, None], "FP32 data must be numbers; got null"),
        ("FP32", [1.5, 2], [1.5, True], "FP32 data must be numbers; got true"),
        ("FP32", [1.5, 2], [1.5], "'data' has 1 values but shape [2] holds 2"),
        ("FP32", [1.5, 2], [1.5, 2, 3], "'data' has 3 values but shape [2] holds 2"),
        ("FP32", [1.5, 2], [1.5, 1e39], "numbers within +-3.40282e+38"),
        ("FP32", [1.5, 2], [1.5, 10**39], "numbers within +-3.40282e+38"),  # no exponent
        ("FP16", [1.5, 2], [1.5, 70000], "numbers within +-65504"),
        ("INT8", [1, 2], [1, 300], "INT8 data must be integers from -128 to 127; got 300"),
        ("INT8", [1, 2], [1, 2.5], "INT8 data must be integers from -128 to 127; got 2.5"),
        ("INT8", [1, 2], [1, False], "INT8 data must be numbers; got false"),
        ("UINT8", [1, 2], [1, -1], "UINT8 data must be integers from 0 to 255; got -1"),
        ("BOOL", [True, False], [True, 1], "BOOL data must be true or false; got 1"),
        ("BYTES", ["a", "b"], ["a", 1], "BYTES data must be strings; got 1"),
    ],
)
def test_a_planned_flat_json_request_gets_the_long_ways_error(
    datatype: str, good: list[Any], bad: list[Any], fragment: str
) -> None:
    forget_plans()
    doc: dict[str, Any] = {"inputs": [{"name": "x", "shape": [2], "datatype": datatype}]}
    for request_id in ("a", "b"):
        doc["id"] = request_id
        doc["inputs"][0]["data"] = good
        decode(json.dumps(doc).encode())  # Python's json writes 10**39 as it is
    assert [plan for plan in _JSON_PLANS.values() if plan is not None]
    doc["inputs"][0]["data"] = bad
    doc["id"] = "c"
    refused(json.dumps(doc).encode(), "input 'x'", fragment)
    doc["inputs"][0]["data"] = good
    assert decode(json.dumps(doc).encode()).id == "c"  # the plan still serves good requests


def test_a_planned_json_request_skips_the_checks_of_all_but_its_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forget_plans()
    for data in ([1, 2, 3, 4], [1, 2, 3, 4]):
        decode(like(data))

    def long_way(*args: Any) -> Any:
        raise AssertionError("the long way checked a request that a plan should have decoded")

    monkeypatch.setattr(_codec, "_parse_input", long_way)
    for data, request_id in (([0.5, -2, 1e-7, 3e30], "s"), ([9, 8, 7, 6], "t")):
        doc = like(data)
        doc["id"] = request_id
        request = decode(doc)
        assert request.id == request_id
        assert_same(request.inputs["x"], np.array(data, dtype=np.float32).reshape(2, 2))


def test_json_requests_of_layouts_alike_in_length_each_decode_as_their_own() -> None:
    # The last plan used is tried first: it must not serve a layout that is not its own.
    layouts = [
        b'{"id":"r","inputs":[{"name":"%s","shape":[2],"datatype":"%s","data":[1,2]}]}'
        % (name, datatype)
        for name in (b"x", b"y")
        for datatype in (b"FP32", b"FP64")
    ]
    want = []
    for body in layouts:
        forget_plans()
        want.append(_outcome(body, None))
    forget_plans()
    got = [_outcome(body, None) for body in layouts + layouts + layouts[::-1] + layouts[::-1]]
    assert got == want + want + want[::-1] + want[::-1]


@pytest.mark.parametrize(
    "text",
    [
        # "data" and "id" elsewhere than where the cut looks for them
        b'{"id":"r","inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[%s]}],'
        b'"parameters":{"data":[1]}}',
        b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[%s]}],'
        b'"parameters":{"id":"p"}}',
        b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[%s],'
        b'"parameters":{"id":"q"}}],"outputs":[{"name":"data"}]}',
        # escapes, spaces and nesting: the long key or none
        b'{"id":"r\\"","inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[%s]}]}',
        b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","d\\u0061ta":[%s]}],'
        b'"parameters":{"data":[1]}}',
        b'{ "id" : "r", "inputs" : [ { "name" : "x", "shape" : [2], "datatype" : "FP32",'
        b' "data" : [ %s ] } ] }',
        b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[[%s]]}]}',
    ],
)
def test_a_json_request_with_data_or_id_elsewhere_decodes_as_the_long_way(text: bytes) -> None:
    bodies = [text.replace(b"%s", values) for values in (b"1,2", b"3,4", b"5,6.5", b"7,true")]
    want = []
    for body in bodies:
        forget_plans()
        want.append(_outcome(body, None))
    forget_plans()
    got = [_outcome(body, None) for body in bodies + bodies]
    assert got == want + want


def test_a_json_request_like_one_seen_before_is_checked_again_under_other_limits() -> None:
    decode(like([1, 2, 3, 4]))
    decode(like([1, 2, 3, 4]))
    refused(like([1, 2, 3, 4]), "at most 3 are accepted", limits=Limits(max_elements_per_tensor=3))


def test_json_requests_with_binary_or_shared_memory_parts_are_not_kept() -> None:
    forget_plans()
    header = orjson.dumps(like([1, 2, 3, 4]))
    decode(header + b"", len(header))  # a header length: the binary extension
    assert not _JSON_PLANS

    class Lease:
        def check(self, name: str, offset: int, byte_size: int, *, what: str = "") -> None:
            pass

    doc = like([1, 2, 3, 4])
    doc["outputs"] = [
        {"name": "y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}
    ]
    decode_infer_request(orjson.dumps(doc), None, LIMITS, Lease())  # type: ignore[arg-type]
    assert not _JSON_PLANS


# -- decoding: the real client ------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_request_bodies_decode(binary: bool) -> None:
    arrays = {name: sample for name, sample in SAMPLES.items()}
    body, length = triton_body(
        arrays,
        binary=binary,
        outputs=[httpclient.InferRequestedOutput("y", binary_data=False)],
        request_id="abc",
        priority=3,
    )
    assert (length is not None) == binary
    request = decode(body, length)
    assert request.id == "abc"
    assert request.parameters["priority"] == 3
    assert request.outputs == (RequestedOutput("y", False),)
    for name, want in arrays.items():
        assert_same(request.inputs[name], want, binary=binary)


def test_tritonclient_default_outputs_ask_for_binary() -> None:
    body, length = triton_body({"x": SAMPLES["FP32"]}, binary=True)
    request = decode(body, length)
    assert request.outputs is None
    assert request.binary_output is True


# -- encoding requests (the client's side) ------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True])
def test_encoded_requests_decode_to_the_same_arrays_in_order(binary: bool) -> None:
    body, length = encode_infer_request(SAMPLES, binary=binary)
    assert (length is not None) == binary
    request = decode(body, length)
    assert list(request.inputs) == list(SAMPLES)
    for name, want in SAMPLES.items():
        assert_same(request.inputs[name], want, binary=binary)
    assert request.binary_output is binary  # binary requests ask for binary outputs too


def test_encoded_binary_data_is_what_tritonclient_sends() -> None:
    ours, our_length = encode_infer_request(SAMPLES, binary=True)
    theirs, their_length = triton_body(SAMPLES, binary=True)
    assert our_length is not None
    assert their_length is not None
    assert ours[our_length:] == theirs[their_length:]


def test_encoded_bytes_elements_go_as_json_strings() -> None:
    body, length = encode_infer_request({"s": np.array([b"ab", "cd", 7], dtype=object)})
    assert length is None
    assert header_of(body, length)["inputs"][0]["data"] == ["ab", "cd", "7"]


def test_encoding_bytes_that_are_not_utf8_as_json_says_to_send_binary() -> None:
    inputs = {"s": np.array([b"ok", b"\xff\xd8"], dtype=object)}
    with pytest.raises(
        ValueError, match=r"^input 's' holds bytes that are not UTF-8 \(element 1\)"
    ):
        encode_infer_request(inputs)
    body, length = encode_infer_request(inputs, binary=True)
    assert decode(body, length).inputs["s"].tolist() == [b"ok", b"\xff\xd8"]


def test_encoding_refuses_a_dtype_without_a_v2_datatype() -> None:
    with pytest.raises(ValueError, match="no V2 datatype"):
        encode_infer_request({"z": np.zeros(2, dtype=np.complex64)})


# -- encoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@pytest.mark.parametrize("binary", [False, True])
def test_outputs_round_trip_through_tritonclient(datatype: str, binary: bool) -> None:
    want = SAMPLES[datatype]
    body, length = response(plain_request(binary_output=binary), {"y": want})
    assert (length is not None) == binary
    got = httpclient.InferResult.from_response_body(body, header_length=length).as_numpy("y")
    if datatype == "BYTES":
        items = [x.decode() if isinstance(x, bytes) else x for x in got.reshape(-1)]
        assert items == want.reshape(-1).tolist()
        assert got.shape == want.shape
    else:
        assert_same(got, want)


def test_response_fields() -> None:
    body, length = response(
        plain_request(request_id="r-7"),
        {"y": np.array([[1.5, 2.5]], dtype=np.float32)},
        parameters={"sequence_id": 3},
    )
    assert length is None
    assert orjson.loads(body) == {
        "model_name": "m",
        "model_version": "1",
        "id": "r-7",
        "parameters": {"sequence_id": 3},
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.5]}],
    }


def test_response_without_id_or_version() -> None:
    body, _ = response(plain_request(), {"y": np.zeros(1, np.int8)}, model_version=None)
    doc = orjson.loads(body)
    assert "id" not in doc
    assert "model_version" not in doc
    assert "parameters" not in doc
    body, _ = response(plain_request(request_id=""), {"y": np.zeros(1, np.int8)})
    assert orjson.loads(body)["id"] == ""


def test_requested_outputs_choose_order_and_binary() -> None:
    outputs = {
        "a": np.array([1, 2], dtype=np.int32),
        "b": np.array([[True], [False]]),
        "c": np.array(["s"], dtype=object),
    }
    request = plain_request(
        (RequestedOutput("c", True), RequestedOutput("a", None)), binary_output=False
    )
    body, length = response(request, outputs, output_order=["a", "b", "c"])
    assert length is not None
    doc = header_of(body, length)
    assert [o["name"] for o in doc["outputs"]] == ["c", "a"]
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 5}
    assert doc["outputs"][1]["data"] == [1, 2]
    assert body[length:] == pack_bytes([b"s"])
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    assert result.as_numpy("c").tolist() == [b"s"]
    assert result.as_numpy("b") is None

    request = plain_request((RequestedOutput("b", False), RequestedOutput("a")), binary_output=True)
    body, length = response(request, outputs)
    assert length is not None
    doc = header_of(body, length)
    assert doc["outputs"][0]["data"] == [True, False]
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": 8}
    assert body[length:] == outputs["a"].tobytes()


def test_all_outputs_in_output_order_when_none_requested() -> None:
    outputs = {"a": np.zeros(2, np.float64), "b": np.ones(3, np.uint16)}
    body, length = response(plain_request(binary_output=True), outputs, output_order=["b", "a"])
    assert length is not None
    doc = header_of(body, length)
    assert [o["name"] for o in doc["outputs"]] == ["b", "a"]
    assert body[length:] == outputs["b"].tobytes() + outputs["a"].tobytes()


def test_requesting_an_unknown_output_is_a_request_error() -> None:
    request = plain_request((RequestedOutput("nope"),))
    with pytest.raises(RequestError, match=r"'nope'.*'a'"):
        response(request, {"a": np.zeros(1)}, output_order=["a"])


def test_output_order_naming_a_missing_output_is_a_server_bug() -> None:
    with pytest.raises(ValueError, match="'b'"):
        response(plain_request(), {"a": np.zeros(1)}, output_order=["a", "b"])


def test_output_dtype_without_v2_name_is_refused() -> None:
    with pytest.raises(ValueError, match="c8"):
        response(plain_request(), {"a": np.zeros(1, np.complex64)})


@pytest.mark.parametrize(
    "request_",
    [
        # What tritonclient sends: it always says one or the other, so it reads binary.
        InferRequest(
            id=None,
            inputs={},
            outputs=None,
            binary_output=False,
            parameters={"binary_data_output": False},
        ),
        plain_request((RequestedOutput("t", False), RequestedOutput("u", False))),
    ],
    ids=["binary_data_output", "binary_data"],
)
def test_non_utf8_bytes_output_goes_binary_to_a_client_of_the_extension(
    request_: InferRequest,
) -> None:
    outputs = {
        "t": np.array([b"\xff\xfe", b"ok"], dtype=object),
        "u": np.array([b"caf\xc3\xa9", "plain", 7], dtype=object),
    }
    body, length = response(request_, outputs)
    assert length is not None
    doc = header_of(body, length)
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert doc["outputs"][1]["data"] == ["café", "plain", "7"]
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    assert result.as_numpy("t").tolist() == [b"\xff\xfe", b"ok"]


@pytest.mark.parametrize("outputs", [None, (RequestedOutput("u"), RequestedOutput("t"))])
def test_non_utf8_bytes_output_to_a_plain_json_client_says_to_ask_for_binary(
    outputs: tuple[RequestedOutput, ...] | None,
) -> None:
    # A client that said nothing of the binary extension (curl, say) could not parse a
    # binary body: it is told what to ask for instead.
    arrays = {
        "u": np.array(["plain"], dtype=object),
        "t": np.array([b"ok", b"\xff\xd8\xff\xe0"], dtype=object),
    }
    with pytest.raises(RequestError) as info:
        response(plain_request(outputs), arrays)
    assert str(info.value) == (
        "output 't' holds bytes that are not UTF-8 (element 1 of the flattened output), which "
        "a JSON response cannot carry; ask for it as binary data (parameters.binary_data = "
        "true on the output, or binary_data_output = true on the request: Triton's binary "
        "tensor extension, which tritonclient reads), or use gRPC"
    )
    # Asked for as binary, it goes.
    body, length = response(plain_request(binary_output=True), arrays)
    assert length is not None
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    assert result.as_numpy("t").tolist() == [b"ok", b"\xff\xd8\xff\xe0"]


def test_a_str_output_with_lone_surrogates_is_no_500() -> None:
    # A model that decodes with errors="surrogateescape" returns str that no UTF-8 (and
    # so no JSON) can carry: the JSON encoder raised, a 500 with a traceback in the log.
    # It goes as the bytes that str stands for, as binary data, to a client of the
    # extension; a plain JSON client is told to ask for binary, as for bytes.
    arrays = {"t": np.array(["ok", b"a\xff".decode("utf-8", "surrogateescape")], dtype=object)}
    tritonclient = InferRequest(
        id=None,
        inputs={},
        outputs=None,
        binary_output=False,
        parameters={"binary_data_output": False},
    )
    body, length = response(tritonclient, arrays)
    assert length is not None
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    assert result.as_numpy("t").tolist() == [b"ok", "a\udcff".encode("utf-8", "surrogatepass")]
    with pytest.raises(RequestError, match=r"^output 't' holds .*\(element 1 of the flattened"):
        response(plain_request(), arrays)
    with pytest.raises(ValueError, match=r"^input 's' holds .*\(element 0\)"):
        encode_infer_request({"s": np.array(["\ud800"], dtype=object)})


def test_numpy_string_outputs_are_bytes() -> None:
    outputs = {"u": np.array(["ab", "c"]), "s": np.array([b"x", b"yz"])}
    body, length = response(plain_request(), outputs)
    assert length is None
    assert [o["data"] for o in orjson.loads(body)["outputs"]] == [["ab", "c"], ["x", "yz"]]
    assert [o["datatype"] for o in orjson.loads(body)["outputs"]] == ["BYTES", "BYTES"]


def test_nan_is_null_in_json_and_kept_in_binary() -> None:
    values = np.array([np.nan, np.inf, 1.0], dtype=np.float32)
    body, _ = response(plain_request(), {"y": values})
    assert orjson.loads(body)["outputs"][0]["data"] == [None, None, 1.0]
    body, length = response(plain_request(binary_output=True), {"y": values})
    assert length is not None
    np.testing.assert_array_equal(np.frombuffer(body[length:], np.float32), values)


def test_strided_and_big_endian_outputs_are_written_row_major_little_endian() -> None:
    base = np.arange(12, dtype=">i4").reshape(3, 4)
    view = base.T[::2]
    for binary in (False, True):
        body, length = response(plain_request(binary_output=binary), {"y": view})
        got = httpclient.InferResult.from_response_body(body, header_length=length)
        np.testing.assert_array_equal(got.as_numpy("y"), view)


def test_scalar_and_empty_outputs() -> None:
    outputs = {
        "s": np.float64(2.5) * np.ones(()),
        "e": np.zeros((0, 3), np.int16),
        "b": np.zeros((2, 0), object),
    }
    for binary in (False, True):
        body, length = response(plain_request(binary_output=binary), outputs)
        result = httpclient.InferResult.from_response_body(body, header_length=length)
        assert result.as_numpy("s").shape == ()
        assert float(result.as_numpy("s")) == 2.5
        assert result.as_numpy("e").shape == (0, 3)
        assert result.as_numpy("b").shape == (2, 0)


def test_dumps_handles_numpy() -> None:
    assert (
        dumps({"a": np.arange(3, dtype=np.int64), "b": np.float32(1.5)}) == b'{"a":[0,1,2],"b":1.5}'
    )


# -- header length ------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "want"), [(None, None), ("0", 0), (" 12 ", 12), ("0040", 40)])
def test_parse_header_length(value: str | None, want: int | None) -> None:
    assert parse_header_length(value, 40) == want


@pytest.mark.parametrize(
    "value", ["", " ", "-1", "+5", "1_0", "abc", "1e3", "4.0", "\u0661\u0662", "9" * 30, "0x10"]
)
def test_parse_header_length_refuses_non_integers(value: str) -> None:
    with pytest.raises(RequestError, match="Inference-Header-Content-Length"):
        parse_header_length(value, 100)


def test_parse_header_length_refuses_more_than_the_body() -> None:
    with pytest.raises(RequestError, match=r"41.*40 bytes"):
        parse_header_length("41", 40)


def test_header_length_equal_to_body_means_no_binary_data() -> None:
    body = orjson.dumps(one())
    assert decode(body, len(body)).inputs["x"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("length", [-1, 10**9, True, "3"])
def test_decode_refuses_bad_header_lengths(length: Any) -> None:
    refused(orjson.dumps(one()), "JSON header length", header_length=length)


def test_header_length_zero_leaves_no_json() -> None:
    refused(b"\x00\x00", "empty", header_length=0)


def test_header_length_inside_the_json() -> None:
    body = orjson.dumps(one())
    refused(body, "not valid JSON", header_length=len(body) - 3)


def test_binary_left_over_without_binary_inputs() -> None:
    body = orjson.dumps(one())
    refused(body + b"\x00" * 8, "8 bytes follow the JSON header", header_length=len(body))


def test_binary_inputs_without_header_length() -> None:
    doc = one(data=..., parameters={"binary_data_size": 8})
    refused(doc, "input 'x'", "Inference-Header-Content-Length")


def test_binary_data_missing_or_left_over() -> None:
    header = orjson.dumps(one(data=..., parameters={"binary_data_size": 8}))
    refused(header + b"\x00" * 4, "input 'x'", "only 4 bytes", header_length=len(header))
    refused(header + b"\x00" * 9, "1 bytes follow", header_length=len(header))


# -- decoding: refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "fragments"),
    [
        (b"", ["empty", "'inputs'"]),
        (b"{", ["not valid JSON"]),
        (b"\xff\xfe", ["not valid JSON"]),
        (b'{"inputs": [1,]}', ["not valid JSON"]),
        (b"NaN", ["not valid JSON"]),
        ([1, 2], ["JSON object", "a list"]),
        ("inputs", ["JSON object", "a string"]),
        ({}, ["'inputs'", "non-empty list"]),
        ({"inputs": []}, ["'inputs'", "non-empty list"]),
        ({"inputs": {"name": "x"}}, ["'inputs'", "non-empty list"]),
        ({"inputs": [3]}, ["inputs[0] must be an object"]),
        (one(name=...), ["inputs[0]", "'name'"]),
        (one(name=5), ["inputs[0]", "'name'", "5"]),
        (one(name=""), ["inputs[0]", "'name'"]),
        (one(datatype="FP8"), ["input 'x'", "'datatype'", "BOOL", '"FP8"']),
        (one(datatype="fp32"), ["input 'x'", "upper-case"]),
        (one(datatype="BF16"), ["input 'x'", "BF16 is not supported"]),
        (one(datatype=...), ["input 'x'", "'datatype'", "null"]),
        (one(shape=2), ["input 'x'", "'shape'", "got 2"]),
        (one(shape=...), ["input 'x'", "'shape'"]),
        (one(shape=[-2]), ["input 'x'", "'shape'", "non-negative"]),
        (one(shape=[2.0]), ["input 'x'", "'shape'"]),
        (one(shape=[True, 2]), ["input 'x'", "'shape'"]),
        (one(shape=["2"]), ["input 'x'", "'shape'"]),
        (one(shape=[1] * 33), ["input 'x'", "at most 32"]),
        (one(data=...), ["input 'x'", "neither 'data' nor parameters.binary_data_size"]),
        (one(parameters={"binary_data_size": 8}), ["input 'x'", "both 'data'"]),
        (one(parameters=[1]), ["input 'x'", "'parameters'", "JSON object"]),
        (one(parameters={"shared_memory_region": "r"}), ["input 'x'", "shared_memory_byte_size"]),
        (
            one(data=..., parameters={"shared_memory_region": "r", "shared_memory_byte_size": 8}),
            ["input 'x'", "shared memory is not available"],
        ),
        (
            one(data=..., parameters={"shared_memory_region": 5, "shared_memory_byte_size": 8}),
            ["input 'x'", "must name a registered region"],
        ),
        (
            one(
                data=...,
                parameters={
                    "shared_memory_region": "r",
                    "shared_memory_byte_size": 8,
                    "shared_memory_offset": -1,
                },
            ),
            ["input 'x'", "shared_memory_offset must be a non-negative integer"],
        ),
        (
            one(
                data=...,
                parameters={
                    "shared_memory_region": "r",
                    "shared_memory_byte_size": 8,
                    "shared_memory_key": "/k",
                },
            ),
            ["input 'x'", "unknown parameter 'shared_memory_key'"],
        ),
        (
            one(parameters={"shared_memory_region": "r", "shared_memory_byte_size": 8}),
            ["input 'x'", "send the values one way"],
        ),
        (
            one(data=..., parameters={"shared_memory_region": "r", "shared_memory_byte_size": 7}),
            ["input 'x'", "shared_memory_byte_size is 7 bytes", "needs 8"],
        ),
        (one(data=..., parameters={"binary_data_size": -8}), ["input 'x'", "non-negative"]),
        (one(data=..., parameters={"binary_data_size": "8"}), ["input 'x'", "binary_data_size"]),
        (one(data=..., parameters={"binary_data_size": 8.0}), ["input 'x'", "binary_data_size"]),
        (one(data=..., parameters={"binary_data_size": 7}), ["input 'x'", "is 7 bytes", "needs 8"]),
        (
            one(datatype="BYTES", data=..., parameters={"binary_data_size": 7}),
            ["input 'x'", "too few for 2 BYTES elements"],
        ),
        (one(data=1.0), ["input 'x'", "'data' must be a list", "1.0"]),
        (one(data={"a": 1}), ["input 'x'", "'data' must be a list"]),
        (one(data=[1.0]), ["input 'x'", "has 1 values", "holds 2"]),
        (one(data=[1, 2, 3]), ["input 'x'", "has 3 values", "holds 2"]),
        (one(shape=[4, 1], data=[[1, 2], [3, 4]]), ["input 'x'", "nests as [2, 2]", "[4, 1]"]),
        (one(shape=[2, 2], data=[[1, 2], [3]]), ["input 'x'", "nesting does not fit"]),
        (one(shape=[2, 2], data=[[1, 2], 3]), ["input 'x'", "nesting does not fit"]),
        (one(shape=[2, 2], data=[[1, 2], [3, [4]]]), ["input 'x'", "nesting does not fit"]),
        (one(shape=[2], data=[1, [2]]), ["input 'x'", "nesting does not fit"]),
        (one(shape=[2, 2, 2], data=[[1, 2, 3, 4], [5, 6, 7, 8]]), ["input 'x'", "nests as [2, 4]"]),
        (one(shape=[1], data=[[1]]), ["input 'x'", "nests as [1, 1]", "[1]"]),
        (one(data=[1, "2"]), ["input 'x'", "FP32 data must be numbers", '"2"']),
        (one(data=[1, None]), ["input 'x'", "must be numbers", "null"]),
        (one(data=[1, {}]), ["input 'x'", "must be numbers", "{}"]),
        (one(data=[True, False]), ["input 'x'", "must be numbers", "true"]),
        (one(data=[1.5, True]), ["input 'x'", "must be numbers", "true"]),
        (one(datatype="INT64", data=[False, 3]), ["input 'x'", "must be numbers", "false"]),
        (one(datatype="FP16", data=[1, 70000]), ["input 'x'", "FP16", "65504", "70000"]),
        (one(data=[1, -1e39]), ["input 'x'", "FP32", "-1e+39"]),
        (one(datatype="UINT8", data=[1, 300]), ["input 'x'", "UINT8", "0 to 255", "got 300"]),
        (one(datatype="INT8", data=[-129, 0]), ["input 'x'", "-128 to 127", "got -129"]),
        (one(datatype="INT32", data=[1, 1.5]), ["input 'x'", "INT32 data must be integers", "1.5"]),
        (one(datatype="INT32", data=[1, 3.0]), ["input 'x'", "INT32", "3.0"]),
        (one(datatype="INT32", data=[1, 2**40]), ["input 'x'", "INT32", str(2**40)]),
        (one(datatype="UINT64", data=[-1, 2**63]), ["input 'x'", "UINT64", "-1"]),
        (one(datatype="INT64", data=[0, 2**63]), ["input 'x'", "INT64", str(2**63)]),
        (
            b'{"inputs":[{"name":"x","shape":[2],"datatype":"INT64","data":[0,18446744073709551616]}]}',
            ["input 'x'", "INT64", "past the 64-bit range (about 1.84467e+19)"],
        ),
        # Integers wider than 64 bits, which orjson reads as floats: named as what they
        # were, never converted.
        (
            b'{"inputs":[{"name":"x","shape":[1],"datatype":"INT64","data":[1180591620717411303424]}]}',
            [
                "input 'x'",
                "INT64 data must be integers from",
                "past the 64-bit range",
                "1.18059e+21",
            ],
        ),
        (
            b'{"inputs":[{"name":"x","shape":[2],"datatype":"UINT64","data":[1,18446744073709551616]}]}',
            ["input 'x'", "UINT64", "0 to 18446744073709551615", "past the 64-bit range"],
        ),
        (
            b'{"inputs":[{"name":"x","shape":[1],"datatype":"INT64","data":[-9223372036854775809]}]}',
            ["input 'x'", "INT64", "past the 64-bit range (about -9.22337e+18)"],
        ),
        (
            b'{"inputs":[{"name":"x","shape":[1],"datatype":"INT8","data":[1180591620717411303424]}]}',
            ["input 'x'", "INT8 data must be integers from -128 to 127", "past the 64-bit range"],
        ),
        (one(datatype="UINT16", data=["1", 2]), ["input 'x'", "must be numbers", '"1"']),
        (one(datatype="BOOL", data=[1, 0]), ["input 'x'", "BOOL data must be true or false", "1"]),
        (one(datatype="BOOL", data=[True, None]), ["input 'x'", "true or false", "null"]),
        (
            one(datatype="BYTES", data=["a", 1]),
            ["input 'x'", "BYTES data must be strings; got 1 at index 1"],
        ),
        (
            one(datatype="BYTES", shape=[2, 2], data=[["a", "b"], ["c", 2.5]]),
            ["input 'x'", "BYTES data must be strings; got 2.5 at index 3 of the flattened"],
        ),
        (one(datatype="BYTES", data=["a", ["b"]]), ["input 'x'", "BYTES data must be strings"]),
        (
            one(datatype="BYTES", shape=[2, 1], data=[["a"], ["b", "c"]]),
            ["input 'x'", "nesting does not fit"],
        ),
        ({**one(), "id": 5}, ["'id' must be a string", "5"]),
        ({**one(), "parameters": "fast"}, ["'parameters'", "JSON object"]),
        (
            {**one(), "parameters": {"binary_data_output": 1}},
            ["binary_data_output must be true or false", "1"],
        ),
        ({**one(), "outputs": "y"}, ["'outputs' must be a list"]),
        ({**one(), "outputs": ["y"]}, ["outputs[0] must be an object"]),
        ({**one(), "outputs": [{"parameters": {}}]}, ["outputs[0]", "'name'"]),
        ({**one(), "outputs": [{"name": "y"}, {"name": "y"}]}, ["output 'y'", "more than once"]),
        (
            {**one(), "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]},
            ["output 'y'", "binary_data must be true or false"],
        ),
        (
            {**one(), "outputs": [{"name": "y", "parameters": {"classification": -1}}]},
            ["output 'y'", "classification must be a number of classes"],
        ),
        (
            {**one(), "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r"}}]},
            ["output 'y'", "shared_memory_byte_size must be"],
        ),
        (
            {
                **one(),
                "outputs": [
                    {
                        "name": "y",
                        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
                    }
                ],
            },
            ["output 'y'", "shared memory is not available"],
        ),
        ({**one(), "outputs": [{"name": "y", "parameters": 3}]}, ["output 'y'", "'parameters'"]),
        ({"inputs": one()["inputs"] * 2}, ["input 'x'", "more than once"]),
    ],
)
def test_bad_requests_are_refused_with_a_reason(doc: Any, fragments: list[str]) -> None:
    refused(doc, *fragments)


def test_huge_shapes_are_refused_before_allocating() -> None:
    tracemalloc.start()
    try:
        refused(one(shape=[2**40, 16], data=[1.0] * 16), "input 'x'", "17592186044416", "67108864")
        refused(one(shape=[2**62, 2**62, 0, 2**62], data=[]), "input 'x'", "spans", "67108864")
        refused(one(shape=[2**40, 0], data=[]), "input 'x'", "spans 1099511627776")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_zero_dims_make_empty_tensors() -> None:
    got = decode(one(shape=[1000, 0, 7], data=[])).inputs["x"]
    assert got.shape == (1000, 0, 7)


def test_element_limits_per_tensor_and_per_request() -> None:
    limits = Limits(max_elements_per_tensor=4, max_elements_per_request=6)
    refused(one(shape=[5], data=[1] * 5), "holds 5 elements", "at most 4", limits=limits)
    doc = {
        "inputs": [
            {"name": "a", "shape": [4], "datatype": "INT8", "data": [1] * 4},
            {"name": "b", "shape": [3], "datatype": "INT8", "data": [1] * 3},
        ]
    }
    refused(doc, "7 elements in all", "at most 6", limits=limits)
    doc["inputs"][1] = {"name": "b", "shape": [2], "datatype": "INT8", "data": [1] * 2}
    assert decode(doc, limits=limits).inputs["b"].tolist() == [1, 1]


def test_input_and_output_count_limits() -> None:
    limits = Limits(max_inputs=2, max_outputs=1)
    inputs = [{"name": f"i{n}", "shape": [1], "datatype": "INT8", "data": [1]} for n in range(3)]
    refused({"inputs": inputs}, "3 inputs", "at most 2", limits=limits)
    doc = {"inputs": inputs[:2], "outputs": [{"name": "a"}, {"name": "b"}]}
    refused(doc, "2 outputs", "at most 1", limits=limits)


def test_json_depth_limit_applies_everywhere_including_data() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    refused({**one(), "parameters": {"p": deep}}, "more than 32 deep")
    refused({**one(), "extra": deep}, "more than 32 deep")
    refused(one(other=deep), "more than 32 deep")
    refused({**one(), "outputs": [{"name": "y", "parameters": {"p": deep}}]}, "more than 32 deep")
    refused(one(shape=[1] * 30, data=deep), "more than 32 deep")
    limits = Limits(max_json_depth=5)
    nested = one(shape=[1, 1], data=[[4.0]])
    assert decode(nested, limits=limits).inputs["x"].shape == (1, 1)
    refused(one(shape=[1, 1, 1], data=[[[4.0]]]), "more than 5 deep", limits=limits)
    assert decode(one(shape=[1, 1, 1], data=[4.0]), limits=limits).inputs["x"].shape == (1, 1, 1)
    refused(one(), "more than 2 deep", limits=Limits(max_json_depth=2))
    header = orjson.dumps(one(data=..., parameters={"binary_data_size": 8}))
    limits = Limits(max_json_depth=2)
    refused(header + bytes(8), "more than 2 deep", header_length=len(header), limits=limits)


def test_depth_past_what_orjson_parses_is_a_request_error() -> None:
    refused(b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", "not valid JSON")


def test_body_over_the_limit() -> None:
    body = orjson.dumps(one())
    refused(
        body, str(len(body)), error=PayloadTooLarge, limits=Limits(max_body_bytes=len(body) - 1)
    )
    assert decode(body, limits=Limits(max_body_bytes=len(body))).inputs["x"].size == 2


def test_bool_binary_data_must_be_zero_or_one() -> None:
    header = orjson.dumps(one(datatype="BOOL", data=..., parameters={"binary_data_size": 2}))
    assert decode(header + b"\x01\x00", len(header)).inputs["x"].tolist() == [True, False]
    refused(header + b"\x01\x02", "input 'x'", "0 or 1", header_length=len(header))


@pytest.mark.parametrize(
    ("blob", "fragments"),
    [
        (pack_bytes([b"a"]) + b"\x01\x00\x00", ["ends inside element 1's 4-byte length"]),
        (pack_bytes([b"a"]) + struct.pack("<I", 9) + b"xyz", ["element 1 says it is 9 bytes", "3"]),
        (pack_bytes([b"a", b"b"]) + b"zz", ["2 bytes follow the last of its 2 BYTES"]),
    ],
)
def test_malformed_bytes_binary_data(blob: bytes, fragments: list[str]) -> None:
    doc = one(datatype="BYTES", data=..., parameters={"binary_data_size": len(blob)})
    header = orjson.dumps(doc)
    refused(header + blob, "input 'x'", *fragments, header_length=len(header))


def test_bytes_binary_data_decodes_to_the_bytes_sent() -> None:
    # Not UTF-8, NULs inside, an empty element: each element is the bytes sent,
    # for the engine to give a model as they are (or refuse for a text input).
    values = [b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", b"", b"a\x00b", "\u00e9".encode()]
    blob = pack_bytes(values)
    doc = one(datatype="BYTES", shape=[4], data=..., parameters={"binary_data_size": len(blob)})
    header = orjson.dumps(doc)
    got = decode(header + blob, len(header)).inputs["x"]
    assert got.dtype == object
    assert got.tolist() == values
    assert all(type(v) is bytes for v in got)


def test_messages_stay_short_for_huge_values() -> None:
    error = refused(one(name=["x" * 10_000]), "inputs[0]")
    assert len(str(error)) < 200
    error = refused(one(name="n" * 10_000, shape="s" * 10_000), "input 'nnn", "...'")
    assert len(str(error)) < 300
    error = refused({**one(), "outputs": [{"name": "o" * 10_000, "parameters": 1}]}, "output 'ooo")
    assert len(str(error)) < 300


# -- decompression ------------------------------------------------------------------------------


PAYLOAD = orjson.dumps(one()) * 50


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        (None, PAYLOAD),
        ("", PAYLOAD),
        ("identity", PAYLOAD),
        ("gzip", gzip.compress(PAYLOAD, mtime=0)),
        ("x-gzip", gzip.compress(PAYLOAD, mtime=0)),
        ("GZip ", gzip.compress(PAYLOAD, mtime=0)),
        ("identity, gzip", gzip.compress(PAYLOAD, mtime=0)),
        ("gzip", gzip.compress(PAYLOAD[:100], mtime=0) + gzip.compress(PAYLOAD[100:], mtime=0)),
        ("deflate", zlib.compress(PAYLOAD)),
        ("deflate", raw_deflate(PAYLOAD)),
    ],
)
def test_decompress(encoding: str | None, body: bytes) -> None:
    assert decompress(body, encoding, LIMITS) == PAYLOAD


def test_empty_body_passes_whatever_the_coding() -> None:
    assert decompress(b"", "gzip", LIMITS) == b""


@pytest.mark.parametrize("encoding", ["br", "compress", "zstd", "gzip, deflate", "gzip;q=1"])
def test_unsupported_encodings(encoding: str) -> None:
    with pytest.raises(UnsupportedEncoding, match="gzip, x-gzip or deflate"):
        decompress(b"abc", encoding, LIMITS)


@pytest.mark.parametrize(
    ("encoding", "body", "fragment"),
    [
        ("gzip", b"not gzip at all", "corrupt"),
        ("deflate", b"\x00\x01\x02 not deflate", "corrupt"),
        ("gzip", gzip.compress(PAYLOAD, mtime=0)[:-12], "truncated"),
        ("deflate", zlib.compress(PAYLOAD)[:-20], "truncated"),
        ("gzip", gzip.compress(PAYLOAD, mtime=0) + b"junk", "corrupt"),
        ("deflate", zlib.compress(PAYLOAD) + b"junk", "4 bytes follow"),
    ],
)
def test_bad_compressed_data(encoding: str, body: bytes, fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        decompress(body, encoding, LIMITS)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_output_limit_is_exact(encoding: str) -> None:
    data = b"a" * 1000
    body = gzip.compress(data) if encoding == "gzip" else zlib.compress(data)
    assert decompress(body, encoding, Limits(max_body_bytes=1000)) == data
    with pytest.raises(PayloadTooLarge, match="999"):
        decompress(body, encoding, Limits(max_body_bytes=999))


def test_multi_member_gzip_shares_one_budget() -> None:
    body = gzip.compress(b"a" * 600) + gzip.compress(b"b" * 600)
    with pytest.raises(PayloadTooLarge):
        decompress(body, "gzip", Limits(max_body_bytes=1000))


def test_compressed_body_over_the_limit_is_refused_as_sent() -> None:
    with pytest.raises(PayloadTooLarge):
        decompress(b"x" * 101, "gzip", Limits(max_body_bytes=100))


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw"])
def test_zip_bomb_is_stopped_at_the_limit(encoding: str) -> None:
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS, "raw": -zlib.MAX_WBITS}
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits[encoding])
    chunk = bytes(2**20)
    bomb = b"".join(packer.compress(chunk) for _ in range(64)) + packer.flush()  # 64 MiB
    limits = Limits(max_body_bytes=2**20)
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge, match="inflates to more than 1048576"):
            decompress(bomb, "gzip" if encoding == "gzip" else "deflate", limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


# -- loads_json ---------------------------------------------------------------------------------


def test_loads_json() -> None:
    assert loads_json(b'{"parameters": {"config": "{}"}}', LIMITS, "the load request") == {
        "parameters": {"config": "{}"}
    }
    with pytest.raises(RequestError, match="the load request is not valid JSON"):
        loads_json(b"{", LIMITS, "the load request")
    with pytest.raises(RequestError, match="the load request is empty"):
        loads_json(b"", LIMITS, "the load request")
    with pytest.raises(RequestError, match="more than 3 deep"):
        loads_json(b"[[[[]]]]", Limits(max_json_depth=3), "the load request")
    assert loads_json(b"[[[]]]", Limits(max_json_depth=3), "the load request") == [[[]]]
    with pytest.raises(PayloadTooLarge):
        loads_json(b"[1, 2]", Limits(max_body_bytes=3), "the load request")


# -- properties ---------------------------------------------------------------------------------


def _arrays(datatype: str, *, finite: bool) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    dtype = DATATYPES[datatype]
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
    if datatype == "BYTES":
        return hnp.arrays(object, shapes, elements=st.text(max_size=8))
    if dtype.kind == "f":
        elements = st.floats(
            width=dtype.itemsize * 8, allow_nan=not finite, allow_infinity=not finite
        )
        return hnp.arrays(dtype, shapes, elements=elements)
    return hnp.arrays(dtype, shapes)


def _assert_equal(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    assert got.shape == want.shape
    if want.dtype == object:
        assert [x.decode() if isinstance(x, bytes) else x for x in got.reshape(-1)] == want.reshape(
            -1
        ).tolist()
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@FUZZ
@given(st.data())
def test_property_client_requests_round_trip(data: st.DataObject) -> None:
    binary = data.draw(st.booleans(), label="binary")
    datatypes = data.draw(st.lists(st.sampled_from(sorted(DATATYPES)), min_size=1, max_size=3))
    arrays = {
        f"in{n}": data.draw(_arrays(datatype, finite=not binary), label=f"in{n}")
        for n, datatype in enumerate(datatypes)
    }
    body, length = triton_body(arrays, binary=binary)
    request = decode(body, length)
    for name, want in arrays.items():
        _assert_equal(request.inputs[name], want)


@FUZZ
@given(st.data())
def test_property_responses_round_trip(data: st.DataObject) -> None:
    datatypes = data.draw(st.lists(st.sampled_from(sorted(DATATYPES)), min_size=1, max_size=3))
    binary = data.draw(st.lists(st.booleans(), min_size=len(datatypes), max_size=len(datatypes)))
    arrays = {
        f"out{n}": data.draw(_arrays(datatype, finite=not flag), label=f"out{n}")
        for n, (datatype, flag) in enumerate(zip(datatypes, binary, strict=True))
    }
    request = plain_request(
        tuple(RequestedOutput(name, flag) for name, flag in zip(arrays, binary, strict=True))
    )
    body, length = response(request, arrays)
    result = httpclient.InferResult.from_response_body(body, header_length=length)
    for name, want in arrays.items():
        _assert_equal(result.as_numpy(name), want)


@FUZZ
@given(st.data())
def test_property_a_memo_response_is_the_long_ways_bytes(data: st.DataObject) -> None:
    # Its head memoised, an all-JSON response is byte for byte what the long way writes.
    datatypes = data.draw(st.lists(st.sampled_from(sorted(DATATYPES)), min_size=1, max_size=3))
    arrays = {
        f"out{n}": data.draw(_arrays(datatype, finite=False), label=f"out{n}")
        for n, datatype in enumerate(datatypes)
    }
    if data.draw(st.booleans(), label="non-contiguous"):
        arrays = {name: array.T for name, array in arrays.items()}
    named = data.draw(st.booleans(), label="named")
    request = InferRequest(
        id=data.draw(st.none() | st.text(max_size=4), label="id"),
        inputs={},
        outputs=tuple(RequestedOutput(name) for name in arrays) if named else None,
        binary_output=False,
        parameters={},
    )
    version = data.draw(st.none() | st.just("1"), label="version")

    def encode() -> tuple[bytes, int | None]:
        return encode_infer_response(
            model_name="m",
            model_version=version,
            request=request,
            outputs=arrays,
            output_order=list(arrays),
        )

    got = [encode(), encode()]  # the second from the memo
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_codec, "_json_response", lambda *args: None)
        want = encode()
    assert got == [want, want]


def test_a_memo_response_is_used_and_keeps_no_data() -> None:
    _codec._RESPONSE_HEADS.clear()
    request = InferRequest("r", {}, None, False, {})
    for value in (1.5, 2.5):
        outputs = {"y": np.full((1, 2), value, dtype=np.float32), "n": np.array([7])}
        body, length = encode_infer_response(
            model_name="m",
            model_version="1",
            request=request,
            outputs=outputs,
            output_order=["y", "n"],
        )
        assert length is None
        assert orjson.loads(body) == {
            "model_name": "m",
            "model_version": "1",
            "id": "r",
            "outputs": [
                {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [value, value]},
                {"name": "n", "datatype": "INT64", "shape": [1], "data": [7]},
            ],
        }
    ((head, entries),) = _codec._RESPONSE_HEADS.values()
    assert b"1.5" not in head + b"".join(entries)


def _json_containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function, not a lambda: hypothesis reads recursive()'s extend from its
    # source to check that it recurses, and a multi-line lambda's source may not parse.
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    _json_containers,
    max_leaves=12,
)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return valid | _json_values | st.just(...)


@st.composite
def _fuzzed_docs(draw: st.DrawFn) -> dict[str, Any]:
    shape = draw(_maybe(st.lists(st.integers(0, 3), max_size=3)))
    item = {
        "name": draw(_maybe(st.sampled_from(["x", "y"]))),
        "datatype": draw(_maybe(st.sampled_from(sorted(DATATYPES)))),
        "shape": shape,
        "data": draw(_maybe(st.lists(_json_values, max_size=6))),
        "parameters": draw(_maybe(st.fixed_dictionaries({"binary_data_size": st.integers(0, 24)}))),
    }
    doc = {
        "inputs": draw(_maybe(st.just([{k: v for k, v in item.items() if v is not ...}]))),
        "outputs": draw(_maybe(st.lists(st.fixed_dictionaries({"name": st.text(max_size=2)})))),
        "parameters": draw(_maybe(st.fixed_dictionaries({"binary_data_output": _json_values}))),
        "id": draw(_maybe(st.text(max_size=3))),
    }
    return {k: v for k, v in doc.items() if v is not ...}


@FUZZ
@given(_fuzzed_docs(), st.binary(max_size=32), st.data())
def test_property_fuzzed_documents_only_raise_request_errors(
    doc: dict[str, Any], tail: bytes, data: st.DataObject
) -> None:
    header = orjson.dumps(doc)
    length = data.draw(st.none() | st.integers(-2, len(header) + len(tail) + 2), label="length")
    with contextlib.suppress(RequestError):
        decode(header + tail, length, Limits(max_elements_per_tensor=64, max_json_depth=6))


_FUZZ_LIMITS = Limits(max_elements_per_tensor=64, max_json_depth=6)


def _outcome(body: bytes, length: int | None) -> tuple[Any, ...]:
    try:
        r = decode_infer_request(body, length, _FUZZ_LIMITS)
    except RequestError as exc:
        return type(exc), str(exc)
    # Bytes, not values: a NaN is not equal to itself (BYTES, as objects, by value).
    arrays = {
        k: (v.dtype.str, v.shape, v.tolist() if v.dtype == object else v.tobytes())
        for k, v in r.inputs.items()
    }
    return arrays, r.id, r.outputs, r.binary_output, dict(r.parameters)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.integers(-3, 300)
    | st.floats(-1e3, 1e3)
    | st.text(max_size=2)
)


def _fitting(datatype: str) -> st.SearchStrategy[Any]:
    """JSON values that a *datatype* input takes."""
    dtype = DATATYPES[datatype]
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "O":
        return st.text(max_size=2)
    if dtype.kind == "f":
        width = 8 * dtype.itemsize
        anywhere = st.floats(allow_nan=False, allow_infinity=False, width=width)
        return st.floats(-1e3, 1e3, width=width) | st.integers(-9, 9) | anywhere
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max)) | st.integers(0, 9)


@st.composite
def _like_docs(
    draw: st.DrawFn, shape: list[int], datatype: str, binary: bool, how: str, with_id: bool
) -> tuple[bytes, int | None]:
    """A request for one input of *shape* and *datatype*, its data (or binary part) drawn,
    and its header length."""
    count = math.prod(shape)
    item: dict[str, Any] = {"name": "x", "shape": shape, "datatype": datatype}
    tail = b""
    if binary:
        size = count * (DATATYPES[datatype].itemsize if datatype != "BYTES" else 4)
        tail = draw(st.binary(min_size=size, max_size=size) | st.binary(max_size=size + 2))
        item["parameters"] = {"binary_data_size": size}
    else:
        # Mostly values of the datatype, so that a plan is made and used; now and then not.
        values = _fitting(datatype) | _fitting(datatype) | st.booleans() | _scalars
        flat = st.lists(values, min_size=count, max_size=count)
        item["data"] = draw(flat | st.lists(_json_values, max_size=4))
    doc: dict[str, Any] = {"inputs": [item]}
    if with_id:
        doc["id"] = draw(st.text("ab1", max_size=3) | st.text(max_size=3) | _scalars)
    # As orjson writes it, or Python's json (spaces; escapes, or none, for non-ASCII).
    if how == "orjson":
        header = orjson.dumps(doc)
    else:
        header = json.dumps(doc, ensure_ascii=how == "json").encode("utf-8", "surrogatepass")
    return header + tail, len(header) if binary else None


@FUZZ
@given(
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from(sorted(DATATYPES)),
    st.booleans(),
    st.sampled_from(["orjson", "json", "json-utf8"]),
    st.booleans(),
    st.data(),
)
def test_property_a_plan_decodes_as_the_long_way(
    shape: list[int], datatype: str, binary: bool, how: str, with_id: bool, data: st.DataObject
) -> None:
    # Requests alike but for their data (or binary part) and id: once a plan was
    # made from one (decoded twice), the others decode exactly as with no plan.
    like_docs = _like_docs(shape, datatype, binary, how, with_id)
    drawn = [data.draw(like_docs, label="body") for _ in range(3)]
    bodies = [body for body, _ in drawn]
    lengths = [length for _, length in drawn]
    want = []
    for body, length in zip(bodies, lengths, strict=True):
        forget_plans()  # the long way each time: no plan made by the one before
        want.append(_outcome(body, length))
    forget_plans()
    got = [_outcome(body, length) for body, length in zip(bodies, lengths, strict=True)]
    _outcome(bodies[0], lengths[0])
    _outcome(bodies[0], lengths[0])
    got += [_outcome(body, length) for body, length in zip(bodies, lengths, strict=True)]
    assert got == want + want


@FUZZ
@given(
    st.sampled_from(["FP16", "FP32", "FP64", "INT8", "INT64", "UINT64", "BOOL"]),
    st.integers(1, 4),
    st.sampled_from(["orjson", "json"]),
    st.data(),
)
def test_property_a_planned_flat_json_request_decodes_as_the_long_way(
    datatype: str, count: int, how: str, data: st.DataObject
) -> None:
    # The layout of a common client: a flat list, an id per request. The first
    # request fits (a plan is made from it); the others' values are anything.
    def body(values: list[Any], request_id: str) -> bytes:
        doc = {"id": request_id, "inputs": [{"name": "x", "shape": [count], "datatype": datatype}]}
        doc["inputs"][0]["data"] = values  # type: ignore[index]
        return orjson.dumps(doc) if how == "orjson" else json.dumps(doc).encode()

    good = st.lists(_fitting(datatype), min_size=count, max_size=count)
    mixed = _fitting(datatype) | st.booleans() | _scalars
    anything = st.lists(mixed, min_size=count - 1, max_size=count + 1)
    bodies = [body(data.draw(good, label="first"), "a")]
    bodies += [body(data.draw(anything, label="next"), str(i)) for i in range(3)]
    want = []
    for one_body in bodies:
        forget_plans()
        want.append(_outcome(one_body, None))
    forget_plans()
    _outcome(bodies[0], None)
    _outcome(bodies[0], None)
    assert [plan for plan in _JSON_PLANS.values() if plan is not None]
    assert [_outcome(one_body, None) for one_body in bodies] == want


@FUZZ
@given(st.data())
def test_property_mutated_bodies_only_raise_request_errors(data: st.DataObject) -> None:
    arrays = {"a": SAMPLES[data.draw(st.sampled_from(sorted(SAMPLES)), label="datatype")]}
    body, length = data.draw(
        st.sampled_from([triton_body(arrays, binary=True), triton_body(arrays, binary=False)]),
        label="body",
    )
    mutated = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, max(len(mutated) - 1, 0)), label="at")
        action = data.draw(st.sampled_from(["flip", "insert", "delete"]), label="action")
        byte = data.draw(st.integers(0, 255), label="byte")
        if action == "flip" and mutated:
            mutated[at] = byte
        elif action == "insert":
            mutated.insert(at, byte)
        elif mutated:
            del mutated[at]
    length = data.draw(st.sampled_from([length, None, len(mutated), len(mutated) // 2]))
    with contextlib.suppress(RequestError):
        decode(bytes(mutated), length)


@FUZZ
@given(st.binary(max_size=200), st.one_of(st.none(), st.text(max_size=6)), st.data())
def test_property_random_bytes_only_raise_request_errors(
    body: bytes, header: str | None, data: st.DataObject
) -> None:
    try:
        length = parse_header_length(header, len(body))
    except RequestError:
        length = data.draw(st.none() | st.integers(0, len(body)))
    for encoding in (None, "gzip", "deflate"):
        with contextlib.suppress(RequestError):
            decode(decompress(body, encoding, LIMITS), length)


@pytest.mark.parametrize(
    ("doc", "fragments"),
    [
        # A flat list of numbers takes a short way (its min and max bound it): these
        # are what that way must still send the long way, and refuse there.
        (one(data=["1", "2"]), ["input 'x'", "FP32 data must be numbers", '"1"']),
        (one(shape=[1], data=["1.5"]), ["input 'x'", "must be numbers", '"1.5"']),
        (one(shape=[1], data=[None]), ["input 'x'", "must be numbers", "null"]),
        (one(shape=[1], data=[{}]), ["input 'x'", "must be numbers", "{}"]),
        (one(data=[None, None]), ["input 'x'", "must be numbers", "null"]),
        (one(data=[1e39, 1.0]), ["input 'x'", "FP32", "1e+39"]),
        (one(datatype="FP16", data=[65520.0, 1]), ["input 'x'", "FP16", "65520"]),
        (one(data=[2.0, True]), ["input 'x'", "must be numbers", "true"]),
    ],
)
def test_flat_numbers_short_way_sends_anything_else_the_long_way(
    doc: Any, fragments: list[str]
) -> None:
    refused(doc, *fragments)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_flat_numbers_convert_as_numpy_does(datatype: str) -> None:
    target = DATATYPES[datatype]
    top = float(np.finfo(target).max)
    data: list[Any] = [0, -3, 1.5, 2**40 if datatype != "FP16" else 7, top, -top, 1e-30]
    got = decode(one(shape=[len(data)], datatype=datatype, data=data)).inputs["x"]
    assert got.dtype == target
    assert got.tobytes() == np.array(data, dtype=np.float64).astype(target).tobytes()


def test_brackets_in_strings_and_long_headers_are_walked_for_depth() -> None:
    # A header with more brackets than the depth limit is walked, not refused.
    doc = one()
    doc["parameters"] = {"note": "[" * 100 + "{" * 100}
    assert decode(doc).inputs["x"].tolist() == [1.0, 2.0]
    # A long header (past the bracket scan) is walked too, and nesting in it counts.
    deep: Any = []
    for _ in range(40):
        deep = [deep]
    refused({**one(), "parameters": {"p": deep, "note": "x" * 20_000}}, "more than 32 deep")
    doc = one(data=[1, True])
    doc["parameters"] = {"note": "x" * 20_000}
    refused(doc, "input 'x'", "must be numbers", "got true")


def test_raw_outputs_as_views_are_the_same_bytes_without_a_copy() -> None:
    """copy=False: an output laid out as sent is a byte view of its array; others are bytes."""
    request = _codec.InferRequest("r", {}, None, False, {})
    batch = np.arange(20, dtype=np.float32).reshape(2, 10)
    outputs = {
        "row": batch[1:2],  # a request's row of its batch's output, as split
        "big": np.arange(3, dtype=">i4"),  # not little-endian: a view of its conversion
        "none": np.zeros((0, 4), np.float32),
        "text": np.array(["ab", "c"], dtype=object),
    }
    order = list(outputs)
    copied = _codec.encode_raw_outputs(request, outputs, order)
    viewed = _codec.encode_raw_outputs(request, outputs, order, copy=False)
    assert [bytes(v[3]) for v in viewed] == [c[3] for c in copied]
    assert [len(v[3]) for v in viewed] == [len(c[3]) for c in copied]
    assert all(type(c[3]) is bytes for c in copied)
    row = viewed[0][3]
    assert isinstance(row, memoryview)
    assert np.shares_memory(np.frombuffer(row, np.float32), batch)
    assert [type(v[3]) for v in viewed[1:]] == [memoryview, bytes, bytes]
