"""Stateful sequences: the sequence batcher, its config, and sequence_id over HTTP."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing

import trioinfer
from _serve import start_serving
from _triton_config import own_setting
from trioinfer import (
    ConfigError,
    Instance,
    InvalidInput,
    ModelConfig,
    SequenceError,
    SequenceFlags,
    open_engine,
)
from trioinfer.testing import (
    SequenceAccumulator,
    SimpleSequence,
    assert_all_ended,
    simple_sequence_config,
)

pytestmark = pytest.mark.sequence

Array = np.ndarray[Any, Any]
STRATEGIES = ["direct", "oldest"]


def value(v: int) -> dict[str, Array]:
    return {"INPUT": np.array([[v]], dtype=np.int32)}


def flags(sequence_id: int | str, i: int, n: int) -> SequenceFlags:
    return SequenceFlags(sequence_id, start=i == 0, end=i == n - 1)


def _tensor(name: str, dtype: str = "int32") -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": ["batch", 1]}


def state_config(
    cls: type,
    *,
    name: str = "acc",
    strategy: str = "oldest",
    max_batch_size: int = 4,
    instances: int = 1,
    max_sequence_idle: float = 5.0,
    corrid: bool = False,
) -> ModelConfig:
    """An implicit-state accumulator like SequenceAccumulator, served by *cls*."""
    inputs = [_tensor("INPUT"), _tensor("START"), _tensor("STATE_IN")]
    outputs = [_tensor("OUTPUT"), _tensor("STATE_OUT")]
    control = {"start": "START"}
    if corrid:
        inputs.append(_tensor("CORRID", "uint64"))
        control["corrid"] = "CORRID"
    return ModelConfig(
        name=name,
        path="model.py",
        backend="python",
        batcher="sequence",
        backend_options={"class": cls, "inputs": inputs, "outputs": outputs},
        instances=[Instance(count=instances)],
        sequence={
            "strategy": strategy,
            "max_batch_size": max_batch_size,
            "max_sequence_idle": max_sequence_idle,
            "control": control,
            "state": [{"input": "STATE_IN", "output": "STATE_OUT"}],
        },
    )


# -- the flags ---------------------------------------------------------------------------


def test_flags_are_read_from_tritons_request_parameters() -> None:
    read = SequenceFlags.from_parameters
    assert read({}) is None
    assert read({"sequence_id": 0}) is None
    assert read({"sequence_id": "", "priority": 1}) is None
    assert read({"sequence_id": 7, "sequence_start": True}) == SequenceFlags(7, start=True)
    assert read({"sequence_id": "abc", "sequence_end": True}) == SequenceFlags("abc", end=True)
    assert read({"sequence_id": 2**64 - 1}) == SequenceFlags(2**64 - 1)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"sequence_id": -1}, "between 1 and 2\\*\\*64-1"),
        ({"sequence_id": 2**64}, "between 1 and 2\\*\\*64-1"),
        ({"sequence_id": True}, "unsigned 64-bit integer or a string"),
        ({"sequence_id": 1.5}, "unsigned 64-bit integer or a string"),
        ({"sequence_id": 1, "sequence_start": "yes"}, "sequence_start must be true or false"),
        ({"sequence_id": 1, "sequence_end": 1}, "sequence_end must be true or false"),
        ({"sequence_start": True}, "need a sequence_id"),
        ({"sequence_id": 0, "sequence_end": True}, "need a sequence_id"),
    ],
)
def test_malformed_flags_are_invalid_input(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        SequenceFlags.from_parameters(parameters)


# -- the config --------------------------------------------------------------------------


def test_a_sequence_table_is_read_from_config_toml(tmp_path: Path) -> None:
    (tmp_path / "acc" / "1").mkdir(parents=True)
    (tmp_path / "acc" / "1" / "model.py").write_text("")
    (tmp_path / "acc" / "config.toml").write_text(
        'backend = "python"\nbatcher = "sequence"\n'
        "[sequence]\n"
        'strategy = "direct"\nmax_sequence_idle = 2.5\nmax_batch_size = 8\n'
        'control = { start = "START", ready = "READY" }\n'
        '[[sequence.state]]\ninput = "S_IN"\noutput = "S_OUT"\ninitial = 1.5\nshape = [2]\n'
    )
    config = ModelConfig.from_toml(tmp_path / "acc" / "config.toml")
    sequence = config.sequence
    assert sequence is not None
    assert (sequence.strategy, sequence.max_sequence_idle, sequence.max_batch_size) == (
        "direct",
        2.5,
        8,
    )
    assert dict(sequence.control) == {"start": "START", "ready": "READY"}
    assert sequence.state == (trioinfer.SequenceState("S_IN", "S_OUT", 1.5, (2,)),)
    assert sequence.hidden_inputs == {"START", "READY", "S_IN"}
    assert sequence.hidden_outputs == {"S_OUT"}


@pytest.mark.parametrize(
    ("sequence", "extra", "message"),
    [
        ({"strategy": "newest"}, {}, "strategy must be 'direct' or 'oldest'"),
        ({"max_sequence_idle": 0}, {}, "max_sequence_idle must be a number of seconds from"),
        ({"max_sequence_idle": math.inf}, {}, "max_sequence_idle must be a number of seconds"),
        ({"max_batch_size": 0}, {}, "max_batch_size must be a positive integer"),
        ({"control": {"begin": "START"}}, {}, "unknown kind 'begin'"),
        ({"control": {"start": "X", "end": "X"}}, {}, "one input for two kinds"),
        ({"control": {"start": 3}}, {}, "must be an input name"),
        ({"state": [{"input": "S"}]}, {}, "needs input and output"),
        ({"state": [{"input": "S", "output": "T", "initial": "zero"}]}, {}, "must be a number"),
        ({"state": [{"input": "S", "output": "T", "shape": [-1]}]}, {}, "sizes >= 0"),
        ({"timeout": 1}, {}, "unknown key 'timeout'"),
        ({}, {"fallback": "resilient"}, "needs fallback = 'none'"),
        ({}, {"response_cache": True}, "cannot use response_cache"),
        ({}, {"backend": "pipeline"}, "a pipeline cannot be stateful"),
    ],
)
def test_a_bad_sequence_config_is_a_config_error(
    sequence: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(name="m", path="m.py", batcher="sequence", sequence=sequence, **extra)


async def test_a_stateful_model_needs_a_sequence_batcher() -> None:
    config = simple_sequence_config()
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match="batcher 'dynamic' is not a sequence batcher"):
            await engine.load(ModelConfig(**{**_fields(config), "batcher": "dynamic"}))


async def test_a_sequence_batcher_needs_a_sequence_table() -> None:
    # It once loaded, and the engine stopped at its first batch (next_batch refused): a
    # server took a load override {"batcher": "sequence"} and shut down.
    config = simple_sequence_config()
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match=r"batcher 'sequence' keeps sequences and needs a"):
            await engine.load(ModelConfig(**{**_fields(config), "sequence": None}))
        assert engine.models() == []


@pytest.mark.parametrize(
    ("sequence", "message"),
    [
        ({"control": {"start": "BEGIN"}}, "control.start names input 'BEGIN'"),
        ({"control": {"start": "INPUT", "ready": "START"}, "max_batch_size": 1}, None),
        ({"state": [{"input": "NOPE", "output": "OUTPUT"}]}, "state input 'NOPE'"),
        ({"state": [{"input": "START", "output": "NOPE"}]}, "state output 'NOPE'"),
    ],
)
async def test_the_sequence_config_is_checked_against_the_model(
    sequence: dict[str, Any], message: str | None
) -> None:
    config = simple_sequence_config()
    config = ModelConfig(**{**_fields(config), "sequence": sequence})
    async with open_engine() as engine:
        if message is None:
            await engine.load(config)  # any int input may carry a control
        else:
            with pytest.raises(ConfigError, match=message):
                await engine.load(config)


def _state_model(cls: type, state_out: dict[str, Any]) -> ModelConfig:
    config = state_config(cls)
    options = dict(config.backend_options)
    options["outputs"] = [_tensor("OUTPUT"), {"name": "STATE_OUT", **state_out}]
    return ModelConfig(**{**_fields(config), "backend_options": options})


@pytest.mark.parametrize(
    ("state_out", "message"),
    [
        ({"dtype": "float32", "shape": ["batch", 1]}, r"is float32\[batch, 1\], but its state"),
        ({"dtype": "int32", "shape": ["batch", 2]}, r"is int32\[batch, 2\], but its state"),
        ({"dtype": "int32", "shape": ["batch"]}, r"is int32\[batch\], but its state"),
    ],
)
async def test_a_state_output_must_fit_its_state_input(
    state_out: dict[str, Any], message: str
) -> None:
    # Fed back unchecked, a float32 output was cast into the int32 state (1.7 became 1),
    # and one of another shape failed the next batch of every sequence in it.
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.load(_state_model(SequenceAccumulator, state_out))


class Widening(SequenceAccumulator):
    """Gives a state of two elements where the state holds one."""

    def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
        out = super().infer(inputs)
        return {**out, "STATE_OUT": np.repeat(out["STATE_OUT"], 2, axis=1)}


async def test_a_state_output_in_another_shape_ends_its_sequence_only() -> None:
    # Its sizes left open, the output's shape is seen at run time: the answer is whole,
    # the sequence ends saying why (it was a "batcher broke its contract" at the next
    # request, failing every sequence batched with it).
    async with open_engine() as engine:
        await engine.load(_state_model(Widening, {"dtype": "int32", "shape": ["batch", -1]}))
        out = await engine.infer("acc", value(1), sequence=SequenceFlags(1, start=True))
        assert out["OUTPUT"][0, 0] == 1
        with pytest.raises(
            SequenceError, match=r"left its state 'STATE_IN' as output 'STATE_OUT' gave it, "
        ) as raised:
            await engine.infer("acc", value(1), sequence=SequenceFlags(1))
        assert "int32[2], which is not the state's int32[1]" in str(raised.value)
        assert_all_ended(engine)


async def test_a_corrid_control_must_be_an_integer_or_string_type() -> None:
    config = simple_sequence_config()
    options = dict(config.backend_options)
    options["inputs"] = [*options["inputs"][:3], _tensor("CORRID", "float32")]
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match="expected an integer or string type"):
            await engine.load(ModelConfig(**{**_fields(config), "backend_options": options}))


async def test_an_id_too_big_for_the_corrid_type_names_the_input_and_model() -> None:
    config = simple_sequence_config()
    options = dict(config.backend_options)
    options["inputs"] = [*options["inputs"][:3], _tensor("CORRID", "uint8")]
    async with open_engine() as engine:
        await engine.load(ModelConfig(**{**_fields(config), "backend_options": options}))
        with pytest.raises(SequenceError) as caught:
            await engine.infer(config.name, value(1), sequence=SequenceFlags(300, start=True))
    # The model's name in quotes once: no "'simple_sequence''s" possessive.
    assert str(caught.value).startswith(
        "sequence_id 300 does not fit the CORRID input 'CORRID' of model 'simple_sequence'"
    ), caught.value


def _fields(config: ModelConfig) -> dict[str, Any]:
    import attrs

    return {f.name: getattr(config, f.name) for f in attrs.fields(ModelConfig)}


# -- sequences on the engine -------------------------------------------------------------


async def test_callers_see_neither_controls_nor_state() -> None:
    async with open_engine() as engine:
        direct = await engine.load(simple_sequence_config("d", strategy="direct"))
        oldest = await engine.load(simple_sequence_config("o", strategy="oldest"))
    assert [s.name for s in direct.signature.inputs] == ["INPUT"]
    assert [s.name for s in direct.signature.outputs] == ["OUTPUT", "ID"]
    assert [s.name for s in oldest.signature.inputs] == ["INPUT"]
    assert [s.name for s in oldest.signature.outputs] == ["OUTPUT"]


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_interleaved_sequences_each_keep_their_own_sum_on_one_instance(
    strategy: str,
) -> None:
    values = {
        1000: [0, 11, 7, 5, 3, 2, 0, 1],
        1001: [100, -11, -7, -5, -3, -2, 0, -1],
        "a-string-id": [20, 1, 2, 3, 4, 5, 6, 7],
        7: [1, 1, 1, 1, 1, 1, 1, 1],
    }
    if strategy == "direct":
        del values["a-string-id"]  # SimpleSequence's CORRID is uint64
    config = simple_sequence_config(strategy=strategy, max_batch_size=2, instances=2)
    got: dict[int | str, list[int]] = {k: [] for k in values}
    instances: dict[int | str, set[int | None]] = {k: set() for k in values}

    async def run(sequence_id: int | str) -> None:
        sent = values[sequence_id]
        for i, v in enumerate(sent):
            result = await engine.infer_detailed(
                "simple_sequence", value(v), sequence=flags(sequence_id, i, len(sent))
            )
            got[sequence_id].append(int(result.outputs["OUTPUT"][0, 0]))
            instances[sequence_id].add(result.instance)
            if strategy == "direct":
                assert result.outputs["ID"][0, 0] == sequence_id
            await trio.lowlevel.checkpoint()  # let the other sequences interleave

    async with open_engine() as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            for sequence_id in values:
                nursery.start_soon(run, sequence_id)
        stats = engine.statistics().models["simple_sequence"]
        assert_all_ended(engine, accepted=sum(map(len, values.values())))
    for sequence_id, sent in values.items():
        assert got[sequence_id] == list(np.cumsum(sent)), sequence_id
        assert len(instances[sequence_id]) == 1, sequence_id
    # Batches held several sequences' requests: fewer executions than requests.
    assert stats.executions < stats.succeeded
    if strategy == "direct":  # two slots per instance: four sequences take both instances
        assert {i for seen in instances.values() for i in seen} == {0, 1}


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_requests_of_one_sequence_sent_at_once_run_in_order(strategy: str) -> None:
    sent = [5, 4, 3, 2, 1, 10]
    results: dict[int, int] = {}

    async def one(i: int) -> None:
        outputs = await engine.infer("simple_sequence", value(sent[i]), sequence=flags(9, i, 6))
        results[i] = int(outputs["OUTPUT"][0, 0])

    async with open_engine() as engine:
        await engine.load(simple_sequence_config(strategy=strategy, instances=2))
        async with trio.open_nursery() as nursery:
            for i in range(len(sent)):
                nursery.start_soon(one, i)
                await trio.testing.wait_all_tasks_blocked()  # admitted in this order
    assert [results[i] for i in range(len(sent))] == list(np.cumsum(sent))


async def test_oldest_puts_at_most_one_request_per_sequence_in_a_batch() -> None:
    batches: list[list[int]] = []

    class Recording(SequenceAccumulator):
        def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
            batches.append([int(c) for c in inputs["CORRID"][:, 0]])
            return super().infer({k: v for k, v in inputs.items() if k != "CORRID"})

    async def sequence(sequence_id: int) -> None:
        for i in range(3):
            await engine.infer("acc", value(1), sequence=flags(sequence_id, i, 3))

    async with open_engine() as engine:
        await engine.load(state_config(Recording, max_batch_size=2, corrid=True))
        async with trio.open_nursery() as nursery:
            for sequence_id in (1, 2, 3):
                nursery.start_soon(sequence, sequence_id)
    assert sorted(c for batch in batches for c in batch) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(len(batch) == len(set(batch)) <= 2 for batch in batches)
    assert any(len(batch) == 2 for batch in batches)


async def test_direct_gives_each_sequence_a_slot_and_pads_the_others_with_ready_0() -> None:
    rows: list[tuple[list[int], list[int]]] = []

    class Recording(SimpleSequence):
        def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
            rows.append(([int(c) for c in inputs["CORRID"][:, 0]], list(inputs["READY"][:, 0])))
            return super().infer(inputs)

    config = simple_sequence_config(max_batch_size=3)
    options = {**config.backend_options, "class": Recording}
    async with open_engine() as engine:
        await engine.load(ModelConfig(**{**_fields(config), "backend_options": options}))
        for sequence_id in (11, 12):
            await engine.infer("simple_sequence", value(1), sequence=flags(sequence_id, 0, 2))
        # Only the second sequence sends its next request: slot 0 is padding.
        out = await engine.infer("simple_sequence", value(5), sequence=flags(12, 1, 2))
    assert out["OUTPUT"][0, 0] == 6
    assert rows[0] == ([11], [1])
    assert rows[1] == ([0, 12], [0, 1])
    assert rows[2] == ([0, 12], [0, 1])


async def test_direct_makes_a_new_sequence_wait_for_a_free_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = simple_sequence_config(max_batch_size=1, max_sequence_idle=10.0)
    async with open_engine() as engine:
        await engine.load(config)
        await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1, start=True))
        t0 = trio.current_time()
        # Sequence 1 holds the only slot until it goes idle; then sequence 2 gets it.
        out = await engine.infer("simple_sequence", value(2), sequence=SequenceFlags(2, start=True))
        assert trio.current_time() - t0 == pytest.approx(10.0)
        assert out["OUTPUT"][0, 0] == 2
        with pytest.raises(SequenceError, match="released after 10s without a request"):
            await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1))


# -- errors ------------------------------------------------------------------------------


async def test_requests_that_do_not_fit_a_sequence_are_refused() -> None:
    async with open_engine() as engine:
        await engine.load(simple_sequence_config(strategy="oldest"))
        await engine.load(state_config(SequenceAccumulator, name="ids", corrid=True))
        await engine.load(
            ModelConfig(
                name="plain",
                path="m.py",
                backend="python",
                backend_options={
                    "class": SequenceAccumulator,
                    "inputs": [_tensor("INPUT"), _tensor("START"), _tensor("STATE_IN")],
                    "outputs": [_tensor("OUTPUT"), _tensor("STATE_OUT")],
                },
            )
        )
        infer = engine.infer
        with pytest.raises(SequenceError, match="is stateful: each request needs a sequence_id"):
            await infer("simple_sequence", value(1))
        with pytest.raises(SequenceError, match="no sequence 5 in progress: a sequence's first"):
            await infer("simple_sequence", value(1), sequence=SequenceFlags(5))
        with pytest.raises(InvalidInput, match="'plain' is not stateful"):
            await infer(
                "plain",
                {**value(1), "START": value(0)["INPUT"], "STATE_IN": value(0)["INPUT"]},
                sequence=SequenceFlags(5),
            )
        with pytest.raises(SequenceError, match="takes integer sequence ids"):
            await infer("ids", value(1), sequence=SequenceFlags("s", start=True))
        two = {"INPUT": np.ones((2, 1), np.int32)}
        with pytest.raises(SequenceError, match="carries one row"):
            await infer("simple_sequence", two, sequence=SequenceFlags(5, start=True))
        with pytest.raises(InvalidInput, match="STATE_IN"):  # callers cannot send state
            await infer(
                "simple_sequence",
                {**value(1), "STATE_IN": value(0)["INPUT"]},
                sequence=SequenceFlags(5, start=True),
            )
        await infer("simple_sequence", value(1), sequence=SequenceFlags(5, start=True, end=True))
        with pytest.raises(SequenceError, match=r"sequence 5 .* ended with its last request"):
            await infer("simple_sequence", value(1), sequence=SequenceFlags(5))
        await infer("simple_sequence", value(1), sequence=SequenceFlags(6, start=True))
        # A new start of a sequence with nothing pending begins it anew.
        out = await infer("simple_sequence", value(3), sequence=SequenceFlags(6, start=True))
        assert out["OUTPUT"][0, 0] == 3
        stats = engine.statistics().models["simple_sequence"]
        assert stats.refused == 4
        assert_all_ended(engine)


async def test_a_request_after_the_end_flag_is_refused_even_before_the_end_ran(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Slow(SequenceAccumulator):
        async def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:  # type: ignore[override]
            await trio.sleep(1)
            return super().infer(inputs)

    async with open_engine() as engine:
        await engine.load(state_config(Slow))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: engine.infer("acc", value(1), sequence=SequenceFlags(3, start=True))
            )
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(lambda: engine.infer("acc", value(1), sequence=SequenceFlags(3)))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(SequenceError, match="cannot start again"):
                await engine.infer("acc", value(1), sequence=SequenceFlags(3, start=True))
            nursery.start_soon(
                lambda: engine.infer("acc", value(1), sequence=SequenceFlags(3, end=True))
            )
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(SequenceError, match="already had its last request"):
                await engine.infer("acc", value(1), sequence=SequenceFlags(3))


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_an_idle_sequence_is_released_and_its_next_request_refused(
    autojump_clock: trio.testing.MockClock, strategy: str
) -> None:
    config = simple_sequence_config(strategy=strategy, max_sequence_idle=2.0)
    async with open_engine() as engine:
        await engine.load(config)
        start = SequenceFlags(1, start=True)
        await engine.infer("simple_sequence", value(4), sequence=start)
        await trio.sleep(1.5)
        out = await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1))
        assert out["OUTPUT"][0, 0] == 5  # 1.5 s idle: still there
        await trio.sleep(2.0)
        with pytest.raises(SequenceError, match=r"sequence 1 .* released after 2s without a req"):
            await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1))
        # It stays refused (never restarted silently), until a new start.
        with pytest.raises(SequenceError, match="released after 2s"):
            await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1))
        out = await engine.infer("simple_sequence", value(7), sequence=start)
        assert out["OUTPUT"][0, 0] == 7


async def test_an_idle_sequence_is_released_with_no_request_arriving(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Under direct, the release frees the slot at once for a sequence that waits.
    config = simple_sequence_config(max_batch_size=1, max_sequence_idle=3.0)
    async with open_engine() as engine:
        await engine.load(config)
        await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1, start=True))
        await trio.sleep(1.0)
        t0 = trio.current_time()
        await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(2, start=True))
        assert trio.current_time() - t0 == pytest.approx(2.0)


class Poisoned(SequenceAccumulator):
    """Fails a batch holding the value 13, as an instance failing mid-sequence would."""

    async def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:  # type: ignore[override]
        await trio.sleep(1)
        if (inputs["INPUT"] == 13).any():
            raise RuntimeError("the device fell off the bus")
        return super().infer(inputs)


async def test_an_instance_failing_mid_sequence_ends_the_sequence_with_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    results: dict[int, object] = {}

    async def send(i: int, v: int, f: SequenceFlags) -> None:
        try:
            results[i] = int((await engine.infer("acc", value(v), sequence=f))["OUTPUT"][0, 0])
        except trioinfer.TrioInferError as exc:
            results[i] = exc

    async with open_engine() as engine:
        await engine.load(state_config(Poisoned, instances=2))
        async with trio.open_nursery() as nursery:
            for i, (v, f) in enumerate(
                [
                    (1, SequenceFlags(1, start=True)),
                    (13, SequenceFlags(1)),
                    (2, SequenceFlags(1)),
                    (3, SequenceFlags(1, end=True)),
                ]
            ):
                nursery.start_soon(send, i, v, f)
                await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(SequenceError, match=r"ended because its request '.*' failed"):
            await engine.infer("acc", value(1), sequence=SequenceFlags(1))
        # Other sequences, on that instance too, go on; a new start begins afresh.
        out = await engine.infer("acc", value(4), sequence=SequenceFlags(1, start=True))
        assert out["OUTPUT"][0, 0] == 4
        assert_all_ended(engine, accepted=5)
        assert engine.statistics().models["acc"].refused == 1
    assert results[0] == 1
    assert isinstance(results[1], trioinfer.BackendError)
    assert "fell off the bus" in str(results[1])
    for later in (results[2], results[3]):
        assert isinstance(later, SequenceError)
        assert "was not run: start a new sequence" in str(later)


class SlowAccumulator(SequenceAccumulator):
    async def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:  # type: ignore[override]
        await trio.sleep(1)
        return super().infer(inputs)


@pytest.mark.parametrize("while_", ["queued", "running"])
async def test_cancelling_one_request_ends_its_sequence(
    autojump_clock: trio.testing.MockClock, while_: str
) -> None:
    async with open_engine() as engine:
        await engine.load(state_config(SlowAccumulator))
        first = await engine.infer("acc", value(1), sequence=SequenceFlags(1, start=True))
        assert first["OUTPUT"][0, 0] == 1
        async with trio.open_nursery() as nursery:
            if while_ == "queued":
                # The second runs for a second; the third, queued behind it, is cancelled.
                nursery.start_soon(lambda: engine.infer("acc", value(2), sequence=SequenceFlags(1)))
                await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.5) as scope:
                await engine.infer("acc", value(3), sequence=SequenceFlags(1))
            assert scope.cancelled_caught
        with pytest.raises(
            SequenceError,
            match=r"was cancelled before its answer was delivered|was cancelled or expired before",
        ):
            await engine.infer("acc", value(4), sequence=SequenceFlags(1))
        stats = engine.statistics().models["acc"]
        assert stats.cancelled == 1
        assert stats.succeeded == (2 if while_ == "queued" else 1)
        assert_all_ended(engine)


class Stubborn(SequenceAccumulator):
    """Computes each request to the end, cancelled or not (as sync code in a thread does)."""

    async def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:  # type: ignore[override]
        with trio.CancelScope(shield=True):
            await trio.sleep(1)
        return super().infer(inputs)


async def test_a_request_computed_after_its_caller_left_ends_its_sequence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Its caller saw no answer: a sequence carried on past it would fold in a step the
    # client believes never ran (1 + 10 + 100 = 111 for a client that sent 1, then 100).
    async with open_engine() as engine:
        await engine.load(state_config(Stubborn))
        await engine.infer("acc", value(1), sequence=SequenceFlags(1, start=True))
        with trio.move_on_after(0.5) as scope:
            await engine.infer("acc", value(10), sequence=SequenceFlags(1))
        assert scope.cancelled_caught
        with pytest.raises(SequenceError, match=r"was cancelled before its answer was delivered"):
            await engine.infer("acc", value(100), sequence=SequenceFlags(1))
        out = await engine.infer("acc", value(5), sequence=SequenceFlags(1, start=True))
        assert out["OUTPUT"][0, 0] == 5
        stats = engine.statistics().models["acc"]
        assert (stats.succeeded, stats.cancelled) == (2, 1)
        assert_all_ended(engine)


@pytest.mark.parametrize("how", ["cancelled", "expired"])
async def test_a_request_that_leaves_while_held_ends_its_sequence_at_once(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """No worker looks at a sequence waiting for a direct slot; its leaving request still ends it.

    Sequence 1 holds the only slot for 100 s (max_sequence_idle); sequence 2's
    first request waits for the slot and leaves after 1 s. Its next request is
    refused then and there, not when the slot frees a hundred seconds later.
    """
    config = state_config(
        SequenceAccumulator, strategy="direct", max_batch_size=1, max_sequence_idle=100.0
    )
    if how == "expired":
        config = ModelConfig(**{**_fields(config), "queue_timeouts": {"0": 1.0}})
    async with open_engine() as engine:
        await engine.load(config)
        await engine.infer("acc", value(1), sequence=SequenceFlags(1, start=True))
        t0 = trio.current_time()
        if how == "cancelled":
            with trio.move_on_after(1.0):
                await engine.infer("acc", value(2), sequence=SequenceFlags(2, start=True))
        else:
            with pytest.raises(trioinfer.DeadlineExceeded):
                await engine.infer("acc", value(2), sequence=SequenceFlags(2, start=True))
        assert trio.current_time() - t0 == 1.0
        with pytest.raises(SequenceError, match="was cancelled or expired before it ran"):
            await engine.infer("acc", value(3), sequence=SequenceFlags(2))
        assert trio.current_time() - t0 == 1.0
        # Sequence 1 still holds its slot and its sum.
        out = await engine.infer("acc", value(4), sequence=SequenceFlags(1, end=True))
        assert out["OUTPUT"][0, 0] == 5
        assert_all_ended(engine)


async def test_oldest_keeps_at_most_max_candidate_sequences_in_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A sequence started past max_candidate_sequences waits until one in progress ends."""
    config = state_config(SlowAccumulator, max_batch_size=4)
    config = ModelConfig(
        **{**_fields(config), "sequence": {**_sequence_table(config), "max_candidate_sequences": 1}}
    )
    done: dict[int, float] = {}

    async def run(sequence_id: int) -> None:
        for i in range(2):
            await engine.infer("acc", value(1), sequence=flags(sequence_id, i, 2))
        done[sequence_id] = trio.current_time()

    async with open_engine() as engine:
        await engine.load(config)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, 2)
        assert_all_ended(engine)
    # Each request takes a second; sequence 2 starts only once sequence 1 ended.
    assert (done[1] - t0, done[2] - t0) == (2.0, 4.0)


