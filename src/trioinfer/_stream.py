"""Streams: one request, any number of responses (Triton's decoupled models).

``async with engine.infer_stream(model, inputs) as responses`` admits the
request and starts a task, in a task group of the caller's own, that runs the
model's generator and hands each response over a channel with a small buffer:
the generator makes at most ``ahead`` responses the reader has not taken
(`STREAM_AHEAD` unless the caller says; a slow reader slows it), and leaving
the block (or being cancelled, or passing the deadline) cancels that task and
closes the generator at the ``yield`` it waits at. Responses that find room in
the buffer go in without a pass of the event loop (until the loop's inline
slice is spent: a model computing between yields holds the loop no longer
than an inline execution may), and a reader takes those waiting there
without one: a model that yields faster than its reader reads
hands over runs of responses, not one per loop pass, and a server writes each
run at once (`ResponseStream.ready`). The engine closing or the model unloading ends the stream with
[`EngineClosed`][trioinfer.EngineClosed]. Streams never queue: each is
admitted at once, or refused with ``QueueFull`` when the model has
``max_queue_size`` streams open, and runs unbatched on the instance with the
fewest open streams; the scheduler, batcher, fallback and response cache do
not apply. A model that is not decoupled answers a stream with its one
response, through [`Engine.infer()`][trioinfer.Engine.infer].

With tracing on, a sampled stream's spans (`trioinfer._tracing.StreamTrace`)
are passed along; a stream not sampled takes the same path with None, and
its per-response loop is the untraced one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, final

import anyio
import anyio.abc
import anyio.lowlevel
import sniffio
import trio

from ._dispatch import Replica
from ._exceptions import BackendError, QueueFull, StreamClosed, TrioInferError
from ._inline import DEFAULT_SLICE_S, inline_slice_spent, restart_inline_slice
from ._request import NO_PARAMETERS, Outputs, Parameter, Request, next_request_id
from ._runner import ModelRunner
from ._tensors import requested_outputs, validate_inputs
from ._threads import LoopClock
from ._util import NoPublicConstructor
from .abc import Status, StreamingInstance

if TYPE_CHECKING:
    from ._engine import Engine
    from ._tracing import StreamTrace

__all__ = [
    "STREAM_AHEAD",
    "ResponseStream",
    "StreamGate",
    "current_stream_parameters",
    "current_stream_request",
    "open_stream",
]

# The hand-over between the model's task and the reader's, on either loop's own channel
# (on Trio, its native channel takes half the time of anyio's per response).
_END = (anyio.EndOfStream, trio.EndOfChannel)
_CLOSED = (anyio.ClosedResourceError, trio.ClosedResourceError)
_BROKEN = (anyio.BrokenResourceError, trio.BrokenResourceError)
_WOULD_BLOCK = (anyio.WouldBlock, trio.WouldBlock)

#: The most responses a stream's model may make that its reader has not taken, unless
#: the caller of ``infer_stream`` says otherwise (``ahead``). One (the hand-over with no
#: buffer) cost a pass of the event loop per response on each side: 34 us of CPU a
#: response in process and 133 us over HTTP, against 13 and 39 us with 16 (runs of
#: responses handed over and written at once; benchmarks/bench_streaming.py).
STREAM_AHEAD = 16

# The request a decoupled model's generator answers (set in _generate, the generator's
# own task): what current_stream_request and current_stream_parameters read.
_stream_request: ContextVar[Request | None] = ContextVar("trioinfer_stream_request", default=None)


def current_stream_parameters() -> Mapping[str, Parameter]:
    """The parameters of the request whose stream a decoupled model is producing.

    For a backend's `StreamingInstance.stream` (from its generator, on the
    event loop: read it before handing work to a thread): the
    ``parameters`` the caller gave `Engine.infer_stream`, read-only; an
    empty mapping when it gave none, and outside a stream. An execution's
    requests carry theirs as `Request.parameters`, which a backend reads by
    taking them (`RequestsInstance.execute_requests`).
    """
    request = _stream_request.get()
    return NO_PARAMETERS if request is None else request.parameters


def current_stream_request() -> Request | None:
    """The request whose stream a decoupled model is producing, or None outside a stream.

    For a backend's `StreamingInstance.stream`, as `current_stream_parameters`
    (read it on the event loop, before handing work to a thread): the
    request's ``id`` (`caller_request_id` tells the caller's own from one the
    engine made), ``parameters``, ``deadline`` and the rest, read-only.
    """
    return _stream_request.get()


class _Send(Protocol):
    async def send(self, item: Outputs | _WithParameters, /) -> None: ...
    def send_nowait(self, item: Outputs | _WithParameters, /) -> None: ...
    def close(self) -> None: ...


class _Receive(Protocol):
    async def receive(self) -> Outputs | _WithParameters: ...
    def receive_nowait(self) -> Outputs | _WithParameters: ...
    def close(self) -> None: ...


@final
class _WithParameters:
    # A response that carries response parameters, as it goes to its stream's reader
    # (one without goes as its outputs alone: the usual case costs a class check).
    __slots__ = ("outputs", "parameters")

    def __init__(self, outputs: Outputs, parameters: Mapping[str, Parameter]) -> None:
        self.outputs = outputs
        self.parameters = parameters


def _channel(ahead: int) -> tuple[_Send, _Receive]:
    # Room for *ahead* and for what `ResponseStream._widen` may raise it to (STREAM_AHEAD):
    # the stream's own ``_ahead`` bounds what the model makes (`_hand_over`), not the
    # buffer, so that a stream's bound can grow while it runs.
    size = max(ahead, STREAM_AHEAD)
    if sniffio.current_async_library() == "trio":
        return trio.open_memory_channel[Outputs | _WithParameters](size)
    return anyio.create_memory_object_stream[Outputs | _WithParameters](size)


async def _hand_over(send: _Send, stream: ResponseStream, item: Outputs | _WithParameters) -> None:
    # Into the buffer at once (no pass of the loop: the model goes on to its next
    # response), and counted in *stream*'s ``_pending`` with it (what
    # ResponseStream.ready reads; a yield between let a reader that looked meanwhile see
    # a response at hand as none) until the reader takes it. The buffer always has room
    # for it (`_channel`): with ``_ahead`` not taken, the model waits for the reader.
    # Once the loop's inline slice is spent, a yield: a model that computes between its
    # yields without awaiting holds the loop no longer than an inline execution would.
    send.send_nowait(item)  # (refused: the reader left; it never reached the reader)
    stream._pending += 1
    if inline_slice_spent(DEFAULT_SLICE_S):
        # A yield, as a send would make after it: the model held the loop a slice long.
        await anyio.lowlevel.cancel_shielded_checkpoint()
        restart_inline_slice()
    if stream._pending >= stream._ahead:
        await stream._wait_room()


def decoupled(runner: object) -> bool:
    """Whether *runner* serves a decoupled (streaming) model."""
    if not isinstance(runner, ModelRunner):
        return False
    instance = runner.replicas[0]._backend_instance
    return isinstance(instance, StreamingInstance) and instance.decoupled


@final
class StreamGate:
    """Admission and instance choice for one decoupled model's streams. The engine's own."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.open = 0
        self._closed: anyio.Event | None = None
        # Open streams per replica, by replica index: a new stream goes to the least busy.
        self._load = [0] * len(runner.replicas)

    @staticmethod
    def of(runner: object) -> StreamGate | None:
        """The gate of *runner* if its model is decoupled, else None."""
        if isinstance(runner, ModelRunner) and decoupled(runner):
            return StreamGate(runner)
        return None

    def admit(self, request: Request) -> tuple[Replica, StreamingInstance]:
        """Take *request* in (or refuse it) and choose its replica."""
        runner = self.runner
        # An instance found gone leaves the rotation here too (`_in_rotation`): one whose
        # streams fail at once always has the fewest open, and would get every stream.
        serving = [
            r for r in runner.replicas if r.serving and (not r._mortal or runner._in_rotation(r))
        ]
        if not serving:
            runner.refused += 1
            raise runner._circuit_open()
        if self.open >= runner.config.max_queue_size:
            runner.refused += 1
            raise QueueFull(
                f"model {runner.config.name!r} has {self.open} streams open, its "
                "max_queue_size; retry later",
                retry_after=0.01,
            )
        replica = min(serving, key=lambda r: self._load[r.index])
        self._load[replica.index] += 1
        self.open += 1
        state = request._state
        state.done = anyio.Event()
        state.status = Status.RUNNING
        state.served_by = replica
        runner._in_flight.add(request)  # drained at unload and ended at stop like any request
        instance = replica._backend_instance
        assert isinstance(instance, StreamingInstance)
        return replica, instance

    def release(self, replica: Replica) -> None:
        """One stream on *replica* has ended (its generator is closed)."""
        self._load[replica.index] -= 1
        self.open -= 1
        if not self.open and self._closed is not None:
            self._closed.set()
            self._closed = None

    async def wait_closed(self) -> None:
        """Wait until every stream's generator has closed (after the runner ended them)."""
        while self.open:
            if self._closed is None:
                self._closed = anyio.Event()
            await self._closed.wait()


