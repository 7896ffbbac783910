"""The ray backend on a real one-node Ray on loopback: outputs, the time left across the hop,
tracing, dtypes and the codec, options, and the probe of a Ray address."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import importlib
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import ray
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import trioinfer_ray
from _ray import Recording, actor_gone, driver_refs
from trioinfer import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelConfig,
    Registry,
    open_engine,
)
from trioinfer.lowlevel import Placement
from trioinfer.testing import FakeBackend, check_backend, models
from trioinfer_ray._options import MODEL_RESOURCE_SHARE, check_options

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.ray


async def test_outputs_match_a_local_instance(local_ray: None, mlp_model: Path) -> None:
    rng = np.random.default_rng(0)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="local", path=mlp_model))
        await engine.load(
            ModelConfig(
                name="remote",
                path=mlp_model,
                backend="ray",
                batcher="dynamic",
                batcher_options={"max_batch_size": 8, "max_queue_delay": 0.005},
            )
        )
        xs = [rng.standard_normal((1 + i % 3, 64), dtype=np.float32) for i in range(24)]
        got: dict[int, Any] = {}

        async def one(i: int) -> None:
            got[i] = (
                await engine.infer("remote", {"input": xs[i]}),
                await engine.infer("local", {"input": xs[i]}),
            )

        async with trio.open_nursery() as nursery:
            for i in range(len(xs)):
                nursery.start_soon(one, i)
        for remote, local in got.values():
            np.testing.assert_array_equal(remote["output"], local["output"])
        stats = engine.statistics().models["remote"]
        (device,) = stats.devices
        node = ray.get_runtime_context().get_node_id()
        assert device == f"cpu@{node[:12]}"  # the node serving it, in statistics and metrics
        assert stats.executions < len(xs)  # batched in the driver, computed remotely


async def test_ray_backend_keeps_the_backend_contract(local_ray: None, add_model: Path) -> None:
    config = ModelConfig(name="add", path=add_model, backend="ray")
    x = np.ones((2, 4), np.float32)
    await check_backend(trioinfer_ray.RayBackend(), config, {"a": x, "b": x})


async def test_a_repository_config_toml_serves_on_ray(local_ray: None, tmp_path: Path) -> None:
    (tmp_path / "digits" / "1").mkdir(parents=True)
    models.write_mlp(tmp_path / "digits" / "1" / "model.onnx")
    (tmp_path / "digits" / "config.toml").write_text(
        'backend = "ray"\n\n[backend_options]\ncodec = "uint8"\nonnxruntime = { dispatch = '
        '"thread" }\n\n[[instances]]\ncount = 2\nthreads = 1\n'
    )
    config = ModelConfig.from_toml(tmp_path / "digits" / "config.toml")
    async with open_engine() as engine:
        await engine.load(config)
        out = await engine.infer("digits", {"input": np.zeros((3, 64), np.float32)})
        assert out["output"].shape == (3, 10)
        devices = engine.statistics().models["digits"].devices
        assert len(devices) == 2
        assert all(d.startswith("cpu@") for d in devices)


async def test_actor_refuses_a_batch_whose_time_ran_out(local_ray: None, mlp_model: Path) -> None:
    config = ModelConfig(name="m", path=mlp_model, backend="ray")
    instance = await trioinfer_ray.RayBackend().load(config, config.placements()[0])
    try:
        x = np.zeros((2, 64), np.float32)
        with pytest.raises(DeadlineExceeded):
            await trioinfer_ray.wait_ref(instance.actor.execute.remote({"input": x}, -0.001))
        out, held = await trioinfer_ray.wait_ref(
            instance.actor.execute.remote({"input": x}, math.inf)
        )
        assert out["output"].shape == (2, 10)
        assert held >= 0  # seconds in the actor, for the driver's measure of the round trip
        stats = await instance.remote_statistics()
        assert stats["expired"] == 1
        assert stats["computed"] == 1
    finally:
        handle = instance.actor
        await instance.aclose()
    assert actor_gone(handle)


async def test_the_remaining_time_crosses_the_wire(local_ray: None, mlp_model: Path) -> None:
    recording = Recording()
    x = np.zeros((1, 64), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(ModelConfig(name="m", path=mlp_model, backend="ray"))
        (instance,) = recording.instances
        await engine.infer("m", {"input": x})
        assert (await instance.remote_statistics())["last_remaining"] == math.inf
        with trio.fail_after(30):
            await engine.infer("m", {"input": x})
        assert 0 < (await instance.remote_statistics())["last_remaining"] <= 30


async def test_across_machines_the_round_trip_is_taken_off_the_time_left(
    local_ray: None, mlp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor on another machine (faked: the driver says another boot id) could not
    count the hop, and computed batches whose time had run out on the way. The driver
    measures the least round trip a call spends outside the actor (each side timing its
    own span) and sends it; the actor takes it off the time left, and refuses, uncomputed,
    a batch with less time than that: it could not be answered in time."""
    monkeypatch.setattr(trioinfer_ray._backend, "clock_id", lambda: "another-machine")
    recording = Recording()
    x = np.zeros((1, 64), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(ModelConfig(name="m", path=mlp_model, backend="ray"))
        (instance,) = recording.instances
        assert instance.round_trip == math.inf  # nothing measured yet: nothing taken off
        await engine.infer("m", {"input": x})
        stats = await instance.remote_statistics()
        assert math.isnan(stats["last_hop"])  # another clock: the hop is not known
        assert stats["last_allowance"] == 0.0
        trip = instance.round_trip
        assert 0 < trip < math.inf
        for _ in range(3):
            await engine.infer("m", {"input": x})
        assert instance.round_trip <= trip  # the least seen
        stats = await instance.remote_statistics()
        assert 0 < stats["last_allowance"] <= trip  # what the driver knew when it sent it
        # Less time left than the way there and back: refused, uncomputed.
        allowance = instance.round_trip
        computed = stats["computed"]
        call = instance.actor.execute.remote(
            {"input": x}, allowance / 2, time.monotonic(), allowance
        )
        with pytest.raises(DeadlineExceeded, match="way here and back takes at least"):
            await trioinfer_ray.wait_ref(call)
        del call
        stats = await instance.remote_statistics()
        assert (stats["computed"], stats["expired"]) == (computed, 1)
        # More than that: computed.
        call = instance.actor.execute.remote({"input": x}, 60.0, time.monotonic(), allowance)
        out, _ = await trioinfer_ray.wait_ref(call)
        del call
        assert out["output"].shape == (1, 10)


async def test_on_one_machine_the_hop_is_counted_and_no_allowance_taken(
    local_ray: None, mlp_model: Path
) -> None:
    """Where the driver shares the actor's clock, the hop itself is measured: the round
    trip the driver sends is not taken off as well."""
    recording = Recording()
    x = np.zeros((1, 64), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(ModelConfig(name="m", path=mlp_model, backend="ray"))
        (instance,) = recording.instances
        for _ in range(2):
            await engine.infer("m", {"input": x})
        stats = await instance.remote_statistics()
        assert stats["last_hop"] >= 0
        assert math.isnan(stats["last_allowance"])
        call = instance.actor.execute.remote({"input": x}, 60.0, time.monotonic(), 120.0)
        out, _ = await trioinfer_ray.wait_ref(call)  # 120 s of allowance: ignored here
        del call
        assert out["output"].shape == (1, 10)


class FarActor:
    """Stands in for an actor on another machine: each call takes the next of *trips* (in
    seconds, there and back) on the driver's clock, faked as *clock*, and is refused as the
    real actor refuses it, when it has no more time left than the allowance sent with it."""

    def __init__(self, clock: list[float], trips: list[float]) -> None:
        self.clock = clock
        self.trips = trips
        self.allowances: list[float] = []
        self.execute = types.SimpleNamespace(remote=self._execute)

    def _execute(
        self, inputs: dict[str, Any], remaining: float, sent: float, allowance: float
    ) -> Any:
        self.clock[0] += self.trips.pop(0)
        self.allowances.append(allowance)
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if remaining <= allowance:
            late = DeadlineExceeded("the batch's deadline passed before it could be answered")
            answer.set_exception(ray.exceptions.RayTaskError("execute", "", late))
        else:
            answer.set_result(({"y": inputs["x"] * 2}, 0.0))  # held no time at all
        return types.SimpleNamespace(future=lambda: answer)


async def test_a_long_first_round_trip_does_not_refuse_every_later_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The allowance is the least round trip of a call the actor answered: one first trip
    measured long (a cold actor, a busy driver) refused every batch with less time left
    than that, for ever, since no batch was answered to measure a shorter one. A refused
    call is a round trip too: the next batch goes with the shorter allowance."""
    clock = [0.0]
    monkeypatch.setattr(
        trioinfer_ray._backend, "time", types.SimpleNamespace(monotonic=lambda: clock[0])
    )
    actor = FarActor(clock, [32.0, 0.25, 0.125])
    config = ModelConfig(name="m", path=Path("m.onnx"), backend="far")
    info = {
        "signature": FakeBackend().signature,
        "device": "cpu",
        "node_id": "ab" * 28,
        "node_ip": "10.0.0.2",
        "pid": 7,
        "preferred_batch_sizes": (),
    }
    instance = trioinfer_ray.RayInstance(
        actor, info, check_options(config, config.placements()[0]), "far instance 0", "m"
    )

    class Far:
        async def load(self, config: ModelConfig, placement: Placement) -> Any:
            return instance

    async def no_actor_to_kill(self: Any) -> None:
        pass  # (ray.kill of the fake would start a Ray to look for it)

    monkeypatch.setattr(trioinfer_ray.RayInstance, "aclose", no_actor_to_kill)

    x = {"x": np.ones((1, 4), np.float32)}
    async with open_engine(registry=Registry(extra={"backends": {"far": Far}})) as engine:
        await engine.load(config)
        await engine.infer("m", x)  # no deadline: answered, after a 32 s round trip
        assert instance.round_trip == 32.0
        with trio.fail_after(10), pytest.raises(DeadlineExceeded):
            await engine.infer("m", x)  # 10 s left, where a trip took 32: refused
        assert instance.round_trip == 0.25  # the refusal's own trip
        with trio.fail_after(10):
            out = await engine.infer("m", x)
        assert out["y"].tolist() == [[2.0] * 4]
        assert actor.allowances == [0.0, 32.0, 0.25]


@pytest.mark.tracing
async def test_a_traced_batch_carries_its_trace_into_the_actor(
    local_ray: None, mlp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    recording = Recording()
    x = np.zeros((1, 64), np.float32)
    async with open_engine(
        registry=recording.registry(), tracer_provider=provider, trace_rate=1.0
    ) as engine:
        await engine.load(ModelConfig(name="m", path=mlp_model, backend="ray"))
        (instance,) = recording.instances
        await engine.infer("m", {"input": x})
        await engine.infer("m", {"input": x})
        spans = exporter.get_finished_spans()

        # A fault in recording the actor's spans does not fail a batch it computed.
        def broken(*args: object) -> None:
            raise KeyError("replied")

        monkeypatch.setattr(trioinfer_ray._backend, "record_span", broken)
        out = await engine.infer("m", {"input": x})
        assert out[next(iter(out))].shape[0] == 1
        assert engine.statistics().models["m"].failed == 0
    computes = [s for s in spans if s.name == "compute m"]
    actors = [s for s in spans if s.name == "ray actor m"]
    assert len(computes) == len(actors) == 2
    by_id = {s.context.span_id: s for s in spans}
    for actor in actors:
        # The actor's work, on the actor's clock (this host's here), under the compute span.
        assert actor.parent is not None
        compute = by_id[actor.parent.span_id]
        assert compute.name == "compute m"
        assert compute.start_time <= actor.start_time <= actor.end_time <= compute.end_time  # type: ignore[operator]
        assert actor.attributes["trioinfer.ray.node_id"] == instance.node_id
        assert actor.attributes["trioinfer.ray.pid"] == instance.pid
        assert actor.attributes["trioinfer.ray.in_flight"] == 1
        children = {
            s.name: s
            for s in spans
            if s.parent is not None and s.parent.span_id == actor.context.span_id
        }
        assert set(children) == {"actor queue m", "onnxruntime m"}
        queue, run = children["actor queue m"], children["onnxruntime m"]
        assert actor.start_time == queue.start_time <= queue.end_time == run.start_time
        assert run.end_time <= actor.end_time  # type: ignore[operator]
        assert run.attributes["trioinfer.device"] == instance.device


def sample(dtype: Any, rows: int) -> np.ndarray[Any, Any]:
    """*rows* rows of 3 distinct values of *dtype* (``object``: bytes, a BYTES tensor)."""
    values = np.arange(rows * 3).reshape(rows, 3)
    if dtype is object:
        out = np.empty((rows, 3), object)
        out.flat[:] = [f"s{v}".encode() for v in values.flat]
        return out
    return (values % 2 if dtype is np.bool_ else values % 100).astype(dtype)


@pytest.mark.parametrize("codec", ["none", "uint8"])
async def test_every_dtype_and_layout_crosses_the_hop_unchanged(
    local_ray: None, tmp_path: Path, codec: str
) -> None:
    """Identity models of every kind of dtype, BYTES and bool included: non-contiguous
    and Fortran-ordered inputs, and requests of different sizes batched together, come
    back as sent (strings as str, as ONNX Runtime returns them locally); the codec
    leaves non-float tensors exact. Numeric outputs are read-only (Ray's zero-copy
    arrays), strings and decoded floats not, as the how-to says."""
    dtypes = [np.float16, np.float64, np.int8, np.uint64, np.bool_, object]
    async with open_engine() as engine:
        for dtype in dtypes:
            name = f"id_{np.dtype(dtype).name}"
            await engine.load(
                ModelConfig(
                    name=name,
                    path=models.write_identity(tmp_path / f"{name}.onnx", dtype=dtype),
                    backend="ray",
                    batcher="dynamic",
                    # All 13 rows sent make one batch, which goes once they are there.
                    batcher_options={"max_batch_size": 13, "max_queue_delay": 2.0},
                    backend_options={"codec": codec},
                )
            )
            sent = {
                "non-contiguous": sample(dtype, 6)[::2, ::-1],
                "fortran": np.asfortranarray(sample(dtype, 4)),
                **{f"rows {n}": sample(dtype, n) for n in (1, 2, 3)},
            }
            got: dict[str, np.ndarray[Any, Any]] = {}

            async def one(case: str) -> None:
                got[case] = (await engine.infer(name, {"x": sent[case]}))["y"]  # noqa: B023

            async with trio.open_nursery() as nursery:
                for case in sent:
                    nursery.start_soon(one, case)
            for case, x in sent.items():
                y = got[case]
                assert y.shape == x.shape, (name, case)
                if dtype is object:
                    assert y.tolist() == [[v.decode() for v in row] for row in x.tolist()]
                    assert y.flags.writeable, (name, case)
                else:
                    assert y.dtype == x.dtype, (name, case)
                    if codec == "none" or x.dtype.kind != "f":
                        np.testing.assert_array_equal(y, x, err_msg=f"{name} {case}")
                        assert not y.flags.writeable, (name, case)
                    else:  # decoded in the driver: a new array
                        assert y.flags.writeable, (name, case)
            assert engine.statistics().models[name].executions < len(sent), name  # batched
            await engine.unload(name)


async def test_tensors_over_100_kb_cross_through_the_object_store_and_are_let_go(
    local_ray: None, tmp_path: Path
) -> None:
    """Inputs and outputs over Ray's 100 KB inline limit go through its shared-memory
    object store: batched, non-contiguous, they come back as sent, and once the caller
    drops them the driver holds no object of theirs."""
    path = models.write_identity(tmp_path / "wide.onnx", shape=("batch", None))
    rng = np.random.default_rng(3)
    sent = [rng.standard_normal((2, 1 << 16), dtype=np.float32) for _ in range(3)]
    sent.append(rng.standard_normal((4, 1 << 17), dtype=np.float32)[::2, ::2])
    before = set(driver_refs())
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(
                name="wide",
                path=path,
                backend="ray",
                batcher="dynamic",
                batcher_options={"max_batch_size": 8, "max_queue_delay": 2.0},
            )
        )
        got: dict[int, np.ndarray[Any, Any]] = {}

        async def one(i: int) -> None:
            got[i] = (await engine.infer("wide", {"x": sent[i]}))["y"]

        async with trio.open_nursery() as nursery:
            for i in range(len(sent)):
                nursery.start_soon(one, i)
        for i, x in enumerate(sent):
            np.testing.assert_array_equal(got[i], x)
        assert engine.statistics().models["wide"].executions == 1  # all 8 rows at once
        got.clear()
    with trio.fail_after(10):
        while set(driver_refs()) - before:  # noqa: ASYNC110  # Ray's state
            await trio.sleep(0.05)


async def test_codec_keeps_outputs_within_the_bound(local_ray: None, mlp_model: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 64), dtype=np.float32)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="local", path=mlp_model))
        await engine.load(
            ModelConfig(
                name="u8", path=mlp_model, backend="ray", backend_options={"codec": "uint8"}
            )
        )
        exact = (await engine.infer("local", {"input": x}))["output"]
        coded = (await engine.infer("u8", {"input": x}))["output"]
    # The input's error travels through the model, so compare with the exact model on
    # the decoded input, plus the output's own bound.
    x_wire = trioinfer_ray.decode(trioinfer_ray.encode({"input": x}))["input"]
    assert np.max(np.abs(x_wire - x)) <= trioinfer_ray.error_bound(x)
    assert not np.array_equal(coded, exact)  # it did go through the codec
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="local", path=mlp_model))
        on_wire = (await engine.infer("local", {"input": x_wire}))["output"]
    assert np.max(np.abs(coded - on_wire)) <= trioinfer_ray.error_bound(on_wire)
    encoded = trioinfer_ray.encode({"input": x})
    assert trioinfer_ray.wire_bytes(encoded) * 4 <= trioinfer_ray.wire_bytes({"input": x}) + 64


# -- no Ray needed -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=16),
        elements=st.floats(-1e4, 1e4, width=16),
    )
)
def test_codec_error_is_within_its_bound(x: np.ndarray[Any, Any]) -> None:
    decoded = trioinfer_ray.decode(trioinfer_ray.encode({"x": x}))["x"]
    assert decoded.dtype == x.dtype
    assert decoded.shape == x.shape
    error = np.max(np.abs(decoded.astype(np.float64) - x.astype(np.float64)), initial=0.0)
    assert error <= trioinfer_ray.error_bound(x)


def test_codec_bound_is_tight() -> None:
    # Half a step is reached: a bound half as large would be wrong.
    x = np.linspace(0.0, 1.0, 1021, dtype=np.float64)
    decoded = trioinfer_ray.decode(trioinfer_ray.encode({"x": x}))["x"]
    error = np.max(np.abs(decoded - x))
    assert error > trioinfer_ray.error_bound(x) / 2


def test_codec_leaves_ints_and_non_finite_floats_alone() -> None:
    ints = np.arange(10, dtype=np.int64)
    odd = np.array([1.0, np.nan, 2.0], np.float32)
    encoded = trioinfer_ray.encode({"i": ints, "f": odd})
    assert encoded["i"] is ints
    assert encoded["f"] is odd
    assert trioinfer_ray.error_bound(odd) == 0.0


def test_a_lost_actor_says_why_it_died() -> None:
    # Ray's message as Ray 2.60 words it for an actor whose creation was cancelled (the
    # driver's token refused by a cluster without token authentication): the why comes
    # after the actor's indented details, and the operator needs it.
    class Died(ray.exceptions.ActorDiedError):
        def __str__(self) -> str:
            return (
                "The actor died unexpectedly before finishing this task.\n"
                "\tclass_name: ModelActor\n"
                "\tactor_id: 7f7baf643ecb50f537557ae502000000\n"
                "The actor is dead because all references to the actor were removed.\n"
                "The actor never ran - it was cancelled before it started running."
            )

    error = trioinfer_ray.remote_error(Died(), "instance 0 (ray)")
    assert isinstance(error, BackendUnavailable)
    assert str(error) == (
        "instance 0 (ray) is gone (Died): The actor died unexpectedly before finishing this"
        " task. The actor is dead because all references to the actor were removed."
        " The actor never ran - it was cancelled before it started running."
    )


async def test_missing_ray_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, mlp_model: Path
) -> None:
    real = importlib.import_module

    def no_ray(name: str, package: str | None = None) -> Any:
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_ray)
    config = ModelConfig(name="m", path=mlp_model, backend="ray")
    with pytest.raises(BackendUnavailable, match=r"'ray' extra.*\[ray,cpu\]"):
        await trioinfer_ray.RayBackend().load(config, config.placements()[0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"adress": "auto"}, "no option 'adress'; it knows address"),
        ({"address": "http://head:8265"}, r"http://head:8265.*dashboard's \(Ray Jobs'\)"),
        ({"codec": "int4"}, "codec must be 'none' or 'uint8'"),
        ({"num_gpus": -1}, "num_gpus must be a number >= 0"),
        ({"resources": {"ssd": "lots"}}, r"resources\['ssd'\] must be a number"),
        ({"node_id": "not hex"}, "node_id must be a Ray node id"),
        ({"model_resource": "yes"}, "model_resource must be true or false"),
        ({"start_timeout": 0}, "start_timeout must be a number of seconds from 1e-06"),
        ({"start_timeout": 1e300}, "start_timeout must be a number of seconds .* got 1e\\+300"),
        ({"onnxruntime": {"dispatsh": "thread"}}, "onnxruntime has no option 'dispatsh'"),
        ({"onnxruntime": {"pipeline_depth": 0}}, "pipeline_depth must be an integer from 1"),
    ],
)
async def test_bad_options_are_refused_before_ray_starts(
    mlp_model: Path, options: dict[str, Any], message: str
) -> None:
    config = ModelConfig(name="m", path=mlp_model, backend="ray", backend_options=options)
    with pytest.raises(ConfigError, match=message):
        await trioinfer_ray.RayBackend().load(config, config.placements()[0])


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"resources": {"CPU": 1}}, "instead of 'CPU' and 'GPU'"),
        ({"num_cpus": 0.00001}, "cannot go beyond 0.0001"),
    ],
)
async def test_options_ray_refuses_are_a_config_error(
    local_ray: None, mlp_model: Path, options: dict[str, Any], said: str
) -> None:
    """Amounts Ray's own checks refuse when the actor is made (a CPU among the custom
    resources, a share finer than Ray counts) escaped the load as a bare ValueError;
    they are a ConfigError naming the model and what Ray said."""
    config = ModelConfig(name="m", path=mlp_model, backend="ray", backend_options=options)
    with pytest.raises(ConfigError, match=f"model 'm'.*{re.escape(said)}"):
        await trioinfer_ray.RayBackend().load(config, config.placements()[0])


async def test_a_python_model_is_refused_before_ray_starts_naming_the_python_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actors hold ONNX Runtime sessions: a Python model's file given to the ray
    backend (as one moving from Ray Serve deployments would) failed on the node with
    "Protobuf parsing failed"; it is refused before Ray is asked, naming the way."""

    def no_ray(*args: object) -> None:
        raise AssertionError("Ray was asked")

    monkeypatch.setattr(trioinfer_ray._backend, "connect", no_ray)
    path = tmp_path / "model.py"
    path.write_text("class Model:\n    def infer(self, inputs):\n        return inputs\n")
    config = ModelConfig(name="m", path=path, backend="ray")
    with pytest.raises(ConfigError, match=r"runs ONNX models.*backend = 'python'"):
        await trioinfer_ray.RayBackend().load(config, config.placements()[0])


@pytest.mark.parametrize(
    ("name", "resource"),
    [("digits", "model:digits"), ("digits.v3", "model:digits"), ("a.v1.v12", "model:a.v1")],
)
def test_model_resource_names_the_model_not_its_served_version(
    mlp_model: Path, name: str, resource: str
) -> None:
    # trioinfer serve loads version 3 of repository model digits as digits.v3; the
    # docs tell operators to start its nodes with --resources '{"model:digits": 1}'.
    config = ModelConfig(
        name=name, path=mlp_model, backend="ray", backend_options={"model_resource": True}
    )
    options = check_options(config, config.placements()[0])
    assert options.resources == {resource: MODEL_RESOURCE_SHARE}


def write_concat(path: Path) -> Path:
    """y = Concat(x, x) on axis 1: x float32[N, k] -> y float32[N, m], both widths open."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=1)],
        "doubled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "k"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "m"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("codec", ["none", "uint8"])
async def test_the_onnxruntime_inputs_and_outputs_options_work_in_the_actors(
    local_ray: None, tmp_path: Path, codec: str
) -> None:
    """The sizes a config fixes narrow the remote session's signature, as they do locally:
    the engine refuses a request of another size, and an answer of another size fails."""
    path = write_concat(tmp_path / "doubled.onnx")

    def config(name: str, width: int) -> ModelConfig:
        ort = {
            "log_severity": 4,
            "inputs": [{"name": "x", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "shape": [-1, width]}],
        }
        return ModelConfig(
            name=name,
            path=path,
            backend="ray",
            backend_options={"onnxruntime": ort, "codec": codec},
        )

    async with open_engine() as engine:
        info = await engine.load(config("doubled", 4))
        assert info.signature.inputs[0].shape == ("N", 2)
        assert info.signature.outputs[0].shape == ("N", 4)
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        out = await engine.infer("doubled", {"x": x})
        np.testing.assert_allclose(out["y"], np.concatenate([x, x], axis=1), atol=0.02)
        with pytest.raises(InvalidInput, match="'x'"):
            await engine.infer("doubled", {"x": np.ones((3, 3), np.float32)})
        # A width the graph does not compute: every answer fails, naming the sizes.
        await engine.load(config("wrong", 3))
        with pytest.raises(BackendError, match="'y'"):
            await engine.infer("wrong", {"x": x})


async def test_a_model_file_missing_on_the_node_names_the_node(
    local_ray: None, tmp_path: Path
) -> None:
    config = ModelConfig(name="m", path=tmp_path / "nowhere.onnx", backend="ray")
    with pytest.raises(BackendError, match="no model file at") as caught:
        await trioinfer_ray.RayBackend().load(config, config.placements()[0])
    assert not isinstance(caught.value, BackendUnavailable)
    node = ray.get_runtime_context().get_node_id()
    assert node[:12] in str(caught.value)  # which node lacks it


@pytest.mark.parametrize(
    ("how", "listening"),
    [
        ("address", "nothing"),
        ("RAY_ADDRESS", "nothing"),
        ("noted", "nothing"),
        ("address", "a silent server"),
        ("address", "an HTTP server"),
    ],
)
def test_a_ray_that_is_not_running_is_backend_unavailable_at_once(
    tmp_path: Path, mlp_model: Path, how: str, listening: str
) -> None:
    """An address where no Ray listens: a typed error, not minutes of Ray's retries.

    Given as the address option, as RAY_ADDRESS with address = "auto" (which Ray
    takes first), or with "auto" as noted by the last `ray start --head` of a head that
    died without `ray stop` (Ray reads the note next); nothing on the port, or a
    server that is not Ray's (one that accepts and says nothing, an HTTP server), where
    ray.init hung for minutes. In a process of its own: this one is connected to the
    tests' Ray.
    """
    with contextlib.ExitStack() as stack:
        if listening == "nothing":
            port = _free_port(socket.AF_INET, "127.0.0.1")
        else:
            answer = None if listening == "a silent server" else _HTTP_ANSWER
            port = stack.enter_context(_serving(socket.AF_INET, "127.0.0.1", answer))
        _load_from_a_process_of_its_own(tmp_path, mlp_model, how, port)


def _load_from_a_process_of_its_own(tmp_path: Path, mlp_model: Path, how: str, port: int) -> None:
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path)}
    address = f"127.0.0.1:{port}"
    if how == "RAY_ADDRESS":
        env["RAY_ADDRESS"], address = address, "auto"
    elif how == "noted":
        env.pop("RAY_ADDRESS", None)
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(address)
        address = "auto"
    program = f"""
import time, trio
import trioinfer
import trioinfer_ray
from trioinfer import BackendUnavailable, ModelConfig
config = ModelConfig(name="m", path={str(mlp_model)!r}, backend="ray",
                     backend_options={{"address": {address!r}, "start_timeout": 5}})
start = time.monotonic()
try:
    trio.run(trioinfer_ray.RayBackend().load, config, config.placements()[0])
except BackendUnavailable as exc:
    print("BackendUnavailable:", exc)
print("took", time.monotonic() - start)
"""
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    said = f"BackendUnavailable: model 'm' instance 0 (ray): no Ray at 127.0.0.1:{port}"
    if how == "noted":  # where the address came from, and why it may be stale
        said += f" (noted in {tmp_path / 'ray' / 'ray_current_cluster'} by the last "
    else:
        said += ":"
    assert said in result.stdout, result.stdout + result.stderr
    took = float(result.stdout.split("took")[1])
    assert took < 60, result.stdout


def _free_port(family: socket.AddressFamily, host: str) -> int:
    with socket.socket(family) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port  # free once closed: nothing listens there


@pytest.mark.parametrize("form", ["{host}:{port}", "ray://{host}:{port}"])
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_the_connect_probe_reads_ipv4_and_bracketed_ipv6_addresses(
    form: str, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`host:port`, `ray://host:port`, and `[v6]:port` in both: probed, and where
    nothing listens a BackendUnavailable naming the address; where something does, no
    error (ray.init is left to speak)."""
    from trioinfer_ray._backend import _probe

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    af, host = (socket.AF_INET, "127.0.0.1") if family == "ipv4" else (socket.AF_INET6, "::1")
    try:
        port = _free_port(af, host)
    except OSError:
        pytest.skip(f"no {family} loopback here")
    shown = host if af == socket.AF_INET else f"[{host}]"
    address = form.format(host=shown, port=port)
    with pytest.raises(BackendUnavailable, match=f"no Ray at {re.escape(address)}: "):
        _probe(address, 5.0)
    with _serving(af, host, _SETTINGS_FRAME) as port:
        _probe(form.format(host=shown, port=port), 5.0)


#: What a gRPC server sends first: an (empty) HTTP/2 SETTINGS frame.
_SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_HTTP_ANSWER = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@contextmanager
def _serving(af: socket.AddressFamily, host: str, answer: bytes | None) -> Iterator[int]:
    """A TCP server on *host* that accepts each connection and sends *answer* (None:
    nothing at all, the connection held open; empty: it is closed); yields its port."""
    held: list[socket.socket] = []
    with socket.socket(af) as listening:
        listening.bind((host, 0))
        listening.listen()

        def serve() -> None:
            with contextlib.suppress(OSError):  # closed at the end of the block
                while True:
                    conn, _ = listening.accept()
                    held.append(conn)
                    if answer is not None:
                        conn.recv(1024)
                        conn.sendall(answer)
                        if not answer:
                            conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield listening.getsockname()[1]
        finally:
            listening.shutdown(socket.SHUT_RDWR)
    thread.join(5)
    for conn in held:
        conn.close()


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (None, "accepted the connection but sent nothing in 1 s"),
        (_HTTP_ANSWER, "answered b'HTTP/1.1 400 Bad Request"),
        (b"", "closed the connection unanswered"),
    ],
)
@pytest.mark.parametrize("form", ["{host}:{port}", "ray://{host}:{port}"])
def test_a_port_where_ray_does_not_answer_fails_fast_naming_it(
    answer: bytes | None, said: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something listens, but not Ray (a server that accepts and says nothing, an HTTP
    server, one that hangs up): ray.init would retry for minutes; the probe says so at
    once, as a BackendUnavailable naming the address."""
    from trioinfer_ray._backend import _probe

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    with _serving(socket.AF_INET, "127.0.0.1", answer) as port:
        address = form.format(host="127.0.0.1", port=port)
        with pytest.raises(BackendUnavailable) as caught:
            _probe(address, 1.0)
    message = str(caught.value)
    assert message.startswith(f"no Ray at {address}: 127.0.0.1:{port} {said}"), message
    assert "ray start --head" in message


def test_a_loopback_address_ray_would_swap_is_probed_where_ray_connects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ray.init connects to a GCS at 127.0.0.1 through the machine's own address (unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): a head on loopback alone passed the probe,
    then the load retried the other address for ten minutes. Now the probe tries the
    address Ray will, and says why it differs."""
    from ray._private import services

    from trioinfer_ray._backend import _probe

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    with _serving(socket.AF_INET, "127.0.0.1", _SETTINGS_FRAME) as port:
        address = f"127.0.0.1:{port}"
        _probe(address, 5.0)  # Ray keeps loopback here (conftest.py's setting)
        monkeypatch.setattr(services, "resolve_ip_for_localhost", lambda host: "127.0.0.2")
        _probe(address, 5.0)  # another loopback address: probed as given
        # As Ray resolves loopback on a machine it serves clusters from (TEST-NET-1
        # here, where nothing answers), while the head listens on 127.0.0.1 alone.
        monkeypatch.setattr(services, "resolve_ip_for_localhost", lambda host: "192.0.2.1")
        with pytest.raises(BackendUnavailable) as caught:
            _probe(address, 1.0)
    message = str(caught.value)
    assert message.startswith(f"no Ray at {address}: connecting to 192.0.2.1:{port} failed")
    assert "Ray connects to 127.0.0.1 through this machine's address, 192.0.2.1" in message
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in this process's environment" in message


def test_a_real_http_server_is_not_taken_for_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard library's HTTP server on the port: refused as not gRPC."""
    from trioinfer_ray._backend import _probe

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_USE_TLS", raising=False)

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        with pytest.raises(BackendUnavailable, match=r"which is not gRPC \(HTTP/2\)") as caught:
            _probe(address, 5.0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    # (It answers "PRI * HTTP/2.0" as HTTP/0.9, with an HTML page and no status line.)
    assert str(caught.value).startswith(f"no Ray at {address}: {address} answered b'")


def test_the_probe_passes_a_real_rays_gcs(local_ray: None) -> None:
    from trioinfer_ray._backend import _probe

    _probe(ray.get_runtime_context().gcs_address, 5.0)


def test_with_ray_tls_on_the_probe_only_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAY_USE_TLS=1: Ray's gRPC speaks TLS first, which ray.init has the certificates
    for; the probe checks that something listens, and leaves the rest to it."""
    from trioinfer_ray._backend import _probe

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_USE_TLS", "1")
    with _serving(socket.AF_INET, "127.0.0.1", None) as port:
        _probe(f"127.0.0.1:{port}", 1.0)


def test_a_ray_jobs_address_in_ray_address_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RAY_ADDRESS=http://head:8265 (the dashboard's, which `ray job submit` reads) with
    address = "auto": the probe said "Name or service not known" of 'http://head'."""
    from trioinfer_ray._backend import _probe

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(BackendUnavailable, match=r"RAY_ADDRESS.*dashboard's \(Ray Jobs'\)"):
        _probe("auto", 5.0)


@pytest.mark.parametrize("address", ["auto", "ray://127.0.0.1:{port}/path", "127.0.0.1"])
def test_addresses_the_probe_cannot_read_are_left_to_ray(
    address: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ "auto" without RAY_ADDRESS nor a noted address (Ray looks for a cluster itself,
    and fails at once), an address with a path or without a port: not probed, so never
    refused by it."""
    from trioinfer_ray._backend import _probe

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no `ray start --head` noted here
    _probe(address.format(port=_free_port(socket.AF_INET, "127.0.0.1")), 5.0)