def test_max_candidate_sequences_is_for_oldest_only() -> None:
    with pytest.raises(ConfigError, match="applies to the 'oldest' strategy only"):
        trioinfer.SequenceConfig(strategy="direct", max_candidate_sequences=2)
    with pytest.raises(ConfigError, match="positive integer"):
        trioinfer.SequenceConfig(max_candidate_sequences=0)


async def test_a_request_expired_in_its_sequence_ends_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = state_config(SlowAccumulator)
    config = ModelConfig(**{**_fields(config), "queue_timeouts": {"0": 0.5}})
    async with open_engine() as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: engine.infer("acc", value(1), sequence=SequenceFlags(1, start=True))
            )
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trioinfer.DeadlineExceeded):
                await engine.infer("acc", value(1), sequence=SequenceFlags(1))
        with pytest.raises(SequenceError, match="ended because"):
            await engine.infer("acc", value(4), sequence=SequenceFlags(1))
        assert_all_ended(engine)


async def test_exactly_once_under_random_cancellation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = np.random.default_rng(0)
    outcomes: dict[str, int] = {"ok": 0, "sequence": 0, "cancelled": 0}
    calls = 0

    async def sequence(sequence_id: int) -> None:
        nonlocal calls
        for i in range(6):
            calls += 1
            with trio.move_on_after(float(rng.uniform(0.5, 4.0))) as scope:
                try:
                    await engine.infer("acc", value(1), sequence=flags(sequence_id, i, 6))
                    outcomes["ok"] += 1
                except SequenceError:
                    outcomes["sequence"] += 1
                    return
            if scope.cancelled_caught:
                outcomes["cancelled"] += 1

    async with open_engine() as engine:
        await engine.load(state_config(SlowAccumulator, instances=2, max_batch_size=3))
        async with trio.open_nursery() as nursery:
            for sequence_id in range(1, 13):
                nursery.start_soon(sequence, sequence_id)
        stats = engine.statistics().models["acc"]
        assert_all_ended(engine)
    assert sum(outcomes.values()) == calls
    assert outcomes["ok"]
    assert outcomes["cancelled"]
    assert outcomes["sequence"]
    assert stats.succeeded == outcomes["ok"]
    assert stats.cancelled == outcomes["cancelled"]


