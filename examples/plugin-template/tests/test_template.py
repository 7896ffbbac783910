"""The template's plugins keep their contracts, and the engine finds them by name."""

from __future__ import annotations

import numpy as np
import pytest
import trioinfer
from trioinfer.testing import check_backend, check_scheduler, make_request

from trioinfer_template import LifoScheduler, ScaleBackend


def test_lifo_keeps_the_scheduler_contract() -> None:
    check_scheduler(LifoScheduler)


def test_lifo_runs_the_newest_first() -> None:
    scheduler = LifoScheduler()
    old, new = make_request(), make_request()
    scheduler.push(old)
    scheduler.push(new)
    assert [scheduler.pop(), scheduler.pop()] == [new, old]


async def test_scale_keeps_the_backend_contract() -> None:
    config = trioinfer.ModelConfig(
        name="triple", backend="scale", backend_options={"factor": 3, "width": 2}
    )
    await check_backend(ScaleBackend(), config, {"x": np.ones((2, 2), dtype=np.float32)})


async def test_scale_refuses_options_it_does_not_know() -> None:
    config = trioinfer.ModelConfig(name="m", backend="scale", backend_options={"factr": 3})
    with pytest.raises(trioinfer.ConfigError, match="factr"):
        await ScaleBackend().load(config, config.placements()[0])


def test_the_entry_points_are_installed() -> None:
    registry = trioinfer.Registry()
    assert "lifo" in registry.names("schedulers")
    assert "scale" in registry.names("backends")
    found = {info.name: info for info in registry.plugins()}
    assert found["scale"].distribution is not None
    assert found["scale"].distribution.startswith("trioinfer-template ")
    assert registry.check(found["lifo"]) is None


async def test_an_engine_serves_a_model_through_both_by_name() -> None:
    config = trioinfer.ModelConfig(
        name="triple",
        backend="scale",
        scheduler="lifo",
        backend_options={"factor": 3},
    )
    async with trioinfer.open_engine() as engine:  # plugins found through entry points
        await engine.load(config)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        outputs = await engine.infer("triple", {"x": x})
        np.testing.assert_array_equal(outputs["y"], 3 * x)
        assert engine.statistics().models["triple"].succeeded == 1
