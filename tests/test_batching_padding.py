"""The dynamic batcher's padding of one ragged dimension to buckets."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import trioinfer
from trioinfer import Instance, ModelConfig, ModelSignature, TensorSpec, open_engine
from trioinfer.testing import FakeBackend, models
from trioinfer_batching import DynamicBatcher

F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)
Arrays = Mapping[str, np.ndarray[Any, Any]]

# x and its mask share the ragged "seq" axis; the outputs hold it on axis 1 (y),
# on axis 2 (z), or not at all (total, a masked sum over it).
SIGNATURE = ModelSignature(
    inputs=(
        TensorSpec("x", F32, ("batch", "seq"), "tensor(float)"),
        TensorSpec("attention_mask", I64, ("batch", "seq"), "tensor(int64)"),
    ),
    outputs=(
        TensorSpec("y", F32, ("batch", "seq"), "tensor(float)"),
        TensorSpec("z", F32, ("batch", 1, "seq"), "tensor(float)"),
        TensorSpec("total", F32, ("batch",), "tensor(float)"),
    ),
)
RAGGED = {"y": 1, "z": 2}


def model(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
    """The model, in numpy: what every caller's share must equal."""
    x, mask = inputs["x"], inputs["attention_mask"]
    return {
        "y": x * 2,
        "z": (x * 2)[:, None, :],
        "total": (x * mask).sum(axis=1, dtype=np.float32),
    }


class Recorder:
    """The model, remembering a copy of every batch the backend saw."""

    def __init__(self) -> None:
        self.seen: list[dict[str, np.ndarray[Any, Any]]] = []

    def __call__(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        self.seen.append({name: array.copy() for name, array in inputs.items()})
        return model(inputs)

    def shapes(self, name: str = "x") -> list[tuple[int, ...]]:
        return [seen[name].shape for seen in self.seen]


def config(**options: object) -> ModelConfig:
    return ModelConfig(
        name="m",
        path="unused.onnx",
        backend="fake",
        batcher="dynamic",
        batcher_options={"max_queue_delay": 0.25, **options},
        instances=[Instance(count=1)],
    )


def request(i: int, length: int, rows: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    """Rows of distinct values; a mask that is not all ones, to show it is kept."""
    x = (100 * i + np.arange(rows * length, dtype=np.float32)).reshape(rows, length)
    mask = np.ones((rows, length), np.int64)
    mask[:, -1] = 0
    return {"x": x, "attention_mask": mask}


def assert_exact(out: Arrays, inputs: Arrays) -> None:
    """The caller's share equals the model run on its request alone, unpadded."""
    expected = model(inputs)
    assert out.keys() == expected.keys()
    for name, array in expected.items():
        assert out[name].shape == array.shape, name
        np.testing.assert_array_equal(out[name], array)


async def run_all(
    engine: trioinfer.Engine, requests: Mapping[int, Arrays]
) -> tuple[dict[int, Arrays], dict[int, float]]:
    """Send the requests in order, each queued before the next; wait for all."""
    outputs: dict[int, Arrays] = {}
    done: dict[int, float] = {}

    async def call(i: int, inputs: Arrays) -> None:
        outputs[i] = await engine.infer("m", inputs)
        done[i] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for i, inputs in requests.items():
            nursery.start_soon(call, i, inputs)
            await trio.testing.wait_all_tasks_blocked()
    return outputs, done


async def test_requests_share_a_batch_per_bucket(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, signature=SIGNATURE, delay=1.0)
    requests = {0: request(0, 3), 1: request(1, 4), 2: request(2, 5, rows=2), 3: request(3, 8)}
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            config(
                max_batch_size=8,
                pad_axis=1,
                pad_buckets=[4, 8],
                pad_value=-1.0,
                mask_input="attention_mask",
                ragged_outputs=RAGGED,
            )
        )
        t0 = trio.current_time()
        outputs, done = await run_all(engine, requests)
    # 3 and 4 go to bucket 4, 5 and 8 to bucket 8: the change of bucket cuts at once.
    assert backend.executions == [2, 3]
    assert recorder.shapes() == recorder.shapes("attention_mask") == [(2, 4), (3, 8)]
    assert done == {0: t0 + 1.0, 1: t0 + 1.0, 2: t0 + 2.0, 3: t0 + 2.0}
    first, second = recorder.seen
    # Real positions keep the caller's values; x's padding is pad_value, the mask's 0.
    np.testing.assert_array_equal(first["x"][0], [*requests[0]["x"][0], -1.0])
    np.testing.assert_array_equal(first["x"][1], requests[1]["x"][0])
    np.testing.assert_array_equal(first["attention_mask"][0], [1, 1, 0, 0])
    np.testing.assert_array_equal(second["x"][:2, 5:], np.full((2, 3), -1.0))
    np.testing.assert_array_equal(second["attention_mask"][:2], [[1, 1, 1, 1, 0, 0, 0, 0]] * 2)
    np.testing.assert_array_equal(second["x"][2], requests[3]["x"][0])
    for i, inputs in requests.items():
        assert_exact(outputs[i], inputs)
        # Views of the batch's outputs, as on the unpadded path.
        assert all(array.base is not None for array in outputs[i].values())


async def test_pad_values_per_input(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, signature=SIGNATURE)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            config(
                pad_axis=1,
                pad_buckets=[6],
                pad_value=3,
                pad_values={"x": 9.5},
                ragged_outputs={"y": 1},
            )
        )
        outputs, _ = await run_all(engine, {0: request(0, 2), 1: request(1, 5)})
    assert recorder.shapes() == [(2, 6)]
    np.testing.assert_array_equal(recorder.seen[0]["x"][0, 2:], [9.5] * 4)
    np.testing.assert_array_equal(recorder.seen[0]["attention_mask"][0, 2:], [3] * 4)
    np.testing.assert_array_equal(outputs[0]["y"], request(0, 2)["x"] * 2)
    # z is not listed in ragged_outputs: only its rows are cut, the padding stays.
    assert outputs[0]["z"].shape == (1, 1, 6)
    # The mask was padded with 3, not 0, so the sum counts padded positions.
    assert outputs[0]["total"][0] == (request(0, 2)["x"][0, 0] + 4 * 9.5 * 3)


