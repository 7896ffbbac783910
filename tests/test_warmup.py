"""Model warm-up: samples every instance runs at load, before the model serves.

Over the engine (`ModelConfig.warmup`), ``config.toml`` (``[[warmup]]``) and
Triton's ``config.pbtxt`` (``model_warmup``), answered back by ``GET .../config``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import (
    BackendError,
    ConfigError,
    Instance,
    ModelConfig,
    ModelSignature,
    Warmup,
    WarmupInput,
    open_engine,
)
from trioinfer.testing import FakeBackend, FaultyBackend

X = np.arange(4, dtype=np.float32).reshape(1, 4)
DIGITS = trioinfer.example_repository() / "digits"


class Recorder:
    """``y = 2 * x``, recording every input it is given."""

    def __init__(self) -> None:
        self.seen: list[np.ndarray[Any, Any]] = []

    def __call__(self, inputs: Any) -> dict[str, np.ndarray[Any, Any]]:
        self.seen.append(np.array(inputs["x"]))
        return {"y": inputs["x"] * 2}


def fake_config(*samples: Warmup | dict[str, Any], count: int = 2, **kw: Any) -> ModelConfig:
    return ModelConfig(
        name="m",
        path="-",
        backend="fake",
        instances=[Instance(count=count)],
        warmup=list(samples),
        **kw,
    )


async def test_every_instance_runs_every_sample_in_order_before_the_model_serves() -> None:
    record = Recorder()
    backend = FakeBackend(record)
    samples = [
        Warmup("zeros", {"x": WarmupInput([4])}, batch_size=3, count=2),
        {"name": "noise", "inputs": {"x": {"dims": [4], "data": "random"}}},
    ]
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config(*samples))
        # Each instance: zeros of 3 rows twice, then one random row; nothing else ran.
        assert [instance.executions for instance in backend.loaded] == [3, 3]
        assert sorted(backend.executions) == [1, 1, 3, 3, 3, 3]
        zeros = [a for a in record.seen if a.shape == (3, 4)]
        noise = [a for a in record.seen if a.shape == (1, 4)]
        assert len(zeros) == 4
        assert all((a == 0).all() for a in zeros)
        assert len(noise) == 2
        assert all(((a >= 0) & (a < 1)).all() for a in noise)
        assert all(a.dtype == np.float32 for a in record.seen)
        # Warm-up runs are not requests: nothing counted.
        stats = engine.statistics().models["m"]
        assert (stats.executions, stats.succeeded, stats.inferences) == (0, 0, 0)
        np.testing.assert_array_equal((await engine.infer("m", {"x": X}))["y"], X * 2)


UNBATCHED = ModelSignature.declared(
    [{"name": "x", "dtype": "float32", "shape": [2, 4]}],
    [{"name": "y", "dtype": "float32", "shape": [2, 4]}],
    model="m",
)


@pytest.mark.parametrize(
    ("sample", "signature", "message"),
    [
        (
            {"name": "w", "inputs": {"z": {"dims": [4]}}},
            None,
            "warm-up sample 'w' gives no 'x'; a sample gives every input of the model but "
            "its optional ones: 'x'",
        ),
        (
            {"name": "w", "inputs": {"x": {"dims": [4]}, "z": {"dims": [4]}}},
            None,
            "the model has no input 'z'; its inputs are 'x'",
        ),
        (
            {"name": "w", "inputs": {"x": {"dims": [4], "dtype": "TYPE_INT64"}}},
            None,
            r"input 'x' is float32\[batch, 4\], not int64",
        ),
        (
            {"name": "w", "inputs": {"x": {"dims": [5]}}},
            None,
            "warm-up sample 'w' does not fit the model: .*size 5 in dimension 1",
        ),
        (
            {"name": "w", "inputs": {"x": {"dims": [2, 4]}}, "batch_size": 2},
            UNBATCHED,
            "batch_size is 2, but the model does not batch",
        ),
        # Refused before it is made (a load override comes over the network): a
        # MemoryError, or gigabytes of zeros, otherwise.
        (
            {"name": "w", "inputs": {"x": {"dims": [10**11]}}},
            None,
            r"input 'x' would hold 100000000000 elements; at most 67108864",
        ),
        (
            {"name": "w", "inputs": {"x": {"dims": [4]}}, "batch_size": 10**9},
            None,
            r"input 'x' would hold 4000000000 elements \(4 in each of 1000000000 rows\)",
        ),
    ],
)
async def test_a_sample_that_does_not_fit_fails_the_load_before_anything_runs(
    sample: dict[str, Any], signature: ModelSignature | None, message: str
) -> None:
    backend = FakeBackend() if signature is None else FakeBackend(signature=signature)
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.load(fake_config(sample))
        assert backend.executions == []
        assert backend.open_instances == 0
        assert engine.models() == []


@pytest.mark.parametrize(
    ("options", "batch_size", "most"),
    [({"max_batch_size": 4}, 5, 4), ({}, 33, 32)],  # the dynamic batcher's default: 32
)
async def test_a_sample_bigger_than_the_max_batch_size_fails_the_load(
    options: dict[str, Any], batch_size: int, most: int
) -> None:
    """As Triton refuses it at load: no batch the model serves is that big."""
    backend = FakeBackend()
    sample = {"name": "w", "inputs": {"x": {"dims": [4]}}, "batch_size": batch_size}
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(
            ConfigError,
            match=rf"warm-up sample 'w': batch_size is {batch_size}, more than the model's "
            rf"max_batch_size \({most}\)",
        ):
            await engine.load(fake_config(sample, batcher="dynamic", batcher_options=options))
        assert backend.executions == []
        assert backend.open_instances == 0
        fits = {**sample, "batch_size": most}
        await engine.load(fake_config(fits, batcher="dynamic", batcher_options=options))
        assert backend.executions == [most, most]  # on each instance


class ThirdParty:
    """A third party's batcher (one request per batch), promising *most* rows if given."""

    def __init__(self, most: int | None = None) -> None:
        self.most = most

    async def next_batch(self, queue: Any) -> list[Any]:
        await queue.wait_not_empty()
        return [queue.pop_nowait()]


