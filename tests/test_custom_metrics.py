"""A Python model's own metrics: declared through its ``metrics`` keyword, kept by the engine."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from _serve import start_serving
from trioinfer import (
    BackendError,
    ConfigError,
    CustomMetricFamily,
    Instance,
    InvalidMetric,
    ModelConfig,
    ModelMetrics,
    open_engine,
)
from trioinfer._custom_metrics import CustomMetrics
from trioinfer.lowlevel import current_model_metrics

pytestmark = pytest.mark.python_model

XY = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 1]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 1]}],
}


def config(cls: Any, name: str = "m", instances: int = 1, **options: Any) -> ModelConfig:
    return ModelConfig(
        name=name,
        backend="python",
        backend_options={"class": cls, **XY, **options},
        instances=[Instance("cpu", count=instances)],
    )


class Counting:
    """Counts rows by kind, times them, and holds the last batch's size (a plain def infer)."""

    def __init__(self, metrics: ModelMetrics) -> None:
        rows = metrics.counter("rows", "Rows seen.", labels=["kind"])
        self.rows = rows.metric(kind="in")
        self.last = metrics.gauge("last_batch", "Rows in the last batch.").metric()
        self.sizes = metrics.histogram("batch_size", "Rows per batch.", buckets=[1, 4, 16]).metric()

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        n = len(inputs["x"])
        self.rows.increment(n)
        self.last.set(n)
        self.sizes.observe(n)
        return {"y": inputs["x"]}


class AsyncCounting(Counting):
    """The same, from an ``async def infer`` on the event loop."""

    async def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:  # type: ignore[override]
        await anyio.lowlevel.checkpoint()
        return super().infer(inputs)


def family(engine: Any, name: str) -> CustomMetricFamily:
    (found,) = [f for f in engine.custom_metrics() if f.name == name]
    return found


def rows(n: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.ones((n, 1), np.float32)}


@pytest.mark.parametrize("cls", [Counting, AsyncCounting])
async def test_a_model_counts_into_the_engines_families_from_a_thread_or_the_loop(
    cls: type,
) -> None:
    async with open_engine() as engine:
        # Four instances on four threads (or the loop) update the same series at once.
        await engine.load(config(cls, instances=4))
        async with anyio.create_task_group() as tg:
            for _ in range(200):
                tg.start_soon(engine.infer, "m", rows(3))
        counted = family(engine, "rows")
        assert (counted.kind, counted.labels, counted.description) == (
            "counter",
            ("kind",),
            "Rows seen.",
        )
        assert [(s.model, dict(s.labels), s.value) for s in counted.samples] == [
            ("m", {"kind": "in"}, 600.0)
        ]
        assert [s.value for s in family(engine, "last_batch").samples] == [3.0]
        (sizes,) = family(engine, "batch_size").samples
        assert family(engine, "batch_size").buckets == (1.0, 4.0, 16.0)
        assert (sizes.bucket_counts, sizes.count, sizes.value) == ((0, 200, 0, 0), 200, 600.0)


async def test_two_models_share_a_family_declared_alike_with_a_series_each() -> None:
    async with open_engine() as engine:
        await engine.load(config(Counting, name="a"))
        await engine.load(config(AsyncCounting, name="b"))
        await engine.infer("a", rows(1))
        await engine.infer("b", rows(2))
        assert [(s.model, s.value) for s in family(engine, "rows").samples] == [
            ("a", 1.0),
            ("b", 2.0),
        ]


def declaring(*declarations: tuple[str, tuple[Any, ...], dict[str, Any]]) -> type:
    class Declares:
        def __init__(self, metrics: ModelMetrics) -> None:
            for kind, args, kwargs in declarations:
                getattr(metrics, kind)(*args, **kwargs)

        def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            return {"y": inputs["x"]}

    return Declares


