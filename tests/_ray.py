"""What the ray backend's tests share (tests/test_ray.py, tests/test_ray_faults.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import trio

import trioinfer_ray
from trioinfer import ModelConfig, Registry
from trioinfer.lowlevel import Placement


class Recording:
    """The ray backend, keeping every instance it loads so that tests can ask the actors."""

    def __init__(self) -> None:
        self.backend = trioinfer_ray.RayBackend()
        self.instances: list[trioinfer_ray.RayInstance] = []
        self.handles: list[Any] = []  # the actors, kept after their instances close

    async def load(self, config: ModelConfig, placement: Placement) -> trioinfer_ray.RayInstance:
        instance = await self.backend.load(config, placement)
        self.instances.append(instance)
        self.handles.append(instance.actor)
        return instance

    def registry(self) -> Registry:
        return Registry(extra={"backends": {"ray": lambda: self}})


def start_local_ray(temp: Path, **kwargs: Any) -> None:
    """A Ray of the test module's own, on 127.0.0.1 only, in its own temporary directory."""
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and no usage stats: set by conftest.py.
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=2,
        _temp_dir=str(temp),
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
        **kwargs,
    )


def actor_gone(handle: Any) -> bool:
    """Whether the actor dies: calls on it fail with RayActorError (Ray's own answer).

    ``ray.kill`` takes effect a moment after it returns, so a call may still be answered
    just after it: ask again for a while.
    """
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        try:
            ray.get(handle.statistics.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.05)
    return False


async def wait_for_counter(
    instance: trioinfer_ray.RayInstance, name: str, value: int
) -> dict[str, int]:
    with trio.fail_after(60):
        while (stats := await instance.remote_statistics())[name] < value:  # noqa: ASYNC110
            await trio.sleep(0.01)
    return stats


def driver_refs() -> dict[Any, Any]:
    """Object refs this driver still holds or waits on.

    Ray's state API (``ray.util.state``) needs Ray's dashboard, which the minimal Ray of
    the ``ray`` extra does not have: this reads the same table from the core worker.
    """
    worker = ray._private.worker.global_worker
    counts: dict[Any, Any] = worker.core_worker.get_all_reference_counts()
    return counts
