"""Routing simulation: the real engine over 100 simulated remote instances, on virtual time.

What the ray backend relies on, checked without Ray: the engine's queue,
batcher, dispatch and the ``resilient`` fallback (breakers, failover,
re-creating instances) keep every request ending exactly once while remote
instances come and go. Each simulated instance lives on its own node, with
its own latency and error rate; every simulated second some nodes leave (the
calls on them fail with ``BackendUnavailable``, as the ray backend reports a
lost node) and some come back (re-creating an instance there succeeds again).
Requests arrive at random with deadlines; each carries its own number in its
rows, so an answer that reaches the wrong caller is caught.

    python benchmarks/ray_routing.py --requests 100000

prints the outcome counts and the share served within deadline. The test
(tests/test_ray_routing.py) runs the same `simulate` with fewer requests.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from trioinfer import (
    BackendError,
    BackendUnavailable,
    CircuitOpen,
    DeadlineExceeded,
    Instance,
    ModelConfig,
    ModelSignature,
    QueueFull,
    Registry,
    TensorSpec,
    open_engine,
)
from trioinfer.lowlevel import Placement

SIGNATURE = ModelSignature(
    (TensorSpec("x", np.dtype(np.float64), ("batch", 1), "tensor(double)"),),
    (TensorSpec("y", np.dtype(np.float64), ("batch", 1), "tensor(double)"),),
)


@attrs.define
class Node:
    """One simulated cluster node holding one instance."""

    latency: float  # seconds per batch, before jitter
    error_rate: float  # share of calls that fail with a transient error
    alive: bool = True
    epoch: int = 0  # bumped when the node leaves: instances of an older epoch are dead


@attrs.define
class Cluster:
    """The nodes, a seeded random source, and counts of what the instances did."""

    nodes: list[Node]
    rng: random.Random
    computed: Counter[int] = attrs.field(factory=Counter)  # rows computed, by request number
    leaves: int = 0
    joins: int = 0


class SimInstance:
    """An instance on a simulated node: sleeps its latency, then echoes its input."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.epoch = cluster.nodes[index].epoch
        self.signature = SIGNATURE
        self.device = f"cpu@node{index}"

    def _check(self) -> None:
        node = self.cluster.nodes[self.index]
        if not node.alive or node.epoch != self.epoch:
            raise BackendUnavailable(f"node {self.index} is gone")

    async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        self._check()
        node = self.cluster.nodes[self.index]
        rng = self.cluster.rng
        await trio.sleep(node.latency * rng.uniform(0.5, 2.0))
        self._check()  # the node left while the batch ran
        if rng.random() < node.error_rate:
            raise BackendError(f"node {self.index}: a transient fault", transient=True)
        x = inputs["x"]
        for number in x[:, 0]:
            self.cluster.computed[int(number)] += 1
        return {"y": x.copy()}

    async def aclose(self) -> None:
        return None


