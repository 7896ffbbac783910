"""The machine's CPU, memory and GPU metrics on ``/metrics`` (Triton's nv_cpu_*, nv_gpu_*).

Read from a fake ``/proc`` and a fake NVML binding here; a real server's
``/metrics`` carries them once (test_server.py, and test_workers.py under
``--workers``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trioinfer.server._host_metrics import HostMetrics, _load_nvml

MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"


def proc(tmp_path: Path, user: int, idle: int) -> Path:
    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
    (tmp_path / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    (tmp_path / "meminfo").write_text(MEMINFO)
    return tmp_path


def scraped(host: HostMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(host)
    text = generate_latest(registry).decode()
    return {
        sample.name: [(s.labels, s.value) for s in family.samples if s.name == sample.name]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_cpu_utilization_is_the_busy_share_since_the_previous_scrape(tmp_path: Path) -> None:
    host = HostMetrics(proc(tmp_path, user=100, idle=900), nvml=None)
    proc(tmp_path, user=175, idle=925)  # 75 of 100 jiffies busy since the server started
    first = scraped(host)
    assert first["trioinfer_cpu_utilization"] == [({}, 0.75)]
    proc(tmp_path, user=185, idle=1015)  # then 10 of 100
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.1)]
    # Scraped again within a tick: the last figure stands (no division by zero).
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.1)]
    assert first["trioinfer_cpu_memory_total_bytes"] == [({}, 16000000 * 1024)]
    assert first["trioinfer_cpu_memory_used_bytes"] == [({}, 12000000 * 1024)]


def test_counters_that_go_back_start_the_count_again(tmp_path: Path) -> None:
    # /proc/stat's counters can go back (a container's view of them restarted, a
    # kernel's iowait): the next interval counts from there, not from the old figures.
    host = HostMetrics(proc(tmp_path, user=100_000, idle=900_000), nvml=None)
    proc(tmp_path, user=150, idle=850)  # went back
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.0)]
    proc(tmp_path, user=200, idle=900)  # 50 of 100 busy since
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.5)]


def test_without_proc_or_nvml_nothing_is_reported(tmp_path: Path) -> None:
    assert scraped(HostMetrics(tmp_path / "none", nvml=None)) == {}
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")  # no MemAvailable: left out
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert scraped(HostMetrics(tmp_path, nvml=None)) == {}


class FakeNVML:
    """Two GPUs, the second without power readings; energy grows by 5 J a reading."""

    def __init__(self) -> None:
        self.energy = {0: 1_000_000.0, 1: 2_000_000.0}  # millijoules since the driver loaded

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, device: int) -> Any:
        return f"GPU-{device}".encode() if device == 0 else f"GPU-{device}"

    def nvmlDeviceGetUtilizationRates(self, device: int) -> Any:
        return SimpleNamespace(gpu=40 + device, memory=7)

    def nvmlDeviceGetMemoryInfo(self, device: int) -> Any:
        return SimpleNamespace(total=80 << 30, used=(device + 1) << 30, free=0)

    def nvmlDeviceGetPowerUsage(self, device: int) -> int:
        if device == 1:
            raise RuntimeError("NVMLError_NotSupported")
        return 250_500  # milliwatts

    def nvmlDeviceGetPowerManagementLimit(self, device: int) -> int:
        if device == 1:
            raise RuntimeError("NVMLError_NotSupported")
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, device: int) -> float:
        self.energy[device] += 5000
        return self.energy[device]


def test_gpus_are_read_through_nvml_each_labelled_by_its_uuid(tmp_path: Path) -> None:
    host = HostMetrics(tmp_path / "none", nvml=FakeNVML())
    found = scraped(host)
    assert found["trioinfer_gpu_utilization"] == [
        ({"gpu_uuid": "GPU-0"}, 0.4),
        ({"gpu_uuid": "GPU-1"}, 0.41),
    ]
    assert found["trioinfer_gpu_memory_total_bytes"] == [
        ({"gpu_uuid": "GPU-0"}, float(80 << 30)),
        ({"gpu_uuid": "GPU-1"}, float(80 << 30)),
    ]
    assert [v for _, v in found["trioinfer_gpu_memory_used_bytes"]] == [1 << 30, 2 << 30]
    # A reading the board does not support is left out, not zero.
    assert found["trioinfer_gpu_power_usage_watts"] == [({"gpu_uuid": "GPU-0"}, 250.5)]
    assert found["trioinfer_gpu_power_limit_watts"] == [({"gpu_uuid": "GPU-0"}, 700.0)]
    # Energy since the server started: 5 J a reading after the one at start.
    assert found["trioinfer_gpu_energy_consumption_joules_total"] == [
        ({"gpu_uuid": "GPU-0"}, 5.0),
        ({"gpu_uuid": "GPU-1"}, 5.0),
    ]


def test_an_nvml_that_cannot_list_its_gpus_reports_none(tmp_path: Path) -> None:
    broken = FakeNVML()
    broken.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(RuntimeError("GPU is lost"))  # type: ignore[method-assign]
    assert scraped(HostMetrics(tmp_path / "none", nvml=broken)) == {}


def test_nvml_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert _load_nvml() is None

    def no_driver() -> None:
        raise RuntimeError("NVMLError_DriverNotLoaded")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=no_driver))
    assert _load_nvml() is None
    fine = SimpleNamespace(nvmlInit=lambda: None)
    monkeypatch.setitem(sys.modules, "pynvml", fine)
    assert _load_nvml() is fine