async def test_the_initial_state_is_the_declared_value() -> None:
    config = state_config(SequenceAccumulator)
    assert config.sequence is not None
    sequence = {
        "control": {},  # no START: the initial state alone begins the sum
        "state": [{"input": "STATE_IN", "output": "STATE_OUT", "initial": 100}],
    }
    options = dict(config.backend_options)
    options["class"] = _NoStart
    options["inputs"] = [_tensor("INPUT"), _tensor("STATE_IN")]
    config = ModelConfig(**{**_fields(config), "sequence": sequence, "backend_options": options})
    async with open_engine() as engine:
        await engine.load(config)
        outs = [
            (await engine.infer("acc", value(v), sequence=flags(1, i, 2)))["OUTPUT"][0, 0]
            for i, v in enumerate([1, 2])
        ]
    assert outs == [101, 103]


class _NoStart:
    def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
        total = inputs["STATE_IN"] + inputs["INPUT"]
        return {"OUTPUT": total, "STATE_OUT": total}


async def test_an_unbatched_stateful_model_runs_one_request_at_a_time() -> None:
    class Unbatched:
        def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
            carried = 0 if inputs["START"] else inputs["STATE_IN"]
            total = np.asarray(carried + inputs["INPUT"], dtype=np.float32)
            return {"OUTPUT": total, "STATE_OUT": total}

    one: Callable[[str, str], dict[str, Any]] = lambda n, d: {"name": n, "dtype": d, "shape": [1]}  # noqa: E731
    config = ModelConfig(
        name="u",
        path="m.py",
        backend="python",
        batcher="sequence",
        backend_options={
            "class": Unbatched,
            "inputs": [one("INPUT", "float32"), one("START", "bool"), one("STATE_IN", "float32")],
            "outputs": [one("OUTPUT", "float32"), one("STATE_OUT", "float32")],
        },
        sequence={
            "control": {"start": "START"},
            "state": [{"input": "STATE_IN", "output": "STATE_OUT"}],
        },
    )
    async with open_engine() as engine:
        await engine.load(config)
        outs = [
            float(
                (
                    await engine.infer(
                        "u", {"INPUT": np.array([v], np.float32)}, sequence=flags("x", i, 3)
                    )
                )["OUTPUT"][0]
            )
            for i, v in enumerate([0.5, 1.0, 2.0])
        ]
        bad = ModelConfig(**{**_fields(config), "name": "v", "sequence": {"max_batch_size": 2}})
        with pytest.raises(ConfigError, match=r"no batch dimension, so sequence\.max_batch_size"):
            await engine.load(bad)
    assert outs == [0.5, 1.5, 3.5]


