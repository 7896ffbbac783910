"""OpenTelemetry tracing: the spans of a request, its queue time, its batch and its compute.

Imported only when tracing is on (``open_engine(tracer_provider=...)``, or
``trioinfer serve --trace-exporter``): with tracing off, nothing imports
``opentelemetry`` and each hook in the engine, runner and server is one
``is not None`` check.

A request's span travels on the request (``Request._state.trace``), as its
deadline does, because the runner's workers are tasks started at load that do
not share the caller's context. The spans:

- ``infer {model}``: the request, a child of the caller's current span (an HTTP
  server span, the caller's own span, a pipeline's request for its steps). A
  batched pipeline's step request for a batch is a child of the pipeline's
  ``compute`` span, linked to every traced member it carries; one for a member
  rerun alone, a child of that member's request span (`Tracing.pipeline_step`).
- ``queue {model}``: the request's time in the queue, a child of the request.
- ``batch {model}``: one execution of a batch, linked to the span of every
  traced request it carries (OpenTelemetry's way for batches), and the child
  of the first of them so that it shows in a trace.
- ``compute {model}``: one backend call of that batch (a retry or failover
  makes another), a child of the batch span; a request failed over to another
  model is a child of it too.
- ``stream {model}``: a decoupled model's stream (``engine.infer_stream``), a
  child of the caller's current span, with the number of responses handed to
  the reader and how it ended (``success``, ``error``, ``cancelled``, or
  ``abandoned``: the reader left before the last response).
- ``generate {model}``: the model's generator at work, a child of the stream
  span, with an event at its first response (time to first response). No
  span or event per response: a stream of thousands of tokens would cost a
  span each and overflow the SDK's 128 events per span.

Sampling is decided once, where a trace starts: a request whose parent span
is valid follows the parent's sampled flag (W3C ``traceparent``); a request
that starts a trace is sampled at the model's rate, else the global rate. An
unsampled request creates no span at all, and its pipeline steps follow it.
"""

from __future__ import annotations

import contextvars
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import trio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ._trace_settings import check_rate

if TYPE_CHECKING:
    from ._dispatch import Replica
    from ._request import Request

T = TypeVar("T")

#: Set while a request that was not sampled runs, so that what it calls (a
#: pipeline's steps) does not start traces of its own.
_UNSAMPLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trioinfer_unsampled", default=False
)
#: Set while a worker runs a traced batch, for `Tracing.in_batch`.
_IN_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trioinfer_in_batch", default=False
)
#: The links the next request span made in this task takes: a batched pipeline's step
#: request links the request spans of the members it carries (`Tracing.pipeline_step`).
_LINKS: contextvars.ContextVar[tuple[Link, ...]] = contextvars.ContextVar(
    "trioinfer_links", default=()
)
#: The engine's tracer while a traced backend call runs in this task (`Tracing.compute`),
#: for a backend that records the spans of work done elsewhere (`record_span`).
_COMPUTING: contextvars.ContextVar[trace.Tracer | None] = contextvars.ContextVar(
    "trioinfer_computing", default=None
)
#: While an HTTP server span is open: the errors its route answered after the status
#: went out (a stream's last event), which only the route sees (`Tracing.answered_late`).
_LATE_ERRORS: contextvars.ContextVar[list[BaseException] | None] = contextvars.ContextVar(
    "trioinfer_late_errors", default=None
)
_PROPAGATOR = TraceContextTextMapPropagator()

# Attribute names: OpenTelemetry's where a convention exists (error.type, the
# HTTP server ones), trioinfer's own namespace for what none covers.
MODEL = "trioinfer.model.name"
VERSION = "trioinfer.model.version"
REQUEST_ID = "trioinfer.request.id"
OUTCOME = "trioinfer.outcome"
BATCH_REQUESTS = "trioinfer.batch.requests"
BATCH_ROWS = "trioinfer.batch.size"
INSTANCE = "trioinfer.instance"
DEVICE = "trioinfer.device"
ERROR_TYPE = "error.type"
CACHE_HIT = "trioinfer.cache.hit"
RESPONSES = "trioinfer.stream.responses"


