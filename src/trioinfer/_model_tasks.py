"""A model's own task group, for its backend's long-lived tasks (`current_model_tasks`).

A backend whose instances run tasks beyond one call (a decoupled model's
executions beside the reading of their streams, a session's keep-alive)
cannot hold a task group across ``load()``: it would have to end with
``load()``. The engine opens one per model in its own task group before the
model's instances load, hands it to the backend's ``load()`` (and to a
re-creation's), and ends it after the model's instances closed: its tasks
are the model's, never outliving the model or the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import anyio
import anyio.abc

from ._dispatch import logger
from ._util import NoPublicConstructor
from .abc import ModelTasks as ModelTasksProtocol


class ModelTasks(metaclass=NoPublicConstructor):
    """The engine's `trioinfer.abc.ModelTasks`: a model's task group, as its backend sees it."""

    __slots__ = ("_closing", "_ended", "_group", "_model")

    def __init__(self, model: str, group: anyio.abc.TaskGroup) -> None:
        self._model = model
        self._group = group
        self._closing = anyio.Event()
        self._ended = anyio.Event()

    @property
    def model(self) -> str:
        """The model's name."""
        return self._model

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` as a task of the model; see `trioinfer.abc.ModelTasks.start_soon`."""
        if self._closing.is_set():
            raise RuntimeError(
                f"model {self._model!r} is unloaded (or its load failed): its tasks have ended "
                "and it starts no more"
            )
        name = f"{self._model}: {getattr(fn, '__qualname__', fn)}"
        self._group.start_soon(self._run, fn, args, name=name)

    async def _run(self, fn: Callable[..., Awaitable[object]], args: tuple[object, ...]) -> None:
        try:
            await fn(*args)
        except Exception:
            # Reported with the model it belongs to; the model's other tasks and the
            # engine go on (a backend's helper task must not take them down).
            logger.exception("model %r: backend task %r failed", self._model, fn)

    async def aclose(self, within: float) -> None:
        """Cancel the tasks left and wait for them, shielded, for *within* seconds at most.

        The engine's, once the model's instances closed (or its load failed).
        """
        self._closing.set()
        with anyio.move_on_after(within, shield=True):
            await self._ended.wait()
        if not self._ended.is_set():
            logger.error(
                "model %r: its backend's tasks did not end within %ss of being cancelled",
                self._model,
                within,
            )


async def open_model_tasks(model: str, task_group: anyio.abc.TaskGroup) -> ModelTasks:
    """Open *model*'s task group as a task of *task_group* (the engine's); see `ModelTasks`."""

    async def host(*, task_status: anyio.abc.TaskStatus[ModelTasks]) -> None:
        tasks: ModelTasks | None = None
        try:
            async with anyio.create_task_group() as group:
                tasks = ModelTasks._create(model, group)
                task_status.started(tasks)
                try:
                    await tasks._closing.wait()
                finally:
                    tasks._closing.set()  # (also when the engine's close cancels it)
                    group.cancel_scope.cancel()
        finally:
            if tasks is not None:
                tasks._ended.set()

    with anyio.CancelScope(shield=True):  # quick; a load cancelled meanwhile closes it
        tasks: ModelTasks = await task_group.start(host, name=f"trioinfer model {model!r} tasks")
    return tasks


#: The task group of the model whose instance is loading (see `current_model_tasks`).
_current: ContextVar[ModelTasks | None] = ContextVar("trioinfer_model_tasks", default=None)


@contextmanager
def loading_for(tasks: ModelTasks | None) -> Iterator[None]:
    """Make *tasks* what `current_model_tasks` returns meanwhile (a backend's ``load()``)."""
    token = _current.set(tasks)
    try:
        yield
    finally:
        _current.reset(token)


def current_model_tasks() -> ModelTasksProtocol:
    """The task group of the model whose instance is loading: tasks that the model owns.

    Call it in a backend's ``load()`` (also when a fallback re-creates an
    instance) and keep what it returns: its
    [`start_soon()`][trioinfer.abc.ModelTasks.start_soon] runs a task for as
    long as the model is loaded, from the instance's calls too (a decoupled
    model's executions, each beside the reading of its stream), where a task
    group of the instance's own would have to end with the call that opened
    it. The group is a task of the engine's: at the model's unload it is
    cancelled after every instance of the model closed (an instance that
    must not be cut short waits for its tasks in its ``aclose()``, or
    cancels them there), and at the engine's close it is cancelled with the
    engine's tasks. A task that raises is logged with the model's name and
    its traceback; the model and its other tasks go on.

    Raises:
        RuntimeError: Outside a backend's ``load()`` run by an engine.
    """
    tasks = _current.get()
    if tasks is None:
        raise RuntimeError(
            "current_model_tasks() is only known in a backend's load() run by an engine "
            "(engine.load, or a fallback re-creating an instance): keep what it returns there"
        )
    return tasks
