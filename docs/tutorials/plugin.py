"""Writing plugins: a shortest-job-first scheduler and a small backend, checked and used.

Run it with ``python docs/tutorials/plugin.py``; the docs' test suite runs it too.
A real plugin would live in its own package and declare entry points (see the how-to).
"""

# --8<-- [start:imports]
import heapq
import itertools
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

import trioinfer
from trioinfer.lowlevel import Execution, Placement, Request, RequestQueue, WorkerThread
from trioinfer.testing import (
    FakeBackend,
    check_backend,
    check_batcher,
    check_fallback,
    check_scheduler,
)

# --8<-- [end:imports]


# --8<-- [start:scheduler]
class ShortestJobFirst:
    """Run the waiting request with the fewest rows first; ties go in arrival order.

    push and pop are O(log n). remove is O(1): it forgets the request, and pop
    skips heap entries that are no longer live ("lazy deletion").
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: set[Request] = set()
        self._numbers = itertools.count()  # breaks ties, so requests are never compared

    def push(self, request: Request) -> None:
        if request in self._live:  # each request is pushed once: say so to who did not
            raise ValueError(f"request {request.id!r} is already queued")
        self._live.add(request)
        heapq.heappush(self._heap, (request.rows, request.arrival, next(self._numbers), request))
        if len(self._heap) > 64 + 2 * len(self._live):
            # Mostly dead entries (cancelled callers): rebuild from the live ones.
            self._heap = [entry for entry in self._heap if entry[3] in self._live]
            heapq.heapify(self._heap)

    def peek(self) -> Request:
        # Drop dead entries from the top, then look at the live one there.
        while self._heap:
            request = self._heap[0][3]
            if request in self._live:
                return request
            heapq.heappop(self._heap)
        raise IndexError("peek into an empty ShortestJobFirst scheduler")

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        self._live.remove(request)
        return request

    def remove(self, request: Request) -> bool:
        if request not in self._live:
            return False
        self._live.remove(request)
        return True

    def __len__(self) -> int:
        return len(self._live)


# --8<-- [end:scheduler]


# --8<-- [start:backend]
class MatmulBackend:
    """A backend whose model file is a ``.npy`` matrix ``w``: it computes ``y = x @ w``."""

    async def load(self, config: trioinfer.ModelConfig, placement: Placement) -> "Matmul":
        if config.backend_options:
            raise trioinfer.ConfigError(
                f"model {config.name!r}: the matmul backend takes no backend_options, "
                f"got {sorted(config.backend_options)}"
            )
        device = str(placement.device)
        if placement.device.kind != "cpu":
            if not placement.cpu_fallback:
                raise trioinfer.BackendUnavailable(
                    f"model {config.name!r}: the matmul backend cannot run on {device}"
                )
            device = "cpu"
        # No path is a ConfigError that says what this backend needs.
        path = config.model_file("the .npy file of the weight matrix")
        # One thread per instance; reading the file is blocking work too, so it runs there.
        worker = await WorkerThread.start(
            f"matmul-{config.name}-{placement.index}", cpu_affinity=placement.cpu_affinity
        )
        try:
            weight = await worker.run_sync(read_weight, config.name, path)
        except BaseException:
            await worker.aclose()
            raise
        return Matmul(weight, device, worker)


def read_weight(model: str, path: Path) -> np.ndarray:
    try:
        weight: np.ndarray = np.load(path, allow_pickle=False)  # numpy types load() as Any
    except (OSError, ValueError) as exc:
        raise trioinfer.BackendError(f"model {model!r}: cannot read {path}: {exc}") from exc
    if weight.ndim != 2:
        raise trioinfer.BackendError(f"model {model!r}: {path} holds shape {weight.shape}")
    return weight.astype(np.float32)


class Matmul:
    """One loaded matrix and the worker thread that multiplies by it."""

    def __init__(self, weight: np.ndarray, device: str, worker: WorkerThread) -> None:
        self._weight = weight
        self._device = device
        self._worker = worker
        self._closed = False
        n_in, n_out = weight.shape
        f32 = np.dtype(np.float32)
        self._signature = trioinfer.ModelSignature(
            inputs=(trioinfer.TensorSpec("x", f32, ("batch", n_in), "tensor(float)"),),
            outputs=(trioinfer.TensorSpec("y", f32, ("batch", n_out), "tensor(float)"),),
        )

    @property
    def signature(self) -> trioinfer.ModelSignature:
        return self._signature

    @property
    def device(self) -> str:
        return self._device

    async def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._closed:
            raise trioinfer.BackendError("this matmul instance is closed")
        try:
            # Off the event loop. numpy cannot be interrupted, so a cancelled caller
            # waits here for the product, then Cancelled propagates (no abort= to pass).
            y = await self._worker.run_sync(np.matmul, inputs["x"], self._weight)
        except Exception as exc:
            raise trioinfer.BackendError(f"matmul failed: {exc}") from exc
        return {"y": y}

    async def aclose(self) -> None:
        self._closed = True
        await self._worker.aclose()  # idempotent


# --8<-- [end:backend]


# --8<-- [start:batcher]
class FixedSizeBatcher:
    """Batches of up to ``max_batch_size`` rows: those waiting, and those within ``max_wait``.

    Requests go in the queue's order (the scheduler's); a batch ends at the first
    request that would take it past ``max_batch_size`` rows or has another layout.
    """

    def __init__(self, *, max_batch_size: int = 4, max_wait: float = 0.002) -> None:
        if max_batch_size < 1 or not max_wait >= 0:
            # A ConfigError is the plugin's own word: the model's load fails with it as it is.
            raise trioinfer.ConfigError(
                "the fixed batcher needs max_batch_size >= 1 and max_wait >= 0, "
                f"got {max_batch_size!r} and {max_wait!r}"
            )
        self._size = max_batch_size
        self._max_wait = max_wait

    @property
    def max_batch_size(self) -> int:
        # Makes it a BoundedBatcher: `trioinfer serve` reports it, check_batcher holds it.
        return self._size

    async def next_batch(self, queue: RequestQueue) -> Sequence[Request]:
        batch: list[Request] = []
        try:
            while not batch:
                await queue.wait_not_empty()
                try:
                    batch.append(queue.pop_nowait())
                except anyio.WouldBlock:  # another instance took it, or it expired
                    continue
            if not queue.batched:  # the model has no batch dimension: one request
                return batch
            rows = batch[0].rows
            give_up_at = trio.current_time() + self._max_wait
            while rows < self._size:
                try:
                    after = queue.peek_nowait()
                except anyio.WouldBlock:  # nothing waiting: wait for company, up to max_wait
                    with trio.move_on_at(give_up_at) as waited:
                        await queue.wait_not_empty()
                    if waited.cancelled_caught:
                        break
                    continue
                if rows + after.rows > self._size or not fits(after, batch[0], queue):
                    break
                batch.append(queue.pop_nowait())
                rows += after.rows
        except BaseException:
            # Cancelled while forming the batch: what it took goes back, in order.
            queue.put_back(batch)
            raise
        return batch


def fits(request: Request, first: Request, queue: RequestQueue) -> bool:
    """Whether *request* can be concatenated with *first*: same inputs, dtypes and row shape."""
    if queue.uniform:  # the signature fixes all of it: every request fits
        return True
    return request.inputs.keys() == first.inputs.keys() and all(
        array.dtype == first.inputs[name].dtype and array.shape[1:] == first.inputs[name].shape[1:]
        for name, array in request.inputs.items()
    )


# --8<-- [end:batcher]


# --8<-- [start:fallback]
class DefaultAnswer:
    """Run each batch as usual; when it fails, answer its callers with a fixed default.

    ``default`` maps each output to one row (float32), repeated for every row of a request.
    """

    def __init__(self, *, default: Mapping[str, Sequence[float]]) -> None:
        self._default = {name: np.asarray(row, np.float32) for name, row in default.items()}

    async def execute(self, execution: Execution) -> None:
        try:
            await execution.run()
        except Exception:  # Cancelled is no Exception: it passes, as the contract asks
            for request in execution.pending():
                outputs = {
                    name: np.broadcast_to(row, (request.rows, *row.shape))
                    for name, row in self._default.items()
                }
                execution.respond(request, outputs, via="default")


# --8<-- [end:fallback]


# --8<-- [start:main]
async def execution_order(
    registry: trioinfer.Registry,
    fake: FakeBackend,
    scheduler: str,
    sent: Sequence[int] = (8, 2, 4),
    batcher: str = "none",
) -> list[int]:
    """Send requests of *sent* rows while the instance is busy; return each execution's rows."""
    fake.executions.clear()
    config = trioinfer.ModelConfig(
        name=f"demo-{scheduler}-{batcher}",
        path="unused.onnx",
        backend="fake",
        scheduler=scheduler,
        batcher=batcher,
        # Only what is waiting: a wait for company would take the busy-making request's.
        batcher_options={"max_wait": 0.0} if batcher == "fixed" else {},
    )

    async def send(rows: int) -> None:
        await engine.infer(config.name, {"x": np.ones((rows, 4), dtype=np.float32)})

    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, 1)  # occupies the only instance for 0.1 s
            await wait_all_tasks_blocked()
            for rows in sent:  # they arrive in this order while it is busy
                nursery.start_soon(send, rows)
                await wait_all_tasks_blocked()
    return fake.executions[1:]


