"""Shared fixtures: small real ONNX models, built once per test session."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trioinfer.testing import models

# Ray (the ray tests) reads these when it is imported, so they are set before any test
# module imports it: every Ray of the tests on 127.0.0.1 alone, and no usage reports.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# The modules that take longest, longest first (minutes each on 2 cores, where most take
# seconds). Under pytest-xdist (make test: --dist loadscope --no-loadscope-reorder) each
# module runs in one process, taken in collection order by whichever process is free:
# started last, test_ray.py alone ran minutes after every other process had finished.
SLOW_MODULES = (
    "test_ray_faults.py",
    "test_ray.py",
    "test_docs.py",
    "test_workers.py",
    "test_server_codec.py",
    "test_server.py",
    "test_grpc_h2.py",
    "test_grpc.py",
    "test_ray_cluster.py",
    "test_poll.py",
    "test_stress.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the modules of SLOW_MODULES first, in its order; then the others.

    The others most tests first. In one process (make test's default) the order stays
    pytest's own.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    per_module: dict[str, int] = {}
    for item in items:
        per_module[item.path.name] = per_module.get(item.path.name, 0) + 1

    def rank(item: pytest.Item) -> tuple[int, int, str]:
        name = item.path.name
        if name in SLOW_MODULES:
            return (SLOW_MODULES.index(name), 0, name)
        return (len(SLOW_MODULES), -per_module[name], name)

    items.sort(key=rank)  # stable: each module's tests stay in their order


@pytest.fixture(autouse=True)
def _recursion_limit() -> Iterator[None]:
    """Each test ends with the recursion limit it started with.

    A library some tests run in this process may raise it for good (mypy's ``api.run``
    sets 16384; mkdocstrings 2000 at least), and a test that then runs in the same
    process (which one varies under pytest-xdist) would not meet Python's own limit:
    a 5000-deep TOML list parsed where it raised RecursionError.
    """
    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


class ShortTmp:
    """New directories under one root in ``/tmp``, with paths short enough for Unix sockets."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        """A new empty directory whose name starts with *name*."""
        return Path(tempfile.mkdtemp(prefix=name, dir=self.root))


@pytest.fixture(scope="session")
def short_tmp_factory() -> Iterator[ShortTmp]:
    """`tmp_path_factory`'s `mktemp`, with paths short enough for Unix sockets.

    Ray's and the worker supervisor's sockets go in the directories they are
    given, and a socket's path may be 107 bytes at most: pytest's own paths
    (``/tmp/pytest-of-USER/pytest-N/popen-gwN/test_name0/...``, longer under
    pytest-xdist) leave too little. These are under ``/tmp/ti-XXXX``, removed
    at the end of the session.
    """
    root = Path(tempfile.mkdtemp(prefix="ti-", dir="/tmp"))
    yield ShortTmp(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def short_tmp_path(short_tmp_factory: ShortTmp) -> Path:
    """`tmp_path`, short enough for Unix sockets (see `short_tmp_factory`)."""
    return short_tmp_factory.mktemp("t")


@pytest.fixture(scope="module")
def local_ray(short_tmp_factory: ShortTmp) -> Iterator[None]:
    """A one-node Ray on 127.0.0.1 of the test module's own (tests/_ray.py)."""
    import ray

    from _ray import start_local_ray

    start_local_ray(short_tmp_factory.mktemp("ray"))  # (a path short enough for its sockets)
    yield
    ray.shutdown()


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
