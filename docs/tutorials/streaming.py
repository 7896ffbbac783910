"""Streaming responses: a decoupled model answers one request with many responses.

Run it with ``python docs/tutorials/streaming.py``; the docs' test suite runs it too.
"""

# --8<-- [start:setup]
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import numpy as np
import trio

import trioinfer
from trioinfer.server import serve_http

Arrays = dict[str, np.ndarray]


class Words:
    """Streams the words of TEXT, one response each, PAUSE seconds apart."""

    made = 0  # responses made so far: the tutorial reads it
    stopped = "not yet"  # how the last stream ended

    async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
        try:
            pause = float(inputs["PAUSE"][0])
            for word in str(inputs["TEXT"][0]).split():
                if pause:
                    await anyio.sleep(pause)
                Words.made += 1
                yield {"WORD": np.array([word], dtype=object)}
        except GeneratorExit:
            Words.stopped = "at its yield"
            raise
        except BaseException as exc:
            Words.stopped = f"by {type(exc).__name__} while it waited"
            raise
        else:
            Words.stopped = "at its end"


WORDS = trioinfer.ModelConfig(
    name="words",
    backend="python",
    backend_options={
        "class": Words,
        "decoupled": True,  # infer is an async generator: any number of responses
        "inputs": [
            {"name": "TEXT", "dtype": "string", "shape": [1], "utf8": True},  # str, not bytes
            {"name": "PAUSE", "dtype": "float32", "shape": [1]},
        ],
        "outputs": [{"name": "WORD", "dtype": "string", "shape": [1]}],
    },
)


def text(words: str, pause: float = 0.0) -> Arrays:
    return {"TEXT": np.array([words], dtype=object), "PAUSE": np.array([pause], np.float32)}


# --8<-- [end:setup]


# --8<-- [start:stream]
async def stream_words(engine: trioinfer.Engine) -> None:
    async with engine.infer_stream("words", text("structured concurrency all the way")) as words:
        async for outputs in words:
            print("word:", outputs["WORD"][0])
    stats = engine.statistics().models["words"]
    print(
        f"stream: ended {Words.stopped}; succeeded {stats.succeeded}, in flight {stats.in_flight}"
    )


# --8<-- [end:stream]


# --8<-- [start:stop]
async def stop_early(engine: trioinfer.Engine) -> None:
    Words.made = 0
    # ahead=1: the model makes at most one response before the reader takes it
    # (16 by default, see "A slow reader"), so the count below is exact.
    async with engine.infer_stream("words", text("a b c d e f g h i j"), ahead=1) as words:
        async for outputs in words:
            if outputs["WORD"][0] == "b":
                break  # leaving the block closes the model's generator
    print(f"early stop: read 2, the model made {Words.made} and stopped {Words.stopped}")

    Words.made = 0
    with trio.move_on_after(0.5):  # the caller's deadline reaches the model
        async with engine.infer_stream("words", text("a b c d e f g h", pause=0.2)) as words:
            async for outputs in words:
                print("before the deadline:", outputs["WORD"][0])
    print(f"deadline: the model made {Words.made} and was stopped {Words.stopped}")
    stats = engine.statistics().models["words"]
    print(f"stats: succeeded {stats.succeeded}, cancelled {stats.cancelled}")


# --8<-- [end:stop]


# --8<-- [start:slow]
async def read_slowly(engine: trioinfer.Engine) -> None:
    Words.made, read, ahead = 0, 0, 0
    six = text("one two three four five six")
    async with engine.infer_stream("words", six, ahead=2) as words:  # 16 by default
        async for _ in words:
            read += 1
            await trio.sleep(0.01)  # a slow reader: the model waits for it
            ahead = max(ahead, Words.made - read)
    print(f"slow reader: read {read}; the model was never more than {ahead} ahead")


# --8<-- [end:slow]


# --8<-- [start:aclose]
async def first_words(words: trioinfer.ResponseStream, count: int) -> list[str]:
    # A helper that is handed the stream, reads what it needs, and closes it.
    got = []
    async with contextlib.aclosing(words):  # calls words.aclose() on the way out
        async for outputs in words:
            got.append(str(outputs["WORD"][0]))
            if len(got) == count:
                break
    return got


async def close_in_a_helper(engine: trioinfer.Engine) -> None:
    Words.made = 0
    async with engine.infer_stream("words", text("a b c d e f g h i j"), ahead=1) as words:
        got = await first_words(words, 2)
        made = Words.made  # the model has stopped: no response after aclose() returns
        await trio.sleep(0.01)
        print(
            f"aclose: read {got}, the model made {made} ({Words.made}) and stopped {Words.stopped}"
        )


# --8<-- [end:aclose]


# --8<-- [start:http]
async def over_http(root: Path) -> None:
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(
            lambda task_status: serve_http(
                root, host="127.0.0.1", port=0, handle_signals=False, task_status=task_status
            )
        )
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            body = {"IN": [4, 2, 0, 1], "DELAY": [10, 10, 10, 10], "WAIT": 0}
            url = "/v2/models/repeat_int32/generate_stream"
            async with client.stream("POST", url, json=body) as answer:
                print("generate_stream:", answer.status_code, answer.headers["content-type"])
                async for line in answer.aiter_lines():
                    if line.startswith("data: "):
                        print("  event:", json.loads(line.removeprefix("data: ")))
            url = "/v2/models/repeat_int32/generate"
            one = await client.post(url, json={"IN": [7], "DELAY": [0], "WAIT": 0})
            print("generate:", one.status_code, one.json())
            two = await client.post(url, json={"IN": [7, 8], "DELAY": [0, 0], "WAIT": 0})
            print("generate:", two.status_code, two.json()["error"])
        nursery.cancel_scope.cancel()


# --8<-- [end:http]


# --8<-- [start:main]
async def main() -> None:
    async with trioinfer.open_engine() as engine:
        await engine.load(WORDS)
        await stream_words(engine)
        await stop_early(engine)
        await read_slowly(engine)
        await close_in_a_helper(engine)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        shutil.copytree(trioinfer.example_repository() / "repeat_int32", root / "repeat_int32")
        await over_http(root)


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
