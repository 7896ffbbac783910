"""Python models: a class as a model, beside an ONNX one, with the same engine guarantees.

Run it with ``python docs/tutorials/python_models.py``; the docs' test suite runs it too.
"""

# --8<-- [start:setup]
import shutil
import tempfile
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

import trioinfer
from trioinfer_python import Models

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_repository(root: Path) -> None:
    """The bundled digits model, and a Python model that names its answers."""
    shutil.copytree(trioinfer.example_repository() / "digits", root / "digits")
    (root / "names" / "1").mkdir(parents=True)
    (root / "names" / "1" / "model.py").write_text(
        textwrap.dedent(
            '''
            import numpy as np


            class Model:
                """Turns the digits model's probabilities into a name and a confidence."""

                def __init__(self, names, threshold):
                    self.names = np.array(names, dtype=object)
                    self.threshold = threshold

                def infer(self, inputs):
                    p = inputs["probabilities"]
                    best = p.argmax(axis=1)
                    confidence = p.max(axis=1)
                    name = np.where(confidence >= self.threshold, self.names[best], "unsure")
                    return {"name": name, "confidence": confidence}
            '''
        )
    )
    (root / "names" / "config.toml").write_text(
        textwrap.dedent(
            f"""
            backend = "python"
            batcher = "dynamic"

            [backend_options]
            parameters = {{ names = {NAMES!r}, threshold = 0.9 }}
            inputs = [{{ name = "probabilities", dtype = "float32", shape = ["batch", 10] }}]
            outputs = [
                {{ name = "name", dtype = "string", shape = ["batch"] }},
                {{ name = "confidence", dtype = "float32", shape = ["batch"] }},
            ]
            """
        )
    )


# --8<-- [end:setup]


# --8<-- [start:chain]
async def classify(engine: trioinfer.Engine, image: np.ndarray) -> tuple[str, float]:
    """One image through both models, under the caller's one deadline."""
    scores = await engine.infer("digits", {"input": image[np.newaxis]})
    named = await engine.infer("names", {"probabilities": scores["probabilities"]})
    return str(named["name"][0]), float(named["confidence"][0])


async def names_for(engine: trioinfer.Engine, images: np.ndarray) -> list[str]:
    answers: dict[int, str] = {}

    async def one(i: int) -> None:
        name, confidence = await classify(engine, images[i])
        answers[i] = f"{name} ({confidence:.2f})"

    with trio.fail_after(2):  # the deadline of every step of every image
        async with trio.open_nursery() as nursery:
            for i in range(len(images)):
                nursery.start_soon(one, i)
    return [answers[i] for i in range(len(images))]


# --8<-- [end:chain]


# --8<-- [start:pipeline]
NAMED_DIGITS = trioinfer.ModelConfig(
    name="named_digits",
    backend="pipeline",
    backend_options={
        "inputs": [{"name": "IMAGE", "dtype": "float32", "shape": ["batch", 64]}],
        "outputs": [
            {"name": "NAME", "dtype": "string", "shape": ["batch"]},
            {"name": "CONFIDENCE", "dtype": "float32", "shape": ["batch"]},
        ],
        "steps": [
            {
                "model": "digits",
                "input_map": {"input": "IMAGE"},  # the model's input <- a pipeline tensor
                "output_map": {"probabilities": "SCORES"},  # the model's output -> one
            },
            {
                "model": "names",
                "input_map": {"probabilities": "SCORES"},
                "output_map": {"name": "NAME", "confidence": "CONFIDENCE"},
            },
        ],
    },
)


async def as_one_model(engine: trioinfer.Engine, images: np.ndarray) -> None:
    await engine.load(NAMED_DIGITS)
    with trio.fail_after(2):
        out = await engine.infer("named_digits", {"IMAGE": images})
    print("pipeline:", out["NAME"].tolist())


# --8<-- [end:pipeline]


# --8<-- [start:async]
class SlowLookup:
    """An async model: its infer runs on the event loop and is cancelled like any task."""

    cancelled = 0

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            await trio.sleep(10)  # stands in for a call to another service
        except trio.Cancelled:
            SlowLookup.cancelled += 1
            raise
        return {"y": inputs["x"]}


