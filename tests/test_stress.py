"""Randomized stress of the ways a request runs: every request ends once and is counted once.

One engine serves plain models (Python ``def``/``async def`` infer, inline and
thread dispatch, ONNX Runtime inline and thread, batched and unbatched, some
that raise, some that suspend) and pipelines over copies of them (unbatched
chains, which take the inline fast paths, and one that batches its own
requests). Callers use ``infer``, ``infer_detailed`` and ``infer_stream``,
some cancelled before they call, at a random checkpoint or after a random
delay, some under tight deadlines; meanwhile models are unloaded and loaded
again, and the engine closes with requests in flight. The inline slice's
clock is random too, so that callers yield for it (and are cancelled there)
at random.

After each run: every caller got exactly one outcome, the engine's task
group exited, and each model's counters (summed over every runner that
served its name, an unloaded one's included) add up to what its callers saw.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import pytest
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trioinfer
import trioinfer._inline
from trioinfer import Instance, ModelConfig, open_engine
from trioinfer.testing import models

pytestmark = [pytest.mark.pipeline, pytest.mark.python_model, pytest.mark.streaming]

Arrays = dict[str, np.ndarray[Any, Any]]

#: An input value per behaviour: below FAILS a model that may fail raises; above
#: SUSPENDS an async model sleeps before it answers; beyond REFUSES (below -REFUSES
#: for one that refuses "low" values, above it for "high") a model that refuses
#: raises InvalidInput, as for one bad row among a batch's: the batched pipeline's
#: steps do, so that its members rerun alone (one refused by its first step, the
#: other by its second).
FAILS, SUSPENDS, REFUSES = -0.5, 0.5, 40.0
VALUES = (0.1, 0.9, -5.0, -50.0, 50.0)


class _Counts:
    calls: ClassVar[Counter[str]] = Counter()
    returned: ClassVar[Counter[str]] = Counter()

    @classmethod
    def clear(cls) -> None:
        cls.calls.clear()
        cls.returned.clear()


def _refuse(name: str, refuses: str, x: np.ndarray[Any, Any]) -> None:
    # InvalidInput when any row is beyond REFUSES on the side *refuses* names.
    if (refuses == "low" and (x < -REFUSES).any()) or (refuses == "high" and (x > REFUSES).any()):
        raise trioinfer.InvalidInput(f"{name} refuses {refuses} values")


class SyncWork:
    """y = x + 1; raises for inputs below FAILS when *fails*, refuses as *refuses* says."""

    def __init__(self, name: str, fails: bool = False, refuses: str = "") -> None:
        self.name, self.fails, self.refuses = name, fails, refuses

    def infer(self, inputs: Arrays) -> Arrays:
        _Counts.calls[self.name] += 1
        x = inputs["x"]
        _refuse(self.name, self.refuses, x)
        if self.fails and x[0, 0] < FAILS:
            raise RuntimeError(f"{self.name} refuses negative inputs")
        _Counts.returned[self.name] += 1
        return {"y": x + 1}


class AsyncWork:
    """SyncWork's answer; sleeps first (it suspends) for inputs above SUSPENDS."""

    def __init__(
        self, name: str, fails: bool = False, refuses: str = "", delay: float = 0.002
    ) -> None:
        self.name, self.fails, self.refuses, self.delay = name, fails, refuses, delay

    async def infer(self, inputs: Arrays) -> Arrays:
        _Counts.calls[self.name] += 1
        x = inputs["x"]
        if x[0, 0] > SUSPENDS:
            await anyio.sleep(self.delay)
        _refuse(self.name, self.refuses, x)
        if self.fails and x[0, 0] < FAILS:
            raise RuntimeError(f"{self.name} refuses negative inputs")
        _Counts.returned[self.name] += 1
        return {"y": x + 1}


class Join:
    """y = a + b."""

    def __init__(self, name: str, fails: bool = False) -> None:
        self.name = name

    def infer(self, inputs: Arrays) -> Arrays:
        _Counts.calls[self.name] += 1
        _Counts.returned[self.name] += 1
        return {"y": inputs["a"] + inputs["b"]}


def _tensor(name: str) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": ["batch", 4]}