# -- HTTP ---------------------------------------------------------------------------------

MODEL_PY = """
import numpy as np


class Model:
    def infer(self, inputs):
        carried = np.where(inputs["START"] != 0, 0, inputs["STATE_IN"])
        total = (carried + inputs["INPUT"]).astype(np.int32)
        return {"OUTPUT": total, "STATE_OUT": total}
"""

CONFIG_TOML = """
backend = "python"
batcher = "sequence"

[backend_options]
dispatch = "inline"
inputs = [
    { name = "INPUT", dtype = "INT32", shape = ["batch", 1] },
    { name = "START", dtype = "INT32", shape = ["batch", 1] },
    { name = "STATE_IN", dtype = "INT32", shape = ["batch", 1] },
]
outputs = [
    { name = "OUTPUT", dtype = "INT32", shape = ["batch", 1] },
    { name = "STATE_OUT", dtype = "INT32", shape = ["batch", 1] },
]

[sequence]
strategy = "oldest"
max_batch_size = 4
max_sequence_idle = 60.0
control = { start = "START" }
state = [{ input = "STATE_IN", output = "STATE_OUT" }]
"""


async def test_tritons_sequence_client_calls_over_http(tmp_path: Path) -> None:
    """The calls of Triton's simple_http_sequence_sync_infer_client.py, and its errors."""
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    (tmp_path / "repo" / "simple_sequence" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "simple_sequence" / "1" / "model.py").write_text(MODEL_PY)
    (tmp_path / "repo" / "simple_sequence" / "config.toml").write_text(CONFIG_TOML)
    values = [11, 7, 5, 3, 2, 0, 1]

    def sync_send(client: Any, values: list[int], sequence_id: int | str) -> list[int]:
        results = []
        for count, v in enumerate(values, start=1):
            data = np.full((1, 1), v, dtype=np.int32)
            infer_input = httpclient.InferInput("INPUT", list(data.shape), "INT32")
            infer_input.set_data_from_numpy(data)
            result = client.infer(
                model_name="simple_sequence",
                inputs=[infer_input],
                outputs=[httpclient.InferRequestedOutput("OUTPUT")],
                sequence_id=sequence_id,
                sequence_start=count == 1,
                sequence_end=count == len(values),
            )
            results.append(int(result.as_numpy("OUTPUT")[0][0]))
        return results

    def client_calls(url: str) -> dict[str, Any]:
        client = httpclient.InferenceServerClient(url=url)
        out: dict[str, Any] = {
            "int0": sync_send(client, [0, *values], 1000),
            "int1": sync_send(client, [100, *[-v for v in values]], 1001),
            "string0": sync_send(client, [20, *[-v for v in values]], "3f2a-uuid-like"),
        }
        data = np.full((1, 1), 1, dtype=np.int32)
        infer_input = httpclient.InferInput("INPUT", [1, 1], "INT32")
        infer_input.set_data_from_numpy(data)
        errors = []
        for kwargs in (
            {"sequence_id": 1000},  # ended with its last request
            {"sequence_id": 4242},  # never started
            {},  # no sequence at all
        ):
            try:
                client.infer("simple_sequence", [infer_input], **kwargs)
            except InferenceServerException as exc:
                errors.append((exc.status(), exc.message()))
        out["errors"] = errors
        meta = client.get_model_metadata("simple_sequence")
        out["inputs"] = [i["name"] for i in meta["inputs"]]
        out["config"] = client.get_model_config("simple_sequence")
        client.close()
        return out

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "repo")
        address = listening.urls[0].removeprefix("http://")
        out = await trio.to_thread.run_sync(client_calls, address)
        nursery.cancel_scope.cancel()
    assert out["int0"] == list(np.cumsum([0, *values]))
    assert out["int1"] == list(np.cumsum([100, *[-v for v in values]]))
    assert out["string0"] == list(np.cumsum([20, *[-v for v in values]]))
    assert out["inputs"] == ["INPUT"]
    assert out["config"]["max_batch_size"] == 4
    # As Triton prints it: every field of the message, at its default when unset.
    assert out["config"]["sequence_batching"] == {
        "max_sequence_idle_microseconds": 60_000_000,
        "oldest": {
            "max_candidate_sequences": 0,
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": 0,
            "preserve_ordering": False,
        },
        "control_input": [
            {
                "name": "START",
                "control": [
                    {
                        "kind": "CONTROL_SEQUENCE_START",
                        "int32_false_true": [0, 1],
                        "fp32_false_true": [],
                        "data_type": "TYPE_INVALID",
                        "bool_false_true": [],
                    }
                ],
            }
        ],
        "state": [
            {
                "input_name": "STATE_IN",
                "output_name": "STATE_OUT",
                "data_type": "TYPE_INT32",
                "dims": [1],
                "initial_state": [
                    {"data_type": "TYPE_INT32", "dims": [1], "name": "initial", "zero_data": True}
                ],
                "use_same_buffer_for_input_output": False,
                "use_growable_memory": False,
            }
        ],
        "iterative_sequence": False,
    }
    assert own_setting(out["config"], "sequence")["state"] == [
        {"input": "STATE_IN", "output": "STATE_OUT", "initial": 0}
    ]
    assert "dynamic_batching" not in out["config"]
    statuses = [status for status, _ in out["errors"]]
    assert statuses == ["400", "400", "400"]
    messages = [message for _, message in out["errors"]]
    assert "ended with its last request" in messages[0]
    assert "no sequence 4242 in progress" in messages[1]
    assert "needs a sequence_id" in messages[2]


