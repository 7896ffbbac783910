"""ModelStreamInfer's requests side by side, bounded, in order per sequence: on virtual time.

`_Service.ModelStreamInfer` runs each request of a stream in a task of the
call's own; these tests give it request messages and a fake per-request step
(`_stream_request`) that takes as long as a test says, so that what runs when
is exact. The real thing, over tritonclient, is in test_grpc.py.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
import trio
import trio.testing

from trioinfer._stream import STREAM_AHEAD
from trioinfer.server import _grpc
from trioinfer.server import _grpc_proto as pb
from trioinfer.server._grpc_h2 import GrpcCall

pytestmark = [pytest.mark.grpc, pytest.mark.streaming]


class FakeService(_grpc._Service):
    """The service with each request's work replaced: it sleeps, then answers its id."""

    def __init__(self, durations: Mapping[str, float]) -> None:
        # What the stream's error responses read of the server: errors' public messages.
        self._state: Any = types.SimpleNamespace(models=types.SimpleNamespace(public_message=str))
        self.durations = durations
        self.started: list[str] = []
        self.running = 0
        self.most_running = 0

    async def _stream_request(
        self,
        request: Any,
        metadata: Mapping[str, str],
        call: GrpcCall,
        stream: _grpc._StreamState,
    ) -> None:
        self.started.append(request.id)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await trio.sleep(self.durations.get(request.id, 0.0))
        finally:
            self.running -= 1
        if request.id.startswith("fail"):
            raise _grpc.RequestError(f"request {request.id} is wrong")
        await stream.send(
            pb.ModelStreamInferResponse(
                infer_response=pb.ModelInferResponse(id=request.id)
            ).SerializeToString()
        )


def message(request_id: str, sequence_id: int | str | None = None, model: str = "m") -> bytes:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    if isinstance(sequence_id, int):
        request.parameters["sequence_id"].int64_param = sequence_id
    elif isinstance(sequence_id, str):
        request.parameters["sequence_id"].string_param = sequence_id
    data: bytes = request.SerializeToString()
    return data


async def run_stream(service: FakeService, messages: list[bytes]) -> list[tuple[float, str, str]]:
    """Run a stream of *messages*; each response as (virtual time, id, error_message)."""
    sent: list[tuple[float, str, str]] = []

    async def requests() -> AsyncIterator[bytes]:
        for data in messages:
            yield data

    async def send(data: bytes) -> None:
        response = pb.ModelStreamInferResponse.FromString(data)
        sent.append((trio.current_time(), response.infer_response.id, response.error_message))

    await service.ModelStreamInfer(requests(), GrpcCall({}, None), send)
    return sent


async def test_requests_run_side_by_side(autojump_clock: trio.testing.MockClock) -> None:
    """Three requests of 3, 2 and 1 s answer at 1, 2 and 3 s: each as it is ready."""
    service = FakeService({"a": 3.0, "b": 2.0, "c": 1.0})
    t0 = trio.current_time()
    sent = await run_stream(service, [message("a"), message("b"), message("c")])
    assert [(t - t0, rid) for t, rid, _ in sent] == [(1.0, "c"), (2.0, "b"), (3.0, "a")]
    assert service.most_running == 3


async def test_a_sequences_requests_run_in_order(autojump_clock: trio.testing.MockClock) -> None:
    """A sequence's requests run one after another, in the order they came; others beside."""
    durations = {"s1": 3.0, "s2": 2.0, "s3": 1.0, "t1": 2.0, "t2": 1.0, "x": 1.0}
    service = FakeService(durations)
    t0 = trio.current_time()
    messages = [
        message("s1", 7),
        message("t1", "seven"),  # another sequence (a string id is never an integer's)
        message("s2", 7),
        message("x"),
        message("t2", "seven"),
        message("s3", 7),
        message("o1", 7, model="other"),  # the same id of another model: its own sequence
    ]
    sent = await run_stream(service, messages)
    at = {rid: t - t0 for t, rid, _ in sent}
    assert at == {"s1": 3.0, "s2": 5.0, "s3": 6.0, "t1": 2.0, "t2": 3.0, "x": 1.0, "o1": 0.0}
    # Started in order within each sequence.
    assert [r for r in service.started if r.startswith("s")] == ["s1", "s2", "s3"]