BAD_DECLARATIONS = {
    "not a name": (("counter", ("2fast", "d"), {}), "must be a Prometheus metric name"),
    "dash": (("gauge", ("queue-depth", "d"), {}), "must be a Prometheus metric name"),
    "ours": (("counter", ("trioinfer_inference_requests", "d"), {}), "trioinfer's own"),
    "label": (("counter", ("c", "d"), {"labels": ["a-b"]}), "not a Prometheus label name"),
    "reserved label": (("gauge", ("g", "d"), {"labels": ["model"]}), "'model' is reserved"),
    "le": (("histogram", ("h", "d"), {"buckets": [1], "labels": ["le"]}), "'le' is reserved"),
    "twice": (("counter", ("c", "d"), {"labels": ["a", "a"]}), "name one label twice"),
    "labels as a str": (("counter", ("c", "d"), {"labels": "kind"}), "sequence of label names"),
    "no buckets": (("histogram", ("h", "d"), {"buckets": []}), "at least one"),
    "unsorted": (("histogram", ("h", "d"), {"buckets": [2, 1]}), "increasing order"),
    "inf": (("histogram", ("h", "d"), {"buckets": [1, math.inf]}), "finite numbers"),
    "workers": (
        ("gauge", ("g", "d"), {"workers": "livesum"}),
        "workers must be one of 'sum', 'max', 'min', 'mostrecent', 'all', got 'livesum'",
    ),
}


@pytest.mark.parametrize("case", BAD_DECLARATIONS)
async def test_a_bad_declaration_fails_the_load_with_an_invalid_metric(case: str) -> None:
    declaration, said = BAD_DECLARATIONS[case]
    async with open_engine() as engine:
        with pytest.raises(BackendError) as caught:
            await engine.load(config(declaring(declaration)))
        assert isinstance(caught.value.__cause__, InvalidMetric)
        assert said in str(caught.value.__cause__)
        assert engine.custom_metrics() == ()  # nothing left behind by the failed load


async def test_a_family_declared_otherwise_by_another_model_is_refused() -> None:
    async with open_engine() as engine:
        await engine.load(config(Counting, name="a"))
        with pytest.raises(BackendError) as caught:
            await engine.load(config(declaring(("gauge", ("rows", "d"), {})), name="b"))
        assert (
            "declares 'rows' as a gauge with no labels, but it is declared already as a "
            "counter with labels ['kind'] (by 'a')" in str(caught.value.__cause__)
        )
        await engine.load(config(declaring(("gauge", ("g", "d"), {"workers": "max"})), name="a2"))
        with pytest.raises(BackendError) as caught:
            await engine.load(config(declaring(("gauge", ("g", "d"), {})), name="b"))
        assert (
            "declares 'g' as a gauge with no labels, but it is declared already as a gauge "
            "with no labels, workers='max' (by 'a2')" in str(caught.value.__cause__)
        )
        # Samples of two families must not clash in the text either.
        for clash in [("gauge", ("rows_total", "d"), {}), ("counter", ("batch_size_sum", "d"), {})]:
            with pytest.raises(BackendError, match="would clash in the Prometheus text"):
                await engine.load(config(declaring(clash), name="b"))
        # Once no model declares it, the name is free again.
        await engine.unload("a")
        await engine.load(config(declaring(("gauge", ("rows", "d"), {})), name="b"))
        assert family(engine, "rows").kind == "gauge"