@pytest.mark.streaming
async def test_generate_routes_sequence_parameters_as_infer_does(tmp_path: Path) -> None:
    """/generate and /generate_stream take sequence_id/start/end, as infer does."""
    import httpx

    (tmp_path / "repo" / "simple_sequence" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "simple_sequence" / "1" / "model.py").write_text(MODEL_PY)
    (tmp_path / "repo" / "simple_sequence" / "config.toml").write_text(CONFIG_TOML)
    shutil.copytree(
        trioinfer.example_repository() / "repeat_int32", tmp_path / "repo" / "repeat_int32"
    )
    url = "/v2/models/simple_sequence/"

    def body(v: int, **parameters: Any) -> dict[str, Any]:
        return {"INPUT": v, "parameters": parameters}

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "repo")
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            first = await client.post(
                url + "generate", json=body(11, sequence_id=7, sequence_start=True)
            )
            other = await client.post(
                url + "generate_stream", json=body(100, sequence_id="s", sequence_start=True)
            )
            second = await client.post(url + "generate_stream", json=body(5, sequence_id=7))
            last = await client.post(
                url + "generate", json=body(2, sequence_id=7, sequence_end=True)
            )
            after_end = await client.post(url + "generate", json=body(1, sequence_id=7))
            no_sequence = await client.post(url + "generate", json=body(1))
            bad_flag = await client.post(url + "generate", json=body(1, sequence_start=True))
            decoupled = await client.post(
                "/v2/models/repeat_int32/generate_stream",
                json={"IN": [1], "DELAY": [0], "WAIT": 0, "parameters": {"sequence_id": 3}},
            )
        nursery.cancel_scope.cancel()
    assert first.status_code == 200, first.text
    assert first.json()["OUTPUT"] == 11
    assert (
        other.text == 'data: {"model_name":"simple_sequence","model_version":"1","OUTPUT":100}\n\n'
    )
    assert (
        second.text == 'data: {"model_name":"simple_sequence","model_version":"1","OUTPUT":16}\n\n'
    )
    assert last.json()["OUTPUT"] == 18
    assert after_end.status_code == 400
    assert "ended with its last request" in after_end.json()["error"]
    assert no_sequence.status_code == 400
    assert "needs a sequence_id" in no_sequence.json()["error"]
    assert bad_flag.status_code == 400
    assert "need a sequence_id" in bad_flag.json()["error"]
    # A decoupled model is never stateful: the parameters are refused, not ignored.
    assert decoupled.status_code == 400
    assert "repeat_int32" in decoupled.json()["error"]
    assert "sequence_id" in decoupled.json()["error"]


