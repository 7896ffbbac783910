"""A backend plugin for tests: numpy compute, virtual-time latency, counters, injected faults."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, final

import anyio
import numpy as np

from .._config import ModelConfig, Placement
from .._exceptions import BackendError
from .._registry import Registry
from .._tensors import ModelSignature, TensorSpec

Arrays = Mapping[str, np.ndarray[Any, Any]]

_DEFAULT_SIGNATURE = ModelSignature(
    inputs=(TensorSpec("x", np.dtype(np.float32), ("batch", 4), "tensor(float)"),),
    outputs=(TensorSpec("y", np.dtype(np.float32), ("batch", 4), "tensor(float)"),),
)


def _double(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
    return {"y": inputs["x"] * 2}


@final
class FakeBackend:
    """A backend for tests whose instances compute ``fn(inputs)`` after ``delay`` seconds.

    *fn* maps the inputs to the outputs; by default ``y = 2 * x``.
    The delay is an ``anyio.sleep`` on the event loop's clock, so tests run it on
    virtual time (``trio.testing.MockClock``). By default the model takes
    ``x: float32[batch, 4]`` and returns ``y = 2 * x``.

    Attributes:
        signature: What every instance reports.
        delay: Seconds each execution takes.
        preferred_batch_sizes: What every instance advertises as the batch sizes
            it runs fastest (see [`TunedInstance`][trioinfer.abc.TunedInstance]).
        error: If set, every execution raises it (after the delay).
        executions: The row count of every execution, in order, across instances.
        loaded: Instances loaded so far.
    """

    def __init__(
        self,
        fn: Callable[[Arrays], dict[str, np.ndarray[Any, Any]]] | None = None,
        *,
        signature: ModelSignature = _DEFAULT_SIGNATURE,
        delay: float = 0.0,
        preferred_batch_sizes: tuple[int, ...] = (),
    ) -> None:
        self.fn = fn or _double
        self.signature = signature
        self.delay = delay
        self.preferred_batch_sizes = preferred_batch_sizes
        self.error: Exception | None = None
        self.executions: list[int] = []
        self.loaded: list[FakeInstance] = []

    def registry(self, name: str = "fake") -> Registry:
        """A registry where this backend is the backend plugin called *name*."""
        return Registry(extra={"backends": {name: lambda: self}})

    @property
    def open_instances(self) -> int:
        """Instances loaded and not yet closed."""
        return sum(not instance.closed for instance in self.loaded)

    async def load(self, config: ModelConfig, placement: Placement) -> FakeInstance:
        """Make an instance; the model file is not read."""
        await anyio.lowlevel.checkpoint()
        instance = FakeInstance(self, str(placement.device))
        self.loaded.append(instance)
        return instance


@final
class FakeInstance:
    """An instance of [`FakeBackend`][trioinfer.testing.FakeBackend]."""

    def __init__(self, backend: FakeBackend, device: str) -> None:
        self._backend = backend
        self._device = device
        self.closed = False
        self.running = 0
        #: Executions this instance ran.
        self.executions = 0

    @property
    def signature(self) -> ModelSignature:
        """The backend's signature."""
        return self._backend.signature

    @property
    def device(self) -> str:
        """The placement's device."""
        return self._device

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """The backend's ``preferred_batch_sizes``."""
        return self._backend.preferred_batch_sizes

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Count the execution, sleep ``delay``, then compute (or raise ``error``)."""
        if self.closed:
            raise BackendError("fake instance is closed")
        backend = self._backend
        first = next(iter(inputs.values()), None)
        backend.executions.append(int(first.shape[0]) if first is not None and first.ndim else 1)
        self.executions += 1
        self.running += 1
        try:
            await anyio.sleep(backend.delay)
        finally:
            self.running -= 1
        if backend.error is not None:
            raise backend.error
        return backend.fn(inputs)

    async def aclose(self) -> None:
        """Mark the instance closed."""
        self.closed = True