async def main() -> None:
    # 1. The conformance checks: they raise AssertionError naming any broken rule.
    check_scheduler(ShortestJobFirst)
    print("ShortestJobFirst passes check_scheduler")

    with tempfile.TemporaryDirectory() as tmp:
        weight_file = Path(tmp) / "weight.npy"
        np.save(weight_file, np.arange(12, dtype=np.float32).reshape(4, 3))
        config = trioinfer.ModelConfig(name="matmul", path=weight_file, backend="matmul")
        x = np.ones((2, 4), dtype=np.float32)
        await check_backend(MatmulBackend(), config, {"x": x})
        print("MatmulBackend passes check_backend")
        await check_batcher(FixedSizeBatcher)
        print("FixedSizeBatcher passes check_batcher")
        # check_fallback's model answers y[batch, 4]: the default is one such row.
        await check_fallback(lambda: DefaultAnswer(default={"y": [0.0] * 4}))
        print("DefaultAnswer passes check_fallback")

        # 2. Use the plugins without packaging them: add them to a registry.
        fake = FakeBackend(delay=0.1)
        broken = FakeBackend()
        broken.error = trioinfer.BackendError("device lost")  # every execution fails
        registry = trioinfer.Registry(
            extra={
                "backends": {
                    "matmul": MatmulBackend,
                    "fake": lambda: fake,
                    "broken": lambda: broken,
                },
                "schedulers": {"sjf": ShortestJobFirst},
                "batchers": {"fixed": FixedSizeBatcher},
                "fallbacks": {"default": DefaultAnswer},
            }
        )
        async with trioinfer.open_engine(registry=registry) as engine:
            await engine.load(config)
            outputs = await engine.infer("matmul", {"x": x})
            print("matmul model:", outputs["y"].tolist())

    # 3. What the scheduler changes: the order in which waiting requests run.
    print("rows in execution order, fifo:", await execution_order(registry, fake, "fifo"))
    print("rows in execution order, sjf: ", await execution_order(registry, fake, "sjf"))

    # 4. What the batcher changes: six 1-row requests wait; they run as batches of 4 and 2.
    batches = await execution_order(registry, fake, "fifo", [1] * 6, batcher="fixed")
    print("rows per execution, fixed:", batches)

    # 5. What the fallback changes: a failing backend's callers get the default.
    guarded = trioinfer.ModelConfig(
        name="guarded",
        backend="broken",
        fallback="default",
        fallback_options={"default": {"y": [0.0, 0.0, 0.0, 0.0]}},
    )
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(guarded)
        outputs = await engine.infer("guarded", {"x": np.ones((1, 4), dtype=np.float32)})
        print("failing backend, default answer:", outputs["y"].tolist())


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
