"""System shared memory: regions of ``/dev/shm`` that clients register, read and written in place.

Triton's shared-memory extension lets a client put input tensors in a POSIX
shared-memory object, register it under a name, and send only
``{region, offset, byte_size}`` in the request; outputs may be written into a
region the same way. The registry here is what the HTTP endpoint (and the
gRPC one) call:

```python
registry = SystemSharedMemory()
registry.register("in", "/input_simple", offset=0, byte_size=128)
with registry.lease() as lease:
    view = lease.read("in", offset=64, byte_size=64)   # read-only memoryview, no copy
    lease.write("out", 0, 64, [array])                  # bytes into a region
registry.unregister("in")   # or unregister() for all
registry.status()           # [RegionStatus(name, key, offset, byte_size)]
```

A region is ``mmap``-ed once, at registration. Requests take a lease on the
regions they use; unregistering a region takes its name away at once (new
requests are refused: "unknown region"), but its mapping is closed only when
the last lease on it ends, so a request in flight never reads or writes
unmapped memory. Python's ``mmap`` refuses to close while a view of it is
alive, which is the last guard: such a mapping is left to the garbage collector.

Every call is thread-safe: the gRPC endpoint may call from its own threads.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Sequence
from typing import Any, Final, final

import attrs

from .._exceptions import InvalidInput
from ._cuda_ipc import IPC_HANDLE_SIZE, CudaError, IpcMemory, probe

__all__ = [
    "CudaRegionStatus",
    "RegionStatus",
    "SharedMemoryError",
    "ShmLease",
    "SystemSharedMemory",
]

log = logging.getLogger("trioinfer.server")

#: Where POSIX shared-memory objects live on Linux (``shm_open`` opens files here).
SHM_DIR: Final = "/dev/shm"

# shm_open's names: one optional leading '/', then a file name (no '/', not . or ..).
_KEY_RE: Final = re.compile(r"/?([^/\x00]{1,255})")
_NAME_RE: Final = re.compile(r"[^\x00-\x1f/]{1,256}")


class SharedMemoryError(InvalidInput):
    """A shared-memory request the server cannot honour: unknown region, bad key, out of range.

    The client's fault (HTTP 400, gRPC ``INVALID_ARGUMENT``); the message names
    the region and says what was expected.
    """


@attrs.frozen
class RegionStatus:
    """A registered region, as the status endpoints report it.

    Attributes:
        name: The name clients use in requests.
        key: The shared-memory object's key (``/name`` as ``shm_open`` takes it).
        offset: Where the region starts in that object, in bytes.
        byte_size: The region's size in bytes.
    """

    name: str
    key: str
    offset: int
    byte_size: int


@attrs.frozen
class CudaRegionStatus:
    """A registered CUDA shared-memory region, as the CUDA status endpoints report it.

    Attributes:
        name: The name clients use in requests.
        device_id: The GPU the memory is on.
        byte_size: The region's size in bytes.
    """

    name: str
    device_id: int
    byte_size: int


@final
@attrs.define(eq=False)
class _Region:
    status: RegionStatus | CudaRegionStatus
    offset: int
    byte_size: int
    mapping: mmap.mmap | None = None
    device: IpcMemory | None = None
    users: int = 0
    retired: bool = False

    def close(self) -> None:
        if self.device is not None:
            self.device.close()
            return
        assert self.mapping is not None
        try:
            self.mapping.close()
        except BufferError:
            # A view of it is still alive somewhere (an output array, say): the
            # mapping closes when that view is collected, never before it.
            log.debug("shared memory region %r stays mapped until its views go", self.status.name)


def _integer(value: object, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SharedMemoryError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


@final
class SystemSharedMemory:
    """The server's registered shared-memory regions, system and CUDA; one per server.

    Requests name either kind the same way (``shared_memory_region``), so a
    name is registered once across both.
    """

    def __init__(self, directory: str = SHM_DIR) -> None:
        self._directory = directory
        self._regions: dict[str, _Region] = {}
        self._cuda: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shared-memory object *key* as *name*.

        Raises:
            SharedMemoryError: *name* is taken or not a valid name, *key* names
                no shared-memory object (or not a regular file), or the object
                is smaller than ``offset + byte_size``.
        """
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise SharedMemoryError(
                f"a shared memory region's name must be 1-256 printable characters without "
                f"'/', got {name!r}"
            )
        match = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
        if match is None or match.group(1) in (".", ".."):
            raise SharedMemoryError(
                f"shared memory key must be a POSIX shared memory name such as '/my_region' "
                f"(one leading '/', no other), got {key!r}"
            )
        offset = _integer(offset, "shared memory offset", minimum=0)
        byte_size = _integer(byte_size, "shared memory byte_size", minimum=1)
        with self._lock:
            self._check_free(name)
            mapping = self._map(name, match.group(1), key, offset, byte_size)
            status = RegionStatus(name, key, offset, byte_size)
            self._regions[name] = _Region(status, offset, byte_size, mapping=mapping)
        log.info("registered shared memory region %r (%s, %d bytes)", name, key, byte_size)

    def _check_free(self, name: str) -> None:
        if name in self._regions or name in self._cuda:
            raise SharedMemoryError(
                f"shared memory region {name!r} is already registered; unregister it first"
            )

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open another process's CUDA memory (a ``cudaIpcMemHandle_t``) as region *name*.

        Raises:
            SharedMemoryError: CUDA is not usable here (the message says why),
                *name* is taken, or the handle cannot be opened.
        """
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise SharedMemoryError(f"invalid CUDA shared memory region name {name!r}")
        if not isinstance(raw_handle, bytes) or len(raw_handle) != IPC_HANDLE_SIZE:
            raise SharedMemoryError(
                f"raw_handle must be a base64 cudaIpcMemHandle_t of {IPC_HANDLE_SIZE} bytes"
            )
        device_id = _integer(device_id, "device_id", minimum=0)
        byte_size = _integer(byte_size, "CUDA shared memory byte_size", minimum=1)
        reason = probe()
        if reason is not None:
            raise SharedMemoryError(
                f"CUDA shared memory is not supported on this server: {reason}; use system "
                "shared memory (/v2/systemsharedmemory), or send tensors in the request body"
            )
        with self._lock:
            self._check_free(name)
            try:
                device = IpcMemory(raw_handle, device_id)
            except CudaError as exc:
                raise SharedMemoryError(
                    f"unable to open CUDA shared memory region {name!r} on device "
                    f"{device_id}: {exc}"
                ) from None
            if byte_size > device.size:
                device.close()
                raise SharedMemoryError(
                    f"CUDA shared memory region {name!r}: byte_size {byte_size} is past the end "
                    f"of the allocation, which holds {device.size} bytes"
                )
            status = CudaRegionStatus(name, device_id, byte_size)
            self._cuda[name] = _Region(status, 0, byte_size, device=device)
        log.info("registered CUDA shared memory region %r (device %d)", name, device_id)

    def unregister_cuda(self, name: str | None = None) -> None:
        """Forget CUDA region *name*, or every one; as `unregister` does for system regions."""
        self._unregister(self._cuda, name)

    def cuda_status(self, name: str | None = None) -> list[CudaRegionStatus]:
        """The registered CUDA regions (or just *name*), by name.

        Raises:
            SharedMemoryError: *name* is given and not registered.
        """
        with self._lock:
            if name is None:
                return [_cuda_status(self._cuda[n]) for n in sorted(self._cuda)]
            region = self._cuda.get(name)
            if region is None:
                raise SharedMemoryError(f"unable to find CUDA shared memory region {name!r}")
            return [_cuda_status(region)]

    def _map(self, name: str, file: str, key: str, offset: int, byte_size: int) -> mmap.mmap:
        path = os.path.join(self._directory, file)
        try:
            # O_NOFOLLOW: a key is a shared-memory object, never a way to another file.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedMemoryError(
                f"unable to open shared memory region {name!r}: no shared memory object "
                f"{key!r} can be opened ({exc.strerror}); create it (shm_open) before registering"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SharedMemoryError(f"shared memory key {key!r} is not a shared memory object")
            if offset + byte_size > info.st_size:
                raise SharedMemoryError(
                    f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} "
                    f"is past the end of {key!r}, which holds {info.st_size} bytes"
                )
            return mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def unregister(self, name: str | None = None) -> None:
        """Forget region *name*, or every region when *name* is ``None``.

        Requests that already hold the region finish with it; its mapping is
        closed when the last of them ends. Unregistering a name that is not
        registered is not an error (as in Triton).
        """
        self._unregister(self._regions, name)

    def _unregister(self, regions: dict[str, _Region], name: str | None) -> None:
        with self._lock:
            names = list(regions) if name is None else [name]
            for each in names:
                region = regions.pop(each, None)
                if region is None:
                    continue
                region.retired = True
                if region.users == 0:
                    region.close()
                log.info("unregistered shared memory region %r", each)

    def status(self, name: str | None = None) -> list[RegionStatus]:
        """The registered regions (or just *name*), by name.

        Raises:
            SharedMemoryError: *name* is given and not registered.
        """
        with self._lock:
            if name is None:
                return [_system_status(self._regions[n]) for n in sorted(self._regions)]
            region = self._regions.get(name)
            if region is None:
                raise _unknown(name)
            return [_system_status(region)]

    def lease(self) -> ShmLease:
        """A lease for one request: ``with registry.lease() as lease:`` (see `ShmLease`).

        The regions it reads or writes stay mapped until the block ends.
        """
        return ShmLease._create(self)

    def _acquire(self, name: str) -> _Region:
        with self._lock:
            region = None
            if isinstance(name, str):
                region = self._regions.get(name) or self._cuda.get(name)
            if region is None:
                raise _unknown(name)
            region.users += 1
            return region

    def _release(self, region: _Region) -> None:
        with self._lock:
            region.users -= 1
            if region.retired and region.users == 0:
                region.close()


def _check_not_truncated(region: _Region) -> None:
    # Reading mapped pages past the end of a file kills the process (SIGBUS): a client that
    # shrinks its object after registering it is refused here instead. (One that shrinks it
    # while a request reads it is not caught; Triton has the same limit.)
    assert region.mapping is not None
    try:
        size = region.mapping.size()  # fstat of the object, through mmap's own descriptor
    except OSError as exc:
        raise SharedMemoryError(
            f"shared memory region {region.status.name!r} cannot be checked: {exc.strerror}"
        ) from None
    needed = region.offset + region.byte_size
    if size < needed:
        raise SharedMemoryError(
            f"shared memory region {region.status.name!r}: its object now holds {size} bytes, "
            f"fewer than the {needed} it was registered with; register it again"
        )


def _system_status(region: _Region) -> RegionStatus:
    assert isinstance(region.status, RegionStatus)  # only system regions are asked
    return region.status


def _cuda_status(region: _Region) -> CudaRegionStatus:
    assert isinstance(region.status, CudaRegionStatus)  # only CUDA regions are asked
    return region.status


def _device(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except CudaError as exc:
        raise SharedMemoryError(f"CUDA shared memory: {exc}") from None


def _unknown(name: object) -> SharedMemoryError:
    return SharedMemoryError(
        f"unable to find system shared memory region {name!r}; register it first "
        "(POST /v2/systemsharedmemory/region/<name>/register)"
    )


@final
class ShmLease:
    """The regions one request reads and writes; they stay mapped while it holds them.

    Made by `SystemSharedMemory.lease()`, which releases it at the end of its block.
    """

    __slots__ = ("_held", "_registry")
    _held: dict[str, _Region]
    _registry: SystemSharedMemory

    def __init__(self, *_args: object) -> None:
        raise TypeError("ShmLease is made by SystemSharedMemory.lease()")

    @classmethod
    def _create(cls, registry: SystemSharedMemory) -> ShmLease:
        self = object.__new__(cls)
        self._registry = registry
        self._held = {}
        return self

    def _region(
        self, name: str, offset: object, byte_size: object, what: str
    ) -> tuple[_Region, int, int]:
        offset = _integer(offset, f"{what}: shared_memory_offset", minimum=0)
        byte_size = _integer(byte_size, f"{what}: shared_memory_byte_size", minimum=0)
        region = self._held.get(name)
        if region is None:
            region = self._registry._acquire(name)
            self._held[name] = region
        if region.mapping is not None:
            _check_not_truncated(region)
        size = region.byte_size
        if offset + byte_size > size:
            raise SharedMemoryError(
                f"{what}: shared memory offset {offset} + byte_size {byte_size} is past the "
                f"end of region {name!r}, which holds {size} bytes"
            )
        return region, region.offset + offset, byte_size

    def read(self, name: str, offset: int, byte_size: int, *, what: str = "input") -> memoryview:
        """A read-only view of *byte_size* bytes at *offset* of region *name* (no copy).

        Raises:
            SharedMemoryError: Unknown region, or a range outside it.
        """
        region, start, size = self._region(name, offset, byte_size, what)
        if region.device is not None:
            # A CUDA region is copied to the host: inputs go to the backend from there.
            return memoryview(_device(region.device.read, start, size)).toreadonly()
        assert region.mapping is not None
        return memoryview(region.mapping)[start : start + size].toreadonly()

    def check(self, name: str, offset: int, byte_size: int, *, what: str = "output") -> None:
        """Check that region *name* exists and holds the range, and hold it (before computing).

        Raises:
            SharedMemoryError: Unknown region, or a range outside it.
        """
        self._region(name, offset, byte_size, what)

    def write(
        self,
        name: str,
        offset: int,
        byte_size: int,
        chunks: Sequence[Any],
        *,
        what: str = "output",
    ) -> int:
        """Copy *chunks* (bytes-like objects) one after another into the range; return the size.

        Raises:
            SharedMemoryError: Unknown region, a range outside it, or data larger
                than *byte_size*.
        """
        region, start, size = self._region(name, offset, byte_size, what)
        views = [memoryview(chunk).cast("B") for chunk in chunks]
        total = sum(len(v) for v in views)
        if total > size:
            raise SharedMemoryError(
                f"{what}: shared memory byte_size {size} is too small for the {total} bytes "
                f"of the result; ask for at least {total}"
            )
        if region.device is not None:
            _device(region.device.write, start, b"".join(views))
            return total
        assert region.mapping is not None
        with memoryview(region.mapping) as target:
            for view in views:
                target[start : start + len(view)] = view
                start += len(view)
        return total

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(self, *_exc: object) -> None:
        # A plain context manager, not @contextmanager: every request takes a lease.
        if self._held:
            held, self._held = self._held, {}
            for region in held.values():
                self._registry._release(region)
