"""The ONNX model builders in trioinfer.testing.models write models ONNX Runtime runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from trioinfer.testing import models

INT_AND_FLOAT_DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
]


def session(path: Path) -> Any:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def check_header(path: Path) -> onnx.ModelProto:
    model = onnx.load(path)
    assert model.ir_version == 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.doc_string
    return model


def test_mlp_matches_numpy_forward_pass(tmp_path: Path) -> None:
    path = models.write_mlp(tmp_path / "mlp.onnx")
    assert path == tmp_path / "mlp.onnx"
    model = check_header(path)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}

    x = np.random.default_rng(1).standard_normal((5, 64), dtype=np.float32)
    sess = session(path)
    assert [(i.name, i.shape, i.type) for i in sess.get_inputs()] == [
        ("input", ["batch", 64], "tensor(float)")
    ]
    (y,) = sess.run(None, {"input": x})

    h = np.maximum(x @ weights["layer0.weight"] + weights["layer0.bias"], 0)
    expected = h @ weights["layer1.weight"] + weights["layer1.bias"]
    assert y.shape == (5, 10)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # Scaled so that standard-normal inputs give outputs of order one.
    assert 0.1 < float(y.std()) < 10


def test_mlp_names_sizes_and_seed(tmp_path: Path) -> None:
    path = models.write_mlp(
        tmp_path / "sub" / "m.onnx", (8, 16, 16, 3), seed=5, input_name="in", output_name="out"
    )
    sess = session(path)
    assert [i.name for i in sess.get_inputs()] == ["in"]
    assert [(o.name, o.shape) for o in sess.get_outputs()] == [("out", ["batch", 3])]
    (y,) = sess.run(None, {"in": np.ones((7, 8), np.float32)})
    assert y.shape == (7, 3)

    same = models.write_mlp(tmp_path / "a.onnx", (8, 16, 16, 3), seed=5, input_name="in")
    other = models.write_mlp(tmp_path / "b.onnx", (8, 16, 16, 3), seed=6, input_name="in")
    again = models.write_mlp(tmp_path / "c.onnx", (8, 16, 16, 3), seed=5, input_name="in")
    assert same.read_bytes() == again.read_bytes()
    assert same.read_bytes() != other.read_bytes()


@pytest.mark.parametrize("sizes", [(), (4,), (4, 0), (4, -1, 2)])
def test_mlp_refuses_bad_sizes(tmp_path: Path, sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="sizes"):
        models.write_mlp(tmp_path / "m.onnx", sizes)


def test_wide_mlp(tmp_path: Path) -> None:
    sess = session(models.write_wide_mlp(tmp_path / "wide.onnx"))
    assert [(i.name, i.shape) for i in sess.get_inputs()] == [("input", ["batch", 1024])]
    (y,) = sess.run(None, {"input": np.zeros((2, 1024), np.float32)})
    assert y.shape == (2, 1000)


@pytest.mark.parametrize("dtype", INT_AND_FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_add_sum_and_diff_are_exact(tmp_path: Path, dtype: type[np.generic]) -> None:
    path = models.write_add(tmp_path / "add.onnx", dtype=dtype, width=6)
    check_header(path)
    sess = session(path)
    assert [(o.name, o.shape) for o in sess.get_outputs()] == [
        ("sum", ["batch", 6]),
        ("diff", ["batch", 6]),
    ]
    # Small values, so neither sum nor difference leaves any dtype's range.
    a = np.arange(18).reshape(3, 6).astype(dtype) + np.array(10).astype(dtype)
    b = np.array([[1, 2, 3, 0, 5, 9]] * 3).astype(dtype)
    total, diff = sess.run(None, {"a": a, "b": b})
    assert total.dtype == diff.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(diff, a - b)


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64, str, object])
def test_add_refuses_types_add_does_not_take(tmp_path: Path, dtype: Any) -> None:
    with pytest.raises(ValueError, match="do not take"):
        models.write_add(tmp_path / "add.onnx", dtype=dtype)


@pytest.mark.parametrize("dtype", [*INT_AND_FLOAT_DTYPES, np.bool_], ids=lambda d: np.dtype(d).name)
def test_identity_round_trips(tmp_path: Path, dtype: type[np.generic]) -> None:
    path = models.write_identity(tmp_path / "id.onnx", dtype=dtype, shape=("batch", 3, None))
    check_header(path)
    sess = session(path)
    (x_info,) = sess.get_inputs()
    assert (x_info.name, x_info.shape) == ("x", ["batch", 3, None])
    x = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    (y,) = sess.run(None, {"x": x})
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("dtype", [str, np.str_, object])
def test_identity_round_trips_strings(tmp_path: Path, dtype: Any) -> None:
    sess = session(models.write_identity(tmp_path / "id.onnx", dtype=dtype, shape=[2]))
    assert sess.get_inputs()[0].type == "tensor(string)"
    x = np.array(["héllo", ""], dtype=object)
    (y,) = sess.run(None, {"x": x})
    assert y.tolist() == ["héllo", ""]


def test_identity_fixed_and_scalar_shapes(tmp_path: Path) -> None:
    sess = session(models.write_identity(tmp_path / "a.onnx", shape=(2, 3)))
    assert sess.get_inputs()[0].shape == [2, 3]
    sess = session(models.write_identity(tmp_path / "b.onnx", dtype=np.int64, shape=()))
    assert sess.get_inputs()[0].shape == []
    (y,) = sess.run(None, {"x": np.array(42, np.int64)})
    assert y.shape == ()
    assert y == 42


def test_identity_writes_complex_models(tmp_path: Path) -> None:
    # ONNX has complex types but ONNX Runtime will not load them, so only check the file.
    model = check_header(models.write_identity(tmp_path / "c.onnx", dtype=np.complex64))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.COMPLEX64


def test_identity_refuses_bad_dtype_and_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no ONNX element type"):
        models.write_identity(tmp_path / "x.onnx", dtype="datetime64[s]")
    with pytest.raises(ValueError, match="shape"):
        models.write_identity(tmp_path / "x.onnx", shape=(-1,))


def test_slow_is_a_chain_of_shared_orthogonal_matmuls(tmp_path: Path) -> None:
    path = models.write_slow(tmp_path / "slow.onnx", width=16, depth=2)
    model = check_header(path)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "MatMul"]
    (weight_proto,) = model.graph.initializer
    weight = numpy_helper.to_array(weight_proto)
    np.testing.assert_allclose(weight @ weight.T, np.eye(16), atol=1e-5)

    x = np.random.default_rng(2).standard_normal((4, 16), dtype=np.float32)
    (y,) = session(path).run(None, {"x": x})
    assert y.shape == (4, 16)
    np.testing.assert_allclose(y, x @ weight @ weight, rtol=1e-4, atol=1e-5)
    # Orthogonal, so lengths survive the chain rather than growing or vanishing.
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-4)


def test_slow_default_keeps_one_weight(tmp_path: Path) -> None:
    model = onnx.load(models.write_slow(tmp_path / "slow.onnx", depth=3))
    assert len(model.graph.initializer) == 1
    assert list(model.graph.initializer[0].dims) == [512, 512]
    assert len(model.graph.node) == 3


def test_without_onnx_the_error_names_the_extra() -> None:
    # The deadlines and batching tutorials use these builders: on an install with only the
    # cpu extra, the reader must learn which extra to add, not just "No module named 'onnx'".
    code = "import sys; sys.modules['onnx'] = None\nfrom trioinfer.testing import models\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ModuleNotFoundError: trioinfer.testing.models writes its models with onnx.helper, and "
        "the onnx package is not installed: install trioinfer with the 'onnx' extra, e.g. "
        "pip install -e '.[cpu,onnx]' in a clone"
    )
