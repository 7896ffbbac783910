"""The machine's CPU and memory, and each GPU's, for ``GET /metrics`` (Triton's host metrics).

Triton reports ``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes`` and
``nv_cpu_memory_used_bytes``, and per GPU ``nv_gpu_utilization``,
``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``,
``nv_gpu_power_usage``, ``nv_gpu_power_limit`` and ``nv_energy_consumption``;
dashboards built for them need the same facts here, under trioinfer's names
(``trioinfer_cpu_utilization``, ...; watts and joules in the name, as
Prometheus would have them).

As in Triton, they are sampled at a fixed interval (``--metrics-interval-ms``,
2 s by default) by a task of the server's own (`HostMetrics.run`), and a
scrape reads the last sample: a scrape does no I/O, and two scrapers (a
Prometheus and a person with curl) read the same figures rather than each
shortening the other's interval. The readings run on a worker thread: NVML
calls can block for milliseconds, and ``/proc`` is a file system. The CPU's
utilization is its busy share over the last interval (from ``/proc/stat``),
memory is ``/proc/meminfo``'s, and GPUs are read through NVML (``pynvml``,
from the ``nvidia-ml-py`` package that the ``gpu`` extra installs), which is
started once when sampling starts and shut down when it stops. Where a
source is missing (no ``/proc``, no NVML, no GPU, a reading the board does
not support, a GPU that fell off the bus) its families are left out, never
reported as zero, and the log says why once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import anyio.abc
import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ._app import ServerConfig

log = logging.getLogger("trioinfer.server")

#: How often the machine is sampled by default: Triton's ``--metrics-interval-ms`` default.
DEFAULT_INTERVAL_S: Final = 2.0

#: How long NVML's shutdown may take when sampling stops, before it is left behind.
CLEANUP_S: Final = 10.0


def host_metrics_for(config: ServerConfig) -> HostMetrics | None:
    """The machine's metrics as *config* asks for them, or None when it asks for none."""
    if not (config.allow_cpu_metrics or config.allow_gpu_metrics):
        return None
    return HostMetrics(
        interval=config.metrics_interval_s,
        cpu=config.allow_cpu_metrics,
        gpu=config.allow_gpu_metrics,
    )


@attrs.frozen
class _Gpu:
    # One GPU's readings in a sample; None where NVML could not read one.
    uuid: str
    utilization: float | None = None
    memory: tuple[float, float] | None = None  # (total, used) bytes
    power_w: float | None = None
    limit_w: float | None = None
    energy_j: float | None = None  # since sampling started


@attrs.frozen
class _Sample:
    # What a scrape reports; replaced whole at each interval, never changed in place.
    cpu_utilization: float | None = None  # None: no /proc/stat (or CPU metrics off)
    memory: tuple[int, int] | None = None  # (total, used) bytes
    gpus: tuple[_Gpu, ...] = ()


