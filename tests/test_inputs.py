"""Inputs are checked against the model's signature before they queue."""

from __future__ import annotations

import numpy as np
import pytest

from trioinfer import ConfigError, InputLimits, InvalidInput, ModelSignature, TensorSpec
from trioinfer._tensors import validate_inputs

F32 = np.dtype(np.float32)
SIG = ModelSignature(
    inputs=(
        TensorSpec("ids", np.dtype(np.int64), ("batch", "seq"), "tensor(int64)"),
        TensorSpec("mask", np.dtype(np.int64), ("batch", "seq"), "tensor(int64)"),
        TensorSpec("scale", F32, ("batch", 1), "tensor(float)"),
    ),
    outputs=(TensorSpec("y", F32, ("batch", 8), "tensor(float)"),),
)
LIMITS = InputLimits()


def good(rows: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    return {
        "ids": np.zeros((rows, seq), np.int64),
        "mask": np.ones((rows, seq), np.int64),
        "scale": np.ones((rows, 1), np.float32),
    }


def check(inputs: object, limits: InputLimits = LIMITS) -> dict[str, np.ndarray]:
    return validate_inputs("m", SIG, inputs, limits)


def test_valid_inputs_pass_without_copies() -> None:
    inputs = good()
    out = check(inputs)
    assert all(out[k] is inputs[k] for k in inputs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("mask"), "needs input 'mask'; its inputs are 'ids' int64"),
        (lambda d: d.update(extra=d["ids"]), "no input named 'extra'"),
        (
            lambda d: d.update(scale=d["scale"].astype(np.float64)),
            r"'scale' of model 'm' has dtype float64; the model expects float32\[batch, 1\]",
        ),
        (lambda d: d.update(scale=d["scale"][0]), r"rank 1\); the model expects float32"),
        (lambda d: d.update(scale=np.ones((2, 3), np.float32)), "size 3 in dimension 1"),
        (lambda d: d.update(mask=np.ones((2, 6), np.int64)), "disagree on dimension 'seq'"),
        (lambda d: d.update(mask=np.ones((3, 5), np.int64)), "disagree on dimension 'batch'"),
        (lambda d: d.update(ids="text"), "has dtype str"),
        (lambda d: d.update(ids=object()), "must be a numpy array"),
        (lambda d: d.update(ids=[[1, 2], [3]]), "not a rectangular array"),
    ],
)
def test_bad_inputs_say_what_was_wrong(change: object, message: str) -> None:
    inputs = good()
    change(inputs)  # type: ignore[operator]
    with pytest.raises(InvalidInput, match=message):
        check(inputs)


def test_a_list_of_floats_is_told_how_to_become_the_models_dtype() -> None:
    # A list has no .astype: the hint for an array would send the user to an AttributeError.
    inputs: dict[str, object] = dict(good())
    inputs["scale"] = [[0.5], [1.5]]
    with pytest.raises(InvalidInput) as info:
        check(inputs)
    message = str(info.value)
    assert "has dtype float64 (a list of Python numbers, as numpy reads it)" in message
    assert "numpy.asarray(..., dtype=numpy.float32)" in message
    assert ".astype" not in message


def test_inputs_must_be_a_mapping() -> None:
    with pytest.raises(InvalidInput, match="must be a mapping of input name to array, got list"):
        check([1, 2])


def test_zero_rows_are_refused() -> None:
    with pytest.raises(InvalidInput, match="0 rows"):
        check(good(rows=0))


def test_inconsistent_batch_dims_are_refused_even_with_different_symbols() -> None:
    sig = ModelSignature(
        inputs=(
            TensorSpec("a", F32, ("N", 2), "tensor(float)"),
            TensorSpec("b", F32, (None, 2), "tensor(float)"),
        ),
        outputs=(TensorSpec("y", F32, ("N", 2), "tensor(float)"),),
    )
    with pytest.raises(InvalidInput, match="disagree on the batch size: 'a' has 2 rows, 'b' has 3"):
        validate_inputs("m", sig, {"a": np.ones((2, 2), F32), "b": np.ones((3, 2), F32)}, LIMITS)


def test_element_caps_refuse_before_any_copy() -> None:
    huge = np.broadcast_to(np.zeros((1, 1), np.int64), (1 << 20, 64))  # no memory behind it
    inputs = good()
    inputs["ids"] = huge
    with pytest.raises(InvalidInput, match="at most 1000 are allowed per input"):
        check(inputs, InputLimits(max_elements_per_input=1000))
    with pytest.raises(InvalidInput, match="more than 15 elements in all"):
        check(good(), InputLimits(max_elements_per_request=15))