class Bounded(ThirdParty):
    @property
    def max_batch_size(self) -> int | None:
        return self.most


@pytest.mark.parametrize(
    ("batcher", "refused"),
    [(Bounded(2), True), (Bounded(None), False), (ThirdParty(2), False)],
)
async def test_a_third_party_batchers_max_batch_size_bounds_the_samples(
    batcher: ThirdParty, refused: bool
) -> None:
    """What the batcher says (trioinfer.abc.BoundedBatcher); None, or saying nothing: no bound."""
    assert isinstance(batcher, trioinfer.abc.BoundedBatcher) is isinstance(batcher, Bounded)
    backend = FakeBackend()
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "batchers": {"mine": lambda: batcher}}
    )
    sample = {"name": "w", "inputs": {"x": {"dims": [4]}}, "batch_size": 3}
    async with open_engine(registry=registry) as engine:
        if refused:
            with pytest.raises(ConfigError, match=r"more than the model's max_batch_size \(2\)"):
                await engine.load(fake_config(sample, batcher="mine"))
            assert backend.executions == []
        else:
            await engine.load(fake_config(sample, batcher="mine"))
            assert backend.executions == [3, 3]


def test_the_bundled_batchers_say_their_max_batch_size() -> None:
    from trioinfer_batching import DynamicBatcher, NoBatcher, SequenceBatcher

    bounded = trioinfer.abc.BoundedBatcher
    assert all(isinstance(b, bounded) for b in (DynamicBatcher(), NoBatcher(), SequenceBatcher()))
    assert DynamicBatcher(max_batch_size=4).max_batch_size == 4
    assert NoBatcher().max_batch_size is None  # one request, of any rows
    assert SequenceBatcher().max_batch_size is None  # until attached to its model


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"name": "w", "inputs": {}}, "warm-up inputs must be a non-empty table"),
        ({"name": "", "inputs": {"x": {"dims": [4]}}}, "name must be a non-empty string"),
        ({"name": "w", "inputs": {"x": {"dims": [4]}}, "count": 0}, "count must be an integer"),
        ({"name": "w", "inputs": {"x": {"dims": [-1]}}}, "dims must be sizes of 0 or more"),
        ({"name": "w", "inputs": {"x": {"dims": [4], "data": "ones"}}}, "'zero', 'random'"),
        ({"name": "w", "inputs": {"x": {"dims": [4], "dtype": "float"}}}, "is not a numpy"),
        ({"name": "w", "inputs": {"x": {"dims": [4], "shape": [4]}}}, "unknown key 'shape'"),
        ({"name": "w", "inputs": {"x": {"data": "zero"}}}, "needs dims"),
        ({"name": "w", "inputs": {"x": {"dims": [4]}}, "rows": 2}, "unknown key 'rows'"),
    ],
)
def test_malformed_samples_are_refused_with_what_is_expected(
    sample: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        fake_config(sample)


def test_a_pipeline_takes_no_warmup() -> None:
    with pytest.raises(ConfigError, match="a pipeline takes no warmup"):
        ModelConfig(
            name="p",
            backend="pipeline",
            warmup=[{"name": "w", "inputs": {"x": {"dims": [4]}}}],
        )


async def test_a_failing_warmup_fails_the_load_and_the_model_it_would_replace_serves_on() -> None:
    backend = FakeBackend()
    sample = {"name": "w", "inputs": {"x": {"dims": [4]}}}
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config(count=1))
        backend.error = RuntimeError("out of device memory")
        with pytest.raises(
            BackendError,
            match="model 'm': warm-up sample 'w' failed on instance [01] "
            r"\(cpu\): RuntimeError: out of device memory",
        ):
            await engine.load(fake_config(sample), replace=True)
        assert backend.open_instances == 1  # the new instances were closed, the old serves
        backend.error = None
        np.testing.assert_array_equal((await engine.infer("m", {"x": X}))["y"], X * 2)


