"""The gRPC client: V2 gRPC (Triton's ``inference.GRPCInferenceService``) load.

`GrpcTarget` is a model on a V2 gRPC server (trioinfer or Triton). Each
request variant is serialized once, before the run, as a ``ModelInferRequest``
with its values in ``raw_input_contents`` (what tritonclient and perf_analyzer
send). A level's workers share a few HTTP/2 connections (`WORKERS_PER_CHANNEL`
calls in flight on each), driven from a worker thread by the lean client of
`_grpc_raw` (the default) or by ``grpc.aio`` (``client="aio"``, to compare
with), and each answer is recorded in the same windows the HTTP levels use;
Trio's side only starts the thread, swaps measurement windows and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
import trio

from ._inputs import BenchError, Tensor
from ._modes import SequenceStep, ShmRegion, tensor_bytes
from ._stats import Result, _Recorder

if TYPE_CHECKING:
    from ._grpc_raw import _RawGrpcLoop

#: Workers sharing one HTTP/2 channel (connection).
WORKERS_PER_CHANNEL: Final = 16
#: The gRPC load clients: the lean one over plain sockets, or grpcio's asyncio one.
GrpcClient = Literal["raw", "aio"]
_INFER: Final = "/inference.GRPCInferenceService/ModelInfer"
_METADATA: Final = "/inference.GRPCInferenceService/ModelMetadata"
_CONFIG: Final = "/inference.GRPCInferenceService/ModelConfig"
_SHM_REGISTER: Final = "/inference.GRPCInferenceService/SystemSharedMemoryRegister"
_SHM_UNREGISTER: Final = "/inference.GRPCInferenceService/SystemSharedMemoryUnregister"


def _proto() -> Any:
    try:
        import grpc  # noqa: F401

        from ..server import _grpc_proto
    except ImportError as exc:
        raise BenchError(
            f"--protocol grpc needs the 'grpc' extra, which is not installed (no module named "
            f"{exc.name or '?'!r}): install trioinfer with it, e.g. pip install -e "
            "'.[cpu,grpc]' in a clone"
        ) from None
    return _grpc_proto


@attrs.frozen
class GrpcTarget:
    """A V2 gRPC server's model.

    Attributes:
        address: ``host:port``.
        model: The model's name.
        version: The model version, or ``None`` for the server's choice.
    """

    address: str
    model: str
    version: str | None = None

    @classmethod
    def from_url(cls, url: str, model: str, version: str | None = None) -> GrpcTarget:
        """Parse ``grpc://HOST:PORT`` or ``HOST:PORT``.

        Raises:
            BenchError: Not such an address.
        """
        address = url.removeprefix("grpc://")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or "/" in address:
            raise BenchError(f"with --protocol grpc, --url must be grpc://HOST:PORT, got {url!r}")
        return cls(address, model, version)

    @property
    def host_port(self) -> tuple[str, int]:
        """The address as a socket address (IPv6 brackets dropped)."""
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)

    async def metadata(self) -> dict[str, Any]:
        """The model's V2 metadata, from ``ModelMetadata``.

        Raises:
            BenchError: No server, or it does not serve the model (with its message).
        """
        from google.protobuf import json_format

        pb = _proto()
        request = pb.message("ModelMetadataRequest")(name=self.model, version=self.version or "")
        response = await self.call(_METADATA, request, pb.ModelMetadataResponse)
        doc: dict[str, Any] = json_format.MessageToDict(response, preserving_proto_field_name=True)
        for tensor in doc.get("inputs", []):
            tensor["shape"] = [int(d) for d in tensor.get("shape", [])]
        return doc

    async def config(self) -> dict[str, Any]:
        """The model's configuration, from ``ModelConfig``, as Triton's JSON names it.

        Raises:
            BenchError: No server, or it does not serve the model (with its message).
        """
        from google.protobuf import json_format

        pb = _proto()
        request = pb.message("ModelConfigRequest")(name=self.model, version=self.version or "")
        response = await self.call(_CONFIG, request, pb.message("ModelConfigResponse"))
        doc: dict[str, Any] = json_format.MessageToDict(
            response.config, preserving_proto_field_name=True
        )
        return doc

    async def call(self, method: str, request: Any, response_type: Any) -> Any:
        """One unary call of the service on a channel of its own (from a worker thread).

        Raises:
            BenchError: The call failed (with the server's status and message).
        """
        import grpc

        def call() -> Any:
            with grpc.insecure_channel(self.address) as channel:
                stub = channel.unary_unary(
                    method,
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=response_type.FromString,
                )
                return stub(request, timeout=30)

        try:
            return await trio.to_thread.run_sync(call)
        except grpc.RpcError as exc:
            raise BenchError(
                f"grpc://{self.address} answered {exc.code().name} for model {self.model!r}: "
                f"{exc.details()}"
            ) from None

    def requests(self, variants: Sequence[Sequence[Tensor]]) -> list[bytes]:
        """Each variant as a serialized ``ModelInferRequest`` (raw contents)."""
        pb = _proto()
        out = []
        for variant in variants:
            request = pb.ModelInferRequest(model_name=self.model, model_version=self.version or "")
            for tensor in variant:
                request.inputs.add(
                    name=tensor.name, datatype=tensor.datatype, shape=list(tensor.array.shape)
                )
                request.raw_input_contents.append(tensor_bytes(tensor))
            out.append(request.SerializeToString())
        return out

    def sequence_requests(
        self, variants: Sequence[Sequence[Tensor]]
    ) -> Callable[[int, SequenceStep], bytes]:
        """A maker of serialized requests: variant *n* as step *step* of its sequence.

        Each variant is serialized once; a request is its bytes followed by its
        sequence parameters, which protobuf merges into the same message.
        """
        pb = _proto()
        bases = self.requests(variants)

        def make(n: int, step: SequenceStep) -> bytes:
            extra = pb.ModelInferRequest()
            extra.parameters["sequence_id"].int64_param = step.id
            extra.parameters["sequence_start"].bool_param = step.start
            extra.parameters["sequence_end"].bool_param = step.end
            return bases[n % len(bases)] + bytes(extra.SerializeToString())

        return make

    def shm_requests(self, regions: Sequence[ShmRegion]) -> list[bytes]:
        """For each region, the serialized request whose inputs and outputs lie in it."""
        pb = _proto()
        out = []
        for region in regions:
            request = pb.ModelInferRequest(model_name=self.model, model_version=self.version or "")
            for name, datatype, shape, offset, size in region.inputs:
                tensor = request.inputs.add(name=name, datatype=datatype, shape=list(shape))
                _in_region(tensor.parameters, region.name, offset, size)
            for name, offset, size in region.outputs:
                _in_region(request.outputs.add(name=name).parameters, region.name, offset, size)
            out.append(request.SerializeToString())
        return out

    async def register_regions(self, regions: Sequence[ShmRegion]) -> None:
        """Register each region with the server's system shared-memory extension.

        Raises:
            BenchError: The server refused one (with its status and message).
        """
        pb = _proto()
        for region in regions:
            request = pb.message("SystemSharedMemoryRegisterRequest")(
                name=region.name, key=region.key, offset=0, byte_size=region.byte_size
            )
            try:
                await self.call(
                    _SHM_REGISTER, request, pb.message("SystemSharedMemoryRegisterResponse")
                )
            except BenchError as exc:
                raise BenchError(
                    f"the server refused to register the shared-memory region "
                    f"{region.name!r}: {exc}"
                ) from None

    async def unregister_regions(self, regions: Sequence[ShmRegion]) -> None:
        """Unregister each region (one the server does not know is no error)."""
        pb = _proto()
        for region in regions:
            request = pb.message("SystemSharedMemoryUnregisterRequest")(name=region.name)
            with contextlib.suppress(BenchError):
                await self.call(
                    _SHM_UNREGISTER, request, pb.message("SystemSharedMemoryUnregisterResponse")
                )


def _in_region(parameters: Any, region: str, offset: int, size: int) -> None:
    # A tensor's place in a shared-memory region, as Triton's parameters name it.
    parameters["shared_memory_region"].string_param = region
    parameters["shared_memory_offset"].int64_param = offset
    parameters["shared_memory_byte_size"].int64_param = size


@attrs.define(eq=False)
class _GrpcLoop:
    """One level's workers: tasks of a ``grpc.aio`` loop, run in a worker thread."""

    address: str
    requests: Sequence[bytes]
    recorder: _Recorder
    count: int
    _stopping: bool = False

    def stop(self) -> None:
        """Ask the workers to stop (from any thread); each does after its answer."""
        self._stopping = True

    def run(self) -> None:
        """Run the level until `stop` (blocks the calling thread)."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        import grpc

        channels = [
            grpc.aio.insecure_channel(self.address)
            for _ in range(math.ceil(self.count / WORKERS_PER_CHANNEL))
        ]
        try:
            calls = [channel.unary_unary(_INFER) for channel in channels]
            await asyncio.gather(
                *(self._worker(calls[i // WORKERS_PER_CHANNEL], i) for i in range(self.count))
            )
        finally:
            for channel in channels:
                await channel.close()

    async def _worker(self, call: Any, first: int) -> None:
        import grpc

        n = first
        requests = self.requests
        recorder = self.recorder
        while not self._stopping:
            start = time.perf_counter_ns()
            try:
                await call(requests[n % len(requests)])
            except grpc.RpcError as exc:
                status = exc.code().name
                recorder.window.errors[status] += 1
                recorder.first_error.setdefault(status, exc.details() or "")
            else:
                recorder.window.latencies.append(time.perf_counter_ns() - start)
            n += 1


async def run_grpc_level(
    target: GrpcTarget,
    requests: Sequence[bytes],
    concurrency: int,
    recorder: _Recorder,
    measure: Callable[[_Recorder], Awaitable[Result]],
    *,
    client: GrpcClient = "raw",
    streaming: bool = False,
    next_request: Callable[[int, int], bytes] | None = None,
    schedule: Iterator[int] | None = None,
    backlog_limit: int = 0,
) -> Result:
    """One level over gRPC: *concurrency* workers; *measure* counts the windows.

    Closed loop, or with *schedule* (the raw client) an open loop: requests due
    at its offsets (ns) go to the *concurrency* workers, a fixed pool, and wait
    in a backlog of at most *backlog_limit* when all are busy.

    *client* ``"raw"`` is the lean client (`_grpc_raw`); ``"aio"`` is grpcio's.
    With *streaming* (the raw client) each worker sends its requests one after
    another on one ``ModelStreamInfer`` stream, each done at its final response.
    *next_request* (the raw client) makes each request from its connection's
    and worker's index.
    """
    from ._grpc_raw import _RawGrpcLoop  # hpack: the grpc extra's

    if client == "aio":
        loop: _GrpcLoop | _RawGrpcLoop = _GrpcLoop(target.address, requests, recorder, concurrency)
    else:
        loop = _RawGrpcLoop(
            target.host_port,
            target.address,
            requests,
            recorder,
            concurrency,
            streams_per_connection=WORKERS_PER_CHANNEL,
            streaming=streaming,
            next_request=next_request,
            schedule=schedule,
            backlog_limit=backlog_limit,
        )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, loop.run)
            try:
                result = await measure(recorder)
            finally:
                loop.stop()
    finally:
        if isinstance(loop, _RawGrpcLoop):
            loop.close()
    return result
