"""Triton's custom metrics (``pb_utils.MetricFamily``), onto trioinfer's custom metrics.

A Triton Python model declares its families in ``initialize`` and updates
their metrics in ``execute``, as for Triton: the series show in
``engine.custom_metrics()`` and on ``/metrics`` of ``trioinfer serve`` (with
``model`` and ``version`` labels, a counter as ``name_total``), added up over
``--workers``; what trioinfer refuses is a ``TritonModelException`` that says why.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import trioinfer
from _serve import start_serving
from trioinfer import BackendError
from trioinfer.server._repository import ModelRepository

pytestmark = [pytest.mark.python_model, pytest.mark.triton_config]

PBTXT = """\
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""

# As a Triton model counts: families in initialize, a Metric of each kept, updated per request.
COUNTED = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        requests = pb_utils.MetricFamily(
            name="app_requests_total",
            description="Requests executed.",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.requests = requests.Metric(labels={"route": "x"})
        self.last = pb_utils.MetricFamily(
            name="app_last_rows",
            description="Rows of the last request.",
            kind=pb_utils.MetricFamily.GAUGE,
        ).Metric()
        self.rows = pb_utils.MetricFamily(
            name="app_rows",
            description="Rows per request.",
            kind=pb_utils.MetricFamily.HISTOGRAM,
        ).Metric(labels={"route": "x"}, buckets=[1.0, 4.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            self.requests.increment(1)
            self.last.set(len(x))
            self.rows.observe(len(x))
            # What the counter says now (metric.value()), as each row's answer.
            counted = np.full_like(x, self.requests.value())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", counted)]))
        return responses
"""

MODELS = {
    "counted": COUNTED,
    # The same declared from an async def initialize (on the event loop, not a thread).
    "counted_async": COUNTED.replace("def initialize", "async def initialize"),
}


def write(root: Path, name: str, code: str) -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(PBTXT.format(name=name))
    (root / name / "1" / "model.py").write_text(code)
    return root


def repository(root: Path) -> Path:
    for name, code in MODELS.items():
        write(root, name, code)
    return root


def rows(n: int) -> dict[str, np.ndarray[Any, Any]]:
    return {"INPUT0": np.ones((n, 1), np.float32)}


async def test_a_triton_models_families_are_the_engines_custom_metrics(tmp_path: Path) -> None:
    repo = ModelRepository(repository(tmp_path / "models"))
    async with trioinfer.open_engine() as engine:
        for name in MODELS:
            await engine.load(repo.entry(name).config(1))
        answers = [(await engine.infer("counted", rows(n)))["OUTPUT0"] for n in (3, 2)]
        await engine.infer("counted_async", rows(5))
        families = {f.name: f for f in engine.custom_metrics()}
    assert [a.ravel().tolist() for a in answers] == [[1.0] * 3, [2.0] * 2]
    counter, gauge, histogram = (
        families["app_requests"],
        families["app_last_rows"],
        families["app_rows"],
    )
    assert (counter.kind, counter.labels, counter.description) == (
        "counter",
        ("route",),
        "Requests executed.",
    )
    assert [(s.model, dict(s.labels), s.value) for s in counter.samples] == [
        ("counted", {"route": "x"}, 2.0),
        ("counted_async", {"route": "x"}, 1.0),
    ]
    assert gauge.kind == "gauge"
    assert [(s.model, s.value) for s in gauge.samples] == [("counted", 2.0), ("counted_async", 5.0)]
    assert histogram.buckets == (1.0, 4.0)
    assert [(s.model, s.bucket_counts, s.count, s.value) for s in histogram.samples] == [
        ("counted", (0, 2, 0), 2, 5.0),
        ("counted_async", (0, 0, 1), 1, 5.0),
    ]


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("app_")
    }


async def test_serve_shows_a_triton_models_families_on_metrics(tmp_path: Path) -> None:
    root = write(tmp_path / "models", "counted", COUNTED)
    body = {"inputs": [{"name": "INPUT0", "shape": [3, 1], "datatype": "FP32", "data": [1] * 3}]}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            listening = await start_serving(nursery, root)
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                for _ in range(2):
                    answer = await client.post("/v2/models/counted/infer", json=body)
                    assert answer.status_code == 200, answer.text
                text = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    assert "# TYPE app_requests_total counter" in text
    assert "# HELP app_rows Rows per request." in text

    def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({"model": "counted", "version": "1", **labels}.items()))

    assert scraped(text) == {
        key("app_requests_total", route="x"): 2.0,
        key("app_last_rows"): 3.0,
        **{
            key("app_rows_bucket", le=le, route="x"): n
            for le, n in [("1.0", 0), ("4.0", 2), ("+Inf", 2)]
        },
        key("app_rows_count", route="x"): 2.0,
        key("app_rows_sum", route="x"): 6.0,
    }


@pytest.mark.workers
def test_under_workers_a_triton_models_series_add_up(tmp_path: Path) -> None:
    from test_workers import fresh, samples, two_workers

    root = write(tmp_path / "models", "counted", COUNTED)
    body = {"inputs": [{"name": "INPUT0", "shape": [2, 1], "datatype": "FP32", "data": [1] * 2}]}
    with two_workers(root, tmp_path / "serve.log") as served:
        for _ in range(20):
            answer = fresh("POST", f"{served.url}/v2/models/counted/infer", json=body)
            assert answer.status_code == 200, answer.text
        per_worker = samples(served.url, "trioinfer_worker_inference_requests_total")
        assert sorted(v > 0 for _, v in per_worker) == [True, True]  # both served some
        labels = {"model": "counted", "version": "1", "route": "x"}
        assert samples(served.url, "app_requests_total") == [(labels, 20.0)]
        assert samples(served.url, "app_rows_count") == [(labels, 20.0)]
        # A gauge adds up over the workers: each one's last request had 2 rows.
        assert samples(served.url, "app_last_rows") == [({"model": "counted", "version": "1"}, 4.0)]
        served.process.terminate()
        served.process.wait(timeout=60)


def family(kind: str, name: str = "app_f") -> str:
    return (
        f"pb_utils.MetricFamily(name={name!r}, description='d', kind=pb_utils.MetricFamily.{kind})"
    )


@pytest.mark.parametrize(
    ("initialize", "said"),
    [
        (f"{family('COUNTER')}.Metric(labels={{'model': 'm'}})", "label 'model' is reserved"),
        (f"{family('GAUGE')}.Metric(labels={{'a-b': 'v'}})", "not a Prometheus label name"),
        (f"{family('COUNTER', 'trioinfer_x')}.Metric()", "are trioinfer's own families"),
        (f"{family('COUNTER')}\n        {family('GAUGE')}", "declared already as a counter"),
        (
            f"f = {family('COUNTER')}\n        f.Metric(labels={{'a': '1'}})\n"
            "        f.Metric(labels={'b': '1'})",
            "as a counter with labels \\['b'\\], but it is declared already as a counter "
            "with labels \\['a'\\]",
        ),
        (f"{family('HISTOGRAM')}.Metric(labels={{}})", "a HISTOGRAM's Metric takes buckets"),
        (f"{family('HISTOGRAM')}.Metric(buckets=[])", "Triton allows buckets=\\[\\]"),
        (f"{family('HISTOGRAM')}.Metric(buckets=[2.0, 1.0])", "increasing order"),
        (
            f"f = {family('HISTOGRAM')}\n        f.Metric(buckets=[1.0])\n"
            "        f.Metric(buckets=[2.0])",
            "buckets \\[1.0\\]",
        ),
        (f"{family('GAUGE')}.Metric(buckets=[1.0])", "buckets are for a HISTOGRAM's Metric"),
        (f"{family('COUNTER')}.Metric().increment(-1)", "only goes up"),
        (f"{family('COUNTER')}.Metric().set(1)", "a counter: set\\(\\) is not one of"),
        (f"{family('GAUGE')}.Metric().observe(1)", "a gauge: observe\\(\\) is not one of"),
        (f"{family('HISTOGRAM')}.Metric(buckets=[1]).value()", "a histogram: value\\(\\)"),
        (f"{family('HISTOGRAM')}.Metric(buckets=[1]).increment(1)", "increment\\(\\) is not"),
        (f"{family('GAUGE')}.Metric().set(float('nan'))", "takes a finite number"),
        ("pb_utils.MetricFamily(name='a', description='d', kind=7)", "kind must be"),
    ],
)
async def test_what_trioinfer_refuses_is_a_triton_model_exception_saying_why(
    tmp_path: Path, initialize: str, said: str
) -> None:
    code = (
        "import triton_python_backend_utils as pb_utils\n\n\n"
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        f"        {initialize}\n\n"
        "    def execute(self, requests):\n"
        "        return []\n"
    )
    repo = ModelRepository(write(tmp_path / "models", "bad", code))
    async with trioinfer.open_engine() as engine:
        with pytest.raises(BackendError, match="initialize") as caught:
            await engine.load(repo.entry("bad").config(1))
        assert engine.custom_metrics() == ()  # the failed load's families went with it
    cause = caught.value.__cause__
    assert type(cause).__name__ == "TritonModelException", repr(cause)
    assert re.search(said, str(cause)), str(cause)


async def test_a_family_made_in_execute_is_the_models(tmp_path: Path) -> None:
    # As in Triton, a family may be made in execute too (its first Metric() declares it).
    code = COUNTED.replace(
        "            self.requests.increment(1)\n",
        "            self.requests.increment(1)\n"
        "            pb_utils.MetricFamily(name='app_late', description='d', "
        "kind=pb_utils.MetricFamily.GAUGE).Metric(labels={'k': 'v'}).set(3)\n",
    )
    repo = ModelRepository(write(tmp_path / "models", "late", code))
    async with trioinfer.open_engine() as engine:
        await engine.load(repo.entry("late").config(1))
        await engine.infer("late", rows(1))
        late = [f for f in engine.custom_metrics() if f.name == "app_late"]
        assert [(s.model, s.labels, s.value) for f in late for s in f.samples] == [
            ("late", {"k": "v"}, 3.0)
        ], late
    # Outside a model's load or execute there is no model to make it for.
    pb_utils = importlib.import_module("trioinfer_python.triton_python_backend_utils")
    with pytest.raises(pb_utils.TritonModelException, match="while the model loads"):
        pb_utils.MetricFamily("app_x", "d", pb_utils.MetricFamily.COUNTER)


async def test_a_family_made_at_the_top_of_model_py_or_in_init_is_the_models(
    tmp_path: Path,
) -> None:
    code = (
        "import triton_python_backend_utils as pb_utils\n\n"
        "TOP = pb_utils.MetricFamily(name='app_top', description='d', "
        "kind=pb_utils.MetricFamily.COUNTER)\n\n\n"
        "class TritonPythonModel:\n"
        "    def __init__(self):\n"
        "        self.made = pb_utils.MetricFamily(name='app_made', description='d', "
        "kind=pb_utils.MetricFamily.GAUGE).Metric()\n"
        "        self.top = TOP.Metric()\n\n"
        "    def execute(self, requests):\n"
        "        self.top.increment(len(requests))\n"
        "        self.made.set(7)\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUTPUT0', "
        "r.inputs()[0].as_numpy())]) for r in requests]\n"
    )
    repo = ModelRepository(write(tmp_path / "models", "early", code))
    async with trioinfer.open_engine() as engine:
        await engine.load(repo.entry("early").config(1))
        await engine.infer("early", rows(1))
        seen = {f.name: [(s.model, s.value) for s in f.samples] for f in engine.custom_metrics()}
    assert seen == {"app_made": [("early", 7.0)], "app_top": [("early", 1.0)]}
