"""Shared fixtures: small real ONNX models, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trioinfer.testing import models

# Ray (the ray tests) reads these when it is imported, so they are set before any test
# module imports it: every Ray of the tests on 127.0.0.1 alone, and no usage reports.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


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


@pytest.fixture
def still_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inline slice's wall time stands still: no request yields for it.

    Where an inline run moves the mock clock past the caller's deadline, a yield
    before the next request or step (the 250 µs slice spent on a slow machine)
    would let the caller's scope see the deadline first: that request would end
    cancelled, not expired, and counts that name the expiry would differ.
    """
    import trioinfer._inline

    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: 0.0)
    monkeypatch.setattr(trioinfer._inline._slice, "start", 0.0)
