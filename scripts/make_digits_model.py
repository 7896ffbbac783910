"""Build the bundled example model: an MLP trained on scikit-learn's digits, written as ONNX.

Run from the repository root (scikit-learn is a development dependency only)::

    python scripts/make_digits_model.py

It trains a small classifier on the 8x8 digit images that ship inside scikit-learn (no
network), writes it to ``src/trioinfer/examples/repository/digits`` as an ONNX graph built by
hand with ``onnx.helper``, checks that ONNX Runtime agrees with scikit-learn, and saves 200
held-out images with their labels for the examples and tests. Running it twice writes the
same bytes.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "src" / "trioinfer" / "examples"
MODEL_DIR = EXAMPLES / "repository" / "digits"
MODEL_PATH = MODEL_DIR / "1" / "model.onnx"
CONFIG_PATH = MODEL_DIR / "config.toml"
SAMPLES_PATH = EXAMPLES / "digits_samples.npz"

N_SAMPLES = 200
PIXEL_MAX = 16.0  # load_digits gives pixel intensities 0..16

CONFIG = """\
# The bundled example: an MLP trained on scikit-learn's digits (8x8 images, 10 classes).
# Made by scripts/make_digits_model.py.
name = "digits"

[[instances]]
device = "cpu"
count = 1
"""

DOC = (
    "A multilayer perceptron trained on scikit-learn's digits data set (8x8 grey images of "
    "handwritten digits, 10 classes). Input 'input': float32[batch, 64], the 64 pixels of each "
    "image in row-major order with raw intensities 0..16 (the graph scales them to 0..1). "
    "Outputs 'probabilities': float32[batch, 10], the softmax over the digits 0-9, and "
    "'label': int64[batch], the most probable digit. Made by scripts/make_digits_model.py."
)


def train() -> tuple[MLPClassifier, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Train the classifier; return it with the raw test images and labels."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.25, random_state=0
    )
    clf = MLPClassifier(hidden_layer_sizes=(64,), random_state=0, max_iter=1000)
    clf.fit(x_train / PIXEL_MAX, y_train)
    accuracy = clf.score(x_test / PIXEL_MAX, y_test)
    print(f"test accuracy: {accuracy:.4f} ({len(y_test)} images, {clf.n_iter_} iterations)")
    return clf, x_test, y_test


def build_model(clf: MLPClassifier) -> onnx.ModelProto:
    """Express the trained network as an ONNX graph."""
    # The graph emits class indices, so they must be the digits themselves.
    if not np.array_equal(clf.classes_, np.arange(10)):
        raise RuntimeError(f"unexpected classes {clf.classes_!r}")
    if clf.activation != "relu" or clf.out_activation_ != "softmax":
        raise RuntimeError(f"unexpected activations {clf.activation}/{clf.out_activation_}")

    initializers = [numpy_helper.from_array(np.array(PIXEL_MAX, dtype=np.float32), "pixel_max")]
    nodes = [helper.make_node("Div", ["input", "pixel_max"], ["scaled"], name="scale")]
    current = "scaled"
    last = len(clf.coefs_) - 1
    for i, (weight, bias) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        initializers += [
            numpy_helper.from_array(weight.astype(np.float32), f"layer{i}.weight"),
            numpy_helper.from_array(bias.astype(np.float32), f"layer{i}.bias"),
        ]
        nodes += [
            helper.make_node(
                "MatMul", [current, f"layer{i}.weight"], [f"layer{i}.matmul"], name=f"matmul{i}"
            ),
            helper.make_node(
                "Add", [f"layer{i}.matmul", f"layer{i}.bias"], [f"layer{i}.out"], name=f"add{i}"
            ),
        ]
        current = f"layer{i}.out"
        if i < last:
            nodes.append(helper.make_node("Relu", [current], [f"layer{i}.relu"], name=f"relu{i}"))
            current = f"layer{i}.relu"
    nodes += [
        helper.make_node("Softmax", [current], ["probabilities"], name="softmax", axis=1),
        # Taking the argmax of the probabilities (not the logits) keeps the two outputs
        # consistent even where float32 rounding makes two classes tie.
        helper.make_node("ArgMax", ["probabilities"], ["label"], name="argmax", axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
        outputs=[
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
        ],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=9,
        producer_name="trioinfer scripts/make_digits_model.py",
        doc_string=DOC,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def verify(
    model_path: Path, clf: MLPClassifier, x_test: np.ndarray[Any, Any]
) -> tuple[float, bool]:
    """Run the written model in ONNX Runtime and compare it with scikit-learn.

    Returns:
        The largest absolute difference in probability, and whether the labels all agree.
    """
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    probabilities, labels = session.run(None, {"input": x_test.astype(np.float32)})
    expected = clf.predict_proba(x_test / PIXEL_MAX)
    if not np.allclose(probabilities, expected, atol=1e-5):
        raise RuntimeError("ONNX Runtime's probabilities differ from scikit-learn's")
    max_diff = float(np.max(np.abs(probabilities - expected)))
    return max_diff, bool(np.array_equal(labels, clf.predict(x_test / PIXEL_MAX)))


def write_samples(path: Path, images: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> None:
    """Write an ``.npz`` archive that ``numpy.load`` reads, with the same bytes every run.

    ``numpy.savez`` stamps each member with the current time, so the archive would change on
    every run; writing the members with a fixed timestamp keeps reruns free of spurious diffs.
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, array in (("images", images), ("labels", labels)):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, array, allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, buffer.getvalue())


def main() -> None:
    """Train, export, verify and write the example files."""
    clf, x_test, y_test = train()

    MODEL_PATH.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(build_model(clf), MODEL_PATH)
    CONFIG_PATH.write_text(CONFIG, encoding="utf-8")

    max_diff, labels_agree = verify(MODEL_PATH, clf, x_test)
    print(
        "onnxruntime matches scikit-learn: probabilities allclose (atol=1e-5, "
        f"max abs diff {max_diff:.2e}), labels {'identical' if labels_agree else 'DIFFER'}"
    )

    images = x_test[:N_SAMPLES].astype(np.float32)
    labels = y_test[:N_SAMPLES].astype(np.int64)
    write_samples(SAMPLES_PATH, images, labels)

    for path in (MODEL_PATH, CONFIG_PATH, SAMPLES_PATH):
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
