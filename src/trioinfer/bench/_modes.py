"""perf_analyzer's modes beyond one request, one answer: streaming, sequences, shared memory.

`check_model` reads a model's configuration (Triton's JSON: decoupled,
``sequence_batching``) and says which mode it needs before any load;
`_Sequencer` hands each closed-loop worker its sequences (ids from a range,
lengths varied around a base, as perf_analyzer makes them); `open_regions`
makes one system shared-memory region per connection, registers them and,
whatever happens, unregisters and removes them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, Literal, Protocol

import attrs
import numpy as np
import trio

from ._inputs import BenchError, Tensor

#: perf_analyzer's defaults: a sequence's base length and its variation (percent).
DEFAULT_SEQUENCE_LENGTH: Final = 20
DEFAULT_SEQUENCE_VARIATION: Final = 20.0
#: perf_analyzer's default number of sequences in flight in an open loop (--num-of-sequences).
DEFAULT_OPEN_SEQUENCES: Final = 4
#: perf_analyzer's default size of each output's part of a shared-memory region (bytes).
DEFAULT_OUTPUT_SHM_SIZE: Final = 102_400
#: Where POSIX shared-memory objects live (what ``shm_open`` opens on Linux).
SHM_DIR: Final = "/dev/shm"

#: ``--shared-memory``: none, or system shared memory (CUDA is not supported).
SharedMemory = Literal["none", "system"]


@attrs.frozen
class Modes:
    """How each request is made, beyond its inputs (perf_analyzer's modes).

    Attributes:
        streaming: Decoupled models: each request's responses are streamed, and
            counted to the last.
        sequence_length: Stateful models: the base number of requests in a
            sequence; ``None``: `DEFAULT_SEQUENCE_LENGTH` for a stateful model.
        sequence_variation: Percent by which a sequence's length varies around
            the base.
        sequence_ids: The first sequence id, and the end of the range (excluded;
            ``None``: no end).
        open_sequences: Open loop: how many sequences are in flight, each on a
            connection (in-process: a worker) of its own, taking due requests in
            turn (perf_analyzer's ``--num-of-sequences``).
        shared_memory: ``"system"``: inputs and outputs in a shared-memory
            region per connection.
        output_shm_size: Bytes of the region per output.
    """

    streaming: bool = False
    sequence_length: int | None = None
    sequence_variation: float = DEFAULT_SEQUENCE_VARIATION
    sequence_ids: tuple[int, int | None] = (1, None)
    open_sequences: int = DEFAULT_OPEN_SEQUENCES
    shared_memory: SharedMemory = "none"
    output_shm_size: int = DEFAULT_OUTPUT_SHM_SIZE


def check_model(config: Mapping[str, Any], modes: Modes, model: str) -> Modes:
    """Check *modes* against the model's configuration (Triton's JSON); return them completed.

    A decoupled model needs ``--streaming`` and only it takes it; a stateful
    one (``sequence_batching``) gets sequences of `DEFAULT_SEQUENCE_LENGTH`
    unless ``--sequence-length`` says otherwise, and only it takes that. An
    empty *config* (a server without the configuration endpoint) is taken at
    the user's word.

    Raises:
        BenchError: A mode the model cannot take, or one it needs and was not given.
    """
    if not config:
        return modes
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    stateful = "sequence_batching" in config
    if decoupled and not modes.streaming:
        raise BenchError(
            f"model {model!r} is decoupled (it streams its responses): add --streaming to "
            "count each request's responses"
        )
    if modes.streaming and not decoupled:
        raise BenchError(
            f"model {model!r} is not decoupled (it answers each request once): --streaming "
            "is for models that stream their responses; leave it out"
        )
    default = Modes()
    sequence_flags = (
        modes.sequence_length is not None
        or modes.sequence_ids != default.sequence_ids
        or modes.open_sequences != default.open_sequences
    )
    if sequence_flags and not stateful:
        raise BenchError(
            f"model {model!r} is not stateful (its config has no sequence_batching): "
            "--sequence-length, --sequence-id-range and --num-of-sequences are for sequence "
            "models; leave them out"
        )
    if stateful and modes.sequence_length is None:
        return attrs.evolve(modes, sequence_length=DEFAULT_SEQUENCE_LENGTH)
    return modes


@attrs.frozen
class SequenceStep:
    """One request's place in its sequence: the parameters perf_analyzer sends."""

    id: int
    start: bool
    end: bool

    def parameters(self) -> dict[str, Any]:
        """``sequence_id``, ``sequence_start`` and ``sequence_end``, as tritonclient sends them."""
        return {"sequence_id": self.id, "sequence_start": self.start, "sequence_end": self.end}


class _Sequencer:
    """Sequences for a level's workers: ids in turn from the range, lengths around the base.

    Each worker (`slot`) runs one sequence at a time, so a level of C workers
    has C sequences in flight; an id comes back into use only after every other
    id of the range has (a range with fewer ids than sequences in flight is refused
    before the run, where the levels are known).
    """

    def __init__(self, modes: Modes, seed: int) -> None:
        first, end = modes.sequence_ids
        self._ids: Iterator[int] = (
            itertools.cycle(range(first, end)) if end is not None else itertools.count(first)
        )
        assert modes.sequence_length is not None
        self._length = modes.sequence_length
        self._variation = modes.sequence_variation / 100
        self._rng = np.random.default_rng(seed)

    def _next(self) -> tuple[int, int]:
        # A new sequence: its id and its length (at least 1).
        spread = self._rng.uniform(-self._variation, self._variation) if self._variation else 0.0
        return next(self._ids), max(1, round(self._length * (1 + spread)))

    def slot(self) -> Iterator[SequenceStep]:
        """One worker's requests, sequence after sequence, endlessly."""
        while True:
            sequence_id, length = self._next()
            for i in range(length):
                yield SequenceStep(sequence_id, i == 0, i == length - 1)


def tensor_bytes(tensor: Tensor) -> bytes:
    """A tensor's values as they lie in shared memory (and in gRPC's raw contents).

    Little-endian, row-major; ``BYTES`` elements each after its 4-byte length.
    """
    if tensor.datatype == "BYTES":
        parts = []
        for item in tensor.array.ravel().tolist():
            data = item if isinstance(item, bytes) else str(item).encode()
            parts += [len(data).to_bytes(4, "little"), data]
        return b"".join(parts)
    array = np.ascontiguousarray(tensor.array)
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


@attrs.frozen
class ShmRegion:
    """One region: its name on the server, its key under /dev/shm, and its layout.

    Attributes:
        name: The name it is registered under.
        key: Its POSIX shared-memory key (``/name``).
        inputs: Each input's (name, datatype, shape, offset, byte size).
        outputs: Each output's (name, offset, byte size).
        byte_size: The whole region.
    """

    name: str
    key: str
    inputs: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    outputs: tuple[tuple[str, int, int], ...]
    byte_size: int


def make_regions(
    count: int, tensors: Sequence[Tensor], outputs: Sequence[str], output_size: int
) -> list[ShmRegion]:
    """Create *count* regions under /dev/shm, each holding *tensors* and room for *outputs*.

    The caller registers them and, at the end, `remove_regions` them; regions
    made before a failure here are removed before it is raised.

    Raises:
        BenchError: A region cannot be created (no /dev/shm, no space).
    """
    blobs = [tensor_bytes(t) for t in tensors]
    inputs = []
    offset = 0
    for tensor, blob in zip(tensors, blobs, strict=True):
        inputs.append((tensor.name, tensor.datatype, tuple(tensor.array.shape), offset, len(blob)))
        offset += len(blob)
    layout = []
    for name in outputs:
        layout.append((name, offset, output_size))
        offset += output_size
    content = b"".join(blobs)
    regions: list[ShmRegion] = []
    try:
        for i in range(count):
            name = f"trioinfer_bench_{os.getpid()}_{i}"
            region = ShmRegion(name, f"/{name}", tuple(inputs), tuple(layout), max(offset, 1))
            fd = os.open(f"{SHM_DIR}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            regions.append(region)
            try:
                os.ftruncate(fd, region.byte_size)
                os.pwrite(fd, content, 0)
            finally:
                os.close(fd)
    except OSError as exc:
        remove_regions(regions)
        raise BenchError(
            f"cannot create a shared-memory region under {SHM_DIR}: {exc.strerror or exc}"
        ) from None
    return regions


def remove_regions(regions: Sequence[ShmRegion]) -> None:
    """Remove the regions' /dev/shm objects (the server keeps no mapping once unregistered)."""
    for region in regions:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{SHM_DIR}/{region.name}")


def shm_request_doc(region: ShmRegion) -> dict[str, Any]:
    """A V2 infer request (JSON) whose inputs and outputs all lie in *region*."""

    def where(offset: int, size: int) -> dict[str, Any]:
        return {
            "shared_memory_region": region.name,
            "shared_memory_byte_size": size,
            "shared_memory_offset": offset,
        }

    return {
        "inputs": [
            {"name": name, "datatype": datatype, "shape": list(shape), "parameters": where(o, n)}
            for name, datatype, shape, o, n in region.inputs
        ],
        "outputs": [{"name": name, "parameters": where(o, n)} for name, o, n in region.outputs],
    }


class _RegionServer(Protocol):
    # What `open_regions` needs of a target (HttpTarget, GrpcTarget).
    async def register_regions(self, regions: Sequence[ShmRegion]) -> None: ...
    async def unregister_regions(self, regions: Sequence[ShmRegion]) -> None: ...


@asynccontextmanager
async def open_regions(
    server: _RegionServer,
    count: int,
    tensors: Sequence[Tensor],
    outputs: Sequence[str],
    output_size: int,
) -> AsyncIterator[list[ShmRegion]]:
    """Make *count* regions (`make_regions`), register them, and yield them.

    On the way out, whatever ends the block (its end, an error, Ctrl-C, a
    cancellation), every region is unregistered and its /dev/shm object removed.

    Raises:
        BenchError: A region cannot be made, or the server refused one (its message).
    """
    regions = make_regions(count, tensors, outputs, output_size)
    try:
        await server.register_regions(regions)
        yield regions
    finally:
        with trio.CancelScope(shield=True):
            try:
                await server.unregister_regions(regions)
            finally:
                remove_regions(regions)