def python_model(
    name: str, cls: type, *, dispatch: str = "inline", batched: bool = False, **kw: Any
) -> ModelConfig:
    parameters = {"name": name, "fails": kw.pop("fails", False)}
    if "refuses" in kw:
        parameters["refuses"] = kw.pop("refuses")
    options: dict[str, Any] = {
        "class": cls,
        "parameters": parameters,
        "inputs": [_tensor("a"), _tensor("b")] if cls is Join else [_tensor("x")],
        "outputs": [_tensor("y")],
    }
    if cls is not AsyncWork:
        options["dispatch"] = dispatch
    if batched:
        kw["batcher"] = "dynamic"
        kw["batcher_options"] = {"max_batch_size": 8, "max_queue_delay": 0.001}
    return ModelConfig(name=name, path="-", backend="python", backend_options=options, **kw)


def ort_model(name: str, path: Path, dispatch: str) -> ModelConfig:
    return ModelConfig(
        name=name, path=path, backend="onnxruntime", backend_options={"dispatch": dispatch}
    )


def _step(model: str, source: str, target: str) -> dict[str, Any]:
    return {"model": model, "input_map": {"x": source}, "output_map": {"y": target}}


def _ort_step(model: str, source: str, target: str) -> dict[str, Any]:
    return {"model": model, "input_map": {"a": source, "b": source}, "output_map": {"sum": target}}


def pipeline(name: str, steps: list[dict[str, Any]], **kw: Any) -> ModelConfig:
    options = {"inputs": [_tensor("IN")], "outputs": [_tensor("OUT")], "steps": steps}
    return ModelConfig(name=name, path="-", backend="pipeline", backend_options=options, **kw)


def configs(add: Path) -> list[ModelConfig]:
    """Every model, steps before their pipelines."""
    return [
        # Called directly.
        python_model("d_inline", SyncWork, fails=True),
        python_model("d_thread", SyncWork, dispatch="thread", fails=True, max_queue_size=3),
        python_model("d_async", AsyncWork, fails=True),
        python_model("d_batched", AsyncWork, batched=True, fails=True, max_queue_size=4),
        # Two instances; and one whose queue policy gives callers without a deadline one.
        python_model("d_two", AsyncWork, fails=True, instances=[Instance(count=2)]),
        python_model("d_timeouts", SyncWork, dispatch="thread", queue_timeouts={0: 0.001}),
        ort_model("d_ort_inline", add, "inline"),
        ort_model("d_ort_thread", add, "thread"),
        # Steps of the unbatched pipelines (each used by one pipeline, once).
        python_model("s_inline", SyncWork),
        ort_model("s_ort_inline", add, "inline"),
        python_model("s_raise", SyncWork, fails=True),
        python_model("s_async", AsyncWork, fails=True),
        python_model("s_batched", AsyncWork, batched=True),
        ort_model("s_ort_thread", add, "thread"),
        python_model("s_thread", SyncWork, dispatch="thread"),
        # Steps of the diamond: two side by side (tasks of their own), then a join.
        python_model("s_left", SyncWork, dispatch="thread"),
        python_model("s_right", AsyncWork, fails=True),
        python_model("s_join", Join),
        # Steps of the pipeline whose queue policy sets its callers' deadline.
        python_model("t_inline", SyncWork),
        python_model("t_async", AsyncWork),
        # Steps of the pipeline that batches.
        python_model("b_inline", SyncWork, fails=True, refuses="low"),
        python_model("b_async", AsyncWork, refuses="high"),
        # All inline: Pipeline.run_now runs it to its end in the caller's frame, or
        # returns a Resume at the step that raised.
        pipeline(
            "p_inline",
            [
                _step("s_inline", "IN", "A"),
                _ort_step("s_ort_inline", "A", "B"),
                _step("s_raise", "B", "OUT"),
            ],
        ),
        # Inline, then a step that may suspend, a batched one, thread ones.
        pipeline(
            "p_mixed",
            [
                _step("s_async", "IN", "A"),
                _step("s_batched", "A", "B"),
                _ort_step("s_ort_thread", "B", "C"),
                _step("s_thread", "C", "OUT"),
            ],
            max_queue_size=6,
        ),
        pipeline(
            "p_diamond",
            [
                _step("s_left", "IN", "A"),
                _step("s_right", "IN", "B"),
                {"model": "s_join", "input_map": {"a": "A", "b": "B"}, "output_map": {"y": "OUT"}},
            ],
        ),
        pipeline(
            "p_timeouts",
            [_step("t_inline", "IN", "A"), _step("t_async", "A", "OUT")],
            queue_timeouts={0: 0.001},
        ),
        pipeline(
            "p_batched",
            [_step("b_inline", "IN", "A"), _step("b_async", "A", "OUT")],
            batcher="dynamic",
            batcher_options={"max_batch_size": 4, "max_queue_delay": 0.001},
        ),
    ]


