"""The machine's CPU and memory, and each GPU's, for ``GET /metrics`` (Triton's host metrics).

Triton reports ``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes`` and
``nv_cpu_memory_used_bytes``, and per GPU ``nv_gpu_utilization``,
``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``,
``nv_gpu_power_usage``, ``nv_gpu_power_limit`` and ``nv_energy_consumption``;
dashboards built for them need the same facts here, under trioinfer's names
(``trioinfer_cpu_utilization``, ...; watts and joules in the name, as
Prometheus would have them). Read when scraped: the CPU's utilization is its
busy share since the previous scrape (from ``/proc/stat``), memory is
``/proc/meminfo``'s, and GPUs are read through NVML (``pynvml``, from the
``nvidia-ml-py`` package that the ``gpu`` extra installs) when it loads and
finds a driver. Where a source is missing (no ``/proc``, no NVML, no GPU) its
families are left out, never reported as zero.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("trioinfer.server")


def _load_nvml() -> Any:
    # NVML if its binding imports and a driver answers; else None, said once in the log.
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        log.debug("GPU metrics: pynvml (the nvidia-ml-py package) is not installed")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        log.debug("GPU metrics: NVML did not start: %s", exc)
        return None
    return pynvml


@final
class HostMetrics:
    """A Prometheus collector of the machine's CPU and memory and of its GPUs.

    Made once per server (the supervisor's under ``--workers``: the machine
    is reported once, not once per worker).

    Args:
        proc: Where ``stat`` and ``meminfo`` are (``/proc``).
        nvml: The NVML binding to read GPUs with (a module such as ``pynvml``),
            or None for no GPU metrics; by default ``pynvml`` if it imports and
            starts.
    """

    def __init__(self, proc: Path = Path("/proc"), nvml: Any = True) -> None:
        self._proc = proc
        self._nvml: Any = _load_nvml() if nvml is True else (nvml or None)
        self._cpu = self._cpu_times()
        self._utilization = 0.0
        # Energy is counted from this server's start, as Triton's nv_energy_consumption.
        self._energy_at_start: dict[str, float] = {}
        binding: Any = self._nvml
        for uuid, device in self._gpus():
            energy = self._read(binding.nvmlDeviceGetTotalEnergyConsumption, device)
            if energy is not None:
                self._energy_at_start[uuid] = energy

    def collect(self) -> Iterator[Metric]:
        """The families there is a source for, read now."""
        yield from self._cpu_families()
        yield from self._gpu_families()

    # -- CPU and memory ------------------------------------------------------------------

    def _cpu_times(self) -> tuple[int, int] | None:
        # (busy, total) jiffies of every CPU since boot, or None without /proc/stat.
        try:
            with (self._proc / "stat").open() as f:
                first = f.readline().split()
        except OSError:
            return None
        if not first or first[0] != "cpu":
            return None
        values = [int(v) for v in first[1:]]
        # user nice system idle iowait irq softirq steal (guest time is within user).
        total = sum(values[:8])
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return total - idle, total

    def _memory(self) -> tuple[int, int] | None:
        # (total, used) bytes, used as MemTotal - MemAvailable; None without /proc/meminfo.
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

    def _cpu_families(self) -> Iterator[Metric]:
        now = self._cpu_times()
        if now is not None and self._cpu is not None:
            busy, total = now[0] - self._cpu[0], now[1] - self._cpu[1]
            if busy < 0 or total < 0:
                # The counters went back (a container's view of them restarted): count
                # from here; until the next scrape, the last figure stands.
                self._cpu = now
            elif total > 0:  # else scraped again within a tick: the last figure stands
                self._utilization = min(busy / total, 1.0)
                self._cpu = now
            yield GaugeMetricFamily(
                "trioinfer_cpu_utilization",
                "The share of the machine's CPU time that was busy since the previous scrape "
                "(0 to 1; Triton's nv_cpu_utilization).",
                value=self._utilization,
            )
        elif now is not None:
            self._cpu = now
        memory = self._memory()
        if memory is not None:
            yield GaugeMetricFamily(
                "trioinfer_cpu_memory_total_bytes",
                "The machine's memory (Triton's nv_cpu_memory_total_bytes).",
                value=memory[0],
            )
            yield GaugeMetricFamily(
                "trioinfer_cpu_memory_used_bytes",
                "The machine's memory in use: total less available (Triton's "
                "nv_cpu_memory_used_bytes).",
                value=memory[1],
            )

    # -- GPUs ----------------------------------------------------------------------------

    def _gpus(self) -> list[tuple[str, Any]]:
        nvml = self._nvml
        if nvml is None:
            return []
        try:
            count = nvml.nvmlDeviceGetCount()
            devices = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [nvml.nvmlDeviceGetUUID(device) for device in devices]
        except Exception as exc:
            log.debug("GPU metrics: NVML could not list the GPUs: %s", exc)
            return []
        return [
            (uuid.decode() if isinstance(uuid, bytes) else str(uuid), device)
            for uuid, device in zip(uuids, devices, strict=True)
        ]

    @staticmethod
    def _read(query: Any, device: Any) -> float | None:
        # One NVML reading; None where the GPU does not support it (power on some boards).
        try:
            return float(query(device))
        except Exception:
            return None

    def _gpu_families(self) -> Iterator[Metric]:
        gpus = self._gpus()
        if not gpus:
            return
        nvml = self._nvml
        labels = ["gpu_uuid"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "utilization": GaugeMetricFamily(
                "trioinfer_gpu_utilization",
                "The share of time a kernel ran on the GPU in NVML's last sample period "
                "(0 to 1; Triton's nv_gpu_utilization).",
                labels=labels,
            ),
            "total": GaugeMetricFamily(
                "trioinfer_gpu_memory_total_bytes",
                "The GPU's memory (Triton's nv_gpu_memory_total_bytes).",
                labels=labels,
            ),
            "used": GaugeMetricFamily(
                "trioinfer_gpu_memory_used_bytes",
                "The GPU's memory in use, by any process (Triton's nv_gpu_memory_used_bytes).",
                labels=labels,
            ),
            "power": GaugeMetricFamily(
                "trioinfer_gpu_power_usage_watts",
                "The GPU's power draw (Triton's nv_gpu_power_usage).",
                labels=labels,
            ),
            "limit": GaugeMetricFamily(
                "trioinfer_gpu_power_limit_watts",
                "The GPU's power management limit (Triton's nv_gpu_power_limit).",
                labels=labels,
            ),
            "energy": CounterMetricFamily(
                "trioinfer_gpu_energy_consumption_joules",
                "Energy the GPU used since the server started (Triton's nv_energy_consumption).",
                labels=labels,
            ),
        }
        for uuid, device in gpus:
            rates = self._utilization_of(device)
            if rates is not None:
                families["utilization"].add_metric([uuid], rates)
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(device)
            except Exception:
                memory = None
            if memory is not None:
                families["total"].add_metric([uuid], float(memory.total))
                families["used"].add_metric([uuid], float(memory.used))
            power = self._read(nvml.nvmlDeviceGetPowerUsage, device)
            if power is not None:
                families["power"].add_metric([uuid], power / 1000)  # milliwatts
            limit = self._read(nvml.nvmlDeviceGetPowerManagementLimit, device)
            if limit is not None:
                families["limit"].add_metric([uuid], limit / 1000)
            energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, device)
            start = self._energy_at_start.get(uuid)
            if energy is not None and start is not None:
                families["energy"].add_metric([uuid], max(energy - start, 0.0) / 1000)  # mJ
        yield from (family for family in families.values() if family.samples)

    def _utilization_of(self, device: Any) -> float | None:
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(device)
        except Exception:
            return None
        return float(rates.gpu) / 100