async def test_longer_than_every_bucket_runs_unpadded_with_its_own_length(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, signature=SIGNATURE, delay=1.0)
    requests = {0: request(0, 10), 1: request(1, 10, rows=2), 2: request(2, 11), 3: request(3, 2)}
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            config(
                pad_axis=1, pad_buckets=[4, 8], mask_input="attention_mask", ragged_outputs=RAGGED
            )
        )
        outputs, _ = await run_all(engine, requests)
    assert recorder.shapes() == [(3, 10), (1, 11), (1, 4)]
    for i, inputs in requests.items():
        assert_exact(outputs[i], inputs)


async def test_inputs_that_disagree_on_the_length_are_not_padded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two symbolic dims: the engine lets x and the mask differ on axis 1.
    signature = ModelSignature(
        inputs=(
            TensorSpec("x", F32, ("batch", "s"), "tensor(float)"),
            TensorSpec("attention_mask", I64, ("batch", "t"), "tensor(int64)"),
        ),
        outputs=(TensorSpec("w", F32, ("batch", "s"), "tensor(float)"),),
    )
    seen: list[Arrays] = []

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        seen.append({name: array.copy() for name, array in inputs.items()})
        lengths = inputs["attention_mask"].sum(axis=1, keepdims=True, dtype=np.float32)
        return {"w": inputs["x"] + lengths}  # float32, as declared (the engine checks)

    backend = FakeBackend(fn, signature=signature, delay=1.0)
    odd = {"x": np.ones((1, 3), np.float32), "attention_mask": np.ones((1, 5), np.int64)}
    requests = {0: request(0, 2), 1: odd, 2: odd, 3: request(3, 3)}
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(pad_axis=1, pad_buckets=[4], ragged_outputs={"w": 1}))
        outputs, _ = await run_all(engine, requests)
    # The odd ones share a batch with their identical twin only, exactly as they came.
    assert [(s["x"].shape, s["attention_mask"].shape) for s in seen] == [
        ((1, 4), (1, 4)),
        ((2, 3), (2, 5)),
        ((1, 4), (1, 4)),
    ]
    for i in (1, 2):
        np.testing.assert_array_equal(outputs[i]["w"], np.full((1, 3), 6.0, np.float32))
    np.testing.assert_array_equal(outputs[3]["w"], request(3, 3)["x"] + 2)


