"""Triton's generate extension: ``POST .../generate`` and ``.../generate_stream`` (SSE).

The request is one JSON object: each top-level key names a model input and
holds its value (a JSON scalar, or a nested list, for a tensor of that
shape; a value with fewer dimensions than the input gets leading dimensions
of 1: ``"WAIT": 5`` is ``[5]``). Every other top-level key is a request
parameter, as Triton maps them (``{"text_input": "hi", "max_tokens": 16,
"temperature": 0.7}``), and so is each key of an optional ``parameters``
object: each a string, number or boolean. ``priority``, ``timeout`` in
microseconds, and a stateful model's ``sequence_id``, ``sequence_start``
and ``sequence_end`` mean what they mean for ``infer``; the others reach the
model as the request's parameters (see `model_parameters`). A request naming a sequence runs
through the model's sequence batcher as an ``infer`` request does, and answers
with its one response on either route; a decoupled model, never stateful,
refuses one (400) rather than run it outside any sequence.

A response is one JSON object: ``model_name``, ``model_version``, and each
output by name: a scalar when it holds one element, else a nested list; a
``BYTES`` output as text, and one holding bytes that are not UTF-8 is refused
(400, or the stream's last event), as a plain-JSON ``infer`` response refuses
it, never sent altered.

``/generate`` answers with exactly one response (``application/json``): a
decoupled model that sends none or more than one is an error (400). A model
that is not decoupled answers both routes with its one response.
``/generate_stream`` answers ``text/event-stream``, one ``data: {...}`` event
per response as the model yields it. An error before the first response is an
ordinary JSON error with its status; an error after it is a last event
``data: {"error": "..."}`` (the status, 200, was sent already); so is a
stream still running when the server's drain period ends at shutdown ("the
server shut down before the stream ended"), so that a client can tell a cut
stream from a whole one. A client that disconnects cancels the request: the
model's generator stops at the ``yield`` it waits at.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from typing import Any, Final, final

import anyio
import numpy as np
from starlette.types import Message, Receive, Scope, Send

from .._exceptions import DeadlineExceeded, InvalidInput, TrioInferError
from .._request import Outputs, Parameter
from .._sequence import SequenceFlags
from .._tensors import ModelSignature, TensorSpec
from ._app import (
    ROUTING_KEY_HEADER,
    ServerState,
    _error_headers,
    _Headers,
    _must_close,
    _read_body,
    _rerouted,
    http_forwarded,
    schedule_parameters,
    send_whole,
    status_for,
    stream_sequence,
    with_headers,
)
from ._codec import RequestError, _json_text, dumps, loads_json
from ._errors import ClientLeft, NotReady
from ._forward import forward_regex
from ._models import ServedVersion

__all__ = ["GenerateEndpoint", "decode_generate_request", "encode_generate_response"]

log = logging.getLogger("trioinfer.server")

_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
#: How long the error event of a stream cut at shutdown may take to leave.
_LAST_EVENT_S: Final = 0.5
#: What a numeric input accepts from JSON, by the kind of its dtype.
_KINDS: Final = {"i": "iu", "u": "iu", "f": "iuf", "b": "b", "O": "U"}


def decode_generate_request(
    body: object, signature: ModelSignature, model: str
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, Any]]:
    """The inputs and parameters of a generate request's JSON object.

    Raises:
        RequestError: Not an object, a key that is not an input, a value
            that does not fit its input's dtype.
    """
    if not isinstance(body, dict):
        raise RequestError(
            f"the generate request must be a JSON object of inputs by name, got "
            f"{type(body).__name__}"
        )
    given = body.get("parameters", {})
    if not isinstance(given, dict):
        raise RequestError(
            "'parameters' must be an object of names to strings, numbers or booleans"
        )
    specs = {spec.name: spec for spec in signature.inputs}
    inputs = {}
    parameters: dict[str, Any] = {}
    for key, value in body.items():
        if key == "parameters":
            continue
        spec = specs.get(key)
        if spec is None:
            # Triton's mapping: a key that names no input is a parameter.
            parameters[key] = value
        else:
            inputs[key] = _tensor(spec, value)
    extra = list(parameters)
    parameters.update(given)
    for key, value in parameters.items():
        if value.__class__ not in (str, int, float, bool):
            raise RequestError(
                f"parameter {key!r} must be a string, number or boolean, got "
                f"{_json_kind(value)} (model {model!r} has inputs "
                f"{', '.join(map(repr, specs))}; any other key is a parameter)"
            )
    if extra and (missing := sorted(signature._required_names - inputs.keys())):
        # Triton's mapping takes a misspelt input for a parameter: say so, with the
        # input the engine would say is missing.
        raise RequestError(
            f"model {model!r} needs input {', '.join(map(repr, missing))}; the request's "
            + _listed(extra)
            + (
                " names no input: it was taken as a parameter"
                if len(extra) == 1
                else " name no input: they were taken as parameters"
            )
            + f" (its inputs are {', '.join(map(repr, specs))})"
        )
    return inputs, parameters


def _listed(keys: list[str]) -> str:
    # 'a', 'b' and 'c'.
    names = [repr(key) for key in keys]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _json_kind(value: object) -> str:
    # What a JSON value is, in JSON's words.
    if value is None:
        return "null"
    return "a list" if isinstance(value, list) else "an object"


def _tensor(spec: TensorSpec, value: object) -> np.ndarray[Any, Any]:
    where = f"input {spec.name!r} ({spec.describe()})"
    try:
        raw = np.asarray(value)
    except ValueError:  # a ragged list
        raise RequestError(f"{where} must be a scalar or a rectangular nested list") from None
    dtype = spec.dtype
    if dtype is None:  # a type numpy has no dtype for: the engine's check says so
        return raw
    allowed = _KINDS.get(dtype.kind, "")
    if raw.dtype.kind not in allowed or (raw.size == 0 and raw.dtype.kind == "f" and allowed):
        if raw.size:
            # The value as the client wrote it, in JSON (true, "a"): tolist() gives the
            # Python value, not numpy's repr of it (np.str_('a')).
            first = dumps(raw.reshape(-1)[:1].tolist()[0]).decode()
            raise RequestError(f"{where} cannot hold JSON values like {first}")
        raw = raw.astype(dtype)  # [] parses as float64: an empty tensor of any dtype
    if dtype.kind == "O":
        array = raw.astype(object)
    else:
        array = raw.astype(dtype)
        if dtype.kind in "iu" and raw.size and not np.array_equal(array, raw):
            raise RequestError(f"{where} has a value out of its range")
        if dtype.kind == "f" and np.isinf(array).any() and not np.isinf(raw).any():
            raise RequestError(f"{where} has a value out of its range")
    if array.ndim < spec.rank:
        array = array.reshape((1,) * (spec.rank - array.ndim) + array.shape)
    return array


def encode_generate_response(
    served: ServedVersion,
    outputs: Outputs,
    signature: ModelSignature,
    parameters: Mapping[str, Parameter] | None = None,
) -> dict[str, Any]:
    """One response's JSON object: the model, its version, each output by name.

    The response's *parameters* (a Triton Python model's response
    parameters) are keys of it too, as Triton's generate maps them, but for
    one named as an output or ``model_name``/``model_version``, which stay.

    Raises:
        RequestError: A ``BYTES`` output holds bytes that are not UTF-8 (or a str
            with lone surrogates), which no JSON string carries as they are: refused
            as a plain-JSON ``infer`` response refuses them, never sent altered.
    """
    response: dict[str, Any] = {"model_name": served.model, "model_version": str(served.version)}
    for spec in signature.outputs:
        array = outputs[spec.name]
        if array.size == 1:
            value = array.reshape(-1)[0]
            value = value.item() if isinstance(value, np.generic) else value
        else:
            value = array.tolist()
        try:
            response[spec.name] = _text(value)
        except UnicodeError:
            raise _not_text(spec.name, array) from None
    if parameters:
        for key, given in parameters.items():
            response.setdefault(key, given)
    return response


def _text(value: Any) -> Any:
    # Bytes as the text they hold; UnicodeError for bytes that are not UTF-8, and for
    # a str no UTF-8 encodes (lone surrogates, a model's decode(errors="surrogateescape")).
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str) and not value.isascii():
        value.encode("utf-8")
        return value
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def _not_text(name: str, array: np.ndarray[Any, Any]) -> RequestError:
    items = array.reshape(-1).tolist()
    index = next(i for i, item in enumerate(items) if not _json_text(item))
    return RequestError(
        f"output {name!r} holds bytes that are not UTF-8 (element {index} of the flattened "
        "output), which a generate response (JSON text) cannot carry unaltered; POST "
        ".../infer asking for it as binary data (binary_data_output = true, Triton's binary "
        "tensor extension), or gRPC, sends it as it is"
    )


def _timeout_text(timeout: float | None) -> str:
    """*timeout* (seconds) as the request gave it, for messages."""
    return f"{(timeout or 0.0) * 1e6:.0f} µs"


def _event(value: object) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


def _cut_message(drain_period: float) -> str:
    return (
        "the server shut down before the stream ended: it was still running when the "
        f"drain period of {drain_period:g} s ran out; the events before this one are all "
        "the model sent (send the request again to a server that is up)"
    )


async def _last_event(send: Send, message: str, before: list[bytes]) -> None:
    # Sent while cancelled, so shielded, and briefly: a client that reads nothing holds
    # the shutdown up no longer than this. (A send the cancellation cut short has marked
    # the connection gone, and this one then writes nothing, never half a frame after it.)
    # *before*: events made and not yet written, which go first.
    body = b"".join([*before, _event({"error": message})])
    with anyio.move_on_after(_LAST_EVENT_S, shield=True):
        await send({"type": "http.response.body", "body": body})


@final
class GenerateEndpoint:
    """``POST /v2/models/{m}[/versions/{v}]/generate[_stream]`` as a raw ASGI app."""

    def __init__(self, state: ServerState, *, stream: bool) -> None:
        self._state = state
        self._stream = stream
        self._tracing = state.models.engine._tracing
        self._forward = forward_regex(
            state.config.http_header_forward_pattern, option="http_header_forward_pattern"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._tracing is None:
            await self._answer(scope, receive, send)
        else:
            # In a server span parented by the traceparent header, as infer is.
            await self._tracing.serve_http(
                scope,
                send,
                lambda send: self._answer(scope, receive, send),
                "generate_stream" if self._stream else "generate",
            )

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self._state
        params = scope["path_params"]
        model, version = params["model"], params.get("version")
        started = False

        async def start(status: int, headers: list[tuple[bytes, bytes]]) -> None:
            nonlocal started
            started = True
            await send({"type": "http.response.start", "status": status, "headers": headers})

        state.in_flight.http += 1
        picked: list[ServedVersion] = []  # the version it went to, once picked
        try:
            try:
                await self._serve(scope, receive, send, start, model, version, picked)
            except ClientLeft:
                return  # there is nobody to answer
            except TrioInferError as exc:
                state.metrics.count(model, version, exc, *picked)
                if status_for(exc) == 500:  # as error_response and gRPC do: the server's fault
                    log.error("request failed: %s: %s", type(exc).__name__, exc)  # noqa: TRY400
                message = state.models.public_message(exc)
                if started:  # the status went out with the first event: say it in one more
                    if self._tracing is not None:
                        self._tracing.answered_late(exc)
                    await send({"type": "http.response.body", "body": _event({"error": message})})
                    return
                body = dumps({"error": message})
                extra = [(k.encode(), v.encode()) for k, v in _error_headers(exc).items()]
                extra.append((b"content-type", b"application/json"))
                if _must_close(scope):
                    extra.append((b"connection", b"close"))
                await start(status_for(exc), [(b"content-length", str(len(body)).encode()), *extra])
                await send({"type": "http.response.body", "body": body})
        finally:
            state.in_flight.http -= 1

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        start: Any,
        model: str,
        version: str | None,
        picked: list[ServedVersion],
    ) -> None:
        state = self._state
        if not state.ready:
            raise NotReady("the server is shutting down and takes no new requests")
        headers = _Headers(scope["headers"])
        state.check_token(headers, admin=False)
        served = state.models.resolve(model, version, key=headers.get(ROUTING_KEY_HEADER))
        if self._tracing is not None:
            self._tracing.served_version(served.version)
        limits = state.config.limits
        body = await _read_body(scope, receive, headers, limits)
        if version is None:
            # Its version may have been retired while the body arrived: routed again.
            served = _rerouted(state, served, headers, self._tracing)
        parsed = loads_json(body, limits, "the generate request")
        # Read as JSON, it goes to *served*, whose signature its inputs are read by:
        # its errors count on that version from here on (before, on none: Metrics.count).
        picked.append(served)
        signature = served.info.signature
        inputs, parameters = decode_generate_request(parsed, signature, served.model)
        priority, timeout = schedule_parameters(parameters, served)
        sequence = stream_sequence(served, parameters)
        watch = scope.get("extensions", {}).get("trioinfer.cancel_on_disconnect")
        error: TrioInferError | None = None
        async with contextlib.AsyncExitStack() as stack:
            if watch is None or not watch():
                # Another HTTP layer: a task of ours watches for the client leaving.
                group = await stack.enter_async_context(anyio.create_task_group())
                group.start_soon(_watch_disconnect, receive, group.cancel_scope)
                stack.callback(group.cancel_scope.cancel)
            try:
                await self._respond(
                    served,
                    signature,
                    inputs,
                    priority,
                    timeout,
                    sequence,
                    with_headers(parameters, http_forwarded(self._forward, scope["headers"])),
                    send,
                    start,
                )
            except TrioInferError as exc:
                error = exc  # raised out of a task group it would arrive in an ExceptionGroup
            except anyio.get_cancelled_exc_class():
                # The client left, or the server stops without waiting: nobody reads on.
                state.metrics.cancelled(served)
                raise
        if error is not None:
            raise error

    async def _respond(
        self,
        served: ServedVersion,
        signature: ModelSignature,
        inputs: dict[str, np.ndarray[Any, Any]],
        priority: int,
        timeout_s: float | None,
        sequence: SequenceFlags | None,
        parameters: Mapping[str, Parameter] | None,
        send: Send,
        start: Any,
    ) -> None:
        state = self._state
        engine = state.models.engine
        streaming = self._stream
        answered = 0
        streamed = False  # the status and some events have gone out, the body goes on
        first = b""
        # Events made and not written yet: while the stream has its next response at
        # hand (ResponseStream.ready) they wait, and a model's run of responses leaves
        # in one write (a write and a pass of the loop for each measured 3.4x the CPU).
        events: list[bytes] = []
        # The request's timeout: a write it would cut part-way goes out whole first.
        scope = anyio.CancelScope(deadline=math.inf)

        async def flush() -> None:
            body = events[0] if len(events) == 1 else b"".join(events)
            events.clear()
            message = {"type": "http.response.body", "body": body, "more_body": True}
            await send_whole(scope, send, message)

        async def answer(
            outputs: Outputs, given: Mapping[str, Parameter] | None = None, more: bool = False
        ) -> None:
            # *more*: another response is at hand; this one's event may wait for it.
            nonlocal answered, streamed, first
            answered += 1
            response = encode_generate_response(served, outputs, signature, given)
            if not streaming:
                if answered > 1:
                    raise InvalidInput(
                        f"model {served.model!r} sent more than one response; "
                        "POST .../generate_stream for all of them"
                    )
                first = dumps(response)
                return
            if answered == 1:
                await start(200, list(_SSE_HEADERS))
                streamed = True
            events.append(_event(response))
            if not more:
                await flush()

        try:
            if timeout_s is not None:
                scope.deadline = anyio.current_time() + timeout_s
            with scope:
                if sequence is None:
                    async with engine.infer_stream(
                        served.engine_name, inputs, priority=priority, parameters=parameters
                    ) as responses:
                        async for outputs in responses:
                            await answer(outputs, responses.parameters, responses.ready)
                else:
                    # A stateful model's request: through its sequence batcher, as infer's.
                    await answer(
                        await engine.infer(
                            served.engine_name,
                            inputs,
                            priority=priority,
                            sequence=sequence,
                            parameters=parameters,
                        )
                    )
        except anyio.get_cancelled_exc_class():
            if streamed and not state.ready:
                # Cut at the end of the server's drain: one last event says so, or the
                # client could not tell this stream from one that ended whole.
                await _last_event(send, _cut_message(state.config.drain_period), events)
            raise
        except TrioInferError:
            if events:
                await flush()  # the responses before the error, then its event
            raise
        if scope.cancelled_caught:
            # Events held for the rest of their run leave first: the stream gave their
            # responses before the deadline (it refuses any read past it), so they were
            # made in time, as those before a model's error. Then the deadline's error.
            if events:
                await flush()
            raise DeadlineExceeded(
                f"the request's timeout of {_timeout_text(timeout_s)} passed before its "
                "last response"
            )
        state.models.mark_inference(served)
        state.metrics.succeeded(served)
        if streaming:
            if not answered:
                await start(200, list(_SSE_HEADERS))
            await send({"type": "http.response.body", "body": b"".join(events)})
            return
        if not answered:
            raise InvalidInput(
                f"model {served.model!r} sent no response; /generate needs exactly one"
            )
        await start(
            200,
            [(b"content-length", str(len(first)).encode()), (b"content-type", b"application/json")],
        )
        await send({"type": "http.response.body", "body": first})


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