class SimBackend:
    """Loads an instance on node *placement.index*; fails while that node is away."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def load(self, config: ModelConfig, placement: Placement) -> SimInstance:
        await trio.sleep(0.05)  # placing an actor and building its session
        if not self.cluster.nodes[placement.index].alive:
            raise BackendUnavailable(f"no node can take instance {placement.index} now")
        return SimInstance(self.cluster, placement.index)


@attrs.frozen
class Outcome:
    """What happened to the simulated requests."""

    requests: int
    outcomes: Mapping[str, int]
    lost: int  # requests that never ended
    doubled: int  # requests answered more than once
    wrong: int  # answers holding another request's rows
    within_deadline: float  # share of requests answered before their deadline
    leaves: int
    joins: int
    virtual_s: float
    wall_s: float


async def _simulate(requests: int, instances: int, seed: int, rate: float, churn: float) -> Outcome:
    rng = random.Random(seed)
    cluster = Cluster(
        [
            Node(rng.uniform(0.002, 0.03), rng.choice([0.0, 0.0, 0.001, 0.02]))
            for _ in range(instances)
        ],
        rng,
    )
    config = ModelConfig(
        name="remote",
        path="simulated",
        backend="sim",
        instances=[Instance(count=instances)],
        batcher="dynamic",
        batcher_options={"max_batch_size": 16, "max_queue_delay": 0.002},
        fallback="resilient",
        fallback_options={
            "attempts": 3,
            "backoff": 0.01,
            "breaker": {"fail_max": 3, "reset_timeout": 0.5, "max_reset_timeout": 2.0},
            "seed": seed,
        },
        max_queue_size=100_000,
    )
    registry = Registry(extra={"backends": {"sim": lambda: SimBackend(cluster)}})
    ended: Counter[int] = Counter()
    outcomes: Counter[str] = Counter()
    wrong = 0
    in_time = 0
    started = trio.current_time()

    async def one(number: int, budget: float) -> None:
        nonlocal wrong, in_time
        x = np.full((1, 1), float(number))
        try:
            with trio.fail_after(budget):
                out = await engine.infer("remote", {"x": x})
        except trio.TooSlowError:
            outcomes["deadline"] += 1
        except (DeadlineExceeded, CircuitOpen, QueueFull, BackendError) as exc:
            outcomes[type(exc).__name__] += 1
        else:
            outcomes["answered"] += 1
            in_time += 1
            if out["y"][0, 0] != number:
                wrong += 1
        ended[number] += 1

    async def churn_nodes() -> None:
        # Every simulated second, some nodes leave and some of those away come back.
        while True:
            await trio.sleep(1.0)
            for node in cluster.nodes:
                if node.alive and rng.random() < churn:
                    node.alive = False
                    node.epoch += 1
                    cluster.leaves += 1
                elif not node.alive and rng.random() < 0.5:
                    node.alive = True
                    cluster.joins += 1

    async with open_engine(registry=registry) as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(churn_nodes)
            async with trio.open_nursery() as callers:
                for number in range(requests):
                    await trio.sleep(rng.expovariate(rate))
                    callers.start_soon(one, number, rng.uniform(0.02, 0.5))
            nursery.cancel_scope.cancel()
    return Outcome(
        requests=requests,
        outcomes=dict(outcomes),
        lost=sum(1 for n in range(requests) if ended[n] == 0),
        doubled=sum(1 for n in range(requests) if ended[n] > 1),
        wrong=wrong,
        within_deadline=in_time / requests,
        leaves=cluster.leaves,
        joins=cluster.joins,
        virtual_s=0.0 if math.isnan(started) else trio.current_time() - started,
        wall_s=0.0,
    )


def simulate(
    requests: int,
    *,
    instances: int = 100,
    seed: int = 0,
    rate: float = 2000.0,
    churn: float = 0.05,
) -> Outcome:
    """Run the simulation on Trio's MockClock (autojump): deterministic for a seed."""
    wall = time.perf_counter()
    outcome = trio.run(
        _simulate,
        requests,
        instances,
        seed,
        rate,
        churn,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    return attrs.evolve(outcome, wall_s=time.perf_counter() - wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--rate", type=float, default=2000.0, help="requests per simulated second")
    parser.add_argument(
        "--churn", type=float, default=0.05, help="share of nodes leaving per second"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # Breakers opening are the point of the run; one line each would bury the figures.
    logging.getLogger("trioinfer").setLevel(logging.ERROR)
    out = simulate(
        args.requests, instances=args.instances, seed=args.seed, rate=args.rate, churn=args.churn
    )
    print(f"requests          {out.requests:,}")
    for name, count in sorted(out.outcomes.items()):
        print(f"  {name:<16}{count:,}")
    print(f"lost              {out.lost}")
    print(f"answered twice    {out.doubled}")
    print(f"wrong rows        {out.wrong}")
    print(f"within deadline   {out.within_deadline:.2%}")
    print(f"nodes left/joined {out.leaves}/{out.joins}")
    print(f"simulated {out.virtual_s:.1f} s in {out.wall_s:.1f} s of wall time")


if __name__ == "__main__":
    main()