async def test_pad_inputs_leaves_other_inputs_alone(autojump_clock: trio.testing.MockClock) -> None:
    signature = ModelSignature(
        inputs=(
            TensorSpec("x", F32, ("batch", "seq"), "tensor(float)"),
            TensorSpec("scale", F32, ("batch", 3), "tensor(float)"),
        ),
        outputs=(TensorSpec("y", F32, ("batch", "seq"), "tensor(float)"),),
    )
    seen: list[Arrays] = []

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        seen.append({name: array.copy() for name, array in inputs.items()})
        return {"y": inputs["x"] * inputs["scale"][:, :1]}

    backend = FakeBackend(fn, signature=signature)
    requests = {
        i: {"x": np.full((1, length), i + 1, np.float32), "scale": np.full((1, 3), 2, np.float32)}
        for i, length in enumerate([1, 2, 3])
    }
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            config(pad_axis=1, pad_buckets=[3], pad_inputs=["x"], ragged_outputs={"y": 1})
        )
        outputs, _ = await run_all(engine, requests)
    assert [(s["x"].shape, s["scale"].shape) for s in seen] == [((3, 3), (3, 3))]
    for i, inputs in requests.items():
        np.testing.assert_array_equal(outputs[i]["y"], inputs["x"] * 2)


async def test_buffers_are_reused_unless_an_output_aliases_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    signature = ModelSignature(
        inputs=(TensorSpec("x", F32, ("batch", "seq"), "tensor(float)"),),
        outputs=(TensorSpec("y", F32, ("batch", "seq"), "tensor(float)"),),
    )
    addresses: list[int] = []
    identity = False

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        addresses.append(inputs["x"].__array_interface__["data"][0])
        return {"y": inputs["x"] if identity else inputs["x"] * 2}

    backend = FakeBackend(fn, signature=signature)
    xs = {i: np.full((1, 2 + i % 2), i, np.float32) for i in range(2)}
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(pad_axis=1, pad_buckets=[4], ragged_outputs={"y": 1}))
        for _ in range(2):
            await run_all(engine, {i: {"x": x} for i, x in xs.items()})
        assert addresses[0] == addresses[1]  # the second batch reused the first's buffer
        identity = True
        first, _ = await run_all(engine, {i: {"x": x} for i, x in xs.items()})
        kept = {i: out["y"].copy() for i, out in first.items()}
        await run_all(engine, {i: {"x": x + 10} for i, x in xs.items()})
    # The identity's outputs are views of its input buffer: it was not filled again.
    for i, out in first.items():
        np.testing.assert_array_equal(out["y"], kept[i])
        np.testing.assert_array_equal(out["y"], xs[i])


async def test_a_ragged_output_without_the_padded_length_is_returned_whole(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeBackend(model, signature=SIGNATURE)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            config(pad_axis=1, pad_buckets=[4], ragged_outputs={"y": 1, "total": 1, "no": 1})
        )
        with caplog.at_level(logging.WARNING, logger="trioinfer.batching"):
            outputs, _ = await run_all(engine, {0: request(0, 2), 1: request(1, 3)})
    assert outputs[0]["y"].shape == (1, 2)
    assert outputs[0]["total"].shape == (1,)
    assert "ragged output 'total' has shape (2,)" in caplog.text


