"""Named resource pools that instances take before each execution: Triton's rate limiter.

An instance group may declare what one execution of one of its instances needs
(``Instance(resources={"R1": 4})``, per device, or ``global_resources``, shared
by every device). Before each execution the instance takes all of it at once
from the engine's pools, or none of it and waits; it gives everything back
when the execution ends, however it ends. Taking everything at once (never a
part while waiting for the rest) is what rules out deadlock between instances
whose needs overlap: whoever holds resources is running, not waiting.

Waiters are served in order, by stride scheduling on their ``resource_priority``
(Triton's ``rate_limiter.priority``, a weight: Triton orders instances by
executions times priority): an instance of priority 2 gets half the grants of
one of priority 1 while both have work, to within a grant. An instance that
asks again keeps up to one round of credit (the longest stride), so that one
that gave back as others did, and asked again only after the first waiter had
granted, keeps its turn; an idle or new one gets no more head start than that.
The head waiter is served
first even when a later one would fit now, so that a large need is never
starved by small ones. Resources given back wake the head waiter, which grants
them when it runs: an instance that asks again meanwhile (the one that gave
them back) takes its turn by its priority, not behind every waiter.

A pool's size is what ``open_engine(resources=...)`` says (for every device,
or per device), or else the largest need of any loaded instance, as Triton sizes
it: then every need fits, and the pool still serializes instances whose needs
together exceed it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Any, final

import anyio
import attrs

from ._exceptions import ConfigError

#: A pool: its resource's name, and its device (None for a global resource).
PoolKey = tuple[str, str | None]


@attrs.frozen
class ResourcePoolStatistics:
    """A snapshot of one resource pool, as in ``EngineStatistics.resources``.

    Attributes:
        name: The resource's name.
        device: The device whose pool it is, or ``None`` for a global resource.
        size: How much the pool holds: as configured, or the largest need.
        in_use: How much running executions hold now.
        waiting: Instances waiting for resources now.
        waits: Executions that had to wait for resources (any of them) since the
            engine opened; counted on each pool they needed.
        wait_s: Seconds those executions waited, in all.
    """

    name: str
    device: str | None
    size: int
    in_use: int
    waiting: int
    waits: int
    wait_s: float


def to_resource_sizes(
    value: Mapping[str, Any] | None,
) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Check ``open_engine(resources=...)``: sizes for every device, and per device."""
    from ._config import Device  # _config imports nothing of the engine's

    every: dict[str, int] = {}
    per_device: dict[tuple[str, str], int] = {}

    def count(where: str, n: object) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"resources[{where}] must be a positive integer, got {n!r}")
        return n

    if value is None:
        return every, per_device
    if not isinstance(value, Mapping):
        raise ConfigError(
            "resources must map a resource's name to its count, or to a table of "
            f"device = count (resources={{'R1': 10}}), got {value!r}"
        )
    for name, size in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"resources: a resource's name must be a string, got {name!r}")
        if isinstance(size, Mapping):
            for device, n in size.items():
                if device == EVERY_DEVICE:
                    every[name] = count(f"{name!r}][{device!r}", n)
                    continue
                key = str(Device.parse(device))
                per_device[name, key] = count(f"{name!r}][{device!r}", n)
        else:
            every[name] = count(repr(name), size)
    return every, per_device


#: In a per-device table of ``open_engine(resources=...)``: every device not named.
EVERY_DEVICE = "*"


