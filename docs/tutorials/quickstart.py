"""Quickstart: load the bundled digits model, send concurrent requests under one deadline.

Run it with ``python docs/tutorials/quickstart.py``; the docs' test suite runs it too.
"""

import numpy as np
import trio

import trioinfer


async def classify(
    engine: trioinfer.Engine, image: np.ndarray, i: int, predictions: dict[int, int]
) -> None:
    # One request: inputs by name, outputs by name. No timeout argument here;
    # the caller's cancel scope decides how long this may take.
    outputs = await engine.infer("digits", {"input": image[np.newaxis, :]})
    predictions[i] = int(outputs["label"][0])


async def main() -> None:
    # 1. A model repository: <repo>/<model>/config.toml and <repo>/<model>/<version>/model.onnx.
    #    trioinfer ships a small one; its digits model classifies 8x8 images of digits.
    config_file = trioinfer.example_repository() / "digits" / "config.toml"
    config = trioinfer.ModelConfig.from_toml(config_file)
    images, labels = trioinfer.digits_samples()
    images, labels = images[:20], labels[:20]

    # 2. Open an engine and load the model. The engine's task group owns every
    #    queue, worker and session until the block ends.
    async with trioinfer.open_engine() as engine:
        info = await engine.load(config)
        # from_toml chose the newest version directory; its model file lies in it. (A
        # config built in Python may have no path: a pipeline reads no file.)
        version = config.path.parent.name if config.path is not None else "none"
        print(f"loaded {info.name!r} (version {version}) on {list(info.devices)}")
        for spec in info.signature.inputs + info.signature.outputs:
            print(f"  {spec.name}: {spec.describe()}")

        # 3. Twenty requests at once, all under one deadline of 2 seconds.
        predictions: dict[int, int] = {}
        with trio.fail_after(2):
            async with trio.open_nursery() as nursery:
                for i, image in enumerate(images):
                    nursery.start_soon(classify, engine, image, i, predictions)

        # 4. The answers, and what the engine counted.
        predicted = [predictions[i] for i in range(len(images))]
        correct = sum(p == label for p, label in zip(predicted, labels, strict=True))
        print(f"predicted: {predicted}")
        print(f"expected:  {labels.tolist()}")
        print(f"{correct} of {len(images)} correct")
        stats = engine.statistics().models["digits"]
        print(f"succeeded {stats.succeeded}, failed {stats.failed}, executions {stats.executions}")
    # Leaving the block closed the session and joined its thread.


if __name__ == "__main__":
    trio.run(main)