def test_the_engine_keeps_its_fast_path_without_padding() -> None:
    assert not hasattr(DynamicBatcher(max_batch_size=4), "assemble")
    padded = DynamicBatcher(pad_axis=1, pad_buckets=(8, 16), pad_value=-1)
    assert callable(padded.assemble)
    assert padded.pad_buckets == (8, 16)
    assert DynamicBatcher(pad_buckets=[]).pad_buckets == ()
    assert repr(padded).endswith("pad_axis=1, pad_buckets=[8, 16], pad_value=-1)")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pad_buckets": [4]}, "pad_buckets needs pad_axis"),
        ({"mask_input": "m"}, "mask_input needs pad_axis"),
        ({"ragged_outputs": {"y": 1}}, "ragged_outputs needs pad_axis"),
        ({"pad_value": 1}, "pad_value needs pad_axis"),
        ({"pad_values": {"x": 1}}, "pad_values needs pad_axis"),
        ({"pad_inputs": ["x"]}, "pad_inputs needs pad_axis"),
        ({"pad_axis": 0, "pad_buckets": [4]}, r"pad_axis must be an axis >= 1 \(axis 0"),
        ({"pad_axis": True, "pad_buckets": [4]}, "pad_axis must be an axis"),
        ({"pad_axis": "1", "pad_buckets": [4]}, "pad_axis must be an axis"),
        ({"pad_axis": 1}, "pad_buckets must be a non-empty list"),
        ({"pad_axis": 1, "pad_buckets": "48"}, "pad_buckets must be a non-empty list"),
        ({"pad_axis": 1, "pad_buckets": [8, 4]}, r"strictly increasing, got \[8, 4\]"),
        ({"pad_axis": 1, "pad_buckets": [0, 4]}, "pad_buckets must hold positive integers"),
        ({"pad_axis": 1, "pad_buckets": [4], "pad_value": "0"}, "pad_value must be a number"),
        ({"pad_axis": 1, "pad_buckets": [4], "pad_value": False}, "pad_value must be a number"),
        (
            {"pad_axis": 1, "pad_buckets": [4], "pad_values": {"x": None}},
            r"pad_values\['x'\] must be a number",
        ),
        ({"pad_axis": 1, "pad_buckets": [4], "pad_values": [1]}, "pad_values must be a table"),
        ({"pad_axis": 1, "pad_buckets": [4], "mask_input": 1}, "mask_input must be an input"),
        (
            {"pad_axis": 1, "pad_buckets": [4], "mask_input": "m", "pad_values": {"m": 1}},
            "a mask is always padded with 0",
        ),
        (
            {"pad_axis": 1, "pad_buckets": [4], "pad_inputs": ["x"], "mask_input": "m"},
            r"names input 'm', which is not among pad_inputs \['x'\]",
        ),
        ({"pad_axis": 1, "pad_buckets": [4], "pad_inputs": "x"}, "pad_inputs must be a non-empty"),
        ({"pad_axis": 1, "pad_buckets": [4], "pad_inputs": []}, "pad_inputs must be a non-empty"),
        (
            {"pad_axis": 1, "pad_buckets": [4], "ragged_outputs": {"y": 0}},
            r"ragged_outputs\['y'\] must be an axis >= 1",
        ),
    ],
)
def test_invalid_padding_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(trioinfer.ConfigError, match=message):
        DynamicBatcher(**options)


async def test_invalid_padding_options_are_refused_at_load() -> None:
    async with open_engine(registry=FakeBackend(signature=SIGNATURE).registry()) as engine:
        with pytest.raises(trioinfer.ConfigError, match="pad_buckets must be strictly"):
            await engine.load(config(pad_axis=1, pad_buckets=[4, 4]))
        assert engine.models() == []


def test_options_from_config_toml(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "m" / "config.toml").write_text(
        'batcher = "dynamic"\n'
        "[batcher_options]\n"
        "max_batch_size = 16\n"
        "pad_axis = 1\n"
        "pad_buckets = [32, 64, 128]\n"
        'mask_input = "attention_mask"\n'
        "pad_values = { input_ids = 1 }\n"
        "ragged_outputs = { logits = 1 }\n"
    )
    loaded = ModelConfig.from_toml(tmp_path / "m" / "config.toml")
    batcher = DynamicBatcher(**loaded.batcher_options)
    assert batcher.pad_buckets == (32, 64, 128)
    assert repr(batcher).endswith(
        "pad_axis=1, pad_buckets=[32, 64, 128], pad_values={'input_ids': 1}, "
        "mask_input='attention_mask', ragged_outputs={'logits': 1})"
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, int]], list[float]]:
    buckets = sorted(draw(st.sets(st.integers(1, 10), min_size=1, max_size=3)))
    calls = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 3)), max_size=12))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.125, 0.5]), min_size=len(calls)))
    return draw(st.integers(1, 6)), buckets, calls, gaps


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from([0.0, -2.0]))
def test_every_caller_gets_its_unbatched_result(
    scenario: tuple[int, list[int], list[tuple[int, int]], list[float]], pad_value: float
) -> None:
    max_batch_size, buckets, calls, gaps = scenario
    recorder = Recorder()
    backend = FakeBackend(recorder, signature=SIGNATURE, delay=0.25)
    requests = {i: request(i, length, rows) for i, (length, rows) in enumerate(calls)}
    outputs: dict[int, Arrays] = {}

    async def call(engine: trioinfer.Engine, i: int) -> None:
        outputs[i] = await engine.infer("m", requests[i])

    async def main() -> None:
        async with open_engine(registry=backend.registry()) as engine:
            await engine.load(
                config(
                    max_batch_size=max_batch_size,
                    pad_axis=1,
                    pad_buckets=buckets,
                    pad_value=pad_value,
                    mask_input="attention_mask",
                    ragged_outputs=RAGGED,
                )
            )
            async with trio.open_nursery() as nursery:
                for i, gap in zip(requests, gaps, strict=False):
                    await trio.sleep(gap)
                    nursery.start_soon(call, engine, i)
                    await trio.testing.wait_all_tasks_blocked()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for i, inputs in requests.items():
        assert_exact(outputs[i], inputs)
    for seen in recorder.seen:
        length = seen["x"].shape[1]
        # Every execution is one bucket, or one exact length above them all.
        assert length in buckets or length > buckets[-1]