def parse_resource_flags(flags: Iterable[str]) -> dict[str, dict[str, int]]:
    """Triton's ``--rate-limit-resource NAME:COUNT[:DEVICE]`` flags as ``open_engine``'s sizes.

    DEVICE is a GPU number as in Triton (``0`` is ``cuda:0``) or a device's name
    (``cpu``, ``cuda:1``); without it, COUNT is every device's (and a global
    resource's) pool size.

    Raises:
        ConfigError: A flag that is not of that form, or one pool given twice.
    """
    from ._config import Device  # _config imports nothing of the engine's

    sizes: dict[str, dict[str, int]] = {}
    for flag in flags:
        name, _, rest = str(flag).partition(":")
        number, _, device = rest.partition(":")
        if not name or not number.isdigit() or int(number) < 1:
            raise ConfigError(
                f"rate limit resource {flag!r} must be NAME:COUNT[:DEVICE] with a COUNT of 1 "
                "or more (R1:10, or R1:4:0 for GPU 0)"
            )
        if not device:
            key = EVERY_DEVICE
        else:
            key = str(Device.parse(f"cuda:{device}" if device.isdigit() else device))
        pools = sizes.setdefault(name, {})
        if key in pools:
            where = "every device" if key == EVERY_DEVICE else key
            raise ConfigError(
                f"rate limit resource {name!r} is sized twice for {where}: give each pool once"
            )
        pools[key] = int(number)
    return sizes


@final
class ResourceGate:
    """What one instance takes before each execution; the runner holds it like a limiter.

    It also takes the instance's device limiter (after its resources), so that the
    runner has one thing to acquire and release.
    """

    __slots__ = ("_device_limiter", "_needs", "_pass", "_pools", "_weight")

    def __init__(
        self,
        pools: ResourcePools,
        needs: dict[PoolKey, int],
        weight: int,
        device_limiter: anyio.CapacityLimiter | None,
    ) -> None:
        self._pools = pools
        self._needs = needs
        self._weight = weight
        self._pass = 0.0
        self._device_limiter = device_limiter

    async def acquire(self) -> None:
        """Wait until this instance holds all it needs, and its device's slot if limited."""
        await self._pools._take(self)
        if self._device_limiter is not None:
            try:
                await self._device_limiter.acquire()
            except BaseException:
                self._pools._give_back(self)
                raise

    def release(self) -> None:
        """Give everything back (the device's slot, then the resources)."""
        if self._device_limiter is not None:
            self._device_limiter.release()
        self._pools._give_back(self)

    def move(self, model: str, device: str, device_limiter: anyio.CapacityLimiter | None) -> None:
        """Take from *device*'s pools from now on: the instance was re-created there.

        Only while nobody holds or waits on this gate (the runner holds every slot
        of the instance); global resources stay as they are.

        Raises:
            ConfigError: A need is bigger than the new device's configured pool
                (then nothing changed).
        """
        self._pools._move(self, model, device)
        self._device_limiter = device_limiter

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *_exc: object) -> None:
        self.release()