async def test_outputs_that_do_not_fit_fail_the_warmup() -> None:
    backend = FakeBackend(lambda inputs: {"y": np.zeros((1, 3), np.float32)})
    sample = {"name": "w", "inputs": {"x": {"dims": [4]}}}
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(BackendError, match=r"warm-up sample 'w' failed on instance .*'y'"):
            await engine.load(fake_config(sample, count=1))
        assert backend.open_instances == 0


async def test_a_recreated_instance_is_warmed_up_before_it_serves_again(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    (tmp_path / "sevens.bin").write_bytes(np.full(4, 7.0, "<f4").tobytes())
    record = Recorder()
    backend = FaultyBackend(FakeBackend(record), crash_after=3)
    config = ModelConfig(
        name="m",
        path="-",
        backend="faulty",
        instances=[Instance()],
        fallback="resilient",
        fallback_options={"breaker": {"fail_max": 1, "reset_timeout": 3.0}},
        warmup=[Warmup("w", {"x": WarmupInput([4], tmp_path / "sevens.bin")})],
    )
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        assert len(record.seen) == 1  # the warm-up
        for _ in range(2):  # the instance dies at its fourth call
            await engine.infer("m", {"x": X})
        with pytest.raises(BackendError, match="crashed"):
            await engine.infer("m", {"x": X})
        while engine.statistics().models["m"].replicas[0].state != "serving":  # noqa: ASYNC110
            await trio.sleep(0.01)
        assert len(backend.instances) == 2
        # The new instance's first call was the warm-up's; the breaker's probes came after.
        new = backend.instances[1].inner.executions  # type: ignore[attr-defined]
        sevens = [bool((seen == 7).all()) for seen in record.seen]
        assert sevens == [True, False, False] + [True] + [False] * (new - 1)


# -- files, config.toml ----------------------------------------------------------------


def digits_copy(root: Path, toml: str) -> Path:
    """The bundled digits model under *root*, with *toml* as its config.toml."""
    model = root / "digits"
    (model / "1").mkdir(parents=True)
    shutil.copy(DIGITS / "1" / "model.onnx", model / "1" / "model.onnx")
    (model / "config.toml").write_text(toml)
    return model


DIGITS_WARMUP = """\
[[warmup]]
name = "image"
batch_size = 4
count = 2
inputs.input = { dims = [64], file = "image.bin" }
"""


async def test_config_toml_reads_a_file_from_the_models_warmup_directory(tmp_path: Path) -> None:
    model = digits_copy(tmp_path, DIGITS_WARMUP)
    (model / "warmup").mkdir()
    image = np.arange(64, dtype="<f4") / 64
    (model / "warmup" / "image.bin").write_bytes(image.tobytes())
    config = ModelConfig.from_toml(model / "config.toml")
    (sample,) = config.warmup
    assert sample.inputs["input"].data == model / "warmup" / "image.bin"
    arrays = sample.arrays(
        "digits",
        ModelSignature.declared(
            [{"name": "input", "dtype": "FP32", "shape": ["batch", 64]}],
            [{"name": "y", "dtype": "FP32", "shape": ["batch"]}],
            model="digits",
        ),
        config.input_limits,
    )
    np.testing.assert_array_equal(arrays["input"], np.tile(image, (4, 1)))
    async with open_engine() as engine:
        await engine.load(config)
        assert engine.statistics().models["digits"].executions == 0
        out = await engine.infer("digits", {"input": image.reshape(1, 64)})
        assert out["label"].shape == (1,)


@pytest.mark.parametrize(
    ("content", "file", "message"),
    [
        (b"\0" * 255, "image.bin", "holds 255 bytes; dims \\[64\\] of float32 take 256"),
        (b"", "missing.bin", "cannot read warm-up data"),
        (b"", "../config.toml", "leads outside the model's warmup directory"),
    ],
)
async def test_a_warmup_file_that_does_not_fit_is_named(
    tmp_path: Path, content: bytes, file: str, message: str
) -> None:
    model = digits_copy(tmp_path, DIGITS_WARMUP.replace("image.bin", file))
    (model / "warmup").mkdir()
    (model / "warmup" / "image.bin").write_bytes(content)
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.load(ModelConfig.from_toml(model / "config.toml"))


async def test_string_inputs_from_a_file_of_length_prefixed_elements(tmp_path: Path) -> None:
    words = [b"ab", b"", "\u00e9t\u00e9".encode()]
    data = b"".join(len(w).to_bytes(4, "little") + w for w in words)
    (tmp_path / "words.bin").write_bytes(data)
    signature = ModelSignature.declared(
        [{"name": "x", "dtype": "BYTES", "shape": ["batch", 3]}],
        [{"name": "y", "dtype": "BYTES", "shape": ["batch", 3]}],
        model="m",
    )
    record = Recorder()
    backend = FakeBackend(record, signature=signature)
    sample = Warmup("w", {"x": WarmupInput([3], tmp_path / "words.bin")})
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config(sample, count=1))
    assert [a.tolist() for a in record.seen] == [[words]]
    (tmp_path / "words.bin").write_bytes(data[:-1])
    with pytest.raises(ConfigError, match="element 2 runs past the file's end"):
        sample.arrays("m", signature, trioinfer.InputLimits())