@final
class ResponseStream(metaclass=NoPublicConstructor):
    """One request's responses, as an async iterator of outputs by name.

    [`Engine.infer_stream()`][trioinfer.Engine.infer_stream] makes it; iterate it
    inside that ``async with`` block. The iteration ends when the model has
    sent its last response, or raises the error that ended the stream (a
    ``BackendError`` the model raised mid-stream, ``EngineClosed``...) after
    the responses sent before it. Iterated after that block has ended, or
    after `aclose`, it raises [`StreamClosed`][trioinfer.StreamClosed].
    """

    def __init__(
        self,
        request_id: str,
        receive: _Receive,
        clock: LoopClock,
        deadline: float,
        ahead: int = STREAM_AHEAD,
    ) -> None:
        self._id = request_id
        self._receive = receive
        self._clock = clock
        self._now = clock.current_time
        self._checkpoint_if_cancelled = clock.checkpoint_if_cancelled
        # The reader's deadline: the one in effect where the stream was opened (the
        # request's), until _expire reads the reader's own again.
        self._deadline = deadline
        # Responses the model has handed over that the reader has not taken (in the
        # buffer): two counts a response, where the channel's statistics() built an
        # object on every `ready` (1-2 us).
        self._pending = 0
        # The most the model may make that the reader has not taken (`_hand_over`), and
        # what the model waits on for room when it has made them (set as one is taken).
        self._ahead = ahead
        self._room: anyio.Event | None = None
        # The error that ended the stream, raised once the responses before it are read.
        self._error: BaseException | None = None
        # Ends the stream as leaving its block does (open_stream's); None once it ran.
        self._closer: Callable[[], None] | None = None
        self._closed_early = False  # by aclose(), for StreamClosed's message
        # Whether the model's task still runs, and what aclose() waits on to see it end.
        self._producing = False
        self._stopped: anyio.Event | None = None
        self._parameters: Mapping[str, Parameter] = NO_PARAMETERS

    @property
    def id(self) -> str:
        """The request's id (given to ``infer_stream``, or generated)."""
        return self._id

    @property
    def parameters(self) -> Mapping[str, Parameter]:
        """The response parameters of the response last yielded (empty: none).

        Where its model gives some (a Triton Python model's
        ``InferenceResponse(parameters=...)``); read it after each response.
        """
        return self._parameters

    @property
    def ready(self) -> bool:
        """Whether the next ``__anext__`` has its answer at hand: it returns (or raises) at once.

        True while a response the model made waits to be read, once the
        stream has ended (its end, or its error, is what the next read
        gives), and once it is closed. A reader that forwards responses
        (to a socket, a queue) can gather those at hand and pass them on
        together: read on while ``ready`` is True, then write what it
        read at once. The server's streams do that, so that a model's run
        of responses leaves in one write.
        """
        return self._pending > 0 or not self._producing  # ended: the rest, then the end

    def __aiter__(self) -> ResponseStream:
        return self

    async def aclose(self) -> None:
        """Stop the stream now, as leaving its ``async with`` block would; idempotent.

        For an iterator held apart from its block (``contextlib.aclosing``, a
        helper that reads a few responses and returns). The model's generator
        is closed at the ``yield`` it waits at (``GeneratorExit`` there), or
        cancelled in the ``await`` it is in, and has ended when this returns:
        it makes no response after. An unfinished request counts as cancelled
        (as when the caller leaves); iterating afterwards raises
        [`StreamClosed`][trioinfer.StreamClosed]. After the stream's end, or
        its block's, there is nothing left to stop.
        """
        closer, self._closer = self._closer, None
        if closer is not None:
            self._closed_early = True
            closer()
        if self._producing:
            if self._stopped is None:
                self._stopped = anyio.Event()
            await self._stopped.wait()
        else:
            await anyio.lowlevel.checkpoint()

    async def _expire(self) -> None:
        # The deadline read at open has passed: the reader's own decides now (a scope of
        # its may have moved its deadline, or it may read from a shielded one). Past it,
        # a pass of the loop lets the loop cancel the reader's scope (on Trio the first
        # does; asyncio's timer may need another); before it, read on to that one.
        clock = self._clock
        while True:
            deadline = clock.current_effective_deadline()
            if clock.current_time() < deadline:
                self._deadline = deadline
                return
            await clock.checkpoint()

    def _widen(self, ahead: int) -> None:
        # Let the model make up to *ahead* (at most STREAM_AHEAD, more than the stream
        # has) that the reader has not taken: for a server that lent the stream less
        # while its call was busy, and has more to lend now (`_grpc._StreamState`).
        assert self._ahead <= ahead <= max(self._ahead, STREAM_AHEAD)
        self._ahead = ahead
        self._make_room()

    async def _wait_room(self) -> None:
        # The model's side: until it may make one more (the reader took one, or _widen).
        while self._pending >= self._ahead:
            room = self._room = anyio.Event()
            await room.wait()

    def _make_room(self) -> None:
        room = self._room
        if room is not None:
            self._room = None
            room.set()

    def _produced(self) -> None:
        # The model's task has ended (its generator is closed): wake aclose().
        self._producing = False
        if self._stopped is not None:
            self._stopped.set()

    async def __anext__(self) -> Outputs:
        """The next response; ``StopAsyncIteration`` after the last one.

        A reader whose scope is cancelled, or whose deadline has passed, gets
        its ``Cancelled`` here (and no response), also when responses wait
        in the buffer and no pass of the event loop came since the deadline.
        """
        receive = self._receive
        try:
            # A cancelled reader stops here, before it takes a response, and so does
            # one whose deadline has passed: the loop turns a deadline into a
            # cancellation only at its next pass, and a response at hand is taken
            # without one (a model's run of responses is read in one go). Else it
            # waits for one. (A clock read a response; none with no deadline.)
            await self._checkpoint_if_cancelled()
            deadline = self._deadline
            if deadline < math.inf and self._now() >= deadline:
                await self._expire()
            try:
                item = receive.receive_nowait()
            except _WOULD_BLOCK:
                if self._pending > 0:
                    # None at hand, yet some counted: a response handed to a read that
                    # asyncio itself cancelled (asyncio.wait_for) as it came, which
                    # anyio's channel drops. Counted again from none: the model, which
                    # may wait for room for it, goes on (else both waited for ever).
                    self._pending = 0
                    self._make_room()
                item = await receive.receive()
        except _END:
            if self._error is not None:
                raise self._error from None
            raise StopAsyncIteration from None
        except _CLOSED:
            # The block ended (or aclose) closed the channel: the loop's own error would
            # name neither the stream nor what to do.
            if self._closed_early:
                raise StreamClosed(
                    f"the response stream of request {self._id!r} is closed: its aclose() "
                    "was called; it has no more responses"
                ) from None
            raise StreamClosed(
                f"the response stream of request {self._id!r} is closed: its `async with "
                "engine.infer_stream(...)` block has ended; iterate it inside that block"
            ) from None
        self._pending -= 1
        if self._room is not None:  # the model waits for room: it has some now
            self._make_room()
        if item.__class__ is _WithParameters:
            assert isinstance(item, _WithParameters)
            self._parameters = item.parameters
            return item.outputs
        self._parameters = NO_PARAMETERS
        return item  # type: ignore[return-value]  # (Outputs: the class said)