DIRECT = (
    "d_inline",
    "d_thread",
    "d_async",
    "d_batched",
    "d_two",
    "d_timeouts",
    "d_ort_inline",
    "d_ort_thread",
)
PIPELINES = {
    "p_inline": ("s_inline", "s_ort_inline", "s_raise"),
    "p_mixed": ("s_async", "s_batched", "s_ort_thread", "s_thread"),
    "p_diamond": ("s_left", "s_right", "s_join"),
    "p_timeouts": ("t_inline", "t_async"),
    "p_batched": ("b_inline", "b_async"),
}
CALLED = DIRECT + tuple(PIPELINES)
#: What each model answers a row of x's (the answer to every one of its rows).
ANSWERS: dict[str, Any] = {
    **{name: (lambda x: x + 1) for name in DIRECT if "ort" not in name},
    "d_ort_inline": lambda x: x + x,
    "d_ort_thread": lambda x: x + x,
    "p_inline": lambda x: 2 * (x + 1) + 1,
    "p_mixed": lambda x: 2 * (x + 2) + 1,
    "p_diamond": lambda x: 2 * (x + 1),
    "p_timeouts": lambda x: x + 2,
    "p_batched": lambda x: x + 2,
}
#: Unbatched models: one execution per request.
UNBATCHED = set(DIRECT) - {"d_batched"}


@attrs.frozen
class Caller:
    model: str
    method: str  # infer, infer_detailed, infer_stream
    value: float
    rows: int
    start: float  # seconds after the models are loaded
    cancel: str  # none, before, checkpoints, after, deadline
    amount: float  # checkpoints before the cancel, or seconds


@attrs.frozen
class Plan:
    callers: list[Caller]
    #: (when, model, how long it stays unloaded, or replaced in place when negative)
    reloads: list[tuple[float, str, float]]
    close_after: float
    drain_period: float
    slice_seed: int


def _plans(max_callers: int) -> st.SearchStrategy[Plan]:
    time = st.sampled_from([0.0, 0.0, 0.0005, 0.001, 0.002, 0.005])
    caller = st.builds(
        Caller,
        model=st.sampled_from(CALLED),
        method=st.sampled_from(["infer", "infer", "infer_detailed", "infer_stream"]),
        value=st.sampled_from(VALUES),
        rows=st.integers(1, 3),
        start=time,
        cancel=st.sampled_from(["none", "none", "before", "checkpoints", "after", "deadline"]),
        amount=st.sampled_from([0, 1, 2, 3, 5, 0.0005, 0.001, 0.003]),
    )
    steps = tuple(model for used in PIPELINES.values() for model in used)
    reload = st.tuples(time, st.sampled_from(CALLED + steps), time | st.just(-1.0))
    return st.builds(
        Plan,
        callers=st.lists(caller, min_size=1, max_size=max_callers),
        reloads=st.lists(reload, max_size=2),
        close_after=st.sampled_from([0.0, 0.001, 0.003, 0.01, 1.0]),
        drain_period=st.sampled_from([0.0, 0.002, 10.0]),
        slice_seed=st.integers(0, 2**32 - 1),
    )


def _inputs(model: str, value: float, rows: int) -> Arrays:
    x = np.full((rows, 4), value, np.float32)
    if model.startswith("p_"):
        return {"IN": x}
    if "ort" in model:
        return {"a": x, "b": x}
    return {"x": x}