# -- config.pbtxt and GET .../config ----------------------------------------------------

PBTXT = """\
max_batch_size: 8
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    inputs { key: "input" value { data_type: TYPE_FP32 dims: [ 64 ] zero_data: true } }
  },
  {
    name: "image"
    count: 3
    inputs { key: "input" value { data_type: TYPE_FP32 dims: [ 64 ] input_data_file: "i.bin" } }
  }
]
"""


@pytest.mark.triton_config
def test_model_warmup_in_config_pbtxt_maps_onto_warmup_tables() -> None:
    from trioinfer.server._triton import TritonModel

    model = TritonModel.parse(PBTXT, name="digits", where="digits/config.pbtxt")
    assert model.settings["warmup"] == [
        {
            "name": "zeros",
            "inputs": {"input": {"dims": [64], "dtype": "FP32", "data": "zero"}},
            "batch_size": 2,
            "count": 1,
        },
        {
            "name": "image",
            "inputs": {"input": {"dims": [64], "dtype": "FP32", "file": "i.bin"}},
            "batch_size": 1,
            "count": 3,
        },
    ]
    with pytest.raises(ConfigError, match="set zero_data, random_data or input_data_file"):
        TritonModel.parse(
            'model_warmup [ { name: "w" inputs { key: "x" value { dims: [ 1 ] } } } ]',
            name="m",
            where="m/config.pbtxt",
        )