@asynccontextmanager
async def open_stream(
    engine: Engine,
    model: str,
    inputs: Mapping[str, Any],
    priority: int,
    tenant: str | None,
    request_id: str | None,
    *,
    follow_up: bool = False,
    parameters: Mapping[str, Parameter] = NO_PARAMETERS,
    outputs: Sequence[str] | None = None,
    ahead: int = STREAM_AHEAD,
) -> AsyncIterator[ResponseStream]:
    """What `Engine.infer_stream` returns: see its docstring.

    *follow_up*: opened for a request accepted already (a model calling
    another), so admitted while the engine drains (``infer_stream_follow_up``).
    *parameters*: the request's, checked already. *outputs*: the caller's.
    *ahead*: the most responses the model may make that the reader has not
    taken (checked already: an int, at least 1).
    """
    find = engine._follow_up_runner if follow_up else engine._runner
    runner = find(model)
    clock = runner.clock
    gate = engine._gates.get(model)
    wanted = requested_outputs(model, runner.signature, outputs) if outputs else ()
    request_id = request_id if request_id is not None else next_request_id()
    request: Request | None = None
    traced: StreamTrace | None = None
    if gate is not None:
        arrays = validate_inputs(model, runner.signature, inputs, runner.input_limits)
        await clock.checkpoint_if_cancelled()
        if engine._gates.get(model) is not gate:  # replaced or unloaded while we yielded
            runner, gate = find(model), engine._gates.get(model)
            arrays = validate_inputs(model, runner.signature, inputs, runner.input_limits)
    if gate is not None:
        request = Request(
            model,
            arrays,
            id=request_id,
            priority=priority,
            tenant=tenant,
            deadline=clock.current_effective_deadline(),
            arrival=clock.current_time(),
            parameters=parameters,
            requested_outputs=wanted,
        )
        # A sampled stream's spans (trioinfer._tracing); with tracing off, None costs a check.
        traced = engine._tracing.stream(request) if engine._tracing is not None else None
        try:
            replica, instance = gate.admit(request)
        except TrioInferError as exc:
            if traced is not None:
                traced.end("error", exc)
            raise
        if traced is not None:
            traced.admitted(replica)
    send, receive = _channel(ahead)
    deadline = request.deadline if request is not None else clock.current_effective_deadline()
    stream = ResponseStream._create(request_id, receive, clock, deadline, ahead)
    body_error: BaseException | None = None
    abandoned = False
    # The model's task runs in it: cancelled when the stream is closed early.
    producer = anyio.CancelScope()

    def close() -> None:
        # The caller is done with the stream (its block ended, or aclose()).
        nonlocal abandoned
        stream._closer = None
        if gate is not None and request is not None and request._state.status is not Status.DONE:
            # The caller left before the model's last response: the stream ends
            # here, once, as cancelled; its generator is closed at its yield.
            abandoned = True
            request._state.abandoned = True
            gate.runner.cancelled += 1
            gate.runner._end(request)
        receive.close()
        producer.cancel()

    stream._closer = close
    stream._producing = True
    try:
        async with anyio.create_task_group() as tg:
            if request is None:
                tg.start_soon(
                    _one,
                    engine,
                    model,
                    inputs,
                    priority,
                    tenant,
                    request_id,
                    send,
                    stream,
                    producer,
                    follow_up,
                    parameters,
                    wanted,
                )
            else:
                assert gate is not None
                tg.start_soon(
                    _generate, gate, replica, instance, request, send, stream, producer, traced
                )
                tg.start_soon(_watch, request, producer)
            try:
                yield stream
            except BaseException as exc:
                body_error = exc
                raise
            finally:
                close()
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The task group wraps the block's own exception; hand it back as the caller raised it.
        if body_error is not None and _only(group, body_error):
            raise body_error from None
        raise
    finally:
        if traced is not None:
            _end_trace(traced, body_error, abandoned, stream._error)