async def test_a_slot_freed_while_forming_goes_at_once_to_a_waiting_sequence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = state_config(SlowAccumulator, strategy="direct", max_batch_size=1)
    config = ModelConfig(
        **{**_fields(config), "sequence": {**_sequence_table(config), "max_sequence_idle": 100.0}}
    )
    async with open_engine() as engine:
        await engine.load(config)
        await engine.infer("acc", value(1), sequence=SequenceFlags(1, start=True))
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: engine.infer("acc", value(1), sequence=SequenceFlags(1)))
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.5):  # queued behind the running one: cancelled
                await engine.infer("acc", value(1), sequence=SequenceFlags(1))
            second = await engine.infer("acc", value(5), sequence=SequenceFlags(2, start=True))
        # Sequence 1 ended when its cancelled request came up: its slot went to sequence 2
        # as its running request finished (at 1 s), not when sequence 1 would go idle.
        assert second["OUTPUT"][0, 0] == 5
        assert trio.current_time() - t0 == pytest.approx(2.0)


def _sequence_table(config: ModelConfig) -> dict[str, Any]:
    import attrs

    assert config.sequence is not None
    return attrs.asdict(config.sequence, recurse=False)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_sequences_on_both_event_loops(backend: str) -> None:
    import anyio

    async def main() -> list[int]:
        async with open_engine() as engine:
            await engine.load(simple_sequence_config(strategy="oldest", instances=2))
            return [
                int(
                    (await engine.infer("simple_sequence", value(v), sequence=flags(5, i, 3)))[
                        "OUTPUT"
                    ][0, 0]
                )
                for i, v in enumerate([3, 4, 5])
            ]

    assert anyio.run(main, backend=backend) == [3, 7, 12]


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_an_onnx_accumulator_keeps_its_sum_as_implicit_state(
    tmp_path: Path, strategy: str
) -> None:
    from trioinfer.testing import models

    config = ModelConfig(
        name="onnx_acc",
        path=models.write_accumulator(tmp_path / "acc.onnx"),
        batcher="sequence",
        instances=[Instance(count=2)],
        sequence={
            "strategy": strategy,
            "max_batch_size": 4,
            "control": {"start": "START"},
            "state": [{"input": "STATE_IN", "output": "STATE_OUT"}],
        },
    )
    values = {1: [3, 1, 4, 1, 5], 2: [9, 2, 6, 5, 3], 3: [5, 8, 9, 7, 9]}
    got: dict[int, list[int]] = {}

    async def run(sequence_id: int) -> None:
        sent = values[sequence_id]
        got[sequence_id] = [
            int(
                (await engine.infer("onnx_acc", value(v), sequence=flags(sequence_id, i, 5)))[
                    "OUTPUT"
                ][0, 0]
            )
            for i, v in enumerate(sent)
        ]

    async with open_engine() as engine:
        info = await engine.load(config)
        assert [s.name for s in info.signature.inputs] == ["INPUT"]
        async with trio.open_nursery() as nursery:
            for sequence_id in values:
                nursery.start_soon(run, sequence_id)
    assert got == {k: list(np.cumsum(v)) for k, v in values.items()}