def test_real_onnx_model_pads_to_buckets(model_dir: Path) -> None:
    path = models.write_identity(model_dir / "identity_seq.onnx", shape=("batch", "seq"))
    lengths = [1, 3, 4, 2, 7, 9]

    async def main() -> dict[int, np.ndarray[Any, Any]]:
        outs: dict[int, np.ndarray[Any, Any]] = {}
        async with open_engine() as engine:
            await engine.load(
                ModelConfig(
                    name="id",
                    path=path,
                    batcher="dynamic",
                    batcher_options={
                        "pad_axis": 1,
                        "pad_buckets": [4, 8],
                        "pad_value": -1,
                        "ragged_outputs": {"y": 1},
                    },
                )
            )

            async def call(i: int, length: int) -> None:
                x = np.arange(length, dtype=np.float32)[None] + 10 * i
                with trio.fail_after(10):
                    outs[i] = (await engine.infer("id", {"x": x}))["y"]

            async with trio.open_nursery() as nursery:
                for i, length in enumerate(lengths):
                    nursery.start_soon(call, i, length)
            stats = engine.statistics().models["id"]
            assert stats.succeeded == len(lengths)
        return outs

    outs = trio.run(main)
    for i, length in enumerate(lengths):
        np.testing.assert_array_equal(outs[i], np.arange(length, dtype=np.float32)[None] + 10 * i)


async def test_concurrent_batches_never_share_a_buffer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    addresses: list[int] = []

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        addresses.append(inputs["x"].__array_interface__["data"][0])
        return recorder(inputs)

    backend = FakeBackend(fn, signature=SIGNATURE, delay=1.0)
    cfg = config(
        max_batch_size=1,
        pad_axis=1,
        pad_buckets=[4],
        mask_input="attention_mask",
        ragged_outputs=RAGGED,
    )
    requests = {i: request(i, 1 + i % 3) for i in range(12)}
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(attrs.evolve(cfg, instances=[Instance(count=6)]))
        t0 = trio.current_time()
        outputs, done = await run_all(engine, requests)
    assert sorted(set(done.values())) == [t0 + 1.0, t0 + 2.0]  # six at a time
    assert len(set(addresses[:6])) == len(set(addresses[6:])) == 6
    for i, inputs in requests.items():
        assert_exact(outputs[i], inputs)


async def test_a_request_missing_the_axis_in_a_pad_input_runs_as_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    signature = ModelSignature(
        inputs=(
            TensorSpec("x", F32, ("batch", "seq"), "tensor(float)"),
            TensorSpec("flag", F32, ("batch",), "tensor(float)"),
        ),
        outputs=(TensorSpec("y", F32, ("batch", "seq"), "tensor(float)"),),
    )
    seen: list[tuple[int, ...]] = []

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        seen.append(inputs["x"].shape)
        return {"y": inputs["x"] * inputs["flag"][:, None]}

    backend = FakeBackend(fn, signature=signature)
    batcher = DynamicBatcher(
        pad_axis=1, pad_buckets=[4], pad_inputs=["x", "flag"], pad_values={"x": 1}
    )
    assert "pad_values={'x': 1}, pad_inputs=['flag', 'x']" in repr(batcher)
    x = np.ones((1, 3), np.float32)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            config(pad_axis=1, pad_buckets=[4], pad_inputs=["x", "flag"], ragged_outputs={"y": 1})
        )
        out = await engine.infer("m", {"x": x, "flag": np.full(1, 3, np.float32)})
    # flag lacks the axis: nothing can be padded, so the request goes as it came.
    assert seen == [(1, 3)]
    np.testing.assert_array_equal(out["y"], 3 * x)