async def test_zero_and_empty_name_no_sequence(autojump_clock: trio.testing.MockClock) -> None:
    """sequence_id 0 or "" (Triton's "none") does not chain the requests that carry it."""
    service = FakeService({"a": 2.0, "b": 1.0, "c": 2.0, "d": 1.0})
    t0 = trio.current_time()
    sent = await run_stream(
        service, [message("a", 0), message("b", 0), message("c", ""), message("d", "")]
    )
    assert sorted((t - t0, rid) for t, rid, _ in sent) == [
        (1.0, "b"), (1.0, "d"), (2.0, "a"), (2.0, "c")
    ]  # fmt: skip


async def test_a_failed_request_answers_with_its_id_and_the_stream_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An error response carries the request's id (Triton's); a bad message has none to give."""
    service = FakeService({"fail1": 1.0})
    sent = await run_stream(service, [message("fail1"), b"\xff\xff", message("ok")])
    assert [rid for _, rid, _ in sent] == ["", "ok", "fail1"]
    assert sent[0][2].startswith("the request is not a valid ModelInferRequest message")
    assert sent[1][2] == ""
    assert sent[2][2] == "request fail1 is wrong"


async def test_requests_in_flight_are_bounded(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past STREAM_CONCURRENCY running requests, the next is read only once one ends."""
    monkeypatch.setattr(_grpc, "STREAM_CONCURRENCY", 2)
    service = FakeService({"a": 1.0, "b": 2.0, "c": 1.0, "d": 1.0})
    t0 = trio.current_time()
    sent = await run_stream(service, [message(r) for r in "abcd"])
    assert service.most_running == 2
    # c starts when a ends (1 s), d when b or c ends (2 s).
    assert sorted((t - t0, rid) for t, rid, _ in sent) == [
        (1.0, "a"), (2.0, "b"), (2.0, "c"), (3.0, "d")
    ]  # fmt: skip


async def test_a_calls_requests_share_a_bound_on_responses_made_ahead() -> None:
    """What a call's decoupled requests may make ahead of its writer is bounded per call.

    Each request's stream gets ``ahead`` from the call: `STREAM_AHEAD` while the call
    has some of its `STREAM_CALL_AHEAD` to spare, then less, and 1 at least; a request
    that ends gives its share back. With every slot of the call taken, its requests
    hold no more than ``STREAM_CALL_AHEAD`` responses beyond one each (16 each before).
    """

    async def send(*_messages: bytes) -> None:  # pragma: no cover  # nothing is sent
        pass

    stream = _grpc._StreamState(send)
    leases = [stream.lend() for _ in range(_grpc.STREAM_CONCURRENCY)]
    lent = [lease.ahead for lease in leases]
    full = _grpc.STREAM_CALL_AHEAD // (STREAM_AHEAD - 1)
    assert lent[:full] == [STREAM_AHEAD] * full
    assert 1 < lent[full] < STREAM_AHEAD
    assert lent[-1] == 1
    assert sum(lent) == _grpc.STREAM_CALL_AHEAD + len(lent)
    for lease in leases:
        stream.repay(lease)
    assert stream.lend().ahead == STREAM_AHEAD  # a share given back is lent again


class Responses:
    """A request's stream, as `_StreamState` sees it: what it was widened to."""

    def __init__(self) -> None:
        self.widened: list[int] = []

    def _widen(self, ahead: int) -> None:
        self.widened.append(ahead)


async def test_a_request_lent_less_gets_more_as_the_call_frees() -> None:
    """A request started while the call's pool was empty does not keep 1 to its end.

    It streamed with ``ahead`` 1 for its whole life, read one response at a time even
    once the requests before it had ended and given their share back. Now what they
    give back goes to the requests with less, the longest streaming first, up to
    `STREAM_AHEAD` each; the call's requests still hold at most `STREAM_CALL_AHEAD`
    beyond one each.
    """

    async def send(*_messages: bytes) -> None:  # pragma: no cover  # nothing is sent
        pass

    stream = _grpc._StreamState(send)
    full = _grpc.STREAM_CALL_AHEAD // (STREAM_AHEAD - 1)
    early = [stream.lend() for _ in range(full)]
    late = [stream.lend() for _ in range(3)]  # what was left, then 1 and 1
    streams = [Responses() for _ in late]
    for lease, responses in zip(late, streams, strict=True):
        stream.attach(lease, responses)
    assert [lease.ahead for lease in late] == [1 + _grpc.STREAM_CALL_AHEAD % 15, 1, 1]

    def held() -> int:  # beyond one each, by the requests in flight
        return sum(lease.ahead - 1 for lease in [*early, *late])

    stream.repay(early.pop(0))
    # 15 given back: the first late one to 16, the rest of it to the second.
    assert late[0].ahead == STREAM_AHEAD
    assert streams[0].widened == [STREAM_AHEAD]
    assert late[1].ahead == 1 + 15 - (STREAM_AHEAD - 1 - _grpc.STREAM_CALL_AHEAD % 15)
    assert held() == _grpc.STREAM_CALL_AHEAD
    while early:
        stream.repay(early.pop())
        assert held() <= _grpc.STREAM_CALL_AHEAD
    assert [lease.ahead for lease in late] == [STREAM_AHEAD] * 3
    assert streams[2].widened[-1] == STREAM_AHEAD
    for lease in late:
        stream.repay(lease)
    assert stream._spare == _grpc.STREAM_CALL_AHEAD  # all given back


