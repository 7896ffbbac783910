"""A batched pipeline's spans: its steps in its members' traces, as a batch is in its requests'."""

from __future__ import annotations

from contextlib import nullcontext, suppress

import anyio
import numpy as np
import pytest
import trio
import trio.testing
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from _spans import named, parent_of, provider_for
from test_pipeline_batched import POISON, X, load_chain, pipeline, step_model, tensor
from trioinfer import InvalidInput, ModelConfig, open_engine

pytestmark = [pytest.mark.pipeline, pytest.mark.tracing]

STEPS = ("first", "second", "third")


def linked(span: ReadableSpan) -> set[int]:
    return {link.context.span_id for link in span.links}


async def traced_calls(
    exporter: InMemorySpanExporter, rows: list[float], unsampled: frozenset[int] = frozenset()
) -> tuple[dict[int, ReadableSpan], list[ReadableSpan]]:
    """Members with the given row values, in one batch; those in *unsampled* not traced.

    Returns each traced member's request span by its index, and every span.
    """
    provider = provider_for(exporter)
    async with open_engine(tracer_provider=provider) as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0))

        async def call(i: int) -> None:
            x = np.full((1, 4), rows[i], np.float32)
            context = trace.SpanContext(1, i + 1, is_remote=True)  # flags 0: not sampled
            unsampled_parent = trace.use_span(trace.NonRecordingSpan(context))
            with unsampled_parent if i in unsampled else nullcontext(), suppress(InvalidInput):
                await engine.infer("p", {"IN": x}, request_id=f"r{i}")

        async with anyio.create_task_group() as tg:
            for i in range(len(rows)):
                tg.start_soon(call, i)
                await trio.sleep(0.001)  # in this order (one batch: the delay is 10 ms)
    spans = list(exporter.get_finished_spans())
    members = {
        int(str(s.attributes["trioinfer.request.id"])[1:]): s for s in named(spans, "infer p")
    }
    return members, spans


def steps_of(spans: list[ReadableSpan], request_id: str) -> list[ReadableSpan]:
    # The step requests a pipeline request id's steps made, in order.
    return [
        s
        for s in spans
        if s.name.split(" ")[1] in STEPS
        and s.name.startswith("infer ")
        and str(s.attributes["trioinfer.request.id"]).rsplit("/", 1)[0] == request_id
    ]


async def test_a_batch_s_steps_are_linked_to_every_member_they_carry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    members, spans = await traced_calls(InMemorySpanExporter(), [0.0, 1.0, 2.0])
    assert len(members) == 3
    member_ids = {span.context.span_id for span in members.values()}
    (batch,) = named(spans, "batch p")
    (compute,) = named(spans, "compute p")
    # As any batch: the child of its first member, linked to every member.
    assert parent_of(batch) == members[0].context.span_id
    assert linked(batch) == member_ids
    assert parent_of(compute) == batch.context.span_id
    # Each step request (one per step, for the whole batch) is the pipeline compute's
    # child, in the first member's trace, linked to every member it carries.
    steps = steps_of(spans, "r0+2")
    assert [s.name for s in steps] == [f"infer {step}" for step in STEPS]
    for step in steps:
        assert parent_of(step) == compute.context.span_id
        assert step.context.trace_id == members[0].context.trace_id
        assert linked(step) == member_ids
    # Each step's own queue, batch and compute are in that trace too.
    for step in STEPS:
        (step_batch,) = named(spans, f"batch {step}")
        assert step_batch.context.trace_id == members[0].context.trace_id


async def test_a_member_rerun_alone_has_its_steps_in_its_own_trace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    members, spans = await traced_calls(InMemorySpanExporter(), [0.0, POISON, 2.0])
    (refused,) = steps_of(spans, "r0+2")  # the batch's first step, refused for member 1
    assert linked(refused) == {span.context.span_id for span in members.values()}
    for i, count in ((0, 3), (1, 1), (2, 3)):
        own = steps_of(spans, f"r{i}")
        assert len(own) == count
        for step in own:
            assert parent_of(step) == members[i].context.span_id
            assert step.context.trace_id == members[i].context.trace_id
            assert not step.links
    assert members[1].attributes["trioinfer.outcome"] == "error"


async def test_the_steps_of_members_not_sampled_start_no_trace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # No member sampled: no span at all, the steps' included.
    members, spans = await traced_calls(
        InMemorySpanExporter(), [0.0, 1.0, 2.0], unsampled=frozenset({0, 1, 2})
    )
    assert members == {}
    assert spans == []
    # Member 0 not sampled, member 2 refused by the first step: the batch's steps link
    # only the traced members, and member 0's rerun makes no span (nor joins another's
    # trace).
    members, spans = await traced_calls(
        InMemorySpanExporter(), [0.0, 1.0, POISON], unsampled=frozenset({0})
    )
    assert sorted(members) == [1, 2]
    (refused,) = steps_of(spans, "r0+2")
    assert linked(refused) == {members[1].context.span_id, members[2].context.span_id}
    assert steps_of(spans, "r0") == []
    assert len(steps_of(spans, "r1")) == 3
    assert {s.context.trace_id for s in spans} == {m.context.trace_id for m in members.values()}


async def test_a_step_that_is_a_pipeline_links_only_its_own_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # IN -> first -> A -> inner (an unbatched pipeline over second) -> B -> third -> OUT
    inner = ModelConfig(
        name="inner",
        path="-",
        backend="pipeline",
        backend_options={
            "inputs": [tensor("x")],
            "outputs": [tensor("y")],
            "steps": [{"model": "second", "input_map": {"x": "x"}, "output_map": {"y": "y"}}],
        },
    )
    steps = [
        {"model": "first", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
        {"model": "inner", "input_map": {"x": "A"}, "output_map": {"y": "B"}},
        {"model": "third", "input_map": {"x": "B"}, "output_map": {"y": "OUT"}},
    ]
    exporter = InMemorySpanExporter()
    provider = provider_for(exporter)
    async with open_engine(tracer_provider=provider) as engine:
        for name in STEPS:
            await engine.load(step_model(name))
        await engine.load(inner)
        await engine.load(pipeline(steps))
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(engine.infer, "p", {"IN": X * i})
    spans = exporter.get_finished_spans()
    members = {s.context.span_id for s in named(spans, "infer p")}
    (step,) = named(spans, "infer inner")
    assert linked(step) == members
    # Its own step is its child, linked to nothing: the links were the batch's step's.
    (nested,) = named(spans, "infer second")
    assert parent_of(nested) == step.context.span_id
    assert not nested.links