class Misuses:
    def __init__(self, metrics: ModelMetrics) -> None:
        self.family = metrics.counter("c_total", "d", labels=["kind"])

    def infer(self, inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        if inputs["x"][0, 0] < 0:
            self.family.metric(kind="a").increment(-1)
        else:
            self.family.metric(sort="a")
        return {"y": inputs["x"]}


async def test_a_bad_update_fails_the_execution_as_the_models_bug() -> None:
    async with open_engine() as engine:
        await engine.load(config(Misuses))
        assert family(engine, "c").name == "c"  # _total is the exposition's
        # Named as the model's bug, with the line, a 500 over HTTP (not the client's 400).
        with pytest.raises(
            BackendError,
            match=r"infer raised InvalidMetric: custom counter 'c' declares labels \['kind'\], "
            r"got \['sort'\]: give each declared label a value, and no other "
            r"\(test_custom_metrics.py, line \d+, in infer\)",
        ):
            await engine.infer("m", rows(1))
        with pytest.raises(BackendError, match=r"only goes up, got an increment of -1\.0"):
            await engine.infer("m", {"x": -np.ones((1, 1), np.float32)})


async def test_an_unload_or_a_new_load_drops_the_models_series() -> None:
    async with open_engine() as engine:
        await engine.load(config(Counting))
        await engine.infer("m", rows(5))
        assert [s.value for s in family(engine, "rows").samples] == [5.0]
        await engine.load(config(Counting), replace=True)  # starts again from zero
        assert [s.value for s in family(engine, "rows").samples] == [0.0]
        await engine.infer("m", rows(2))
        assert [s.value for s in family(engine, "rows").samples] == [2.0]
        await engine.unload("m")
        assert engine.custom_metrics() == ()


async def test_the_backend_passes_metrics_itself() -> None:
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match="sets 'metrics', which the backend passes itself"):
            await engine.load(config(Counting, parameters={"metrics": 1}))
    with pytest.raises(TypeError, match="no public constructor"):
        ModelMetrics()
    with pytest.raises(RuntimeError, match="only known in a backend's load"):
        current_model_metrics()


MODEL_PY = """\
class Model:
    def __init__(self, metrics):
        self.rows = metrics.counter("app_rows", "Rows seen.", labels=["kind"]).metric(kind="in")
        self.last = metrics.gauge("app_last_batch", "Rows in the last batch.").metric()
        self.sizes = metrics.histogram(
            "app_batch_size", "Rows per batch.", buckets=[1, 4]
        ).metric()

    def infer(self, inputs):
        n = len(inputs["x"])
        self.rows.increment(n)
        self.last.set(n)
        self.sizes.observe(n)
        return {"y": inputs["x"]}
"""

CONFIG_TOML = """\
backend = "python"
batcher = "none"
[backend_options]
inputs = [{ name = "x", dtype = "FP32", shape = ["batch", 1] }]
outputs = [{ name = "y", dtype = "FP32", shape = ["batch", 1] }]
"""


def repository(root: Path) -> Path:
    for version in ("1", "2"):
        (root / "counted" / version).mkdir(parents=True)
        (root / "counted" / version / "model.py").write_text(MODEL_PY)
    (root / "counted" / "config.toml").write_text('version_policy = "all"\n' + CONFIG_TOML)
    return root


def body(n: int) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": [n, 1], "datatype": "FP32", "data": [1.0] * n}]}


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("app_")
    }


