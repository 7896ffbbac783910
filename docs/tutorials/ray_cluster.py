"""Serving on a Ray cluster: instances as actors on two nodes, one node lost, traffic moved.

Run it with ``python docs/tutorials/ray_cluster.py`` (it needs the ``ray``
extra); the docs' test suite runs it too. It starts a two-node Ray on this
machine (127.0.0.1 only), so it takes half a minute or so on a small machine.
"""

# --8<-- [start:cluster]
import os
import shutil
import tempfile
from typing import Any

# Before Ray is imported: every process of this cluster on 127.0.0.1, no usage reports.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import ray
import trio
from ray.cluster_utils import Cluster  # Ray's documented mini-cluster for one machine

import trioinfer

# Ray's files, this cluster's own. A short path: Ray's socket paths must fit in 107 bytes.
TEMP = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
os.environ["RAY_TMPDIR"] = TEMP  # where Ray notes the cluster's address
os.makedirs(os.path.join(TEMP, "ray"))

# Each node as `ray start` would start it on a machine that has the digits
# model's weights at hand: one CPU, the custom resource model:digits.
NODE: dict[str, Any] = {
    "node_ip_address": "127.0.0.1",
    "include_dashboard": False,
    "num_cpus": 1,
    "temp_dir": TEMP,
    "resources": {"model:digits": 1},
}


def start_cluster() -> Cluster:
    """A head node and a worker node, both advertising the digits model; connect to it."""
    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def node_names() -> dict[str, str]:
    """The nodes by id (its first 12 hex digits, as instances' devices show it)."""
    head = ray.get_runtime_context().get_node_id()  # the driver runs on the head
    names = {head[:12]: "the head"}
    for node in ray.nodes():  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
        if node["Alive"] and node["NodeID"] != head:
            names[node["NodeID"][:12]] = "the worker"
    return names


def crash_worker(cluster: Cluster) -> None:
    """Kill the worker node's processes at once, as a crash would (no graceful exit)."""
    (worker,) = cluster.worker_nodes
    cluster.remove_node(worker, allow_graceful=False)


# --8<-- [end:cluster]

# --8<-- [start:model]
IMAGES, LABELS = trioinfer.digits_samples()
DIGITS = trioinfer.example_repository() / "digits" / "1" / "model.onnx"

CONFIG = trioinfer.ModelConfig(
    name="digits",
    path=DIGITS,
    backend="ray",
    instances=[trioinfer.Instance(count=2)],
    backend_options={
        "model_resource": True,  # only on nodes that advertise model:digits
        "num_cpus": 1,  # one CPU each: one instance per node here
    },
    fallback="resilient",
    fallback_options={
        "attempts": 3,
        # Tutorial-sized waits; production values are seconds.
        "breaker": {"fail_max": 1, "reset_timeout": 0.5},
    },
)


def show_instances(engine: trioinfer.Engine, nodes: dict[str, str]) -> None:
    """Each instance's state and the node serving it (as /metrics labels them too)."""
    for replica in engine.statistics().models["digits"].replicas:
        node = nodes.get(replica.device.split("@")[1], "a new node")
        print(
            f"  instance {replica.index} on {node}: {replica.state},"
            f" taken out {replica.taken_out}, re-created {replica.recreated}"
        )


def states(engine: trioinfer.Engine) -> set[str]:
    """The states of the model's instances: "serving", and "out" while one is out."""
    return {replica.state for replica in engine.statistics().models["digits"].replicas}


async def classify_many(engine: trioinfer.Engine, count: int) -> tuple[int, int]:
    """Send *count* images, 8 at a time; return (correct answers, answers via failover)."""
    correct = failovers = 0

    async def one(i: int) -> None:
        nonlocal correct, failovers
        result = await engine.infer_detailed("digits", {"input": IMAGES[i : i + 1]})
        correct += int(result.outputs["label"][0]) == LABELS[i]
        failovers += any(step.startswith("failover") for step in result.fallbacks)

    limit = trio.CapacityLimiter(8)

    async def limited(i: int) -> None:
        async with limit:
            await one(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(limited, i % len(IMAGES))
    return correct, failovers


# --8<-- [end:model]


# --8<-- [start:main]
async def main() -> None:
    cluster = start_cluster()
    nodes = node_names()
    try:
        async with trioinfer.open_engine() as engine:
            await engine.load(CONFIG)
            print("step 1: two instances, one per node")
            show_instances(engine, nodes)
            correct, _ = await classify_many(engine, 200)
            print(f"  {correct} of 200 correct")

            print("step 2: the worker node dies; requests go on")
            await trio.to_thread.run_sync(crash_worker, cluster)
            answered = correct = failovers = 0
            with trio.fail_after(120):
                # Until a batch meets the lost actor: Ray notices a dead node in its own time.
                while "out" not in states(engine):
                    right, moved = await classify_many(engine, 50)
                    answered, correct, failovers = answered + 50, correct + right, failovers + moved
            print(f"  {answered} answered, {correct} correct; some via a failover: {failovers > 0}")
            show_instances(engine, nodes)

            print("step 3: a new node joins; the instance is re-created there")
            cluster.add_node(**NODE)
            with trio.fail_after(120):
                while "out" in states(engine):  # noqa: ASYNC110
                    await trio.sleep(0.1)
            show_instances(engine, nodes)
            correct, _ = await classify_many(engine, 200)
            print(f"  {correct} of 200 correct")
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
        shutil.rmtree(TEMP, ignore_errors=True)


# --8<-- [end:main]

if __name__ == "__main__":
    trio.run(main)
