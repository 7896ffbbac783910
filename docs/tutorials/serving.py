"""Serving over HTTP: a model repository behind the KServe V2 server, queried with httpx.

Run it with ``python docs/tutorials/serving.py``; the docs' test suite runs it too.
It starts the server in-process on a free loopback port, so nothing else needs
to run; each step prints what the server answered.
"""

# --8<-- [start:setup]
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio
from prometheus_client.parser import text_string_to_metric_families

import trioinfer
from trioinfer.server import serve_http
from trioinfer.testing import models

IMAGES, LABELS = trioinfer.digits_samples()  # float32[200, 64] and the digit each shows
DIGITS = trioinfer.example_repository() / "digits" / "1" / "model.onnx"


def tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    """One V2 input as JSON: name, shape, datatype and the values, flat and row-major."""
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": "FP32",
        "data": array.ravel().tolist(),
    }


# --8<-- [end:setup]


# --8<-- [start:repository]
DIGITS_CONFIG = """\
version_policy = { latest = 2 }  # serve the two highest versions on disk
batcher = "dynamic"

[batcher_options]
max_batch_size = 32
max_queue_delay = 0.005  # seconds

[[instances]]
device = "cpu"
count = 1
"""

SLOW_CONFIG = """\
scheduler = "priority"  # a request's "priority" parameter decides the order

[[instances]]
device = "cpu"
threads = 1
"""


def make_repository(root: Path) -> Path:
    """Lay out a model repository with three models; return its directory."""
    repo = root / "models"
    # digits: three versions (copies of the bundled model), batching, a version policy.
    for version in (1, 2, 3):
        add_version(repo / "digits", version)
    (repo / "digits" / "config.toml").write_text(DIGITS_CONFIG)
    # mlp: no config.toml at all; the defaults apply, the signature comes from the file.
    models.write_mlp(repo / "mlp" / "1" / "model.onnx", sizes=(64, 32, 10))
    # slow: takes long enough to queue behind; only loaded when asked for.
    models.write_slow(repo / "slow" / "1" / "model.onnx", width=256, depth=400)
    (repo / "slow" / "config.toml").write_text(SLOW_CONFIG)
    return repo


def add_version(model_dir: Path, version: int) -> None:
    (model_dir / str(version)).mkdir(parents=True)
    shutil.copy(DIGITS, model_dir / str(version) / "model.onnx")


# --8<-- [end:repository]


# --8<-- [start:health]
async def health_and_metadata(client: httpx.AsyncClient) -> None:
    live = await client.get("/v2/health/live")
    ready = await client.get("/v2/health/ready")
    print(f"health: live {live.status_code}, ready {ready.status_code}")
    server = (await client.get("/v2")).json()
    print(f"server: {server['name']} {server['version']}, extensions {server['extensions']}")
    for model in ("digits", "mlp"):
        meta = (await client.get(f"/v2/models/{model}")).json()
        signature = [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]]
        print(f"{model}: versions {meta['versions']}, inputs {signature}")
    config = (await client.get("/v2/models/digits/config")).json()
    print(f"digits config: max_batch_size {config['max_batch_size']}, {config['dynamic_batching']}")
    config = (await client.get("/v2/models/mlp/config")).json()
    # trioinfer's own settings are among Triton's parameters, as trioinfer.<setting>.
    own = {
        key.removeprefix("trioinfer."): value["string_value"]
        for key, value in config["parameters"].items()
        if key.startswith("trioinfer.")
    }
    defaults = {key: own[key] for key in ("scheduler", "batcher", "instances")}
    print(f"mlp config: max_batch_size {config['max_batch_size']}, {defaults}")


# --8<-- [end:health]


# --8<-- [start:infer]
async def infer_json(client: httpx.AsyncClient) -> None:
    request = {
        "id": "first-four",
        "inputs": [tensor("input", IMAGES[:4])],
        "outputs": [{"name": "label"}],  # leave "outputs" out to get every output
    }
    response = await client.post("/v2/models/digits/infer", json=request)
    answer = response.json()
    (label,) = answer["outputs"]
    print(f"infer: {response.status_code} from {answer['model_name']} v{answer['model_version']}")
    print(f"infer: labels {label['data']}, expected {LABELS[:4].tolist()}")
    # A version of its own: any version the policy serves can be asked for by number.
    response = await client.post("/v2/models/digits/versions/2/infer", json=request)
    print(f"infer: version 2 answered {response.json()['outputs'][0]['data']}")


