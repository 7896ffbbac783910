"""Stateful sequences: a model that keeps a running sum per sequence, as Triton's sequence batcher.

Run it with ``python docs/tutorials/sequences.py``; the docs' test suite runs it too.
"""

# --8<-- [start:setup]
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import trio

import trioinfer
from trioinfer import SequenceError, SequenceFlags


def make_repository(root: Path) -> None:
    """An accumulator: OUTPUT is the running sum of a sequence's INPUTs."""
    (root / "accumulator" / "1").mkdir(parents=True)
    (root / "accumulator" / "1" / "model.py").write_text(
        textwrap.dedent(
            '''
            import numpy as np


            class Model:
                """Adds INPUT to the sum carried in STATE_IN (0 on a sequence's START)."""

                def infer(self, inputs):
                    carried = np.where(inputs["START"] != 0, 0, inputs["STATE_IN"])
                    total = (carried + inputs["INPUT"]).astype(np.int32)
                    return {"OUTPUT": total, "STATE_OUT": total}
            '''
        )
    )
    (root / "accumulator" / "config.toml").write_text(
        textwrap.dedent(
            """
            backend = "python"
            batcher = "sequence"
            instances = [{ count = 2 }]

            [backend_options]
            dispatch = "inline"
            inputs = [
                { name = "INPUT", dtype = "INT32", shape = ["batch", 1] },
                { name = "START", dtype = "INT32", shape = ["batch", 1] },
                { name = "STATE_IN", dtype = "INT32", shape = ["batch", 1] },
            ]
            outputs = [
                { name = "OUTPUT", dtype = "INT32", shape = ["batch", 1] },
                { name = "STATE_OUT", dtype = "INT32", shape = ["batch", 1] },
            ]

            [sequence]
            strategy = "oldest"       # batch the oldest requests, one per sequence
            max_batch_size = 4
            max_sequence_idle = 0.2   # seconds without a request before release
            control = { start = "START" }
            state = [{ input = "STATE_IN", output = "STATE_OUT" }]
            """
        )
    )


# --8<-- [end:setup]


# --8<-- [start:interleaved]
async def send(
    engine: trioinfer.Engine, sequence_id: int | str, values: list[int], instances: set[int]
) -> list[int]:
    """Send one sequence's values in order; return the running sums the model answered."""
    sums = []
    for i, value in enumerate(values):
        flags = SequenceFlags(sequence_id, start=i == 0, end=i == len(values) - 1)
        result = await engine.infer_detailed(
            "accumulator", {"INPUT": np.array([[value]], np.int32)}, sequence=flags
        )
        sums.append(int(result.outputs["OUTPUT"][0, 0]))
        if result.instance is not None:
            instances.add(result.instance)
    return sums


async def interleaved(engine: trioinfer.Engine) -> None:
    values = [11, 7, 5, 3, 2, 0, 1]
    streams: dict[int | str, list[int]] = {
        1000: [0, *values],
        "speaker-b": [100, *[-v for v in values]],
    }
    sums: dict[int | str, list[int]] = {}
    instances: dict[int | str, set[int]] = {key: set() for key in streams}

    async def one(sequence_id: int | str) -> None:
        sums[sequence_id] = await send(
            engine, sequence_id, streams[sequence_id], instances[sequence_id]
        )

    async with trio.open_nursery() as nursery:
        for sequence_id in streams:
            nursery.start_soon(one, sequence_id)
    for sequence_id in streams:
        print(f"sequence {sequence_id!r}: {sums[sequence_id]}")
    print(
        "instances: "
        + ", ".join(f"{key!r} on {len(seen)} instance" for key, seen in instances.items())
    )


# --8<-- [end:interleaved]


# --8<-- [start:errors]
async def errors(engine: trioinfer.Engine) -> None:
    one = {"INPUT": np.array([[1]], np.int32)}
    try:
        await engine.infer("accumulator", one, sequence=SequenceFlags(42))
    except SequenceError as exc:
        print(f"unknown: {exc}")
    await engine.infer("accumulator", one, sequence=SequenceFlags(7, start=True))
    await trio.sleep(0.5)  # longer than max_sequence_idle
    try:
        await engine.infer("accumulator", one, sequence=SequenceFlags(7))
    except SequenceError as exc:
        print(f"idle: {exc}")


# --8<-- [end:errors]


# --8<-- [start:main]
async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_repository(root)
        config = trioinfer.ModelConfig.from_toml(root / "accumulator" / "config.toml")
        async with trioinfer.open_engine() as engine:
            info = await engine.load(config)
            inputs = [spec.name for spec in info.signature.inputs]
            outputs = [spec.name for spec in info.signature.outputs]
            print(f"signature: {inputs} -> {outputs}")
            await interleaved(engine)
            await errors(engine)


if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:main]
