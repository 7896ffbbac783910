"""Failing over from GPU to CPU: the ``resilient`` fallback keeps a model answering.

Run it with ``python docs/tutorials/failover.py``; the docs' test suite runs it too.
It takes about a second and needs no GPU: the GPU's faults are injected with
``trioinfer.testing.FaultyBackend``, which stands in for a real GPU fault. Each
step prints what happened.
"""

# --8<-- [start:setup]
import trio

import trioinfer
from trioinfer.testing import FaultyBackend
from trioinfer_onnxruntime import OnnxRuntimeBackend

IMAGES, LABELS = trioinfer.digits_samples()  # float32[200, 64] and the digit each shows
DIGITS = trioinfer.example_repository() / "digits" / "1" / "model.onnx"


def make_config(**breaker: float) -> trioinfer.ModelConfig:
    """The digits model on a GPU instance and a CPU instance, with the resilient fallback."""
    return trioinfer.ModelConfig(
        name="digits",
        path=DIGITS,
        instances=[
            trioinfer.Instance("cuda:0", capacity=8),  # instance 0: takes the work when free
            trioinfer.Instance("cpu"),  # instance 1: the spare
        ],
        fallback="resilient",
        fallback_options={
            "attempts": 3,  # executions of a batch in all, across instances
            "backoff": 0.01,  # a transient error waits up to 10 ms before the next attempt
            # Tutorial-sized waits; production values are seconds (see the config.toml below).
            "breaker": {"fail_max": 3, "reset_timeout": 0.25, "probes": 2, **breaker},
        },
    )


async def classify(engine: trioinfer.Engine, i: int) -> trioinfer.InferenceResult:
    """Send image *i* and print which instance answered, and through which fallback steps."""
    result = await engine.infer_detailed("digits", {"input": IMAGES[i : i + 1]})
    label = int(result.outputs["label"][0])
    print(
        f"  image {i}: {label} (expected {LABELS[i]}) from instance {result.instance},"
        f" fallbacks {list(result.fallbacks)}"
    )
    return result


def gpu_instance(engine: trioinfer.Engine) -> trioinfer.ReplicaStatistics:
    """Instance 0's state and counters, as the engine's statistics report them."""
    return engine.statistics().models["digits"].replicas[0]


def show_instances(engine: trioinfer.Engine, *, only: int | None = None) -> None:
    """Print each instance's state and counters (or just instance *only*'s)."""
    for replica in engine.statistics().models["digits"].replicas:
        if only is not None and replica.index != only:
            continue
        print(
            f"  instance {replica.index}: {replica.state}; executions {replica.executions},"
            f" failures {replica.failures}, taken out {replica.taken_out},"
            f" re-created {replica.recreated}"
        )
        if replica.reason is not None:
            print(f"    reason: {replica.reason}")


# --8<-- [end:setup]


# --8<-- [start:main]
async def main() -> None:
    # The real ONNX Runtime backend, wrapped: calls 6 to 9 of each instance placed
    # on cuda:0 fail. In production, drop FaultyBackend and the registry argument.
    backend = FaultyBackend(OnnxRuntimeBackend(), devices=["cuda:0"], fail_on=range(6, 10))
    async with trioinfer.open_engine(registry=backend.registry("onnxruntime")) as engine:
        config = make_config()
        info = await engine.load(config)
        for placement, device in zip(config.placements(), info.devices, strict=True):
            print(
                f"instance {placement.index}: asked for {placement.device}"
                f" (capacity {placement.capacity:g}), runs on {device}"
            )
        await healthy(engine)
        await gpu_fails(engine)
        await gpu_recovers(engine)
    await session_dies()
    await everything_out()


# --8<-- [end:main]


# --8<-- [start:healthy]
async def healthy(engine: trioinfer.Engine) -> None:
    print("step 1: both instances healthy")
    for i in range(5):
        await classify(engine, i)


# --8<-- [end:healthy]


# --8<-- [start:fails]
async def gpu_fails(engine: trioinfer.Engine) -> None:
    print("step 2: the GPU instance fails (its calls 6 to 9)")
    for i in range(5, 8):
        await classify(engine, i)  # fails on instance 0, answered by instance 1
    show_instances(engine)
    for i in range(8, 10):
        await classify(engine, i)  # instance 0 is out: straight to instance 1


# --8<-- [end:fails]


# --8<-- [start:recovers]
async def gpu_recovers(engine: trioinfer.Engine) -> None:
    print("step 3: the breaker probes instance 0 in the background")
    answered_by: set[int | None] = set()
    probe_failed = False
    i = 10
    with trio.fail_after(5):  # far longer than the breaker's waits: a hang fails loudly
        # Requests keep coming while instance 0 is out; none of them waits for it.
        while gpu_instance(engine).state == "out":
            reason = gpu_instance(engine).reason or ""
            if not probe_failed and reason.startswith("circuit open: a probe failed"):
                probe_failed = True
                print(f"  instance 0 is still out: {reason}")
            image = IMAGES[i % len(IMAGES)][None, :]  # one row: a batch of one
            result = await engine.infer_detailed("digits", {"input": image})
            answered_by.add(result.instance)
            i += 1
            await trio.sleep(0.01)
    print("  instance 0 is serving again")
    alone = answered_by == {1}
    print(f"  all {i - 10} requests sent while it was out were answered by instance 1: {alone}")
    show_instances(engine, only=0)
    for i in range(197, 200):
        await classify(engine, i)
    print(f"  fallback steps taken: {engine.statistics().models['digits'].fallbacks}")


# --8<-- [end:recovers]


# --8<-- [start:dies]
async def session_dies() -> None:
    print("step 4: the GPU session dies after 5 calls, and is re-created")
    backend = FaultyBackend(OnnxRuntimeBackend(), devices=["cuda:0"], crash_after=5)
    async with trioinfer.open_engine(registry=backend.registry("onnxruntime")) as engine:
        await engine.load(make_config())
        for i in range(8):
            await classify(engine, i)
        with trio.fail_after(5):
            # Statistics are the public view of an instance's state; there is no event to wait on.
            while gpu_instance(engine).state == "out":  # noqa: ASYNC110
                await trio.sleep(0.01)
        # Back in service, instance 0's worker still has to ask for its turn; until
        # it has, a request sent now goes to the free CPU instance. Yield to it.
        await trio.sleep(0.01)
        show_instances(engine, only=0)
        await classify(engine, 8)


# --8<-- [end:dies]


# --8<-- [start:out]
async def everything_out() -> None:
    print("step 5: both instances fail")
    backend = FaultyBackend(OnnxRuntimeBackend(), fail_on=range(1, 100))  # every device
    async with trioinfer.open_engine(registry=backend.registry("onnxruntime")) as engine:
        await engine.load(make_config(fail_max=1, reset_timeout=30))
        for i in range(2):
            try:
                await classify(engine, i)
            except trioinfer.CircuitOpen as exc:
                print(f"  image {i}: CircuitOpen, retry after {exc.retry_after:.0f} s")
            except trioinfer.BackendError as exc:
                print(f"  image {i}: BackendError: {exc}")
        show_instances(engine)


# --8<-- [end:out]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