async def _generate(
    gate: StreamGate,
    replica: Replica,
    instance: StreamingInstance,
    request: Request,
    send: _Send,
    stream: ResponseStream,
    scope: anyio.CancelScope,
    traced: StreamTrace | None,
) -> None:
    runner = gate.runner
    # Each response is checked as an execution's answer is (unbatched: a stream's
    # request runs alone): a caller gets what the model's metadata says.
    check = runner._output_check
    try:
        with scope:
            # The model's generator runs in this task: what current_stream_request reads.
            _stream_request.set(request)
            generator = instance.stream(request.inputs)
            wanted = request.requested_outputs
            state = request._state
            try:
                if traced is None and not wanted:
                    async for outputs in generator:
                        if check is not None:
                            check.check(outputs, 0, replica)
                        if state.response_parameters:
                            await _hand_over(send, stream, _parameterised(state, outputs))
                        else:
                            await _hand_over(send, stream, outputs)
                else:

                    async def checked(outputs: Outputs) -> None:
                        if wanted:
                            # The requested outputs alone, where the model may answer
                            # with those only (as an execution's answer: _runner).
                            if check is not None:
                                outputs = check.requested(outputs, wanted, 0, replica)
                            else:
                                outputs = {name: outputs[name] for name in wanted}
                        elif check is not None:
                            check.check(outputs, 0, replica)
                        if state.response_parameters:
                            await _hand_over(send, stream, _parameterised(state, outputs))
                        else:
                            await _hand_over(send, stream, outputs)

                    if traced is None:
                        async for outputs in generator:
                            await checked(outputs)
                    else:
                        await traced.generate(generator, checked)
            finally:
                # The caller left, was cancelled, or the engine closes: the model stops at
                # the yield it waits at (GeneratorExit there), never later.
                await generator.aclose()
    except _BROKEN:
        pass  # the caller left; it has ended the request already
    except TrioInferError as exc:
        stream._error = exc
        runner.finish(request, error=exc)
    except Exception as exc:  # a backend's bug, not the model's (those are BackendError)
        error = BackendError(
            f"model {runner.config.name!r}: the stream of request {request.id!r} failed: "
            f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        stream._error = error
        runner.finish(request, error=error)
    else:
        if request._state.status is Status.DONE:
            # Ended from outside while the model ran: the caller left (no error), or
            # the model unloaded and the engine closed (EngineClosed), which it must see.
            stream._error = request._state.error
        else:
            runner._request_duration.observe(runner.clock.current_time() - request.arrival)
            runner.finish(request, outputs={})
    finally:
        send.close()
        gate.release(replica)
        stream._produced()


def _end_trace(
    traced: StreamTrace,
    body_error: BaseException | None,
    abandoned: bool,
    stream_error: BaseException | None,
) -> None:
    # How the stream ended, as the reader saw it: its own error or cancellation first.
    if body_error is not None:
        cancelled = isinstance(body_error, anyio.get_cancelled_exc_class())
        traced.end("cancelled" if cancelled else "error", body_error)
    elif abandoned:
        traced.end("abandoned", None)
    elif stream_error is not None:
        traced.end("error", stream_error)
    else:
        traced.end("success", None)


async def _watch(request: Request, producer: anyio.CancelScope) -> None:
    # The runner ends every in-flight request when the model unloads or the engine
    # closes (EngineClosed): then the generator must stop too.
    done = request._state.done
    assert done is not None
    await done.wait()
    producer.cancel()


def _parameterised(state: Any, outputs: Outputs) -> _WithParameters:
    # A response with the parameters its backend gave it (set_response_parameters):
    # taken, so that the next response carries only its own.
    given, state.response_parameters = state.response_parameters, NO_PARAMETERS
    return _WithParameters(outputs, given)


async def _one(
    engine: Engine,
    model: str,
    inputs: Mapping[str, Any],
    priority: int,
    tenant: str | None,
    request_id: str,
    send: _Send,
    stream: ResponseStream,
    scope: anyio.CancelScope,
    follow_up: bool,
    parameters: Mapping[str, Parameter],
    wanted: tuple[str, ...],
) -> None:
    # A model that is not decoupled: its one answer, by the ordinary request path (a
    # follow-up's, also while the engine drains, as a pipeline's step).
    try:
        with scope:
            if follow_up:
                outputs = await engine._infer_step(
                    model,
                    inputs,
                    priority=priority,
                    tenant=tenant,
                    request_id=request_id,
                    parameters=parameters or None,
                )
                send.send_nowait(outputs)  # (the buffer has room: the stream's one)
                stream._pending += 1
            else:
                # infer_detailed: its answer's response parameters go with it.
                result = await engine.infer_detailed(
                    model,
                    inputs,
                    priority=priority,
                    tenant=tenant,
                    request_id=request_id,
                    parameters=parameters or None,
                    outputs=wanted or None,
                )
                if result.parameters:
                    send.send_nowait(_WithParameters(result.outputs, result.parameters))
                else:
                    send.send_nowait(result.outputs)
                stream._pending += 1
    except _BROKEN:
        pass
    except TrioInferError as exc:
        stream._error = exc
    finally:
        send.close()
        stream._produced()


def _only(group: BaseExceptionGroup[BaseException], error: BaseException) -> bool:
    return all(
        leaf is error or (isinstance(leaf, BaseExceptionGroup) and _only(leaf, error))
        for leaf in group.exceptions
    )