async def test_requests_held_for_their_sequences_are_bounded_by_max_queue_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = state_config(SlowAccumulator)
    config = ModelConfig(**{**_fields(config), "max_queue_size": 3})
    async with open_engine() as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            for i in range(3):  # one runs, two wait behind it in their sequence
                nursery.start_soon(
                    lambda i=i: engine.infer("acc", value(1), sequence=flags(1, i, 5))
                )
                await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trioinfer.QueueFull, match="max_queue_size") as info:
                await engine.infer("acc", value(1), sequence=SequenceFlags(1))
            assert info.value.retry_after > 0
        # The refused request never entered its sequence: the next one goes on.
        out = await engine.infer("acc", value(1), sequence=SequenceFlags(1))
        assert out["OUTPUT"][0, 0] == 4
        assert_all_ended(engine, accepted=4)


async def test_a_sequence_batcher_whose_admit_raises_breaks_its_contract() -> None:
    from trioinfer_batching import SequenceBatcher

    def broken_admit(request: object) -> None:
        raise KeyError("oops")

    batcher = SequenceBatcher()
    batcher.admit = broken_admit  # type: ignore[method-assign]
    registry = trioinfer.Registry(extra={"batchers": {"broken": lambda: batcher}})
    config = ModelConfig(**{**_fields(simple_sequence_config()), "batcher": "broken"})
    async with open_engine(registry=registry) as engine:
        await engine.load(config)
        with pytest.raises(trioinfer.PluginContractError, match="raised KeyError in admit"):
            await engine.infer("simple_sequence", value(1), sequence=SequenceFlags(1, start=True))
        stats = engine.statistics().models["simple_sequence"]
        assert (stats.refused, stats.queued) == (1, 0)
        assert_all_ended(engine)


class Kinds:
    """A stateless sequence model that answers what type each row's BYTES element was."""

    def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
        text = inputs["TEXT"]
        kinds = [type(v).__name__ for v in text.ravel()]
        return {"KIND": np.array(kinds, dtype=object).reshape(text.shape)}


async def test_a_bytes_inputs_padding_rows_are_bytes_too() -> None:
    # A direct sequence batch pads the slots no request fills. A BYTES input reaches a
    # Python model as bytes (utf8 false), but its padding rows held str "": a model
    # that decodes each element (v.decode()) failed on them, answering nobody wrong.
    strings = {"dtype": "BYTES", "shape": ["batch", 1]}
    config = ModelConfig(
        name="kinds",
        path="-",
        backend="python",
        batcher="sequence",
        backend_options={
            "class": Kinds,
            "inputs": [{"name": "TEXT", **strings}],
            "outputs": [{"name": "KIND", **strings}],
        },
        sequence={"strategy": "direct", "max_batch_size": 2, "max_sequence_idle": 5.0},
    )
    seen: list[list[Any]] = []
    original = Kinds.infer

    def infer(self: Kinds, inputs: dict[str, Array]) -> dict[str, Array]:
        seen.append([type(v) for v in inputs["TEXT"].ravel()])
        return original(self, inputs)

    text = {"TEXT": np.array([[b"x"]], dtype=object)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Kinds, "infer", infer)
        async with open_engine() as engine:
            await engine.load(config)
            await engine.infer("kinds", text, sequence=SequenceFlags(1, start=True))
            await engine.infer("kinds", text, sequence=SequenceFlags(2, start=True))
            # Sequence 2 holds slot 1 alone: slot 0 is a padding row.
            await engine.infer("kinds", text, sequence=SequenceFlags(1, end=True))
            await engine.infer("kinds", text, sequence=SequenceFlags(2, end=True))
    assert any(len(types) == 2 for types in seen)
    assert all(t is bytes for types in seen for t in types), seen


async def test_a_string_corrid_reaches_a_bytes_model_as_bytes() -> None:
    # A Python model's BYTES tensors hold bytes (utf8 false), as Triton's Python backend
    # gives a TYPE_STRING CORRID: the id went in as the caller gave it (str, or an int),
    # and the padding rows as str "".
    strings = {"dtype": "BYTES", "shape": ["batch", 1]}
    seen: list[list[Any]] = []

    class Ids:
        def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
            seen.append(inputs["CORRID"].ravel().tolist())
            return {"KIND": np.array([[b"ok"]] * len(inputs["CORRID"]), dtype=object)}

    config = ModelConfig(
        name="ids",
        path="-",
        backend="python",
        batcher="sequence",
        backend_options={
            "class": Ids,
            "inputs": [{"name": "TEXT", **strings}, {"name": "CORRID", **strings}],
            "outputs": [{"name": "KIND", **strings}],
        },
        sequence={
            "strategy": "direct",
            "max_batch_size": 2,
            "max_sequence_idle": 5.0,
            "control": {"corrid": "CORRID"},
        },
    )
    text = {"TEXT": np.array([[b"x"]], dtype=object)}
    async with open_engine() as engine:
        await engine.load(config)
        await engine.infer("ids", text, sequence=SequenceFlags("a", start=True))
        await engine.infer("ids", text, sequence=SequenceFlags(7, start=True))
        await engine.infer("ids", text, sequence=SequenceFlags("a", end=True))
        await engine.infer("ids", text, sequence=SequenceFlags(7, end=True))
    assert [b"a"] in seen
    assert [b"", b"7"] in seen  # slot 0 a padding row