def _in_order(needs: dict[PoolKey, int]) -> dict[PoolKey, int]:
    # Sorted: gates take and give back their pools in one fixed order.
    return dict(sorted(needs.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")))


@attrs.define(eq=False)
class _Waiter:
    pass_: float
    seq: int
    gate: ResourceGate
    event: anyio.Event
    granted: bool = False
    left: bool = False

    def __lt__(self, other: _Waiter) -> bool:
        return (self.pass_, self.seq) < (other.pass_, other.seq)


@final
class ResourcePools:
    """The engine's resource pools: their sizes, what is free, who waits."""

    def __init__(
        self, every: dict[str, int], per_device: dict[tuple[str, str], int], *, enabled: bool
    ) -> None:
        #: Whether instances take what they declare (False: Triton's --rate-limit=off).
        self.enabled = enabled
        self._every = every
        self._per_device = per_device
        self._size: dict[PoolKey, int] = {}
        self._free: dict[PoolKey, int] = {}
        # The pools some attached model's gates take from: statistics() lists these.
        # A pool none does any more (its model unloaded, its instance moved to another
        # device) keeps its entries, never dropped under a gate that may still give
        # back to it, and is sized afresh if a model takes from it again.
        self._used: set[PoolKey] = set()
        # Each attached model's gates' needs, for the default sizes (and for whether
        # each resource is global: as the models loaded now declare it, see attach).
        self._owners: dict[object, list[dict[PoolKey, int]]] = {}
        self._heap: list[_Waiter] = []
        self._waiting: dict[PoolKey, int] = {}
        self._waits: dict[PoolKey, int] = {}
        self._wait_s: dict[PoolKey, float] = {}
        self._vtime = 0.0
        # How far behind the clock a gate's pass may be when it asks: see _resize.
        self._lag = 1
        self._strides: dict[object, int] = {}
        self._seq = 0

    # -- loading ------------------------------------------------------------------

    def attach(
        self,
        owner: object,
        model: str,
        groups: Iterable[tuple[str, Mapping[str, int], Mapping[str, int], int]],
        device_limits: Mapping[str, anyio.CapacityLimiter],
    ) -> list[ResourceGate | None]:
        """Gates for a model's instances, one per ``(device, resources, global, priority)``.

        None for an instance that needs nothing (the runner then takes only its
        device's limiter). Pools without a configured size grow to the largest need.

        Raises:
            ConfigError: A need is bigger than its configured pool, or a resource is
                global for one instance and per device for another.
        """
        gates: list[ResourceGate | None] = []
        all_needs: list[dict[PoolKey, int]] = []
        # Whether each resource is global, as the loaded models declare it: not kept
        # apart from them, so that a model refused here, or unloaded, fixes nothing.
        kinds = {
            name: (where is None, True)  # (global, declared by another model)
            for needs_list in self._owners.values()
            for needs in needs_list
            for name, where in needs
        }
        for device, local, shared, priority in groups:
            needs: dict[PoolKey, int] = {}
            for names, key_device in ((local, device), (shared, None)):
                for name, n in names.items():
                    is_global = key_device is None
                    known, other = kinds.setdefault(name, (is_global, False))
                    if known != is_global:
                        said = (
                            f"is {'global' if is_global else 'per device'} for this model, "
                            f"but {'global' if known else 'per device'} for a model loaded "
                            "before"
                            if other
                            else "is declared both global and per device by this model"
                        )
                        raise ConfigError(
                            f"model {model!r}: resource {name!r} {said}: each resource is "
                            "one or the other"
                        )
                    key = (name, key_device)
                    self._check_need(model, key, n)
                    needs[key] = n
            if needs:
                needs = _in_order(needs)
                all_needs.append(needs)
                gates.append(ResourceGate(self, needs, max(priority, 1), device_limits.get(device)))
            else:
                gates.append(None)
        if all_needs:
            self._owners[owner] = all_needs
            self._strides[owner] = max(g._weight for g in gates if g is not None)
            self._resize()
        return gates

    def detach(self, owner: object) -> None:
        """Forget an unloaded model's needs: default sizes shrink to what is still loaded."""
        if self._owners.pop(owner, None) is not None:
            del self._strides[owner]
            self._resize()

    def _move(self, gate: ResourceGate, model: str, device: str) -> None:
        needs = {
            (name, None if where is None else device): n for (name, where), n in gate._needs.items()
        }
        for key, n in needs.items():
            self._check_need(model, key, n)
        # In place: the owner's list of needs (the default sizes) holds this dict.
        gate._needs.clear()
        gate._needs.update(_in_order(needs))
        self._resize()

    def _check_need(self, model: str, key: PoolKey, n: int) -> None:
        size = self._configured(key)
        if size is not None and n > size:
            name, device = key
            where = "all devices" if device is None else device
            raise ConfigError(
                f"model {model!r}: an instance needs {n} of resource {name!r} "
                f"on {where}, more than its pool holds ({size}): expected at "
                f"most {size}, or a larger --rate-limit-resource"
            )

    def _configured(self, key: PoolKey) -> int | None:
        name, device = key
        if device is not None and (name, device) in self._per_device:
            return self._per_device[name, device]
        return self._every.get(name)

    def _resize(self) -> None:
        # A gate asking again keeps at most one round of credit: the clock (the last
        # grant's pass) minus the longest stride. Gates that gave back at once (several
        # ending together, their next batches not formed yet) while the head granted
        # without them are at most that far behind; a gate back from idling (or new)
        # gets that much head start and no more, as CFS places a waking task.
        self._lag = max(self._strides.values(), default=1)
        largest: dict[PoolKey, int] = {}
        for needs_list in self._owners.values():
            for needs in needs_list:
                for key, n in needs.items():
                    largest[key] = max(largest.get(key, 0), n)
        self._used = set(largest)
        for key, need in largest.items():
            size = self._configured(key) or need
            old = self._size.get(key)
            if old is None:
                self._size[key] = size
                self._free[key] = size
            elif old != size:
                # What running executions hold stays held: free may go below 0 for a
                # while after a pool shrinks.
                self._size[key] = size
                self._free[key] += size - old
        self._grant()

    # -- executions ---------------------------------------------------------------

    def _fits(self, needs: dict[PoolKey, int]) -> bool:
        free = self._free
        return all(free[key] >= n for key, n in needs.items())

    def _hand(self, gate: ResourceGate) -> None:
        for key, n in gate._needs.items():
            self._free[key] -= n
        # Stride scheduling: the grant moves the clock to this gate's pass, and
        # its next pass is its weight later.
        start = max(gate._pass, self._vtime - self._lag)
        self._vtime = max(self._vtime, start)
        gate._pass = start + gate._weight

    async def _take(self, gate: ResourceGate) -> None:
        if not self._heap and self._fits(gate._needs):
            self._hand(gate)  # uncontended: no wait, no checkpoint (as the slot's)
            return
        gate._pass = max(gate._pass, self._vtime - self._lag)
        self._seq += 1
        waiter = _Waiter(gate._pass, self._seq, gate, anyio.Event())
        heapq.heappush(self._heap, waiter)
        for key in gate._needs:
            self._waiting[key] = self._waiting.get(key, 0) + 1
            self._waits[key] = self._waits.get(key, 0) + 1
        started = anyio.current_time()
        try:
            while True:
                await waiter.event.wait()
                if waiter.granted:
                    break
                # Woken to choose, as resources came back: the first in turn gets
                # them, which may be an instance that asked again meanwhile (the one
                # that gave them back, if its priority says it goes first).
                self._grant()
                if waiter.granted:
                    break
                waiter.event = anyio.Event()
        except BaseException:
            if waiter.granted:
                self._give_back(gate)  # granted as it was cancelled: hand it on
            else:
                waiter.left = True
                self._grant()  # it may have blocked the head: the next may fit
            raise
        finally:
            waited = anyio.current_time() - started
            for key in gate._needs:
                self._waiting[key] -= 1
                self._wait_s[key] = self._wait_s.get(key, 0.0) + waited

    def _give_back(self, gate: ResourceGate) -> None:
        for key, n in gate._needs.items():
            self._free[key] += n
        heap = self._heap
        while heap and heap[0].left:
            heapq.heappop(heap)
        if heap:
            # Not granted here: the first waiter wakes and grants then, so that an
            # instance that asks again at once (the one giving back, its next batch
            # waiting) takes its turn by its priority, not behind every waiter.
            heap[0].event.set()

    def _grant(self) -> None:
        heap = self._heap
        while heap:
            head = heap[0]
            if head.left:
                heapq.heappop(heap)
                continue
            if not self._fits(head.gate._needs):
                return  # the head first: a large need is not starved by small ones
            heapq.heappop(heap)
            self._hand(head.gate)
            head.granted = True
            head.event.set()

    def statistics(self) -> tuple[ResourcePoolStatistics, ...]:
        """A snapshot of every pool some loaded model's instances take from, by name then device.

        A pool no loaded model uses any more is left out (its size would be stale);
        its counters carry on if a model takes from it again.
        """
        return tuple(
            ResourcePoolStatistics(
                name=name,
                device=device,
                size=size,
                in_use=size - self._free[name, device],
                waiting=self._waiting.get((name, device), 0),
                waits=self._waits.get((name, device), 0),
                wait_s=self._wait_s.get((name, device), 0.0),
            )
            for (name, device), size in sorted(
                self._size.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
            )
            if (name, device) in self._used
        )