@pytest.mark.triton_config
@pytest.mark.grpc
def test_served_config_answers_model_warmup_as_triton_does(tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from test_grpc import run_server

    model = digits_copy(tmp_path / "repo", "")
    (model / "config.toml").unlink()
    (model / "config.pbtxt").write_text(PBTXT)
    (model / "warmup").mkdir()
    (model / "warmup" / "i.bin").write_bytes(np.zeros(64, "<f4").tobytes())
    toml = digits_copy(tmp_path / "other", DIGITS_WARMUP)
    shutil.move(toml, tmp_path / "repo" / "toml_digits")
    (tmp_path / "repo" / "toml_digits" / "warmup").mkdir()
    (tmp_path / "repo" / "toml_digits" / "warmup" / "image.bin").write_bytes(
        np.ones(64, "<f4").tobytes()
    )
    with run_server(tmp_path / "repo", "--grpc-port", "0", log=tmp_path / "log") as server:
        with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as http:
            pbtxt = http.get_model_config("digits")
            toml_config = http.get_model_config("toml_digits")
        with grpcclient.InferenceServerClient(server.grpc) as grpc:
            over_grpc = grpc.get_model_config("toml_digits", as_json=True)["config"]
    assert [w["name"] for w in pbtxt["model_warmup"]] == ["zeros", "image"]
    assert pbtxt["model_warmup"][1]["inputs"]["input"]["input_data_file"] == "i.bin"
    expected = [
        {
            "name": "image",
            "batch_size": 4,
            "inputs": {
                "input": {"data_type": "TYPE_FP32", "dims": [64], "input_data_file": "image.bin"}
            },
            "count": 2,
        }
    ]
    assert toml_config["model_warmup"] == expected
    # gRPC's JSON writes 64-bit integers as strings and leaves defaults out.
    assert over_grpc["model_warmup"][0]["inputs"]["input"]["input_data_file"] == "image.bin"
    assert over_grpc["model_warmup"][0]["batch_size"] == 4


def test_tritons_key_in_config_toml_says_where_it_goes(tmp_path: Path) -> None:
    model = digits_copy(tmp_path, "model_warmup = []\n")
    with pytest.raises(ConfigError, match=r"write \[\[warmup\]\] tables"):
        ModelConfig.from_toml(model / "config.toml")


async def test_an_unbatched_model_and_a_streaming_one_warm_up() -> None:
    # Their answers are judged as the engine judges theirs: no rows to count.
    backend = FakeBackend(lambda inputs: {"y": inputs["x"] * 2}, signature=UNBATCHED)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config({"name": "w", "inputs": {"x": {"dims": [2, 4]}}}, count=1))
        assert backend.executions == [2]


class Repeat:
    """A decoupled model: each request's x, twice."""

    async def infer(self, inputs: dict[str, Any]) -> Any:
        for _ in range(2):
            yield {"y": inputs["x"]}


async def test_a_streaming_model_runs_its_samples_to_their_last_response() -> None:
    config = ModelConfig(
        name="repeat",
        backend="python",
        backend_options={
            "class": Repeat,
            "decoupled": True,
            "inputs": [{"name": "x", "dtype": "int32", "shape": [1]}],
            "outputs": [{"name": "y", "dtype": "int32", "shape": [1]}],
        },
        warmup=[{"name": "w", "inputs": {"x": {"dims": [1]}}, "count": 2}],
    )
    async with open_engine() as engine:
        await engine.load(config)
        async with engine.infer_stream("repeat", {"x": np.array([7], np.int32)}) as responses:
            assert [r["y"].tolist() async for r in responses] == [[7], [7]]