async def cancelled_at_the_deadline(engine: trioinfer.Engine) -> None:
    await engine.load(
        trioinfer.ModelConfig(
            name="lookup",
            backend="python",
            backend_options={
                "class": SlowLookup,
                "inputs": [{"name": "x", "dtype": "int64", "shape": ["batch"]}],
                "outputs": [{"name": "y", "dtype": "int64", "shape": ["batch"]}],
            },
        )
    )
    with trio.move_on_after(0.1):
        await engine.infer("lookup", {"x": np.array([7])})
    await wait_all_tasks_blocked()  # let the cancellation reach the model
    print(f"async model: cancelled {SlowLookup.cancelled} time at the caller's deadline")


# --8<-- [end:async]


# --8<-- [start:calls]
class Reader:
    """One model that calls two others while it computes: digits, then names."""

    def __init__(self, models: Models) -> None:  # the engine's other models, to call
        self.models = models

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = await self.models.infer("digits", {"input": inputs["IMAGE"]})
        if scores["probabilities"].max() < 0.5:  # a branch a pipeline's DAG cannot take
            return {"NAME": np.full(len(inputs["IMAGE"]), "unreadable", dtype=object)}
        named = await self.models.infer("names", {"probabilities": scores["probabilities"]})
        return {"NAME": named["name"]}


async def calling_other_models(engine: trioinfer.Engine, images: np.ndarray) -> None:
    await engine.load(
        trioinfer.ModelConfig(
            name="reader",
            backend="python",
            backend_options={
                "class": Reader,
                "inputs": [{"name": "IMAGE", "dtype": "float32", "shape": ["batch", 64]}],
                "outputs": [{"name": "NAME", "dtype": "string", "shape": ["batch"]}],
            },
        )
    )
    with trio.fail_after(2):  # the deadline of the request, and of the calls it makes
        out = await engine.infer("reader", {"IMAGE": images})
    print("reader:", out["NAME"].tolist())


# --8<-- [end:calls]


# --8<-- [start:stream_calls]
class Spell:
    """A decoupled model: a word, one letter per response."""

    async def infer(self, inputs: dict[str, np.ndarray]) -> AsyncIterator[dict[str, np.ndarray]]:
        for letter in inputs["WORD"][0]:
            yield {"LETTER": np.array([letter], dtype=object)}


class Initial:
    """Reads Spell's stream for its first response only: leaving the block stops Spell."""

    def __init__(self, models: Models) -> None:
        self.models = models

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        async with self.models.infer_stream("spell", {"WORD": inputs["WORD"]}) as letters:
            async for outputs in letters:
                return {"INITIAL": outputs["LETTER"]}
        return {"INITIAL": np.array([""], dtype=object)}  # an empty word: no response


async def streaming_calls(engine: trioinfer.Engine) -> None:
    word = {"name": "WORD", "dtype": "string", "shape": [1], "utf8": True}
    for name, cls, output in (("spell", Spell, "LETTER"), ("initial", Initial, "INITIAL")):
        await engine.load(
            trioinfer.ModelConfig(
                name=name,
                backend="python",
                backend_options={
                    "class": cls,
                    "decoupled": cls is Spell,
                    "inputs": [word],
                    "outputs": [{"name": output, "dtype": "string", "shape": [1]}],
                },
            )
        )
    out = await engine.infer("initial", {"WORD": np.array(["eight"], dtype=object)})
    print("initial:", out["INITIAL"].tolist())


# --8<-- [end:stream_calls]


# --8<-- [start:main]
async def main() -> None:
    images, labels = trioinfer.digits_samples()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_repository(root)
        async with trioinfer.open_engine() as engine:
            for model in ("digits", "names"):
                info = await engine.load(
                    trioinfer.ModelConfig.from_toml(root / model / "config.toml")
                )
                signature = info.signature
                print(
                    f"{model}: {[s.describe() for s in signature.inputs]} -> "
                    f"{[f'{s.name} {s.describe()}' for s in signature.outputs]}"
                )
            print("names:", await names_for(engine, images[:6]))
            print("expected:", [NAMES[label] for label in labels[:6]])
            stats = engine.statistics().models["names"]
            print(f"names: {stats.succeeded} answered in {stats.executions} executions")
            await as_one_model(engine, images[:6])
            await cancelled_at_the_deadline(engine)
            await calling_other_models(engine, images[:6])
            await streaming_calls(engine)


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