class _Trace:
    # The spans one sampled request owns; it rides on Request._state.trace.
    __slots__ = ("queue", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.queue: trace.Span | None = None


class StreamTrace:
    """The spans of one sampled stream: `Tracing.stream` makes it, the stream's code ends it."""

    __slots__ = ("_tracer", "model", "responses", "span")

    def __init__(self, tracer: trace.Tracer, model: str, span: trace.Span) -> None:
        self._tracer = tracer
        self.model = model
        self.span = span
        #: Responses handed over to the reader so far.
        self.responses = 0

    def admitted(self, replica: Replica) -> None:
        """Note the instance the stream runs on."""
        self.span.set_attribute(INSTANCE, replica.index)
        self.span.set_attribute(DEVICE, replica.device)

    async def generate(
        self, generator: AsyncIterator[T], send: Callable[[T], Awaitable[None]]
    ) -> None:
        """Hand each response of *generator* to *send* inside the ``generate`` span.

        The span is current while the generator runs, so that what the model
        calls (another model, a traced library) is its child.
        """
        span = self._tracer.start_span(
            f"generate {self.model}",
            context=trace.set_span_in_context(self.span),
            attributes={MODEL: self.model},
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        outcome, error = "success", None
        try:
            async for outputs in generator:
                await send(outputs)
                self.responses += 1
                if self.responses == 1:
                    span.add_event("first response")
        except BaseException as exc:
            outcome, error = _stream_outcome(exc), exc
            raise
        finally:
            otel_context.detach(token)
            span.set_attribute(RESPONSES, self.responses)
            _end(span, outcome, error)

    def end(self, outcome: str, error: BaseException | None) -> None:
        """End the stream span: the reader is done with it (*outcome* says how)."""
        self.span.set_attribute(RESPONSES, self.responses)
        _end(self.span, outcome, error)


class Tracing:
    """An engine's tracer and sampling rates; created by `open_engine` when tracing is on.

    Attributes:
        rate: The global sampling ratio for requests that start a trace.
        model_rates: Ratios that override *rate* for some models.
        enabled: False stops all tracing, a sampled ``traceparent`` included
            (Triton's ``trace_level`` ``OFF``), while remembering the rates.
    """

    def __init__(self, tracer_provider: Any, rate: float = 1.0) -> None:
        from . import __version__

        self._tracer = trace.get_tracer("trioinfer", __version__, tracer_provider=tracer_provider)
        self.provider = tracer_provider
        self.rate = check_rate(rate)
        self.initial_rate = self.rate
        self.model_rates: dict[str, float] = {}
        self.enabled = True
        self._random = random.random
        self._get_current = otel_context.get_current
        # Traced requests not yet ended: while there are none (most of the time at a
        # low rate), no batch can carry one, and `traced` needs no look at the batch.
        self._open = 0

    # -- sampling --------------------------------------------------------------------

    def _sampled(self, model: str, parent: trace.SpanContext) -> bool:
        if not self.enabled:  # trace_level OFF: nothing, whatever a traceparent says
            return False
        if parent.is_valid:
            return parent.trace_flags.sampled
        if _UNSAMPLED.get():
            return False
        rate = self.model_rates.get(model, self.rate) if self.model_rates else self.rate
        return rate >= 1.0 or self._random() < rate

    def sampled_parent(self, model: str, failover: bool) -> otel_context.Context | None:
        """The context a request's span goes under if it is traced; None if it is not.

        Synchronous and cheap, for the engine to skip every span of a request
        not traced (999 in 1000 at 1-in-1000). A *failover* request (sent here by
        a fallback) is traced only under its batch's span, never on its own.
        """
        if not self.enabled:  # trace_level OFF
            return None
        current = self._get_current()
        if current:  # something is set in the context: maybe the caller's span
            parent = trace.get_current_span(current).get_span_context()
            if parent.is_valid:
                return current if parent.trace_flags.sampled else None
        if failover or _UNSAMPLED.get():
            return None
        rate = self.model_rates.get(model, self.rate) if self.model_rates else self.rate
        return current if rate >= 1.0 or self._random() < rate else None

    # -- a request (engine) ----------------------------------------------------------

    async def submit(
        self,
        request: Request,
        parent: otel_context.Context | None,
        queued: bool,
        call: Callable[[], Awaitable[T]],
    ) -> T:
        """Run *call* (the request's way through the engine) inside the request's spans.

        With *parent* None (not traced: a pipeline's request), no span is made,
        and the steps it calls are not traced either.
        """
        if parent is None:
            return await _untraced(call)
        links = _LINKS.get()
        span = self._tracer.start_span(
            f"infer {request.model}",
            context=parent,
            links=links,
            attributes={MODEL: request.model, REQUEST_ID: request.id},
        )
        traced = request._state.trace = _Trace(span)
        self._open += 1
        if queued:
            self.queued(request)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        # The links were this span's: not those of what it calls (an unbatched pipeline's steps).
        unlinked = _LINKS.set(()) if links else None
        outcome, error = "success", None
        try:
            return await call()
        except BaseException as exc:
            outcome, error = _outcome(exc), exc
            raise
        finally:
            self._open -= 1
            if unlinked is not None:
                _LINKS.reset(unlinked)
            otel_context.detach(token)
            if traced.queue is not None:  # left while queued: withdrawn, expired, refused
                traced.queue.set_attribute(OUTCOME, outcome)
                traced.queue.end()
                traced.queue = None
            _end(span, outcome, error)

    def queued(self, request: Request) -> None:
        """Start the queue span of traced *request*, which enters its model's queue now."""
        traced = request._state.trace
        traced.queue = self._tracer.start_span(
            f"queue {request.model}",
            context=trace.set_span_in_context(traced.span),
            attributes={MODEL: request.model},
        )

    @staticmethod
    def cache_answered(request: Request, *, hit: bool) -> None:
        """Note on traced *request*'s span whether the response cache answered it.

        A hit is an answer stored earlier or computed for an identical request
        in flight: this request was never queued.
        """
        request._state.trace.span.set_attribute(CACHE_HIT, hit)

    def stream(self, request: Request) -> StreamTrace | None:
        """Start the span of a decoupled model's stream if it is traced; None if not.

        Sampled as any request is: the caller's span decides, else the model's
        rate.
        """
        parent = self.sampled_parent(request.model, False)
        if parent is None:
            return None
        span = self._tracer.start_span(
            f"stream {request.model}",
            context=parent,
            attributes={MODEL: request.model, REQUEST_ID: request.id},
        )
        return StreamTrace(self._tracer, request.model, span)

    # -- a batch and its compute (runner) ----------------------------------------------

    def traced(self, requests: Sequence[Request]) -> bool:
        """Whether any of a batch's *requests* is traced (then `execute` makes its span)."""
        if not self._open:
            return False
        for request in requests:  # noqa: SIM110  # a loop is cheaper than any() on a generator
            if request._state.trace is not None:
                return True
        return False

    @staticmethod
    def in_batch() -> bool:
        """Whether this task runs a traced batch (then `compute` makes a span)."""
        return _IN_BATCH.get()

    async def execute(
        self,
        model: str,
        requests: Sequence[Request],
        replica: Replica,
        run: Callable[[], Awaitable[None]],
    ) -> None:
        """Run one execution of a batch (*run*) inside its batch span.

        Called for a batch that carries a traced request (see `traced`).
        """
        links = []
        for request in requests:
            traced = request._state.trace
            if traced is not None:
                links.append(Link(traced.span.get_span_context()))
                if traced.queue is not None:  # it runs now
                    traced.queue.end()
                    traced.queue = None
        first = next(r for r in requests if r._state.trace is not None)
        span = self._tracer.start_span(
            f"batch {model}",
            context=trace.set_span_in_context(first._state.trace.span),
            links=links,
            attributes={
                MODEL: model,
                BATCH_REQUESTS: len(requests),
                BATCH_ROWS: sum(r.rows for r in requests),
                INSTANCE: replica.index,
                DEVICE: replica.device,
            },
        )
        # Current in the worker's task while the fallback runs: compute spans and
        # a failover's request span become its children.
        token = otel_context.attach(trace.set_span_in_context(span))
        in_batch = _IN_BATCH.set(True)
        outcome, error = "success", None
        try:
            await run()
        except BaseException as exc:
            outcome, error = _outcome(exc), exc
            raise
        finally:
            _IN_BATCH.reset(in_batch)
            otel_context.detach(token)
            _end(span, outcome, error)

    async def compute(
        self,
        model: str,
        replica: Replica,
        rows: int,
        call: Callable[[], Awaitable[T]],
    ) -> T:
        """Run one backend call (*call*) inside a compute span (its batch is traced)."""
        span = self._tracer.start_span(
            f"compute {model}",
            attributes={
                MODEL: model,
                BATCH_ROWS: rows,
                INSTANCE: replica.index,
                DEVICE: replica.device,
            },
        )
        # Current while the backend runs: a remote backend sends it along (see
        # `current_trace_context`) and records what ran there as its children.
        token = otel_context.attach(trace.set_span_in_context(span))
        computing = _COMPUTING.set(self._tracer)
        outcome, error = "success", None
        try:
            return await call()
        except BaseException as exc:
            outcome, error = _outcome(exc), exc
            raise
        finally:
            _COMPUTING.reset(computing)
            otel_context.detach(token)
            _end(span, outcome, error)

    # -- a batched pipeline's steps (trioinfer._pipeline_batched) ------------------------

    async def pipeline_step(
        self, members: Sequence[Request], alone: bool, call: Callable[[], Awaitable[T]]
    ) -> T:
        """Run *call*, a batched pipeline's step request for *members*, in their traces.

        A step request for a batch is the child of the current span (the
        pipeline's ``compute`` span, in its batch's trace: that of its first
        traced member) and links the request span of every traced member it
        carries, as a batch span links its requests. One for a member rerun
        *alone* is the child of that member's request span, in its own
        trace. One that carries no traced member is not traced, nor is
        anything it calls: no trace starts halfway, and none joins another
        member's.
        """
        spans = [m._state.trace.span for m in members if m._state.trace is not None]
        if not spans:
            # Not under the batch's span either (a member not sampled, rerun alone).
            token = otel_context.attach(trace.set_span_in_context(trace.INVALID_SPAN))
            try:
                return await _untraced(call)
            finally:
                otel_context.detach(token)
        if alone:
            token = otel_context.attach(trace.set_span_in_context(spans[0]))
            try:
                return await call()
            finally:
                otel_context.detach(token)
        links = _LINKS.set(tuple(Link(span.get_span_context()) for span in spans))
        try:
            return await call()
        finally:
            _LINKS.reset(links)

    # -- HTTP (server) -------------------------------------------------------------------

    async def serve_http(
        self,
        scope: MutableMapping[str, Any],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
        serve: Callable[[Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]],
        action: str = "infer",
    ) -> None:
        """Serve one HTTP inference request (*serve*) inside its server span.

        *action* is the route's last part: ``infer``, ``generate`` or
        ``generate_stream``. The span's parent comes from the W3C
        ``traceparent`` and ``tracestate`` headers; the sampling decision
        follows it, or the model's rate.
        """
        carrier = {}
        for key, value in scope["headers"]:
            name = key.lower()
            if name == b"traceparent" or name == b"tracestate":  # bytes: no decoding per header
                carrier[name.decode()] = value.decode("latin-1")
        params = scope["path_params"]
        model, version = params["model"], params.get("version")
        parent_context, sampled = self._parent(carrier, model)
        if not sampled:
            return await _untraced(lambda: serve(send))
        route = f"/v2/models/{{model}}/{action}"
        if version is not None:
            route = f"/v2/models/{{model}}/versions/{{version}}/{action}"
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "http.route": route,
            "url.path": scope["path"],
            MODEL: model,
        }
        if version is not None:
            attributes[VERSION] = version
        span = self._tracer.start_span(
            f"POST {route}", context=parent_context, kind=SpanKind.SERVER, attributes=attributes
        )
        status: int | None = None

        async def send_and_note(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span))
        late: list[BaseException] = []
        noting = _LATE_ERRORS.set(late)
        error: BaseException | None = None
        try:
            await serve(send_and_note)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _LATE_ERRORS.reset(noting)
            otel_context.detach(token)
            if status is None:  # the client left (or the server stopped) before an answer
                span.set_attribute(OUTCOME, "cancelled" if error is None else _outcome(error))
            else:
                span.set_attribute("http.response.status_code", status)
                if error is not None:  # after the status: a stream's client left mid-stream
                    span.set_attribute(OUTCOME, _outcome(error))
                elif late:  # a 200 went out, then the stream failed (its last event says so)
                    span.set_attribute(OUTCOME, "error")
                    span.set_attribute(ERROR_TYPE, type(late[0]).__name__)
                else:
                    span.set_attribute(OUTCOME, "success" if status < 400 else "error")
                if status >= 400:
                    span.set_attribute(ERROR_TYPE, str(status))
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
            span.end()

    async def serve_grpc(
        self,
        method: str,
        metadata: Mapping[str, str],
        model: str,
        version: str | None,
        serve: Callable[[], Awaitable[T]],
    ) -> T:
        """Serve one gRPC call (*serve*) inside its server span.

        As over HTTP, the span's parent comes from the W3C ``traceparent`` and
        ``tracestate`` metadata (gRPC metadata keys are lower case), and the
        sampling decision follows it, or the model's rate.
        """
        carrier = {key: metadata[key] for key in ("traceparent", "tracestate") if key in metadata}
        parent_context, sampled = self._parent(carrier, model)
        if not sampled:
            return await _untraced(serve)
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": "inference.GRPCInferenceService",
            "rpc.method": method,
            MODEL: model,
        }
        if version is not None:
            attributes[VERSION] = version
        span = self._tracer.start_span(
            f"inference.GRPCInferenceService/{method}",
            context=parent_context,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            result = await serve()
        except BaseException as exc:
            otel_context.detach(token)
            _end(span, _outcome(exc), exc)
            raise
        otel_context.detach(token)
        _end(span, "success", None)
        return result

    def _parent(
        self, carrier: Mapping[str, str], model: str
    ) -> tuple[otel_context.Context | None, bool]:
        # A server span's parent context from W3C trace context, and whether to trace.
        parent_context = _PROPAGATOR.extract(carrier) if carrier else None
        parent = trace.get_current_span(parent_context).get_span_context()
        return parent_context, self._sampled(model, parent)

    @staticmethod
    def answered_late(error: BaseException) -> None:
        """Note on the current HTTP server span that its stream failed after the status went out.

        The route answered *error* in the stream's last event, under a 200
        already sent: the span says ``error`` (and the error's class) instead
        of ``success``.
        """
        late = _LATE_ERRORS.get()
        if late is not None:
            late.append(error)

    def served_version(self, version: int) -> None:
        """Note on the current server span which version answers (a traffic split picks it)."""
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute(VERSION, str(version))


def current_trace_context() -> dict[str, str]:
    """See `trioinfer.lowlevel.current_trace_context`."""
    if _COMPUTING.get() is None:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    parent: Mapping[str, str],
    attributes: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """See `trioinfer.lowlevel.record_span`."""
    tracer = _COMPUTING.get()
    if tracer is None or not parent:
        return {}
    span = tracer.start_span(
        name,
        context=_PROPAGATOR.extract(parent),
        start_time=start_ns,
        attributes=dict(attributes) if attributes else None,
    )
    span.end(end_time=end_ns)
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


async def _untraced(call: Callable[[], Awaitable[T]]) -> T:
    # Not traced: neither is anything *call* starts (pipeline steps, failovers).
    skip = _UNSAMPLED.set(True)
    try:
        return await call()
    finally:
        _UNSAMPLED.reset(skip)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return "error"


def _stream_outcome(exc: BaseException) -> str:
    # The reader closed its end while the model handed a response over: it left early.
    if isinstance(exc, anyio.BrokenResourceError | trio.BrokenResourceError):
        return "abandoned"
    return _outcome(exc)


def _end(span: trace.Span, outcome: str, error: BaseException | None) -> None:
    span.set_attribute(OUTCOME, outcome)
    if error is not None and outcome == "error":
        span.set_attribute(ERROR_TYPE, type(error).__name__)
        span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
        span.record_exception(error)
    span.end()
