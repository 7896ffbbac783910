"""Shared fixtures: small real ONNX models, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioinfer.testing import models


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def add_model(model_dir: Path) -> Path:
    """Inputs a, b: float32[batch, 4]; outputs sum = a + b, diff = a - b."""
    return models.write_add(model_dir / "add.onnx")


@pytest.fixture(scope="session")
def mlp_model(model_dir: Path) -> Path:
    """input: float32[batch, 64] -> output: float32[batch, 10]."""
    return models.write_mlp(model_dir / "mlp.onnx")


@pytest.fixture(scope="session")
def slow_model(model_dir: Path) -> Path:
    """x: float32[batch, 512] -> y; about a second per batch of 256 on one thread."""
    return models.write_slow(model_dir / "slow.onnx")
