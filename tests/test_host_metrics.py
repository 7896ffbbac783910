"""The machine's CPU, memory and GPU metrics on ``/metrics`` (Triton's nv_cpu_*, nv_gpu_*).

Sampled at a fixed interval off the event loop, from a fake ``/proc`` and a
fake NVML binding here, on virtual time; a real server's ``/metrics`` carries
them once (test_server.py, and test_workers.py under ``--workers``).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trioinfer._exceptions import ConfigError
from trioinfer.server import ServerConfig, _host_metrics
from trioinfer.server._host_metrics import HostMetrics, _import_nvml, host_metrics_for
from trioinfer.server._workers import MetricsLedger

MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"

#: Whether this machine has the /proc a real server reads (Linux).
HAS_MEMINFO = Path("/proc/meminfo").exists()

Scraped = dict[str, list[tuple[dict[str, str], float]]]


def proc(tmp_path: Path, user: int, idle: int) -> Path:
    # /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
    (tmp_path / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    (tmp_path / "meminfo").write_text(MEMINFO)
    return tmp_path


def parse(text: str) -> Scraped:
    return {
        sample.name: [(s.labels, s.value) for s in family.samples if s.name == sample.name]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scraped(host: HostMetrics) -> Scraped:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(host)
    return parse(generate_latest(registry).decode())


class FakeNVML:
    """Two GPUs, the second without power readings; energy grows by 5 J a reading.

    Counts its calls, and notes the threads they came from.
    """

    def __init__(self) -> None:
        self.energy = {0: 1_000_000.0, 1: 2_000_000.0}  # millijoules since the driver loaded
        self.calls: list[str] = []
        self.threads: set[int] = set()
        self.inits = self.shutdowns = 0
        #: Queries (by NVML name, per device) that raise, as for a GPU that fell off the bus.
        self.failing: set[tuple[str, int]] = set()

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name.startswith("nvml"):
            object.__getattribute__(self, "calls").append(name)
            object.__getattribute__(self, "threads").add(threading.get_ident())
        return value

    def _check(self, query: str, device: int) -> None:
        if (query, device) in self.failing:
            raise RuntimeError("NVMLError_GpuIsLost")

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, device: int) -> Any:
        return f"GPU-{device}".encode() if device == 0 else f"GPU-{device}"

    def nvmlDeviceGetUtilizationRates(self, device: int) -> Any:
        self._check("utilization", device)
        return SimpleNamespace(gpu=40 + device, memory=7)

    def nvmlDeviceGetMemoryInfo(self, device: int) -> Any:
        self._check("memory", device)
        return SimpleNamespace(total=80 << 30, used=(device + 1) << 30, free=0)

    def nvmlDeviceGetPowerUsage(self, device: int) -> int:
        self._check("power", device)
        if device == 1:
            raise RuntimeError("NVMLError_NotSupported")
        return 250_500  # milliwatts

    def nvmlDeviceGetPowerManagementLimit(self, device: int) -> int:
        self._check("limit", device)
        if device == 1:
            raise RuntimeError("NVMLError_NotSupported")
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, device: int) -> float:
        self._check("energy", device)
        self.energy[device] += 5000
        return self.energy[device]


async def test_two_scrapes_in_one_interval_read_the_same_sample(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    host = HostMetrics(interval=2.0, proc=proc(tmp_path, user=100, idle=900), nvml=None)
    assert scraped(host) == {}  # nothing before the first sample
    await nursery.start(host.run)
    t0 = trio.current_time()
    first = scraped(host)
    # No interval yet: 0, as Triton's gauge until its first interval ends.
    assert first["trioinfer_cpu_utilization"] == [({}, 0.0)]
    assert first["trioinfer_cpu_memory_total_bytes"] == [({}, 16000000 * 1024)]
    assert first["trioinfer_cpu_memory_used_bytes"] == [({}, 12000000 * 1024)]
    proc(tmp_path, user=175, idle=925)  # 75 of 100 jiffies busy over the first interval
    (tmp_path / "meminfo").write_text(MEMINFO.replace("4000000", "8000000"))
    # Scrapes read the last sample: nothing a scrape does (or how many scrape) moves it.
    assert scraped(host) == first
    await trio.sleep(1.999)
    assert scraped(host) == first
    await host.wait_samples(2)
    assert trio.current_time() - t0 == 2.0
    second = scraped(host)
    assert second["trioinfer_cpu_utilization"] == [({}, 0.75)]
    assert second["trioinfer_cpu_memory_used_bytes"] == [({}, 8000000 * 1024)]
    assert scraped(host) == second
    proc(tmp_path, user=185, idle=1015)  # then 10 of 100
    await host.wait_samples(3)
    assert trio.current_time() - t0 == 4.0
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.1)]
    # Sampled again within a tick (no jiffy passed): the last figure stands.
    await host.wait_samples(4)
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.1)]


async def test_counters_that_go_back_start_the_count_again(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # /proc/stat's counters can go back (a container's view of them restarted, a
    # kernel's iowait): the next interval counts from there, not from the old figures.
    host = HostMetrics(interval=1.0, proc=proc(tmp_path, user=100_000, idle=900_000), nvml=None)
    await nursery.start(host.run)
    proc(tmp_path, user=150, idle=850)  # went back
    await host.wait_samples(2)
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.0)]
    proc(tmp_path, user=200, idle=900)  # 50 of 100 busy since
    await host.wait_samples(3)
    assert scraped(host)["trioinfer_cpu_utilization"] == [({}, 0.5)]


async def test_without_proc_or_nvml_nothing_is_reported(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    host = HostMetrics(proc=tmp_path / "none", nvml=None)
    await nursery.start(host.run)
    assert scraped(host) == {}
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")  # no MemAvailable: left out
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    other = HostMetrics(proc=tmp_path, nvml=None)
    await nursery.start(other.run)
    assert scraped(other) == {}
    (tmp_path / "stat").write_text("cpu  1 2 x\n")  # not numbers: left out, not an error
    third = HostMetrics(proc=tmp_path, nvml=None)
    await nursery.start(third.run)
    assert scraped(third) == {}


async def test_cpu_and_gpu_metrics_can_each_be_turned_off(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # Triton's --allow-cpu-metrics=false and --allow-gpu-metrics=false.
    nvml = FakeNVML()
    no_cpu = HostMetrics(cpu=False, proc=proc(tmp_path, user=1, idle=1), nvml=nvml)
    await nursery.start(no_cpu.run)
    assert {name.split("_")[1] for name in scraped(no_cpu)} == {"gpu"}
    no_gpu = HostMetrics(gpu=False, proc=tmp_path, nvml=nvml)
    await nursery.start(no_gpu.run)
    assert {name.split("_")[1] for name in scraped(no_gpu)} == {"cpu"}
    assert nvml.inits == 1  # NVML is not even started for it
    config = ServerConfig(allow_cpu_metrics=False, allow_gpu_metrics=False)
    assert host_metrics_for(config) is None
    host = host_metrics_for(ServerConfig(metrics_interval_s=0.5, allow_gpu_metrics=False))
    assert host is not None
    assert host.interval == 0.5


async def test_gpus_are_read_through_nvml_each_labelled_by_its_uuid(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    nvml = FakeNVML()
    host = HostMetrics(proc=tmp_path / "none", nvml=nvml)
    await nursery.start(host.run)
    await host.wait_samples(2)
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
    # Energy since sampling started: 5 J a reading after the first.
    assert found["trioinfer_gpu_energy_consumption_joules_total"] == [
        ({"gpu_uuid": "GPU-0"}, 5.0),
        ({"gpu_uuid": "GPU-1"}, 5.0),
    ]


async def test_a_scrape_never_calls_nvml_and_sampling_runs_off_the_loop(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    nvml = FakeNVML()
    host = HostMetrics(proc=tmp_path / "none", nvml=nvml)
    await nursery.start(host.run)
    await host.wait_samples(3)
    calls = list(nvml.calls)
    assert calls.count("nvmlInit") == 1
    # The GPUs are listed once, at the first sample, as Triton does.
    assert calls.count("nvmlDeviceGetCount") == 1
    assert calls.count("nvmlDeviceGetUtilizationRates") == 2 * 3
    for _ in range(5):
        scraped(host)
    assert nvml.calls == calls
    # Every NVML call came from a worker thread, never the event loop's.
    assert threading.get_ident() not in nvml.threads
    assert nvml.threads


async def test_nvml_is_shut_down_once_when_sampling_stops(tmp_path: Path) -> None:
    nvml = FakeNVML()
    host = HostMetrics(proc=tmp_path / "none", nvml=nvml)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        await host.wait_samples(2)
        assert (nvml.inits, nvml.shutdowns) == (1, 0)
        with pytest.raises(RuntimeError, match="already running"):
            await host.run()
        nursery.cancel_scope.cancel()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)
    assert nvml.calls[-1] == "nvmlShutdown"


async def test_nvml_is_shut_down_when_the_first_sample_is_cancelled(tmp_path: Path) -> None:
    # Cancelled while the first sample (NVML's start) runs on its thread: the thread
    # finishes, then NVML is shut down all the same.
    nvml = FakeNVML()
    entered, release = threading.Event(), threading.Event()

    def slow_count() -> int:
        entered.set()
        release.wait()
        return 2

    nvml.nvmlDeviceGetCount = slow_count  # type: ignore[method-assign]
    host = HostMetrics(proc=tmp_path / "none", nvml=nvml)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.run)
        await trio.to_thread.run_sync(entered.wait)
        nursery.cancel_scope.cancel()
        release.set()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)
    assert nvml.calls[-1] == "nvmlShutdown"


async def test_a_sample_that_hangs_does_not_hold_the_server_s_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An NVML reading that never returns (a wedged driver): the server stops all the
    # same, NVML's shutdown left to run once the reading ends (it waited on the
    # reading's thread for ever, and the server with it).
    monkeypatch.setattr(_host_metrics, "CLEANUP_S", 0.05)
    nvml = FakeNVML()
    entered, release, stopped = threading.Event(), threading.Event(), threading.Event()
    hang = False

    def utilization(device: int) -> Any:
        if hang:
            entered.set()
            release.wait()
        return SimpleNamespace(gpu=40, memory=7)

    def shutdown() -> None:
        stopped.set()

    nvml.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[method-assign]
    nvml.nvmlShutdown = shutdown  # type: ignore[method-assign]
    host = HostMetrics(interval=0.01, proc=tmp_path / "none", nvml=nvml)
    # Released after a while whatever happens, so that a server that waits fails
    # below rather than hanging the test run.
    watchdog = threading.Timer(30, release.set)
    watchdog.start()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run)
            hang = True
            await trio.to_thread.run_sync(entered.wait)
            nursery.cancel_scope.cancel()
        assert not release.is_set(), "the server's stop waited for the hung reading"
        assert "NVML did not shut down" in caplog.text
        assert not stopped.is_set()  # never while a reading runs
        release.set()
        assert await trio.to_thread.run_sync(stopped.wait, 30)
    finally:
        release.set()
        watchdog.cancel()


def nvml_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "GPU metrics" in r.getMessage()]


async def test_an_nvml_without_a_driver_costs_the_gpu_families_only(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "trioinfer.server")
    nvml = FakeNVML()

    def no_driver() -> None:
        raise RuntimeError("NVMLError_DriverNotLoaded")

    nvml.nvmlInit = no_driver  # type: ignore[method-assign]
    host = HostMetrics(proc=proc(tmp_path, user=1, idle=1), nvml=nvml)
    async with trio.open_nursery() as inner:
        await inner.start(host.run)
        await host.wait_samples(1)
        assert {name.split("_")[1] for name in scraped(host)} == {"cpu"}
        inner.cancel_scope.cancel()
    assert nvml.shutdowns == 0  # never started: nothing to shut down
    assert nvml.calls == ["nvmlInit"]
    (line,) = nvml_lines(caplog)
    assert "NVML did not start" in line
    assert "NVMLError_DriverNotLoaded" in line


async def test_a_gpu_that_vanishes_costs_its_own_families_logged_once(
    tmp_path: Path,
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "trioinfer.server")
    nvml = FakeNVML()
    host = HostMetrics(proc=tmp_path / "none", nvml=nvml)
    await nursery.start(host.run)
    # GPU 1 has no power readings (NotSupported): said once, whatever the samples.
    assert len(nvml_lines(caplog)) == 2
    assert all("GPU-1" in line for line in nvml_lines(caplog))
    # Then GPU 1 falls off the bus, and GPU 0 fails one query.
    nvml.failing |= {(query, 1) for query in ("utilization", "memory", "energy")}
    nvml.failing.add(("energy", 0))
    await host.wait_samples(4)
    found = scraped(host)
    for family in (
        "trioinfer_gpu_utilization",
        "trioinfer_gpu_memory_total_bytes",
        "trioinfer_gpu_memory_used_bytes",
        "trioinfer_gpu_power_usage_watts",
        "trioinfer_gpu_power_limit_watts",
    ):
        assert [labels for labels, _ in found[family]] == [{"gpu_uuid": "GPU-0"}], family
    assert "trioinfer_gpu_energy_consumption_joules_total" not in found
    lines = nvml_lines(caplog)
    assert len(lines) == 2 + 4  # each reading that failed, once, over three samples
    assert sum("NVMLError_GpuIsLost" in line for line in lines) == 4
    assert any("energy consumption of GPU GPU-0" in line for line in lines)
    # GPU 0's energy comes back, counted from the start as before (5 J a reading).
    nvml.failing.discard(("energy", 0))
    await host.wait_samples(5)
    (energy,) = scraped(host)["trioinfer_gpu_energy_consumption_joules_total"]
    assert energy == ({"gpu_uuid": "GPU-0"}, 5.0)
    assert len(nvml_lines(caplog)) == 6


async def test_an_nvml_that_cannot_list_its_gpus_reports_none_until_it_can(
    tmp_path: Path,
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "trioinfer.server")
    nvml = FakeNVML()
    listing: list[Callable[[], int]] = [nvml.nvmlDeviceGetCount]

    def count() -> int:
        if len(listing) == 1:
            raise RuntimeError("NVMLError_Unknown")
        return listing[0]()

    nvml.nvmlDeviceGetCount = count  # type: ignore[method-assign]
    host = HostMetrics(proc=tmp_path / "none", nvml=nvml)
    await nursery.start(host.run)
    await host.wait_samples(2)
    assert scraped(host) == {}
    (line,) = nvml_lines(caplog)
    assert "could not list the GPUs: NVMLError_Unknown" in line
    listing.append(count)  # it lists them now
    await host.wait_samples(3)
    assert "trioinfer_gpu_utilization" in scraped(host)


def test_nvml_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert _import_nvml() is None
    fine = SimpleNamespace(nvmlInit=lambda: None)
    monkeypatch.setitem(sys.modules, "pynvml", fine)
    assert _import_nvml() is fine


@pytest.mark.parametrize(
    "interval", [0, -1.0, 86_400.001, float("inf"), float("nan"), True, "2", None]
)
def test_the_interval_is_a_positive_number_of_seconds_up_to_a_day(interval: Any) -> None:
    # Checked in one place, ServerConfig (the CLI's --metrics-interval-ms arrives there).
    with pytest.raises(
        ConfigError,
        match=r"metrics_interval_s must be a number of seconds above 0 and at most a day "
        r"\(86400\).*gives in milliseconds, 1 to 86400000",
    ):
        ServerConfig(metrics_interval_s=interval)
    assert ServerConfig(metrics_interval_s=86_400).metrics_interval_s == 86_400
    assert ServerConfig(metrics_interval_s=0.001).metrics_interval_s == 0.001


async def test_under_workers_the_supervisor_reports_the_machine_once(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # Each worker's exposition carries no host families (serve_http gives a worker
    # none); the supervisor's ledger adds its own sample once, after their sums.
    host = HostMetrics(proc=proc(tmp_path, user=1, idle=1), nvml=FakeNVML())
    await nursery.start(host.run)
    ledger = MetricsLedger(host)
    worker = (
        "# HELP trioinfer_inferences_total Rows.\n# TYPE trioinfer_inferences_total counter\n"
        'trioinfer_inferences_total{model="m",version="1"} 3.0\n'
    )
    ledger.report(0, 100, worker.encode())
    ledger.report(1, 101, worker.encode())
    text = ledger.merged(0).decode()
    found = parse(text)
    assert found["trioinfer_inferences_total"] == [({"model": "m", "version": "1"}, 6.0)]
    assert found["trioinfer_cpu_memory_total_bytes"] == [({}, 16000000 * 1024)]
    assert text.count("# TYPE trioinfer_cpu_utilization gauge") == 1
    assert [labels for labels, _ in found["trioinfer_gpu_utilization"]] == [
        {"gpu_uuid": "GPU-0"},
        {"gpu_uuid": "GPU-1"},
    ]


@pytest.mark.parametrize("gpu", [True, False])
async def test_a_server_samples_while_it_serves_and_stops_nvml_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> None:
    import httpx

    from _serve import WAIT_S, start_serving
    from trioinfer.server import _host_metrics

    nvml = FakeNVML()
    monkeypatch.setattr(_host_metrics, "_import_nvml", lambda: nvml)
    (tmp_path / "empty").mkdir()
    # An hour between samples: every scrape below reads the one taken at start.
    config = ServerConfig(metrics_interval_s=3600.0, allow_gpu_metrics=gpu)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "empty", config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0], timeout=WAIT_S) as client:
            first = (await client.get("/metrics")).text
            calls = list(nvml.calls)
            assert (await client.get("/metrics")).text == first
        assert nvml.calls == calls  # the scrapes read the sample; NVML is not called
        found = parse(first)
        assert ("trioinfer_gpu_utilization" in found) == gpu
        assert ("trioinfer_cpu_memory_used_bytes" in found) == HAS_MEMINFO
        assert (nvml.inits, nvml.shutdowns) == ((1, 0) if gpu else (0, 0))
        nursery.cancel_scope.cancel()
    assert (nvml.inits, nvml.shutdowns) == ((1, 1) if gpu else (0, 0))


async def test_a_server_asked_for_no_host_metrics_reports_none(tmp_path: Path) -> None:
    import httpx

    from _serve import WAIT_S, start_serving

    (tmp_path / "empty").mkdir()
    config = ServerConfig(allow_cpu_metrics=False, allow_gpu_metrics=False)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "empty", config=config)
        async with httpx.AsyncClient(base_url=listening.urls[0], timeout=WAIT_S) as client:
            text = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    assert "trioinfer_inference_in_flight" in text
    assert not [name for name in parse(text) if name.startswith(("trioinfer_cpu", "trioinfer_gpu"))]