def test_casting_only_when_configured() -> None:
    inputs = good()
    inputs["scale"] = inputs["scale"].astype(np.float16)
    with pytest.raises(
        InvalidInput,
        match=r"convert it with .astype\(numpy.float32\), or over HTTP or gRPC send it as "
        "datatype FP32",
    ):
        check(inputs)
    out = check(inputs, InputLimits(casting="safe"))
    assert out["scale"].dtype == np.float32
    inputs["scale"] = inputs["scale"].astype(np.float64)
    with pytest.raises(InvalidInput, match="casting 'safe' does not allow"):
        check(inputs, InputLimits(casting="safe"))
    assert check(inputs, InputLimits(casting="same_kind"))["scale"].dtype == np.float32


def test_the_models_dtype_in_the_other_byte_order_is_named_so() -> None:
    # np.frombuffer(data, ">f4") is refused (ONNX Runtime reads the machine's order), and
    # the message read "has dtype float32; the model expects float32".
    inputs = good()
    inputs["scale"] = inputs["scale"].astype(">f4")
    with pytest.raises(
        InvalidInput,
        match=r"has dtype float32 in the other byte order \('>f4'\), not the machine's; "
        r"the model expects float32\[batch, 1\] \(convert it with .astype\(numpy.float32\)",
    ):
        check(inputs)


def test_nested_lists_are_accepted_when_dtypes_fit() -> None:
    sig = ModelSignature(
        inputs=(TensorSpec("x", np.dtype(np.int64), ("batch", 2), "tensor(int64)"),),
        outputs=(),
    )
    out = validate_inputs("m", sig, {"x": [[1, 2], [3, 4]]}, LIMITS)
    assert out["x"].dtype == np.int64


def test_strings_are_passed_as_objects() -> None:
    sig = ModelSignature(
        inputs=(TensorSpec("s", np.dtype(object), ("batch",), "tensor(string)"),), outputs=()
    )
    out = validate_inputs("m", sig, {"s": np.array(["a", "bc"])}, LIMITS)
    assert out["s"].dtype == object


STRINGS = ModelSignature(
    inputs=(TensorSpec("s", np.dtype(object), ("batch", None), "tensor(string)"),), outputs=()
)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.array([["a", 1]], dtype=object), "got int 1 at index [0, 1]"),
        (np.array([["a"], [2.5]], dtype=object), "got float 2.5 at index [1, 0]"),
        (np.array([[None]], dtype=object), "got NoneType None at index [0, 0]"),
        ([["a", 7]], None),
        (np.array([[1, 2]]), "got int 1 at index [0, 0]"),  # int64, cast to object
    ],
)
def test_string_inputs_hold_only_str_or_bytes(value: object, message: str | None) -> None:
    limits = InputLimits(casting="same_kind")
    if message is None:
        # numpy turns a list that mixes str and int into str: nothing is left to refuse
        # (and a BYTES input that is not UTF-8 text gets the str elements as bytes).
        out = validate_inputs("m", STRINGS, {"s": value}, limits)
        assert out["s"].tolist() == [[b"a", b"7"]]
        return
    with pytest.raises(InvalidInput) as info:
        validate_inputs("m", STRINGS, {"s": value}, limits)
    assert str(info.value).startswith(
        "input 's' of model 'm' is a string (BYTES) tensor: its elements must be bytes or str"
    )
    assert message in str(info.value)


def test_string_inputs_take_str_bytes_and_numpy_strings_and_give_bytes() -> None:
    # A BYTES input without utf8 (a Python model's) reaches the model as bytes, as
    # Triton's Python backend gives it: str elements encoded as UTF-8, in a new array.
    value = np.array([["a", b"b", np.str_("c"), np.bytes_(b"d"), "\u00e9"]], dtype=object)
    out = validate_inputs("m", STRINGS, {"s": value}, LIMITS)["s"]
    assert out.tolist() == [[b"a", b"b", b"c", b"d", "\u00e9".encode()]]
    assert all(isinstance(v, bytes) for v in out.ravel())
    assert value[0, 0] == "a"  # the caller's array is not changed
    # All bytes already: the array as it came.
    raw = np.array([[b"a", b"\xff"]], dtype=object)
    assert validate_inputs("m", STRINGS, {"s": raw}, LIMITS)["s"] is raw
    # A numpy str array.
    out = validate_inputs("m", STRINGS, {"s": np.array([["x"], ["yz"]])}, LIMITS)["s"]
    assert out.tolist() == [[b"x"], [b"yz"]]