async def test_serve_shows_the_models_families_on_metrics_by_model_and_version(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            listening = await start_serving(nursery, repository(tmp_path / "repo"))
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                for version, n in (("1", 3), ("2", 2), ("2", 2)):
                    answer = await client.post(
                        f"/v2/models/counted/versions/{version}/infer", json=body(n)
                    )
                    assert answer.status_code == 200, answer.text
                text = (await client.get("/metrics")).text
                unload = await client.post("/v2/repository/models/counted/unload")
                assert unload.status_code == 200
                after = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    assert "# TYPE app_rows_total counter" in text
    assert "# HELP app_batch_size Rows per batch." in text
    v1, v2 = (("model", "counted"), ("version", "1")), (("model", "counted"), ("version", "2"))
    assert scraped(text) == {
        ("app_rows_total", (("kind", "in"), *v1)): 3.0,
        ("app_rows_total", (("kind", "in"), *v2)): 4.0,
        ("app_last_batch", v1): 3.0,
        ("app_last_batch", v2): 2.0,
        **{
            ("app_batch_size_bucket", (("le", le), *v1)): n
            for le, n in [("1.0", 0), ("4.0", 1), ("+Inf", 1)]
        },
        ("app_batch_size_count", v1): 1.0,
        ("app_batch_size_sum", v1): 3.0,
        **{
            ("app_batch_size_bucket", (("le", le), *v2)): n
            for le, n in [("1.0", 0), ("4.0", 2), ("+Inf", 2)]
        },
        ("app_batch_size_count", v2): 2.0,
        ("app_batch_size_sum", v2): 4.0,
    }
    # Unloaded, its series and families go, as Triton's do with the model.
    assert scraped(after) == {}
    assert "app_rows" not in after


@pytest.mark.workers
def test_under_workers_the_figures_of_every_worker_add_up(tmp_path: Path) -> None:
    from test_workers import fresh, samples, two_workers

    root = repository(tmp_path / "repo")
    with two_workers(root, tmp_path / "serve.log") as served:
        for _ in range(30):
            answer = fresh("POST", f"{served.url}/v2/models/counted/versions/1/infer", json=body(2))
            assert answer.status_code == 200, answer.text
        per_worker = samples(served.url, "trioinfer_worker_inference_requests_total")
        assert sorted(v > 0 for _, v in per_worker) == [True, True]  # both served some
        v1 = {"model": "counted", "version": "1"}

        def of_v1(name: str) -> list[tuple[dict[str, str], float]]:
            return [
                (labels, v) for labels, v in samples(served.url, name) if labels["version"] == "1"
            ]

        assert of_v1("app_rows_total") == [({**v1, "kind": "in"}, 60.0)]
        assert of_v1("app_batch_size_count") == [(v1, 30.0)]
        # Gauges are summed by default: each worker's last batch had 2 rows.
        assert of_v1("app_last_batch") == [(v1, 4.0)]
        served.process.terminate()
        served.process.wait(timeout=60)


GAUGES_PY = """\
class Model:
    def __init__(self, metrics):
        self.last = {
            workers: metrics.gauge(
                f"app_last_{workers}", "Rows in the last batch.", workers=workers
            ).metric()
            for workers in ("sum", "max", "min", "mostrecent", "all")
        }

    def infer(self, inputs):
        for gauge in self.last.values():
            gauge.set(len(inputs["x"]))
        return {"y": inputs["x"]}
"""


@pytest.mark.workers
def test_under_workers_a_gauge_combines_as_declared(tmp_path: Path) -> None:
    from test_workers import fresh, samples, two_workers

    root = tmp_path / "repo"
    (root / "gauged" / "1").mkdir(parents=True)
    (root / "gauged" / "1" / "model.py").write_text(GAUGES_PY)
    (root / "gauged" / "config.toml").write_text(CONFIG_TOML)
    with two_workers(root, tmp_path / "serve.log") as served:
        for n in [2] * 30 + [5]:  # the last batch, of 5 rows, on one worker
            answer = fresh("POST", f"{served.url}/v2/models/gauged/infer", json=body(n))
            assert answer.status_code == 200, answer.text
        per_worker = samples(served.url, "trioinfer_worker_inference_requests_total")
        assert sorted(v > 0 for _, v in per_worker) == [True, True]  # both served some
        one = {"model": "gauged", "version": "1"}
        # One worker's last batch had 5 rows, the other's 2.
        assert samples(served.url, "app_last_sum") == [(one, 7.0)]
        assert samples(served.url, "app_last_max") == [(one, 5.0)]
        assert samples(served.url, "app_last_min") == [(one, 2.0)]
        assert samples(served.url, "app_last_mostrecent") == [(one, 5.0)]
        pids = {str(pid) for pid in served.pids}
        each = samples(served.url, "app_last_all")
        assert sorted(v for _, v in each) == [2.0, 5.0]
        assert {labels.pop("pid") for labels, _ in each} == pids
        assert [labels for labels, _ in each] == [one, one]
        served.process.terminate()
        served.process.wait(timeout=60)


kept: dict[str, Any] = {}


class KeepsItsMetrics(Counting):
    """Keeps its metrics where a thread of the model's outlives its unload."""

    def __init__(self, metrics: ModelMetrics) -> None:
        super().__init__(metrics)
        kept["metrics"] = metrics
        kept["rows"] = metrics.counter("rows", "Rows seen.", labels=["kind"])


async def test_updates_and_declarations_after_the_unload_count_into_nothing() -> None:
    async with open_engine() as engine:
        await engine.load(config(Counting, name="other"))  # holds the families on
        await engine.load(config(KeepsItsMetrics))
        await engine.unload("m")
        # A thread of the unloaded model still updating and declaring: no error, and
        # nothing kept by the engine (a series or a family that no drop would ever end).
        kept["rows"].metric(kind="late").increment()
        kept["metrics"].gauge("late_gauge", "Declared after the unload.").metric().set(1)
        assert [f.name for f in engine.custom_metrics()] == ["batch_size", "last_batch", "rows"]
        assert [s.model for s in family(engine, "rows").samples] == ["other"]
        # The engine's registry holds the other model's one series, no more.
        assert len(engine._custom._families["rows"].series) == 1


def test_label_values_of_any_text_and_histograms_read_back_from_the_exposition() -> None:
    # Quotes, backslashes, newlines and unicode in label values and descriptions, as
    # Prometheus's parser reads them, from one server and summed over two workers.
    from trioinfer.server._metrics import exposition_of
    from trioinfer.server._workers import merge_expositions

    odd = ['a"b', "back\\slash", "new\nline", "ünï€😀", "", "\\n", 'x\\"y']

    def samples(value: float, counts: list[int], count: int) -> list[Any]:
        return [["m", "1", [v], value, counts, count, 0.0] for v in odd]

    custom = [
        ["c", 'Help: \\ "q"\nnext line', "counter", ["k"], [], samples(2.0, [], 0), "sum"],
        ["g", "A gauge.", "gauge", ["k"], [], samples(1.5, [], 0), "sum"],
        [
            "h",
            "A histogram.",
            "histogram",
            ["k"],
            [1e-05, 0.5, 1e20],
            samples(3.5, [1, 2, 0, 1], 4),
            "sum",
        ],
    ]
    no_requests = {"outcomes": [], "in_flight": 0, "in_flight_protocols": {}, "versions": []}
    text = exposition_of({**no_requests, "custom": custom})  # type: ignore[typeddict-item]
    for exposition, times in ((text, 1), (merge_expositions([text, text]), 2)):
        families = {f.name: f for f in text_string_to_metric_families(exposition.decode())}
        assert families["c"].documentation == 'Help: \\ "q"\nnext line'
        for name in "cgh":
            assert {s.labels["k"] for s in families[name].samples} == set(odd), name
        assert {s.value for s in families["c"].samples} == {2.0 * times}
        assert {s.value for s in families["g"].samples} == {1.5 * times}
        buckets = [
            (s.labels["le"], s.value)
            for s in families["h"].samples
            if s.labels["k"] == 'a"b' and "le" in s.labels
        ]
        assert buckets == [
            (b, n * times) for b, n in (("1e-05", 1), ("0.5", 3), ("1e+20", 3), ("+Inf", 4))
        ]
        [total] = [
            s.value for s in families["h"].samples if s.name == "h_sum" and s.labels["k"] == ""
        ]
        assert total == 3.5 * times


def test_an_update_that_is_not_a_finite_number_is_refused_and_changes_nothing() -> None:
    # +inf in a counter stays there for good (and rate() of it is NaN from then on);
    # NaN in any series, or inf in a gauge or a histogram's sum, makes every figure
    # computed from it NaN: each is the model's bug, refused where it happens.
    registry = CustomMetrics()
    owner = registry.begin("m")
    registry.install(owner)
    metrics = ModelMetrics._create(registry, owner)
    counter = metrics.counter("c", "d").metric()
    gauge = metrics.gauge("g", "d").metric()
    histogram = metrics.histogram("h", "d", buckets=[1]).metric()
    updates = [
        ("counter", "increment", counter.increment),
        ("gauge", "set", gauge.set),
        ("gauge", "increment", gauge.increment),
        ("gauge", "decrement", gauge.decrement),
        ("histogram", "observe", histogram.observe),
    ]
    for kind, what, update in updates:
        for bad in (math.inf, -math.inf, math.nan, 10**400, "1", True):
            with pytest.raises(InvalidMetric) as caught:
                update(bad)
            assert str(caught.value) == (
                f"custom {kind} {kind[0]!r}: {what} takes a finite number, got {bad!r}"
            )
    assert (counter.value(), gauge.value(), histogram.value(), histogram.count()) == (0, 0, 0, 0)
    counter.increment(0)  # zero and -0.0 are no step back
    counter.increment(-0.0)
    gauge.set(-1e300)
    assert (counter.value(), gauge.value()) == (0, -1e300)


class DeclaresThenFails:
    def __init__(self, metrics: ModelMetrics) -> None:
        metrics.gauge("g", "d", labels=["k"])
        raise RuntimeError("the weights are not there")


async def test_a_reload_may_change_its_models_declaration() -> None:
    # The model's file edited (a label added, a gauge made a counter) and reloaded: the
    # load that serves still holds the family as it was declared, until the new one
    # replaces it, and was the only one declaring it.
    old = declaring(("gauge", ("g", "d"), {}))
    async with open_engine() as engine:
        await engine.load(config(old))
        with pytest.raises(BackendError, match="the weights are not there"):
            await engine.load(config(DeclaresThenFails), replace=True)  # the old one stays
        [kept] = engine.custom_metrics()
        assert (kept.kind, kept.labels) == ("gauge", ())
        await engine.load(config(declaring(("gauge", ("g", "d"), {"labels": ["k"]}))), replace=True)
        [changed] = engine.custom_metrics()
        assert (changed.kind, changed.labels) == ("gauge", ("k",))
        await engine.load(config(declaring(("counter", ("g", "d"), {}))), replace=True)
        assert [(f.name, f.kind) for f in engine.custom_metrics()] == [("g", "counter")]
        # Shared with another model, the family is not the reloaded model's to change.
        await engine.load(config(declaring(("counter", ("g", "d"), {})), name="other"))
        with pytest.raises(BackendError, match="declared already as a counter with no labels"):
            await engine.load(config(old), replace=True)
        assert [(f.name, f.kind) for f in engine.custom_metrics()] == [("g", "counter")]


def test_numpy_numbers_are_numbers() -> None:
    # What a model computes is often a numpy scalar: a mask's sum, an array's mean.
    registry = CustomMetrics()
    owner = registry.begin("m")
    registry.install(owner)
    metrics = ModelMetrics._create(registry, owner)
    counter = metrics.counter("c", "d").metric()
    gauge = metrics.gauge("g", "d").metric()
    buckets = np.array([0.5, 1.0], np.float32)
    histogram = metrics.histogram("h", "d", buckets=buckets).metric()  # type: ignore[arg-type]
    counter.increment(np.ones(3, np.int64).sum())
    gauge.set(np.float32(1.5))
    gauge.increment(np.int32(2))
    histogram.observe(np.float16(0.25))
    assert (counter.value(), gauge.value(), histogram.count()) == (3.0, 3.5, 1)
    assert type(counter.value()) is float
    with pytest.raises(InvalidMetric, match=r"takes a finite number, got np\.True_"):
        counter.increment(np.True_)  # type: ignore[arg-type]
    with pytest.raises(InvalidMetric, match="takes a finite number"):
        gauge.set(np.float32("nan"))


def test_workers_between_two_declarations_of_a_family_still_make_a_valid_exposition() -> None:
    # Under --workers a reload reaches each worker in turn: for a moment one has the
    # model's new declaration of a family (a gauge made a counter) and another the old.
    # The sum keeps the first worker's kind, whole, rather than samples of two kinds
    # under one TYPE line.
    from trioinfer.server._metrics import exposition_of
    from trioinfer.server._workers import merge_expositions

    no_requests = {"outcomes": [], "in_flight": 0, "in_flight_protocols": {}, "versions": []}

    def text(kind: str, value: float, counts: list[int], count: int) -> bytes:
        family = ["g", "d", kind, [], [1.0] if kind == "histogram" else []]
        sample = ["m", "1", [], value, counts, count, 0.0]
        return exposition_of({**no_requests, "custom": [[*family, [sample], "sum"]]})  # type: ignore[typeddict-item]

    gauge, counter = text("gauge", 1.0, [], 0), text("counter", 2.0, [], 0)
    histogram = text("histogram", 2.0, [1, 0], 1)
    for first, then, kind, names in [
        (gauge, counter, "gauge", ["g"]),
        (counter, gauge, "counter", ["g_total"]),
        (gauge, histogram, "gauge", ["g"]),
        (histogram, counter, "histogram", ["g_bucket", "g_bucket", "g_count", "g_sum"]),
    ]:
        merged = merge_expositions([first, then, first]).decode()
        families = [f for f in text_string_to_metric_families(merged) if f.name.startswith("g")]
        assert [(f.name, f.type) for f in families] == [("g", kind)], merged
        assert [s.name for s in families[0].samples] == names, merged


def test_any_label_name_is_given_by_keyword_self_included() -> None:
    registry = CustomMetrics()
    owner = registry.begin("m")
    registry.install(owner)
    metrics = ModelMetrics._create(registry, owner)
    family = metrics.counter("c", "d", labels=["self", "labels"])
    family.metric(self="a", labels="b").increment()
    [sample] = registry.snapshot()[0].samples
    assert sample.labels == {"self": "a", "labels": "b"}


def test_the_supervisor_combines_each_workers_gauge_as_declared() -> None:
    # What each worker reports (exposition_of with its pid), as the supervisor sums it.
    from trioinfer.server._metrics import exposition_of, gauges_of
    from trioinfer.server._workers import merge_expositions

    no_requests = {"outcomes": [], "in_flight": 0, "in_flight_protocols": {}, "versions": []}
    modes = ("sum", "max", "min", "mostrecent", "all")

    def counts(value: float, updated: float) -> Any:
        sample = ["m", "1", [], value, [], 0, updated]
        custom = [[f"g_{mode}", "d", "gauge", [], [], [sample], mode] for mode in modes]
        return {**no_requests, "custom": custom}

    # Worker 2 updated its gauges last (at 20.5 s), with the smallest value.
    reports = [(101, counts(3.0, 10.25)), (102, counts(1.0, 20.5)), (103, counts(2.0, 0.0))]
    texts = [exposition_of(c, pid=pid) for pid, c in reports]
    assert b" 20500\n" in texts[1]  # the time it was last updated, for mostrecent only
    assert gauges_of(reports[0][1]) == {
        "g_max": "max",
        "g_min": "min",
        "g_mostrecent": "mostrecent",
        "g_all": "all",
    }
    merged = merge_expositions(texts, gauges_of(reports[0][1])).decode()
    values = {
        (s.name, s.labels.get("pid")): (s.value, s.timestamp)
        for f in text_string_to_metric_families(merged)
        for s in f.samples
    }
    assert {k: v for k, v in values.items() if k[0].startswith("g_")} == {
        ("g_sum", None): (6.0, None),
        ("g_max", None): (3.0, None),
        ("g_min", None): (1.0, None),
        ("g_mostrecent", None): (1.0, None),
        ("g_all", "101"): (3.0, None),
        ("g_all", "102"): (1.0, None),
        ("g_all", "103"): (2.0, None),
    }
    # One server shows its own value, with no pid and no timestamp.
    alone = exposition_of(reports[0][1]).decode()
    assert "pid" not in alone
    assert 'g_mostrecent{model="m",version="1"} 3.0\n' in alone


GAUGE_PY = """\
class Model:
    def __init__(self, metrics):
        self.g = metrics.{kind}("app_g", "A family version 2 declares otherwise.").metric()

    def infer(self, inputs):
        return {{"y": inputs["x"]}}
"""


async def test_a_new_version_that_replaces_the_served_one_may_declare_a_family_otherwise(
    tmp_path: Path,
) -> None:
    # Version 2 of a model (its latest, the one served) with its model.py edited: a
    # gauge made a counter. Version 1 holds the family until version 2 serves.
    root = tmp_path / "repo"
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.py").write_text(GAUGE_PY.format(kind="gauge"))
    (root / "m" / "config.toml").write_text(CONFIG_TOML)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            listening = await start_serving(nursery, root)
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                assert "# TYPE app_g gauge" in (await client.get("/metrics")).text
                (root / "m" / "2").mkdir()
                (root / "m" / "2" / "model.py").write_text(GAUGE_PY.format(kind="counter"))
                answer = await client.post("/v2/repository/models/m/load")
                assert answer.status_code == 200, answer.text
                text = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    assert "# TYPE app_g_total counter" in text
    assert 'app_g_total{model="m",version="2"} 0.0' in text