@final
class HostMetrics:
    """A Prometheus collector of the machine's CPU and memory and of its GPUs, sampled.

    Made once per server (the supervisor's under ``--workers``: the machine
    is reported once, not once per worker), and sampled by `run`, which the
    server starts in its own task group: a scrape (`collect`) returns the last
    sample and never reads ``/proc`` or NVML itself. Before `run` has taken a
    sample, it reports nothing.

    Args:
        interval: Seconds between samples (Triton's ``--metrics-interval-ms``),
            as [`ServerConfig.metrics_interval_s`][trioinfer.server.ServerConfig],
            which checks it.
        cpu: Report the CPU's utilization and the memory (Triton's
            ``--allow-cpu-metrics``).
        gpu: Report the GPUs through NVML (Triton's ``--allow-gpu-metrics``).
        proc: Where ``stat`` and ``meminfo`` are (``/proc``).
        nvml: The NVML binding (a module such as ``pynvml``, not yet
            initialised: `run` calls its ``nvmlInit`` and ``nvmlShutdown``), or
            None for no GPU metrics; by default ``pynvml`` if it imports.
    """

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        cpu: bool = True,
        gpu: bool = True,
        proc: Path = Path("/proc"),
        nvml: Any = True,
    ) -> None:
        self._interval = float(interval)
        self._proc = proc if cpu else None
        self._nvml: Any = nvml if gpu else None
        self._sample = _Sample()
        self._taken = 0
        self._new_sample: anyio.Event | None = None
        self._running = False

    @property
    def interval(self) -> float:
        """Seconds between samples."""
        return self._interval

    def collect(self) -> Iterator[Metric]:
        """The families of the last sample (no I/O: `run` reads the machine)."""
        sample = self._sample
        yield from _cpu_families(sample)
        yield from _gpu_families(sample)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sample the machine every `interval` until cancelled; for ``task_group.start``.

        Reports started once the first sample is in, so that the server's
        first scrape has figures. NVML is started here, on the worker thread
        of the first sample, and shut down when this ends, however it ends
        (shielded, for up to `CLEANUP_S`).

        Raises:
            RuntimeError: It is already running.
        """
        if self._running:
            raise RuntimeError("HostMetrics.run is already running: one sampler a collector")
        self._running = True
        reader = _Reader(self._proc, self._nvml)
        # Its own thread token: a sample never waits behind inference work on the
        # default limiter's threads, and never overlaps another sample.
        limiter = anyio.CapacityLimiter(1)
        try:
            # Left behind when cancelled (a reading can hang: a wedged driver), so that
            # the server's stop never waits for one; the reader's lock keeps NVML's
            # shutdown after it.
            self._publish(
                await anyio.to_thread.run_sync(reader.open, limiter=limiter, abandon_on_cancel=True)
            )
            task_status.started()
            tick = anyio.current_time()
            while True:
                # Fixed ticks, as Triton's; a sample that took longer than an interval
                # is followed by the next one at once, not by a burst of missed ones.
                tick = max(tick + self._interval, anyio.current_time())
                await anyio.sleep_until(tick)
                self._publish(
                    await anyio.to_thread.run_sync(
                        reader.read, limiter=limiter, abandon_on_cancel=True
                    )
                )
        finally:
            self._running = False
            with anyio.move_on_after(CLEANUP_S, shield=True) as cleanup:
                # Left behind (abandoned) if NVML's shutdown, or the reading it waits
                # for, takes past CLEANUP_S.
                await anyio.to_thread.run_sync(reader.close, abandon_on_cancel=True)
            if cleanup.cancelled_caught:
                log.warning("GPU metrics: NVML did not shut down within %.0fs", CLEANUP_S)

    async def wait_samples(self, count: int) -> None:
        """Wait until `run` has taken *count* samples in all (the first before it started)."""
        while self._taken < count:
            if self._new_sample is None:
                self._new_sample = anyio.Event()
            await self._new_sample.wait()

    def _publish(self, sample: _Sample) -> None:
        # On the event loop: a scrape sees the old sample or the new one, never a mix.
        self._sample = sample
        self._taken += 1
        if self._new_sample is not None:
            self._new_sample.set()
            self._new_sample = None


def _import_nvml() -> Any:
    # The NVML binding if it imports; else None, said once in the log.
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        log.debug("GPU metrics: pynvml (the nvidia-ml-py package) is not installed")
        return None
    return pynvml


@final
class _Reader:
    """Reads ``/proc`` and NVML: blocking, so called on a worker thread, one call at a time.

    A call may be left running (abandoned) when sampling is cancelled; its lock
    keeps the next one, NVML's shutdown, after it, and nothing starts NVML or
    reads it once `close` has run.
    """

    def __init__(self, proc: Path | None, nvml: Any) -> None:
        self._proc = proc
        self._binding: Any = nvml
        self._nvml: Any = None  # the binding once nvmlInit succeeded, until nvmlShutdown
        self._gpus: list[tuple[str, Any]] | None = None  # None: not listed yet
        self._cpu: tuple[int, int] | None = None
        self._utilization = 0.0
        # Energy is counted from sampling's start, as Triton's nv_energy_consumption.
        self._energy_at_start: dict[str, float] = {}
        self._said: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def open(self) -> _Sample:
        """Start NVML (where there is one) and take the first sample."""
        with self._lock:
            if self._closed:
                return _Sample()
            self._start_nvml()
            return self._read()

    def _start_nvml(self) -> None:
        binding = _import_nvml() if self._binding is True else self._binding
        if binding:
            try:
                binding.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
                log.info("GPU metrics: NVML did not start, so no GPU is reported: %s", exc)
            else:
                self._nvml = binding

    def read(self) -> _Sample:
        """A sample: the CPU's utilization since the previous one, memory, the GPUs'."""
        with self._lock:
            return _Sample() if self._closed else self._read()

    def _read(self) -> _Sample:
        if self._proc is None:
            cpu, memory = None, None
        else:
            cpu, memory = self._cpu_utilization(), self._memory()
        return _Sample(cpu, memory, tuple(self._read_gpus()))

    def close(self) -> None:
        """Shut NVML down, once, if it started (after a reading still running)."""
        with self._lock:
            self._closed = True
            nvml, self._nvml = self._nvml, None
            if nvml is None:
                return
            try:
                nvml.nvmlShutdown()
            except Exception as exc:
                log.warning("GPU metrics: NVML's shutdown failed: %s", exc)

    def _once(self, key: tuple[str, ...], message: str, *args: object) -> None:
        # A failing source is said once, not at every interval.
        if key not in self._said:
            self._said.add(key)
            log.info(message, *args)

    # -- CPU and memory ------------------------------------------------------------------

    def _cpu_times(self) -> tuple[int, int] | None:
        # (busy, total) jiffies of every CPU since boot, or None without /proc/stat.
        assert self._proc is not None
        try:
            with (self._proc / "stat").open() as f:
                first = f.readline().split()
            if not first or first[0] != "cpu":
                return None
            values = [int(v) for v in first[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal (guest time is within user).
        total = sum(values[:8])
        idle = sum(values[3:5])
        return total - idle, total

    def _cpu_utilization(self) -> float | None:
        now = self._cpu_times()
        if now is None:
            self._cpu = None
            return None
        if self._cpu is None:
            # The first reading (or /proc/stat came back): nothing to compare it with
            # yet, so 0 (as Triton's gauge) or the last figure, until the next sample.
            self._cpu = now
            return self._utilization
        busy, total = now[0] - self._cpu[0], now[1] - self._cpu[1]
        if busy < 0 or total < 0:
            # The counters went back (a container's view of them restarted): count
            # from here; until the next sample, the last figure stands.
            self._cpu = now
        elif total > 0:  # else sampled again within a tick: the last figure stands
            self._utilization = min(busy / total, 1.0)
            self._cpu = now
        return self._utilization

    def _memory(self) -> tuple[int, int] | None:
        # (total, used) bytes, used as MemTotal - MemAvailable; None without /proc/meminfo.
        assert self._proc is not None
        fields: dict[str, int] = {}
        try:
            with (self._proc / "meminfo").open() as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("MemTotal", "MemAvailable"):
                        fields[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        if len(fields) != 2:
            return None
        return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]

    # -- GPUs ----------------------------------------------------------------------------

    def _list_gpus(self) -> list[tuple[str, Any]]:
        # The GPUs by UUID, listed once (as Triton does at start); tried again at the
        # next sample while NVML cannot list them.
        if self._gpus is not None:
            return self._gpus
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
            devices = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [nvml.nvmlDeviceGetUUID(device) for device in devices]
        except Exception as exc:
            self._once(("list",), "GPU metrics: NVML could not list the GPUs: %s", exc)
            return []
        self._gpus = [
            (uuid.decode() if isinstance(uuid, bytes) else str(uuid), device)
            for uuid, device in zip(uuids, devices, strict=True)
        ]
        return self._gpus

    def _query(self, what: str, uuid: str, query: Callable[[Any], Any], device: Any) -> Any:
        # One NVML reading, or None where it fails (power on some boards, a GPU that
        # fell off the bus): that family leaves this GPU out, and the log says so once.
        try:
            return query(device)
        except Exception as exc:
            self._once(
                (what, uuid),
                "GPU metrics: NVML could not read the %s of GPU %s (%s); /metrics leaves it "
                "out while it cannot",
                what,
                uuid,
                exc,
            )
            return None

    def _read_gpus(self) -> Iterator[_Gpu]:
        nvml = self._nvml
        if nvml is None:
            return
        for uuid, device in self._list_gpus():
            rates = self._query("utilization", uuid, nvml.nvmlDeviceGetUtilizationRates, device)
            memory = self._query("memory", uuid, nvml.nvmlDeviceGetMemoryInfo, device)
            power = self._query("power usage", uuid, nvml.nvmlDeviceGetPowerUsage, device)
            limit = self._query("power limit", uuid, nvml.nvmlDeviceGetPowerManagementLimit, device)
            energy = self._query(
                "energy consumption", uuid, nvml.nvmlDeviceGetTotalEnergyConsumption, device
            )
            since = None
            if energy is not None:
                start = self._energy_at_start.setdefault(uuid, float(energy))
                since = max(float(energy) - start, 0.0) / 1000  # millijoules
            yield _Gpu(
                uuid,
                utilization=None if rates is None else float(rates.gpu) / 100,
                memory=None if memory is None else (float(memory.total), float(memory.used)),
                power_w=None if power is None else float(power) / 1000,  # milliwatts
                limit_w=None if limit is None else float(limit) / 1000,
                energy_j=since,
            )


def _cpu_families(sample: _Sample) -> Iterator[Metric]:
    if sample.cpu_utilization is not None:
        yield GaugeMetricFamily(
            "trioinfer_cpu_utilization",
            "The share of the machine's CPU time that was busy over the last sampling "
            "interval (--metrics-interval-ms; 0 to 1; Triton's nv_cpu_utilization).",
            value=sample.cpu_utilization,
        )
    if sample.memory is not None:
        yield GaugeMetricFamily(
            "trioinfer_cpu_memory_total_bytes",
            "The machine's memory (Triton's nv_cpu_memory_total_bytes).",
            value=sample.memory[0],
        )
        yield GaugeMetricFamily(
            "trioinfer_cpu_memory_used_bytes",
            "The machine's memory in use: total less available (Triton's "
            "nv_cpu_memory_used_bytes).",
            value=sample.memory[1],
        )


def _gpu_families(sample: _Sample) -> Iterator[Metric]:
    if not sample.gpus:
        return
    labels = ["gpu_uuid"]
    utilization = GaugeMetricFamily(
        "trioinfer_gpu_utilization",
        "The share of time a kernel ran on the GPU in NVML's last sample period "
        "(0 to 1; Triton's nv_gpu_utilization).",
        labels=labels,
    )
    total = GaugeMetricFamily(
        "trioinfer_gpu_memory_total_bytes",
        "The GPU's memory (Triton's nv_gpu_memory_total_bytes).",
        labels=labels,
    )
    used = GaugeMetricFamily(
        "trioinfer_gpu_memory_used_bytes",
        "The GPU's memory in use, by any process (Triton's nv_gpu_memory_used_bytes).",
        labels=labels,
    )
    power = GaugeMetricFamily(
        "trioinfer_gpu_power_usage_watts",
        "The GPU's power draw (Triton's nv_gpu_power_usage).",
        labels=labels,
    )
    limit = GaugeMetricFamily(
        "trioinfer_gpu_power_limit_watts",
        "The GPU's power management limit (Triton's nv_gpu_power_limit).",
        labels=labels,
    )
    energy = CounterMetricFamily(
        "trioinfer_gpu_energy_consumption_joules",
        "Energy the GPU used since the server started (Triton's nv_energy_consumption).",
        labels=labels,
    )
    for gpu in sample.gpus:
        uuid = [gpu.uuid]
        if gpu.utilization is not None:
            utilization.add_metric(uuid, gpu.utilization)
        if gpu.memory is not None:
            total.add_metric(uuid, gpu.memory[0])
            used.add_metric(uuid, gpu.memory[1])
        if gpu.power_w is not None:
            power.add_metric(uuid, gpu.power_w)
        if gpu.limit_w is not None:
            limit.add_metric(uuid, gpu.limit_w)
        if gpu.energy_j is not None:
            energy.add_metric(uuid, gpu.energy_j)
    families: tuple[Metric, ...] = (utilization, total, used, power, limit, energy)
    yield from (family for family in families if family.samples)