def test_str_that_utf8_cannot_encode_is_refused_for_a_bytes_input() -> None:
    value = np.array([["ok", "\ud800"]], dtype=object)
    with pytest.raises(InvalidInput) as info:
        validate_inputs("m", STRINGS, {"s": value}, LIMITS)
    assert str(info.value) == (
        "input 's' of model 'm' is a BYTES tensor, and its str element at index [0, 1] "
        "cannot be encoded as UTF-8 (surrogates not allowed at character 0 of '\\ud800'); "
        "send bytes, or str without lone surrogates"
    )


TEXT = ModelSignature(
    inputs=(TensorSpec("s", np.dtype(object), ("batch", None), "tensor(string)", utf8=True),),
    outputs=(),
)


def test_utf8_string_inputs_get_bytes_decoded_into_a_new_array() -> None:
    value = np.array([["a", b"b", np.str_("c"), np.bytes_(b"d"), "\u00e9".encode()]], dtype=object)
    out = validate_inputs("m", TEXT, {"s": value}, LIMITS)["s"]
    assert out.shape == value.shape
    assert out.tolist() == [["a", "b", "c", "d", "\u00e9"]]
    assert all(isinstance(v, str) for v in out.ravel())
    assert value[0, 1] == b"b"  # the caller's array is not changed
    # Nothing to decode: the array as it came.
    text = np.array([["a", "b"]], dtype=object)
    assert validate_inputs("m", TEXT, {"s": text}, LIMITS)["s"] is text
    # A numpy bytes array, and an empty one.
    out = validate_inputs("m", TEXT, {"s": np.array([[b"x"], [b"yz"]])}, LIMITS)["s"]
    assert out.tolist() == [["x"], ["yz"]]
    empty = np.empty((1, 0), dtype=object)
    assert validate_inputs("m", TEXT, {"s": empty}, LIMITS)["s"].shape == (1, 0)


def test_utf8_string_inputs_refuse_bytes_that_are_not_utf8() -> None:
    value = np.array([[b"ok", "fine"], [b"caf\xc3", b"x"]], dtype=object)
    with pytest.raises(InvalidInput) as info:
        validate_inputs("m", TEXT, {"s": value}, LIMITS)
    assert str(info.value) == (
        "input 's' of model 'm' is a string tensor of UTF-8 text, but its element at index "
        "[1, 0] is not UTF-8 (unexpected end of data at byte 3 of b'caf\\xc3'); send UTF-8 "
        "encoded bytes, or str"
    )
    # Elements that are not strings at all are told so first, as without utf8.
    with pytest.raises(InvalidInput, match="got int 1 at index \\[0, 1\\]"):
        validate_inputs("m", TEXT, {"s": np.array([[b"\xff", 1]], dtype=object)}, LIMITS)


def test_declared_string_inputs_keep_the_bytes_they_were_given() -> None:
    # A declared BYTES input (a Python model's) is not text: binary bytes pass as they are.
    value = np.array([[b"\xff\x00", b"a\x00b"]], dtype=object)
    assert validate_inputs("m", STRINGS, {"s": value}, LIMITS)["s"] is value


def test_a_declared_input_says_utf8_for_text() -> None:
    signature = ModelSignature.declared(
        [
            {"name": "image", "dtype": "BYTES", "shape": ["batch"]},
            {"name": "prompt", "dtype": "string", "shape": ["batch"], "utf8": True},
            {"name": "blob", "dtype": "TYPE_STRING", "shape": ["batch"], "utf8": False},
        ],
        [{"name": "y", "dtype": "BYTES", "shape": ["batch"]}],
        model="m",
    )
    assert [spec.utf8 for spec in signature.inputs] == [False, True, False]
    out = validate_inputs(
        "m",
        signature,
        {
            "image": np.array(["\u00e9"], dtype=object),
            "prompt": np.array(["\u00e9".encode()], dtype=object),
            "blob": np.array([b"\xff"], dtype=object),
        },
        LIMITS,
    )
    assert out["image"].tolist() == ["\u00e9".encode()]
    assert out["prompt"].tolist() == ["\u00e9"]
    assert out["blob"].tolist() == [b"\xff"]


