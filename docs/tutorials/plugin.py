"""Writing plugins: a shortest-job-first scheduler and a small backend, checked and used.

Run it with ``python docs/tutorials/plugin.py``; the docs' test suite runs it too.
A real plugin would live in its own package and declare entry points (see the how-to).
"""

# --8<-- [start:imports]
import heapq
import itertools
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

import trioinfer
from trioinfer.lowlevel import Placement, Request, WorkerThread
from trioinfer.testing import FakeBackend, check_backend, check_scheduler

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


# --8<-- [start:main]
async def execution_order(
    registry: trioinfer.Registry, fake: FakeBackend, scheduler: str
) -> list[int]:
    """Send requests of 8, 2 and 4 rows while the instance is busy; return the order they ran in."""
    fake.executions.clear()
    config = trioinfer.ModelConfig(
        name=f"demo-{scheduler}", path="unused.onnx", backend="fake", scheduler=scheduler
    )

    async def send(rows: int) -> None:
        await engine.infer(config.name, {"x": np.ones((rows, 4), dtype=np.float32)})

    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, 1)  # occupies the only instance for 0.1 s
            await wait_all_tasks_blocked()
            for rows in [8, 2, 4]:  # they arrive in this order while it is busy
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

        # 2. Use the plugins without packaging them: add them to a registry.
        fake = FakeBackend(delay=0.1)
        registry = trioinfer.Registry(
            extra={
                "backends": {"matmul": MatmulBackend, "fake": lambda: fake},
                "schedulers": {"sjf": ShortestJobFirst},
            }
        )
        async with trioinfer.open_engine(registry=registry) as engine:
            await engine.load(config)
            outputs = await engine.infer("matmul", {"x": x})
            print("matmul model:", outputs["y"].tolist())

    # 3. What the scheduler changes: the order in which waiting requests run.
    print("rows in execution order, fifo:", await execution_order(registry, fake, "fifo"))
    print("rows in execution order, sjf: ", await execution_order(registry, fake, "sjf"))


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
