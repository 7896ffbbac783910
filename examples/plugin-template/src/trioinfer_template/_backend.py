"""The ``scale`` backend: ``y = factor * x``, computed off the event loop."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, final

import numpy as np
from trioinfer import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    ModelConfig,
    ModelSignature,
    TensorSpec,
)
from trioinfer.lowlevel import Placement, WorkerThread

Array = np.ndarray[Any, Any]


@final
class ScaleBackend:
    """Loads ``scale`` models: ``y = factor * x`` on ``float32[batch, width]``.

    The model has no file; its ``backend_options`` say what it computes:
    ``factor`` (a number, default 1) and ``width`` (a positive integer,
    default 4). It runs on the CPU only: asked for a GPU, it falls back to the
    CPU when the placement allows, else refuses.
    """

    async def load(self, config: ModelConfig, placement: Placement) -> ScaleInstance:
        """Check the options, start the instance's worker thread, and return the instance.

        Raises:
            ConfigError: An unknown option, or a value of the wrong kind.
            BackendUnavailable: A GPU was asked for and ``cpu_fallback`` is off.
        """
        options = dict(config.backend_options)
        factor = options.pop("factor", 1.0)
        width = options.pop("width", 4)
        if options:
            raise ConfigError(
                f"model {config.name!r}: the scale backend takes factor and width, "
                f"got also {sorted(options)}"
            )
        if not isinstance(factor, int | float) or isinstance(factor, bool):
            raise ConfigError(f"model {config.name!r}: factor must be a number, got {factor!r}")
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ConfigError(
                f"model {config.name!r}: width must be a positive integer, got {width!r}"
            )
        if placement.device.kind != "cpu" and not placement.cpu_fallback:
            raise BackendUnavailable(
                f"model {config.name!r}: the scale backend runs on the CPU only, "
                f"not on {placement.device}"
            )
        worker = await WorkerThread.start(
            f"scale-{config.name}-{placement.index}", cpu_affinity=placement.cpu_affinity
        )
        return ScaleInstance(np.float32(factor), width, worker)


@final
class ScaleInstance:
    """One loaded ``scale`` model: a factor and the thread that multiplies by it."""

    def __init__(self, factor: np.float32, width: int, worker: WorkerThread) -> None:
        self._factor = factor
        self._worker = worker
        self._closed = False
        f32 = np.dtype(np.float32)
        self._signature = ModelSignature(
            inputs=(TensorSpec("x", f32, ("batch", width), "tensor(float)"),),
            outputs=(TensorSpec("y", f32, ("batch", width), "tensor(float)"),),
        )

    @property
    def signature(self) -> ModelSignature:
        """``x: float32[batch, width]`` in, ``y`` of the same shape out."""
        return self._signature

    @property
    def device(self) -> str:
        """Always ``"cpu"``."""
        return "cpu"

    async def execute(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """Compute ``y = factor * x`` on the worker thread.

        numpy cannot be interrupted: a cancelled call waits for the product,
        then lets ``Cancelled`` propagate, leaving the instance ready.

        Raises:
            BackendError: The instance is closed, or numpy failed.
        """
        if self._closed:
            raise BackendError("this scale instance is closed")
        try:
            y = await self._worker.run_sync(np.multiply, inputs["x"], self._factor)
        except Exception as exc:
            raise BackendError(f"scale failed: {type(exc).__name__}: {exc}") from exc
        return {"y": y}

    async def aclose(self) -> None:
        """Stop the worker thread; idempotent."""
        self._closed = True
        await self._worker.aclose()