async def test_sends_never_interleave(autojump_clock: trio.testing.MockClock) -> None:
    """A send that waits (the client's window) holds off the others until it is done."""
    sending = 0
    most = 0
    order: list[str] = []

    async def requests() -> AsyncIterator[bytes]:
        for rid in "abc":
            yield message(rid)

    async def send(data: bytes) -> None:
        nonlocal sending, most
        sending += 1
        most = max(most, sending)
        await trio.sleep(1.0)  # a message sent in pieces, waiting for the window
        order.append(pb.ModelStreamInferResponse.FromString(data).infer_response.id)
        sending -= 1

    service = FakeService({})
    await service.ModelStreamInfer(requests(), GrpcCall({}, None), send)
    assert most == 1
    assert sorted(order) == ["a", "b", "c"]


async def test_cancelling_the_call_cancels_every_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The client leaving (the call's scope cancelled) ends every request in flight."""
    service = FakeService({"a": 10.0, "b": 10.0})
    sent: list[bytes] = []

    async def requests() -> AsyncIterator[bytes]:
        yield message("a")
        yield message("b")
        await trio.sleep_forever()

    async def send(data: bytes) -> None:
        sent.append(data)

    with trio.move_on_after(1.0):
        await service.ModelStreamInfer(requests(), GrpcCall({}, None), send)
    assert sent == []
    assert service.running == 0
    assert service.started == ["a", "b"]


# -- the real service ------------------------------------------------------------------


async def test_the_drain_finishes_a_streams_requests_in_flight() -> None:
    """On SIGTERM (shutdown set), every request in flight on a stream gets all its answers."""
    grpc = pytest.importorskip("grpc")
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")
    import numpy as np

    import trioinfer
    from _serve import start_serving
    from trioinfer.server import ServerConfig

    def request(request_id: str) -> Any:
        # repeat_int32: three responses, 100 ms apart.
        message = service_pb2.ModelInferRequest(model_name="repeat_int32", id=request_id)
        for name, datatype, array in (
            ("IN", "INT32", np.array([1, 2, 3], np.int32)),
            ("DELAY", "UINT32", np.array([100, 100, 100], np.uint32)),
            ("WAIT", "UINT32", np.array([0], np.uint32)),
        ):
            message.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
            message.raw_input_contents.append(array.tobytes())
        return message

    first = trio.Event()
    stop = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def call(address: str) -> list[tuple[str, str]]:
        got = []
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            answers = stub.ModelStreamInfer(iter([request("a"), request("b")]), timeout=30)
            for answer in answers:
                got.append((answer.infer_response.id, answer.error_message))
                if len(got) == 2:  # both started: the server is told to stop now
                    trio.from_thread.run_sync(first.set, trio_token=token)
        return got

    got: list[list[tuple[str, str]]] = []
    async with trio.open_nursery() as nursery:
        listening = await start_serving(
            nursery,
            trioinfer.example_repository(),
            grpc_port=0,
            config=ServerConfig(drain_period=20.0),
            shutdown=stop,
        )

        async def client() -> None:
            got.append(await trio.to_thread.run_sync(call, listening.grpc))

        nursery.start_soon(client)
        with trio.fail_after(20):
            await first.wait()
        stop.set()
    [answers] = got
    assert sorted(answers) == [("a", "")] * 3 + [("b", "")] * 3