@pytest.mark.parametrize(
    ("inputs", "outputs", "message"),
    [
        (
            [{"name": "x", "dtype": "float32", "shape": [1], "utf8": True}],
            [{"name": "y", "dtype": "float32", "shape": [1]}],
            "utf8 must be true or false, and only a string (BYTES) tensor takes it; got "
            "utf8 = True for dtype 'float32'",
        ),
        (
            [{"name": "x", "dtype": "BYTES", "shape": [1], "utf8": "yes"}],
            [{"name": "y", "dtype": "float32", "shape": [1]}],
            "got utf8 = 'yes' for dtype 'BYTES'",
        ),
        (
            [{"name": "x", "dtype": "BYTES", "shape": [1]}],
            [{"name": "y", "dtype": "BYTES", "shape": [1], "utf8": True}],
            "an output takes no utf8",
        ),
        (
            [{"name": "x", "dtype": "BYTES", "shape": [1], "text": True}],
            [{"name": "y", "dtype": "BYTES", "shape": [1]}],
            "must be a table of name, dtype, shape (and, for a string input, utf8; for an "
            "input, optional)",
        ),
    ],
)
def test_a_misdeclared_utf8_is_a_config_error(
    inputs: list[dict[str, object]], outputs: list[dict[str, object]], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        ModelSignature.declared(inputs, outputs, model="m")
    assert message in str(info.value)


def test_numbers_for_a_string_input_are_told_to_send_strings() -> None:
    with pytest.raises(InvalidInput) as info:
        validate_inputs("m", STRINGS, {"s": np.array([[1, 2]])}, LIMITS)
    message = str(info.value)
    assert "has dtype int64; the model expects object[batch, ?]" in message
    assert "numpy.object" not in message
    assert "datatype object" not in message
    assert "str or bytes" in message
    assert "datatype BYTES" in message


def test_unsupported_element_type_is_refused() -> None:
    sig = ModelSignature(
        inputs=(TensorSpec("x", None, ("batch",), "tensor(bfloat16)"),), outputs=()
    )
    with pytest.raises(InvalidInput, match="tensor\\(bfloat16\\), which numpy cannot hold"):
        validate_inputs("m", sig, {"x": np.ones(2, np.float32)}, LIMITS)


# A signature that fixes every dimension but the batch: validate_inputs checks
# such inputs on a short path first, and must refuse exactly what the full checks do.
FIXED = ModelSignature(
    inputs=(
        TensorSpec("x", F32, ("batch", 4), "tensor(float)"),
        TensorSpec("ids", np.dtype(np.int64), ("batch", 2, 3), "tensor(int64)"),
    ),
    outputs=(TensorSpec("y", F32, ("batch", 8), "tensor(float)"),),
)


def fixed_good(rows: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.ones((rows, 4), np.float32), "ids": np.zeros((rows, 2, 3), np.int64)}


def test_fixed_signature_inputs_pass_in_a_new_dict_without_copies() -> None:
    inputs = fixed_good()
    out = validate_inputs("m", FIXED, inputs, LIMITS)
    assert out is not inputs  # the caller may reuse its dict for its next request
    assert list(out) == ["x", "ids"]
    assert all(out[k] is inputs[k] for k in inputs)


@pytest.mark.parametrize(
    ("change", "message", "limits"),
    [
        (lambda d: d.pop("ids"), "needs input 'ids'", LIMITS),
        (lambda d: d.update(z=d.pop("ids")), "no input named 'z'", LIMITS),
        (lambda d: d.update(x=d["x"].astype(np.float64)), "has dtype float64", LIMITS),
        (lambda d: d.update(x=d["x"].astype(">f4")), "has dtype", LIMITS),
        (lambda d: d.update(x=np.ones((2, 5), np.float32)), "size 5 in dimension 1", LIMITS),
        (lambda d: d.update(x=np.ones(4, np.float32)), r"rank 1\)", LIMITS),
        (lambda d: d.update(x=np.float32(1.0)), "rank 0", LIMITS),
        (lambda d: d.update(ids=np.zeros((2, 3, 2), np.int64)), "size 3 in dimension 1", LIMITS),
        (lambda d: d.update(x=np.ones((3, 4), np.float32)), "disagree on dimension 'b", LIMITS),
        (lambda d: d.update(fixed_good(0)), "0 rows", LIMITS),
        (lambda d: d.update(x=[[1.0] * 4] * 2), "", InputLimits(casting="same_kind")),
        (lambda d: None, "at most 7 are allowed per input", InputLimits(max_elements_per_input=7)),
        (lambda d: None, "more than 19 elements in all", InputLimits(max_elements_per_request=19)),
    ],
)
def test_fixed_signature_refuses_what_the_full_checks_refuse(
    change: object, message: str, limits: InputLimits
) -> None:
    inputs = fixed_good()
    change(inputs)  # type: ignore[operator]
    if not message:  # accepted by the full checks (a list, converted): the same answer
        out = validate_inputs("m", FIXED, inputs, limits)
        assert out["x"].dtype == np.float32
        assert out["x"].shape == (2, 4)
        return
    with pytest.raises(InvalidInput, match=message):
        validate_inputs("m", FIXED, inputs, limits)


# One input: validate_rows() checks it in line, and must refuse what the full checks do.
ONE = ModelSignature(
    inputs=(TensorSpec("x", F32, ("batch", 4), "tensor(float)"),),
    outputs=(TensorSpec("y", F32, ("batch", 8), "tensor(float)"),),
)


@pytest.mark.parametrize(
    ("x", "message", "limits"),
    [
        (np.ones((3, 4), np.float64), "has dtype float64", LIMITS),
        (np.ones((3, 4), ">f4"), "has dtype", LIMITS),
        (np.ones((3, 5), np.float32), "size 5 in dimension 1", LIMITS),
        (np.ones(4, np.float32), r"rank 1\)", LIMITS),
        (np.ones((3, 4, 1), np.float32), r"rank 3\)", LIMITS),
        (np.array(1.0, np.float32), "rank 0", LIMITS),
        (np.ones((0, 4), np.float32), "0 rows", LIMITS),
        (np.ones((3, 4), np.float32), "at most 11 are allowed per input", InputLimits(11)),
        (np.ones((3, 4), np.float32), "more than 11 elements in all", InputLimits(12, 11)),
        ([[1.0] * 4] * 3, "", InputLimits(casting="same_kind")),
        (np.ones((3, 4), np.float32), "", LIMITS),
    ],
)
@pytest.mark.parametrize("way", ["validate_rows", "rows_validator"])
def test_one_input_is_refused_as_the_full_checks_refuse_it(
    x: object, message: str, limits: InputLimits, way: str
) -> None:
    from trioinfer._tensors import rows_validator, validate_rows

    def check(inputs: object, batched: bool = True) -> tuple[dict[str, np.ndarray], int]:
        if way == "validate_rows":
            return validate_rows("m", ONE, inputs, limits, batched)
        return rows_validator("m", ONE, limits, batched)(inputs)

    if message:
        for batched in (True, False):  # (unbatched: a pipeline's request)
            with pytest.raises(InvalidInput, match=message):
                check({"x": x}, batched)
        return
    inputs = {"x": x}
    arrays, rows = check(inputs)
    assert rows == 3
    assert arrays is not inputs
    assert list(arrays) == ["x"]
    assert arrays["x"].dtype == np.float32
    assert arrays["x"].shape == (3, 4)
    if isinstance(x, np.ndarray):
        assert arrays["x"] is x  # no copy
    assert check(inputs, batched=False)[1] == 1  # no batch dimension: 1


def test_fixed_signature_fast_path_refuses_a_first_input_of_zero_rows() -> None:
    # {a: 0 rows, b: 3 rows} passed _fixed_arrays (batch stayed 0 at the first input,
    # then took b's 3) and, batched with other callers' requests, failed their batch.
    import numpy as np

    import trioinfer
    from trioinfer._tensors import InputLimits, ModelSignature, validate_inputs, validate_rows

    sig = ModelSignature.declared(
        [
            {"name": "a", "dtype": "float32", "shape": ["batch", 4]},
            {"name": "b", "dtype": "float32", "shape": ["batch", 4]},
        ],
        [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
        model="m",
    )
    bad = {"a": np.ones((0, 4), np.float32), "b": np.ones((3, 4), np.float32)}
    with pytest.raises(trioinfer.InvalidInput):
        validate_rows("m", sig, bad, InputLimits(), True)
    with pytest.raises(trioinfer.InvalidInput):
        validate_inputs("m", sig, bad, InputLimits())
    good = {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)}
    assert validate_rows("m", sig, good, InputLimits(), True)[1] == 2