class Scaled:
    """A running sum of INPUT times the optional SCALE (1 when a request leaves it out).

    Sleeps a (virtual) second per batch, so that requests queue behind a running one,
    and records each batch: the inputs its requests sent and its ready rows' CORRIDs.
    """

    batches: list[tuple[set[str], list[int]]]

    async def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
        await trio.sleep(1)
        ready = inputs["READY"][:, 0] != 0
        sent = set(inputs) - {"START", "READY", "CORRID", "STATE_IN"}
        Scaled.batches.append((sent, [int(c) for c in inputs["CORRID"][ready, 0]]))
        scale = inputs.get("SCALE", np.ones_like(inputs["INPUT"]))
        carried = np.where(inputs["START"] != 0, 0, inputs["STATE_IN"])
        total = (carried + inputs["INPUT"] * scale).astype(np.int32)
        return {"OUTPUT": total, "STATE_OUT": total.copy()}


def _scaled_config(strategy: str) -> ModelConfig:
    inputs = [
        _tensor("INPUT"),
        {**_tensor("SCALE"), "optional": True},
        _tensor("START"),
        _tensor("READY"),
        _tensor("CORRID", "uint64"),
        _tensor("STATE_IN"),
    ]
    return ModelConfig(
        name="scaled",
        path="-",
        backend="python",
        batcher="sequence",
        backend_options={
            "class": Scaled,
            "inputs": inputs,
            "outputs": [_tensor("OUTPUT"), _tensor("STATE_OUT")],
        },
        sequence={
            "strategy": strategy,
            "max_batch_size": 4,
            "max_sequence_idle": 100.0,
            "control": {"start": "START", "ready": "READY", "corrid": "CORRID"},
            "state": [{"input": "STATE_IN", "output": "STATE_OUT"}],
        },
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_a_sequences_requests_may_send_or_leave_out_an_optional_input(
    autojump_clock: trio.testing.MockClock, strategy: str
) -> None:
    # As in Triton: a batch holds requests that send the same inputs (the oldest
    # request's set); one that sends another set waits for a later batch (under direct,
    # its slot is a padding row meanwhile).
    Scaled.batches = []
    got: dict[int, int] = {}

    async def send(sequence_id: int, v: int, scale: int | None, **flags: bool) -> None:
        inputs = value(v)
        if scale is not None:
            inputs["SCALE"] = np.array([[scale]], dtype=np.int32)
        out = await engine.infer("scaled", inputs, sequence=SequenceFlags(sequence_id, **flags))
        got[sequence_id] = int(out["OUTPUT"][0, 0])

    async def round_(sends: list[tuple[int, int, int | None, dict[str, bool]]]) -> None:
        async with trio.open_nursery() as nursery:
            for sequence_id, v, scale, flags in sends:  # admitted in this order
                nursery.start_soon(lambda a=(sequence_id, v, scale), f=flags: send(*a, **f))
                await trio.testing.wait_all_tasks_blocked()

    async with open_engine() as engine:
        await engine.load(_scaled_config(strategy))
        # Sequence 1's request runs while 2, 3 and 4 start: 3 sends SCALE, 2 and 4 don't.
        await round_(
            [
                (1, 1, None, {"start": True}),
                (2, 2, None, {"start": True}),
                (3, 3, 10, {"start": True}),
                (4, 4, None, {"start": True}),
            ]
        )
        assert got == {1: 1, 2: 2, 3: 30, 4: 4}
        # A sequence's requests may switch: now 2 and 4 send SCALE, 3 doesn't.
        await round_(
            [
                (1, 1, None, {"end": True}),
                (2, 1, 100, {"end": True}),
                (3, 1, None, {"end": True}),
                (4, 1, 100, {"end": True}),
            ]
        )
        assert got == {1: 2, 2: 102, 3: 31, 4: 104}
        assert_all_ended(engine, accepted=8)
    assert Scaled.batches == [
        ({"INPUT"}, [1]),
        ({"INPUT"}, [2, 4]),
        ({"INPUT", "SCALE"}, [3]),
        ({"INPUT"}, [1]),
        ({"INPUT", "SCALE"}, [2, 4]),
        ({"INPUT"}, [3]),
    ]


SCALED_PY = """
import numpy as np

class Model:
    def infer(self, inputs):
        scale = inputs.get("SCALE", np.ones_like(inputs["INPUT"]))
        carried = np.where(inputs["START"] != 0, 0, inputs["STATE_IN"])
        total = (carried + inputs["INPUT"] * scale).astype(np.int32)
        return {"OUTPUT": total, "STATE_OUT": total}
"""


async def test_a_sequence_sends_or_leaves_out_an_optional_input_over_http(
    tmp_path: Path,
) -> None:
    httpclient = pytest.importorskip("tritonclient.http")

    (tmp_path / "repo" / "scaled" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "scaled" / "1" / "model.py").write_text(SCALED_PY)
    (tmp_path / "repo" / "scaled" / "config.toml").write_text(
        CONFIG_TOML.replace(
            '    { name = "START"',
            '    { name = "SCALE", dtype = "INT32", shape = ["batch", 1], optional = true },\n'
            '    { name = "START"',
        )
    )
    sent = [(2, None), (3, 10), (1, None), (1, 100)]  # (INPUT, SCALE or left out)

    def client_calls(url: str) -> tuple[list[int], list[dict[str, Any]]]:
        client = httpclient.InferenceServerClient(url=url)
        results = []
        for count, (v, scale) in enumerate(sent, start=1):
            inputs = []
            for name, data in (("INPUT", v), ("SCALE", scale)):
                if data is not None:
                    inputs.append(httpclient.InferInput(name, [1, 1], "INT32"))
                    inputs[-1].set_data_from_numpy(np.full((1, 1), data, dtype=np.int32))
            result = client.infer(
                "scaled",
                inputs,
                sequence_id=5,
                sequence_start=count == 1,
                sequence_end=count == len(sent),
            )
            results.append(int(result.as_numpy("OUTPUT")[0][0]))
        config = client.get_model_config("scaled")
        client.close()
        return results, config["input"]

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "repo")
        address = listening.urls[0].removeprefix("http://")
        results, inputs = await trio.to_thread.run_sync(client_calls, address)
        nursery.cancel_scope.cancel()
    assert results == [2, 32, 33, 133]
    assert [(i["name"], i.get("optional", False)) for i in inputs] == [
        ("INPUT", False),
        ("SCALE", True),
    ]