def _random_slice(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The inline slice's wall clock leaps at random: the slice is spent at random."""
    rng = random.Random(seed)
    now = [0.0]

    def wall() -> float:
        now[0] += rng.choice((0.0, 0.0, 1e-5, 1e-4, 1e-3))
        return now[0]

    monkeypatch.setattr(trioinfer._inline, "_wall", wall)
    monkeypatch.setattr(trioinfer._inline._slice, "start", 0.0)


async def _call(engine: trioinfer.Engine, c: Caller) -> Any:
    inputs = _inputs(c.model, c.value, c.rows)
    if c.method == "infer":
        return await engine.infer(c.model, inputs)
    if c.method == "infer_detailed":
        return (await engine.infer_detailed(c.model, inputs)).outputs
    answers = []
    async with engine.infer_stream(c.model, inputs) as responses:
        async for outputs in responses:
            answers.append(outputs)
    assert len(answers) == 1, f"{c}: {len(answers)} responses from a model that is not decoupled"
    return answers[0]


async def _cancel_after(scope: anyio.CancelScope, checkpoints: int) -> None:
    for _ in range(checkpoints):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


async def run_plan(plan: Plan, add: Path, watchdog: bool = False) -> None:
    _Counts.clear()
    outcomes: list[list[str]] = [[] for _ in plan.callers]
    runners: dict[str, list[Any]] = {}
    every = {config.name: config for config in configs(add)}

    def keep(engine: trioinfer.Engine) -> None:
        # Every runner that ever served a name: an unloaded one's counts still count.
        for name, runner in engine._runners.items():
            if not any(r is runner for r in runners.setdefault(name, [])):
                runners[name].append(runner)

    async def caller(engine: trioinfer.Engine, tg: anyio.abc.TaskGroup, i: int, c: Caller) -> None:
        await anyio.sleep(c.start)
        outcome = "cancelled"
        with anyio.CancelScope() as scope:
            if c.cancel == "before":
                scope.cancel()
            elif c.cancel == "checkpoints":
                tg.start_soon(_cancel_after, scope, int(c.amount))
            elif c.cancel == "after":
                scope.deadline = anyio.current_time() + c.amount
            elif c.cancel == "deadline":
                # Tight: the caller's scope and the engine's expiry race.
                scope.deadline = anyio.current_time() + min(c.amount, 0.001)
            try:
                outputs = await _call(engine, c)
            except trioinfer.TrioInferError as exc:
                outcome = type(exc).__name__
            else:
                outcome = "ok"
                name = "OUT" if c.model.startswith("p_") else ("sum" if "ort" in c.model else "y")
                assert outputs[name].shape == (c.rows, 4), (c, outputs)
                # Its own rows' answer: not another member's, nor a rerun's of another.
                expected = np.full((c.rows, 4), ANSWERS[c.model](np.float32(c.value)))
                np.testing.assert_array_equal(outputs[name], expected, err_msg=str(c))
            if outcome == "InvalidInput":
                # Only a batched pipeline's member with a row its steps refuse.
                assert c.model == "p_batched", c
                assert abs(c.value) > REFUSES, c
            if c.model == "p_batched" and abs(c.value) > REFUSES:
                assert outcome != "ok", c  # the steps refuse it, however it was batched
        outcomes[i].append(outcome)

    async def reloads(engine: trioinfer.Engine) -> None:
        for when, name, gone in sorted(plan.reloads):
            await anyio.sleep(when)
            try:
                if gone < 0:
                    if name in engine._runners:
                        # A new runner serves the name; the old one drains what it holds.
                        await engine.load(every[name], replace=True)
                        keep(engine)
                    continue
                if name in engine._runners:
                    await engine.unload(name)
                await anyio.sleep(gone)
                for config in every.values():  # (steps before their pipelines)
                    if config.name not in engine._runners:
                        await engine.load(config)
                        keep(engine)
            except trioinfer.EngineClosed:
                return

    # (No watchdog on Trio: the mock clock leaps to any deadline while a thread works.)
    with anyio.fail_after(60) if watchdog else contextlib.nullcontext():
        async with anyio.create_task_group() as outside:
            async with open_engine(drain_period=plan.drain_period) as engine:
                for config in every.values():
                    await engine.load(config)
                keep(engine)
                for i, c in enumerate(plan.callers):
                    outside.start_soon(caller, engine, outside, i, c)
                outside.start_soon(reloads, engine)
                await anyio.sleep(plan.close_after)
            # The engine's task group has exited: nothing of it is left.
            assert engine.closing
    assert all(len(o) == 1 for o in outcomes), outcomes
    check_accounts(plan, [o[0] for o in outcomes], runners)


def _sum(runners: list[Any], field: str) -> int:
    return sum(getattr(r.statistics(), field) for r in runners)


def check_accounts(plan: Plan, outcomes: list[str], runners: dict[str, list[Any]]) -> None:
    """Each model's counters against what its callers saw.

    A caller that got outputs, an error of the model or a refusal was counted
    so; one cancelled after it called was counted once, as cancelled, or as
    what the engine saw first (an answer or expiry in the same instant); one
    whose stream was cancelled may not have reached the model (its task had
    not run yet); one that found the engine closed, once or never; one that
    found no model, never.
    """
    seen: dict[str, Counter[str]] = {name: Counter() for name in CALLED}
    rows: Counter[str] = Counter()
    for c, outcome in zip(plan.callers, outcomes, strict=True):
        if c.cancel == "before":
            # Cancelled before it called: never entered (or found no model).
            assert outcome in ("cancelled", "ModelNotFound", "EngineClosed"), (c, outcome)
            seen[c.model]["before"] += 1
            continue
        if outcome == "cancelled" and (
            c.method == "infer_stream" or (c.cancel in ("after", "deadline") and not c.amount)
        ):
            # A stream's task may not have called yet; on asyncio a scope whose
            # deadline is now is cancelled at once, as one cancelled before the call.
            outcome = "maybe cancelled"
        seen[c.model][outcome] += 1
        rows[c.model, outcome] += c.rows
    for name, stats_of in runners.items():
        for runner in stats_of:
            stats = runner.statistics()
            assert (stats.in_flight, stats.queued) == (0, 0), (name, stats)
            assert stats.successful_executions <= stats.executions, (name, stats)
    report = {name: _counts(runners.get(name, [])) for name in runners}
    for name, counts in report.items():
        if runners[name][0].config.backend == "python":
            # What the model's own code saw: each call was an execution counted, and
            # each execution counted successful had returned.
            where = f"{name}: counters {dict(counts)}, model {_Counts.calls[name]} calls"
            assert _Counts.calls[name] <= counts["executions"], where
            assert _Counts.returned[name] >= counts["successful_executions"], where
    for name in CALLED:
        counts, callers = report.get(name, Counter()), seen[name]
        where = f"{name}: counters {dict(counts)}, callers {dict(callers)}"
        certain = callers["ok"] + callers["QueueFull"] + callers["BackendError"]
        certain += callers["DeadlineExceeded"] + callers["InvalidInput"]
        late = callers["cancelled"] + callers["maybe cancelled"]
        assert counts["refused"] == callers["QueueFull"], where
        assert counts["expired"] >= callers["DeadlineExceeded"], where
        assert counts["failed"] >= callers["BackendError"] + callers["InvalidInput"], where
        assert callers["ok"] <= counts["succeeded"] <= callers["ok"] + late, where
        assert rows[name, "ok"] <= counts["inferences"], where
        assert (
            counts["inferences"]
            <= rows[name, "ok"] + rows[name, "cancelled"] + rows[name, "maybe cancelled"]
        ), where
        low = certain + callers["cancelled"]
        high = low + callers["maybe cancelled"] + callers["EngineClosed"]
        if name in PIPELINES:
            # A pipeline's request whose step found no model fails with ModelNotFound.
            high += callers["ModelNotFound"]
        assert low <= counts["ended"] <= high, where
        if name in UNBATCHED:
            assert counts["successful_executions"] == counts["succeeded"], where
    for name, steps in PIPELINES.items():
        pipeline = report.get(name, Counter())
        for step in steps:
            counts = report.get(step, Counter())
            where = f"step {step} of {name}: {dict(counts)}; pipeline {dict(pipeline)}"
            if name != "p_batched":
                # Each pipeline request runs each of its steps at most once.
                assert pipeline["succeeded"] <= counts["succeeded"], where
                assert counts["ended"] <= pipeline["ended"], where
                assert counts["inferences"] >= pipeline["inferences"], where
            if step not in ("s_batched", "b_inline", "b_async"):
                assert counts["successful_executions"] == counts["succeeded"], where


def _counts(runners: list[Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for runner in runners:
        stats = runner.statistics()
        for field in (
            "succeeded",
            "failed",
            "cancelled",
            "expired",
            "refused",
            "inferences",
            "executions",
            "successful_executions",
        ):
            counts[field] += getattr(stats, field)
    counts["ended"] = sum(
        counts[f] for f in ("succeeded", "failed", "cancelled", "expired", "refused")
    )
    return counts


#: Runs per test: a few seconds by default; set TRIOINFER_STRESS_EXAMPLES for a longer search.
EXAMPLES = int(os.environ.get("TRIOINFER_STRESS_EXAMPLES", "12"))


@pytest.fixture(scope="module")
def add(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_add(tmp_path_factory.mktemp("stress") / "add.onnx")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=_plans(max_callers=14))
def test_every_request_ends_once_and_is_counted_once_on_trio(
    plan: Plan, add: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _random_slice(monkeypatch, plan.slice_seed)
    clock = trio.testing.MockClock(autojump_threshold=0)
    anyio.run(run_plan, plan, add, backend="trio", backend_options={"clock": clock})


@settings(
    max_examples=max(EXAMPLES // 3, 1),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=_plans(max_callers=10))
def test_every_request_ends_once_and_is_counted_once_on_trio_in_real_time(
    plan: Plan, add: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Threads' answers and deadlines interleave as they come, not as the mock clock leaps.
    _random_slice(monkeypatch, plan.slice_seed)
    anyio.run(run_plan, plan, add, True, backend="trio")


@settings(
    max_examples=max(EXAMPLES // 3, 1),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=_plans(max_callers=10))
def test_every_request_ends_once_and_is_counted_once_on_asyncio(
    plan: Plan, add: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _random_slice(monkeypatch, plan.slice_seed)
    anyio.run(run_plan, plan, add, True, backend="asyncio")


class _LeavesAsItEnds:
    """Cancels its caller as it ends, then returns after a shielded checkpoint.

    What an instance waiting on a thread does (trioinfer._threads): the thread has
    answered, and the instance resumes one scheduling pass later, shielded, while
    its caller leaves meanwhile.
    """

    scope: ClassVar[anyio.CancelScope | None] = None

    async def infer(self, inputs: Arrays) -> Arrays:
        assert self.scope is not None
        self.scope.cancel()
        with anyio.CancelScope(shield=True):
            for _ in range(3):  # (the caller's task runs meanwhile, in any order)
                await anyio.lowlevel.checkpoint()
        return {"y": inputs["x"]}


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_an_execution_whose_caller_left_as_it_ended_is_not_a_successful_one(backend: str) -> None:
    # Its outputs went to nobody: successful_executions (Triton's execution_count,
    # trioinfer_inference_executions_succeeded) must not count it, as it does not
    # count one aborted because its callers left.
    async def main() -> None:
        config = ModelConfig(
            name="m",
            path="-",
            backend="python",
            backend_options={
                "class": _LeavesAsItEnds,
                "inputs": [_tensor("x")],
                "outputs": [_tensor("y")],
            },
            batcher="dynamic",
            batcher_options={"max_batch_size": 4, "max_queue_delay": 0.0},
        )
        async with open_engine() as engine:
            await engine.load(config)
            for call in (engine.infer, engine.infer_detailed):
                with anyio.CancelScope() as scope:
                    _LeavesAsItEnds.scope = scope
                    await call("m", {"x": np.ones((1, 4), np.float32)})
                assert scope.cancelled_caught
            stats = engine.statistics().models["m"]
            assert (stats.succeeded, stats.cancelled) == (0, 2)
            assert (stats.executions, stats.successful_executions) == (2, 0)

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_caller_cancelled_before_it_calls_is_counted_by_no_way(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It never entered: infer raises its cancellation counting nothing; so must
    # infer_detailed, also when the loop's inline slice is spent (it yielded for the
    # slice first, and counted the caller cancelled there).
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: 1e9)  # the slice always spent

    async def main() -> None:
        async with open_engine() as engine:
            await engine.load(python_model("m", SyncWork))
            for call in (engine.infer, engine.infer_detailed):
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await call("m", {"x": np.ones((1, 4), np.float32)})
                assert scope.cancelled_caught
            stats = engine.statistics().models["m"]
            assert (stats.succeeded, stats.cancelled, stats.executions) == (0, 0, 0)

    anyio.run(main, backend=backend)
