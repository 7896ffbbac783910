"""The walls of the core: who may import what, and who may make what."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trioinfer
from trioinfer import ModelConfig, open_engine
from trioinfer._runner import ModelRunner
from trioinfer.lowlevel import (
    Execution,
    FallbackContext,
    Request,
    RequestQueue,
    SchedulerContext,
)
from trioinfer.testing import FakeBackend

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "trioinfer"
#: The engine's modules: one private layer, behind trioinfer.abc and trioinfer.lowlevel.
CORE = {"_engine", "_runner", "_dispatch", "_request", "_buffers", "_threads"}


def imported_modules(path: Path) -> set[str]:
    """Every module *path* imports, as written (relative ones with their dots), anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_the_contracts_import_no_engine_module() -> None:
    # Not even under TYPE_CHECKING: a contract must not come to depend on its implementation.
    modules = imported_modules(SRC / "abc.py")
    assert not {m for m in modules if m.lstrip(".").split(".")[0] in CORE}, modules


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "plugins").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_plugins_import_only_the_public_api(path: Path) -> None:
    public = {"trioinfer", "trioinfer.abc", "trioinfer.lowlevel", "trioinfer.testing"}
    for module in imported_modules(path):
        if module.split(".")[0] == "trioinfer":
            assert module in public, f"{path.name} imports {module}"


def test_executions_and_contexts_reach_the_runner_through_its_port_only() -> None:
    # Execution.run() once called ModelRunner._attempt(); now every object a fallback
    # holds talks to its runner through RunnerPort's public names.
    path = SRC / "_dispatch.py"
    assert not {m for m in imported_modules(path) if "_runner" in m}
    tree = ast.parse(path.read_text())
    reached = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "_port"
    }
    assert reached
    assert not {name for name in reached if name.startswith("_")}, reached


async def test_what_only_the_engine_makes_refuses_public_construction() -> None:
    seen: dict[str, Any] = {}

    class Watching:
        """A scheduler, batcher and fallback at once, keeping what the engine hands it."""

        def __init__(self) -> None:
            self.held: list[Request] = []

        def attach(self, context: Any) -> None:
            seen[type(context).__name__] = context

        def push(self, request: Request) -> None:
            self.held.append(request)

        def peek(self) -> Request:
            if not self.held:
                raise IndexError
            return self.held[0]

        def pop(self) -> Request:
            if not self.held:
                raise IndexError
            return self.held.pop(0)

        def remove(self, request: Request) -> bool:
            if request in self.held:
                self.held.remove(request)
                return True
            return False

        def __len__(self) -> int:
            return len(self.held)

        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            seen["queue"] = queue
            await queue.wait_not_empty()
            return [queue.pop_nowait()]

        async def execute(self, execution: Execution) -> None:
            seen["execution"] = execution
            seen["replica"] = execution.replica
            await execution.run()

    watching = Watching()
    registry = trioinfer.Registry(
        extra={
            "backends": {"fake": FakeBackend},
            "schedulers": {"w": lambda: watching},
            "batchers": {"w": lambda: watching},
            "fallbacks": {"w": lambda: watching},
        }
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(
            ModelConfig(
                name="m", path="-", backend="fake", scheduler="w", batcher="w", fallback="w"
            )
        )
        await engine.infer("m", {"x": np.ones((1, 4), np.float32)})

    made_by_the_engine = [
        seen["queue"],
        seen["SchedulerContext"],
        seen["FallbackContext"],
        seen["execution"],
        seen["replica"],
    ]
    for obj in made_by_the_engine:
        with pytest.raises(TypeError, match="has no public constructor"):
            type(obj)()
    with pytest.raises(TypeError, match="has no public constructor"):
        ModelRunner(config=None)
    # What plugins annotate with are Protocols: nothing to construct either.
    for protocol in (Request, RequestQueue, SchedulerContext, FallbackContext, Execution):
        with pytest.raises(TypeError):
            protocol()
