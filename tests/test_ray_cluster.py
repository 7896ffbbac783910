"""The ray backend on a three-node Ray on loopback: placement by affinity, and losing a node."""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import ray
import trio
from ray.cluster_utils import Cluster

import trioinfer_ray
from trioinfer import BackendUnavailable, InferenceResult, Instance, ModelConfig, open_engine

if TYPE_CHECKING:
    from conftest import ShortTmp

pytestmark = pytest.mark.ray

# Nodes that advertise the model, where its weights would be cached; the head does not.
TAG = "model:add"


def node_args(temp: Path, **kwargs: Any) -> dict[str, Any]:
    return {
        "node_ip_address": "127.0.0.1",
        "include_dashboard": False,
        "temp_dir": str(temp),
        "object_store_memory": 80 * 1024 * 1024,
        **kwargs,
    }


@pytest.fixture(scope="module")
def temp(short_tmp_factory: ShortTmp) -> Path:
    # Ray's sockets go under it: a path short enough for them.
    return short_tmp_factory.mktemp("ray")


@pytest.fixture(scope="module")
def cluster(temp: Path) -> Iterator[Cluster]:
    """A head with a CPU but no model tag, and two nodes tagged for the add model."""
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (conftest.py) keeps every node on 127.0.0.1.
    # Ray writes the cluster's address under $RAY_TMPDIR/ray: ours, not the machine's /tmp/ray.
    os.environ["RAY_TMPDIR"] = str(temp)
    (temp / "ray").mkdir(exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args=node_args(temp, num_cpus=1))
    try:
        for _ in range(2):
            cluster.add_node(**node_args(temp, num_cpus=1, resources={TAG: 1}))
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        del os.environ["RAY_TMPDIR"]


def tagged_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and TAG in n["Resources"]}


def ray_process(line: str) -> bool:
    if "raylet" in line or "gcs_server" in line or "ray::" in line:
        return True
    pid = re.search(r"pid=(\d+)", line)
    try:
        cmdline = Path(f"/proc/{pid.group(1)}/cmdline").read_bytes() if pid else b""
    except OSError:
        return False
    return b"site-packages/ray/" in cmdline


def test_everything_listens_on_loopback_only(cluster: Cluster) -> None:
    listening = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True)
    ours = [line for line in listening.stdout.splitlines() if ray_process(line)]
    assert len(ours) >= 6  # it does see Ray's listeners (GCS, raylets, workers) ...
    for line in ours:  # ... and each is on 127.0.0.1
        local = line.split()[3]
        assert local.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]"), line


async def test_instances_go_where_the_model_is_advertised(
    cluster: Cluster, add_model: Path
) -> None:
    tagged = tagged_node_ids()
    assert len(tagged) == 2
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(
                name="add",
                path=add_model,
                backend="ray",
                instances=[Instance(count=3)],
                # No CPU asked: only the tag limits where they may go (the head has a CPU).
                backend_options={"model_resource": True, "num_cpus": 0},
            )
        )
        devices = engine.statistics().models["add"].devices
        assert {device.split("@")[1] for device in devices} <= {n[:12] for n in tagged}
        other = next(iter(tagged))
        await engine.load(
            ModelConfig(
                name="pinned", path=add_model, backend="ray", backend_options={"node_id": other}
            )
        )
        assert engine.statistics().models["pinned"].devices == (f"cpu@{other[:12]}",)


async def test_a_model_no_node_advertises_is_not_placed(cluster: Cluster, add_model: Path) -> None:
    config = ModelConfig(
        name="nowhere",
        path=add_model,
        backend="ray",
        backend_options={"model_resource": True, "start_timeout": 2},
    )
    with pytest.raises(BackendUnavailable, match=r"no Ray node took the actor.*model:nowhere"):
        await trioinfer_ray.RayBackend().load(config, config.placements()[0])
    # The actor that waited for a node is gone: the head's CPU is still free.
    with trio.fail_after(30):
        while ray.available_resources().get("CPU", 0) < 3:  # noqa: ASYNC110  # Ray's state
            await trio.sleep(0.05)


async def test_losing_a_node_under_load(cluster: Cluster, temp: Path, add_model: Path) -> None:
    """0 lost, 0 answered twice or wrongly; the breaker opens, traffic moves, a new node is used."""
    config = ModelConfig(
        name="add",
        path=add_model,
        backend="ray",
        instances=[Instance(count=2)],
        # One CPU each, on tagged nodes of one CPU: one instance per node.
        backend_options={"model_resource": True, "num_cpus": 1, "start_timeout": 30},
        fallback="resilient",
        fallback_options={"attempts": 3, "breaker": {"fail_max": 1, "reset_timeout": 0.2}},
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.002},
    )
    answers: Counter[int] = Counter()
    wrong: list[int] = []
    served: list[tuple[int, str | None, tuple[str, ...]]] = []
    async with open_engine() as engine:
        await engine.load(config)
        devices = engine.statistics().models["add"].devices
        assert len({d.split("@")[1] for d in devices}) == 2  # one instance per tagged node
        victim_id = devices[1].split("@")[1]
        victim = next(n for n in cluster.worker_nodes if n.node_id.startswith(victim_id))
        next_id = 0
        stop = False

        async def client() -> None:
            nonlocal next_id
            while not stop:
                i = next_id
                next_id += 1
                a = np.full((1, 4), float(i), np.float32)
                result: InferenceResult = await engine.infer_detailed(
                    "add", {"a": a, "b": np.zeros_like(a)}
                )
                answers[i] += 1
                if not np.array_equal(result.outputs["sum"], a):
                    wrong.append(i)
                served.append((i, result.device, result.fallbacks))

        async def answered(n: int) -> None:
            while len(served) < n:  # noqa: ASYNC110  # the clients' progress
                await trio.sleep(0.01)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(client)
                await answered(60)
                # A crash, not a drain: the node's processes are killed under load.
                await trio.to_thread.run_sync(cluster.remove_node, victim, False)
                while engine.statistics().models["add"].replicas[1].state == "serving":  # noqa: ASYNC110
                    await trio.sleep(0.01)
                await answered(len(served) + 60)  # traffic goes on, on the other node
                stop = True
        total = next_id
        assert sorted(answers) == list(range(total))  # none lost
        assert set(answers.values()) == {1}  # none answered twice
        assert wrong == []  # each caller got its own rows
        stats = engine.statistics().models["add"]
        assert stats.replicas[1].taken_out >= 1  # the breaker opened on the lost node
        moved = [
            device for i, device, fallbacks in served if any("failover" in f for f in fallbacks)
        ]
        assert moved  # batches in flight on the lost node failed over ...
        assert all(device == devices[0] for device in moved)  # ... to the other node
        # Capacity comes back: a new tagged node; the breaker's re-prober re-creates the
        # instance there (a new actor) and puts it back.
        # On this thread: starting a node installs signal handlers. The loop waits meanwhile.
        cluster.add_node(**node_args(temp, num_cpus=1, resources={TAG: 1}))
        with trio.fail_after(90):
            while (replica := engine.statistics().models["add"].replicas[1]).state != "serving":  # noqa: ASYNC110
                await trio.sleep(0.1)
        assert replica.recreated >= 1
        # On the new node (its probe ran there), neither the lost one nor the other.
        assert replica.device.split("@")[1] not in (victim_id, devices[0].split("@")[1])