@pytest.mark.parametrize(("utf8", "blank"), [(False, b""), (True, "")])
async def test_a_string_inputs_padding_is_an_empty_string_of_its_type(
    autojump_clock: trio.testing.MockClock, utf8: bool, blank: object
) -> None:
    # pad_value is a number: a BYTES input was padded with the int 0 (str "0" to ONNX
    # Runtime, an int among a Python model's bytes). Its padding is an empty string of
    # the type its elements reach the model as (TensorSpec.utf8).
    strings = np.dtype(object)
    signature = ModelSignature(
        inputs=(TensorSpec("tokens", strings, ("batch", "seq"), utf8=utf8),),
        outputs=(TensorSpec("n", I64, ("batch",)),),
    )
    seen: list[list[Any]] = []

    def count(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        seen.append(inputs["tokens"].tolist())
        return {"n": np.array([len(row) for row in inputs["tokens"]], np.int64)}

    backend = FakeBackend(count, signature=signature, delay=1.0)
    requests = {
        0: {"tokens": np.array([[b"a", b"b"]], dtype=object)},
        1: {"tokens": np.array([[b"c", b"d", b"e"]], dtype=object)},
    }
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(max_batch_size=4, pad_axis=1, pad_buckets=[4]))
        await run_all(engine, requests)
    a, b, c, d, e = (s if not utf8 else s.decode() for s in (b"a", b"b", b"c", b"d", b"e"))
    assert seen == [[[a, b, blank, blank], [c, d, e, blank]]]


def fixed_signature(size: int) -> ModelSignature:
    """x fixed at *size* on the padded axis; the mask left open there."""
    return ModelSignature(
        inputs=(
            TensorSpec("x", F32, ("batch", size), "tensor(float)"),
            TensorSpec("attention_mask", I64, ("batch", "seq"), "tensor(int64)"),
        ),
        outputs=(TensorSpec("y", F32, ("batch", size), "tensor(float)"),),
    )


async def test_padding_an_axis_the_model_fixes_is_refused_at_load() -> None:
    # A request of length 5 passes the signature's check, then would be padded to 8:
    # the model would be fed a size it fixes at 5 (and the caller get 8 columns of y).
    seen: list[tuple[int, ...]] = []

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        seen.append(inputs["x"].shape)
        return {"y": inputs["x"] * 2}

    backend = FakeBackend(fn, signature=fixed_signature(5))
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(trioinfer.ConfigError) as caught:
            await engine.load(config(pad_axis=1, pad_buckets=[4, 8]))
        assert engine.models() == []
    message = str(caught.value)
    assert "model 'm'" in message
    assert "input 'x', which the model fixes at 5" in message
    assert "pad_buckets [4, 8]" in message
    assert "pad_inputs" in message  # what to do instead
    assert seen == []


@pytest.mark.parametrize("buckets", [[4, 5, 8], [2, 4]])
async def test_a_fixed_size_padding_never_changes_is_accepted(
    autojump_clock: trio.testing.MockClock, buckets: list[int]
) -> None:
    # 5 is a bucket itself, or above every bucket: a request of length 5 is never padded.
    seen: list[tuple[int, ...]] = []

    def fn(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        seen.append(inputs["x"].shape)
        return {"y": inputs["x"] * 2}

    backend = FakeBackend(fn, signature=fixed_signature(5))
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(pad_axis=1, pad_buckets=buckets))
        out = await engine.infer(
            "m", {"x": np.ones((1, 5), np.float32), "attention_mask": np.ones((1, 5), np.int64)}
        )
    assert seen == [(1, 5)]
    assert out["y"].shape == (1, 5)


async def test_an_input_left_out_of_pad_inputs_may_fix_the_axis() -> None:
    backend = FakeBackend(signature=fixed_signature(5))
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(pad_axis=1, pad_buckets=[4, 8], pad_inputs=["attention_mask"]))
        assert [m.name for m in engine.models()] == ["m"]


@pytest.mark.parametrize("where", ["graph", "config"])
def test_real_onnx_model_with_a_fixed_axis_is_refused(model_dir: Path, where: str) -> None:
    # Fixed by the graph, or only by the config's dims over an open graph (as a
    # config.pbtxt's dims reach the backend): either way padding 5 to 8 is refused.
    shape = ("batch", 5) if where == "graph" else ("batch", "seq")
    path = models.write_identity(model_dir / f"identity_{where}.onnx", shape=shape)
    declared = {"inputs": [{"name": "x", "shape": [-1, 5]}]} if where == "config" else {}

    async def main() -> None:
        async with open_engine() as engine:
            with pytest.raises(trioinfer.ConfigError, match=r"'x'.*fixes at 5"):
                await engine.load(
                    ModelConfig(
                        name="id",
                        path=path,
                        backend_options=declared,
                        batcher="dynamic",
                        batcher_options={"pad_axis": 1, "pad_buckets": [8]},
                    )
                )

    trio.run(main)