# --8<-- [end:infer]


# --8<-- [start:binary]
def binary_request(
    name: str, array: np.ndarray, outputs: list[str], **parameters: Any
) -> tuple[bytes, dict[str, str]]:
    """A V2 request with *array* as raw little-endian bytes after the JSON header."""
    header = json.dumps(
        {
            "parameters": parameters,
            "inputs": [
                {
                    "name": name,
                    "shape": list(array.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": array.nbytes},
                }
            ],
            "outputs": [{"name": out, "parameters": {"binary_data": True}} for out in outputs],
        }
    ).encode()
    body = header + array.astype("<f4").tobytes()
    return body, {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


async def infer_binary(client: httpx.AsyncClient) -> None:
    body, headers = binary_request("input", IMAGES[:4], ["label"])
    response = await client.post("/v2/models/digits/infer", content=body, headers=headers)
    json_length = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:json_length])
    (label,) = header["outputs"]
    data = np.frombuffer(response.content[json_length:], dtype="<i8").reshape(label["shape"])
    print(f"binary: {label['datatype']} {label['shape']}, {label['parameters']}")
    print(f"binary: labels {data.tolist()}, expected {LABELS[:4].tolist()}")


# --8<-- [end:binary]


# --8<-- [start:batching]
async def batching(client: httpx.AsyncClient) -> None:
    async def stats() -> dict[str, Any]:
        response = await client.get("/v2/models/digits/versions/3/stats")
        model_stats: dict[str, Any] = response.json()["model_stats"][0]
        return model_stats

    async def one(i: int) -> None:
        request = {"inputs": [tensor("input", IMAGES[i : i + 1])]}
        response = await client.post("/v2/models/digits/infer", json=request)
        response.raise_for_status()

    before = await stats()
    async with trio.open_nursery() as nursery:
        for i in range(32):
            nursery.start_soon(one, i)
    after = await stats()
    requests = (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    )
    executions = after["execution_count"] - before["execution_count"]
    print(f"batching: {requests} one-row requests ran in {executions} executions")


# --8<-- [end:batching]


# --8<-- [start:manage]
async def show_index(client: httpx.AsyncClient) -> None:
    for row in (await client.post("/v2/repository/index")).json():
        version = row.get("version", "-")
        print(f"  {row['name']:<7} {version:>2} {row['state']:<12} {row['reason']}".rstrip())


async def manage_repository(client: httpx.AsyncClient, repo: Path) -> None:
    print("index:")
    await show_index(client)
    response = await client.post("/v2/repository/models/slow/load")
    print(f"load slow: {response.status_code}")
    # A new version on disk is served when the model is loaded again.
    add_version(repo / "digits", 4)
    response = await client.post("/v2/repository/models/digits/load")
    versions = (await client.get("/v2/models/digits")).json()["versions"]
    print(f"load digits again: {response.status_code}, now serving versions {versions}")


# --8<-- [end:manage]


# --8<-- [start:schedule]
ONE_ROW = np.ones((1, 256), dtype=np.float32)  # a few milliseconds of work
BIG = np.ones((16384, 256), dtype=np.float32)  # many seconds of work


async def slow_gauges(client: httpx.AsyncClient) -> tuple[float, float]:
    """The slow model's requests in the engine (queued or running), and queued, from /metrics."""
    values = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            if sample.labels.get("model") == "slow":
                values[sample.name] = sample.value
    return values["trioinfer_inference_pending"], values["trioinfer_inference_queue_depth"]


async def wait_for(client: httpx.AsyncClient, pending: int, queued: int) -> None:
    """Poll /metrics until the slow model has *pending* requests, *queued* of them waiting."""
    with trio.fail_after(10):  # a few milliseconds, unless something is wrong
        while True:
            if await slow_gauges(client) == (pending, queued):
                return
            await trio.sleep(0.01)


