"""The bundled example: a model repository and sample data that ship inside the package.

``trioinfer demo`` uses them, and so can tutorials and tests: the repository
holds one model, ``digits``, a small MLP trained on scikit-learn's 8x8 digit
images, and [`digits_samples()`][trioinfer.digits_samples] returns held-out images with their
labels.
Both are found with `importlib.resources`, so they work from a source
tree and from an installed wheel alike.
"""

from __future__ import annotations

import atexit
import importlib.resources
import shutil
import tempfile
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np
import numpy.typing as npt

_PACKAGE = "trioinfer"
_extracted_to: dict[str, Path] = {}


def _examples() -> Traversable:
    return importlib.resources.files(_PACKAGE).joinpath("examples")


def example_repository() -> Path:
    """Return the directory of the bundled model repository.

    It is laid out as ``<repo>/<model>/config.toml`` and
    ``<repo>/<model>/<version>/model.onnx``, so
    ``ModelConfig.from_toml(example_repository() / "digits" / "config.toml")``
    loads the example model. Treat it as read-only: it is part of the
    installed package.

    When the package is imported from somewhere that is not a directory on
    disk (a zip file), the repository is copied once to a temporary directory
    that is removed when the interpreter exits, because model files must be
    real files for ONNX Runtime to open them.
    """
    repository = _examples().joinpath("repository")
    if isinstance(repository, Path):
        return repository
    return _extracted(repository)


def _extracted(tree: Traversable) -> Path:
    # Only reached for zip imports; the copy is made once per process.
    target = _extracted_to.get(tree.name)
    if target is None:
        root = Path(tempfile.mkdtemp(prefix="trioinfer-examples-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        target = root / tree.name
        _copy(tree, target)
        _extracted_to[tree.name] = target
    return target


def _copy(source: Traversable, target: Path) -> None:
    if source.is_dir():
        target.mkdir()
        for child in source.iterdir():
            _copy(child, target / child.name)
    else:
        target.write_bytes(source.read_bytes())


def digits_samples() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Return held-out samples for the example ``digits`` model: ``(images, labels)``.

    Returns:
        ``images``, float32 of shape ``[200, 64]``: 8x8 images flattened row by
        row, with pixel values from 0 to 16, exactly what the model's
        ``"input"`` takes (one row per request, or several as a batch); and
        ``labels``, int64 of shape ``[200]``: the digit (0-9) each image shows,
        to compare with the model's ``"label"`` output.
    """
    with (
        _examples().joinpath("digits_samples.npz").open("rb") as f,
        np.load(f, allow_pickle=False) as data,
    ):
        images = np.asarray(data["images"], dtype=np.float32)
        labels = np.asarray(data["labels"], dtype=np.int64)
    return images, labels