async def timeout_and_priority(client: httpx.AsyncClient) -> None:
    # "timeout" is in microseconds: past it the request is withdrawn and the answer is 504.
    body, headers = binary_request("x", BIG, ["y"], timeout=100_000)  # 0.1 s
    start = trio.current_time()
    response = await client.post("/v2/models/slow/infer", content=body, headers=headers)
    waited = trio.current_time() - start
    print(f"timeout: {response.status_code} {response.json()['error']} ({waited:.2f} s)")

    # "priority": larger runs sooner (with the priority scheduler).
    order = []

    async def ask(name: str, priority: int) -> None:
        request = {"inputs": [tensor("x", ONE_ROW)], "parameters": {"priority": priority}}
        response = await client.post("/v2/models/slow/infer", json=request)
        response.raise_for_status()
        order.append(name)

    async def occupy(scope: trio.CancelScope) -> None:
        body, headers = binary_request("x", BIG, ["y"])  # no timeout this time
        with scope:  # the client gives up: the server cancels BIG in the engine
            await client.post("/v2/models/slow/infer", content=body, headers=headers)

    await wait_for(client, pending=0, queued=0)  # the BIG above has left the engine
    async with trio.open_nursery() as nursery:
        leave = trio.CancelScope()
        nursery.start_soon(occupy, leave)
        await wait_for(client, pending=1, queued=0)  # BIG is running
        nursery.start_soon(ask, "low", 0)
        await wait_for(client, pending=2, queued=1)
        nursery.start_soon(ask, "high", 10)
        await wait_for(client, pending=3, queued=2)
        leave.cancel()
    print(f"priority: order of answers {order}")


# --8<-- [end:schedule]


# --8<-- [start:observe]
async def observe(client: httpx.AsyncClient) -> None:
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "trioinfer_inference_requests":
            for sample in family.samples:
                labels = sample.labels
                if labels["model"] == "slow":
                    print(
                        f"metrics: slow v{labels['version']} {labels['outcome']}: {sample.value:g}"
                    )
    stats = (await client.get("/v2/models/slow/stats")).json()["model_stats"][0]
    success = stats["inference_stats"]["success"]
    print(
        f"stats: slow v{stats['version']}: {success['count']} succeeded, "
        f"{stats['execution_count']} executions, "
        f"{success['ns'] / success['count'] / 1e6:.1f} ms per success, queueing included"
    )


# --8<-- [end:observe]


# --8<-- [start:unload]
async def unload_and_errors(client: httpx.AsyncClient) -> None:
    response = await client.post("/v2/repository/models/slow/unload")
    print(f"unload slow: {response.status_code}")
    request = {"inputs": [tensor("x", ONE_ROW)]}
    response = await client.post("/v2/models/slow/infer", json=request)
    print(f"errors: {response.status_code} {response.json()['error']}")
    request = {"inputs": [tensor("input", IMAGES[0])]}  # shape [64]: the batch axis is missing
    response = await client.post("/v2/models/digits/infer", json=request)
    print(f"errors: {response.status_code} {response.json()['error']}")
    print("index:")
    await show_index(client)


# --8<-- [end:unload]


# --8<-- [start:main]
async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repository(Path(tmp))
        async with trio.open_nursery() as nursery:
            listening = await nursery.start(
                functools.partial(
                    serve_http,
                    repo,
                    port=0,  # any free port on 127.0.0.1
                    models=["digits", "mlp"],  # slow stays unloaded until asked for
                    handle_signals=False,  # this program, not the server, decides when to stop
                )
            )
            print(f"serving {listening.models} at {listening.urls[0]}")
            # trust_env=False: talk to the loopback server directly, never through a proxy.
            async with httpx.AsyncClient(base_url=listening.urls[0], trust_env=False) as client:
                await health_and_metadata(client)
                await infer_json(client)
                await infer_binary(client)
                await batching(client)
                await manage_repository(client, repo)
                await timeout_and_priority(client)
                await observe(client)
                await unload_and_errors(client)
            nursery.cancel_scope.cancel()  # stops the server and closes its engine


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
