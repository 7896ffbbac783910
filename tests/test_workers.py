"""``trioinfer serve --workers 2``: one port, two processes, one supervisor, as a user runs it.

The server runs as a real subprocess on 127.0.0.1 (port 0: the supervisor
picks one port and every worker binds it); the tests learn the port and the
workers' pids from the banner on stdout. Requests go over fresh connections
(``connection: close``), so that the kernel spreads them over both workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from _triton_config import own_setting
from test_sequence import CONFIG_TOML as ACCUMULATOR_CONFIG
from test_sequence import MODEL_PY as ACCUMULATOR_MODEL
from test_server_repository import CHAIN, chain_request
from trioinfer import ConfigError, ModelNotFound, TrioInferError, example_repository
from trioinfer.cli import main
from trioinfer.server import ServerConfig, status_for
from trioinfer.server._metrics import Counts, VersionCounts, triton_entry
from trioinfer.server._workers import (
    MetricsLedger,
    StatsLedger,
    WorkersDisagree,
    _first,
    _raise_error,
    _serve_calls,
    _Supervisor,
    merge_expositions,
    merge_stats,
    worker_socket,
)

pytestmark = pytest.mark.workers

#: The longest any step here may take (start-up, a restart, a drain).
WAIT_S = 30.0
POLL_S = 0.05

SLOW_CONFIG = """\
# An async Python model that sleeps x seconds and answers y = x.
backend = "python"
batcher = "none"
instances = [{ device = "cpu", count = 16 }]

[backend_options]
inputs = [{ name = "x", dtype = "float32", shape = ["batch", 1] }]
outputs = [{ name = "y", dtype = "float32", shape = ["batch", 1] }]
"""

SLOW_MODEL = """\
import anyio


class Model:
    async def infer(self, inputs):
        await anyio.sleep(float(inputs["x"].max()))
        return {"y": inputs["x"]}
"""

DIGIT = [0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4]
DIGIT += [12, 0, 0, 8, 8, 0, 0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5]
DIGIT += [10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    shutil.copytree(example_repository() / "digits", root / "digits")
    (root / "chain" / "1").mkdir(parents=True)  # a pipeline a load override configures
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "config.toml").write_text(SLOW_CONFIG)
    (root / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    return root


@attrs.define
class Served:
    process: subprocess.Popen[str]
    url: str
    pids: list[int]
    log: Path
    #: The next line the server prints (None once it has exited).
    next_line: Callable[[], str | None]
    #: Where every worker serves gRPC (``host:port``), or None when not served.
    grpc: str | None = None

    def directory(self) -> Path:
        """The supervisor's control directory, as its log names it."""
        found = re.search(r"control sockets in (\S+)", self.log.read_text())
        assert found is not None
        return Path(found.group(1))


def start(
    repository: Path, log: Path, *args: str
) -> tuple[subprocess.Popen[str], Callable[[], str | None]]:
    """Run ``trioinfer serve`` with *args*; return it and a reader of its stdout lines."""
    with log.open("w") as stderr:  # the child keeps its own copy
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "trioinfer", "serve", "--model-repository", repository),
                *("--host", "127.0.0.1", "--port", "0", "--drain-period", "5", *args),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        with process.stdout:
            for line in process.stdout:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()

    def next_line() -> str | None:
        return lines.get(timeout=WAIT_S)

    return process, next_line


@contextlib.contextmanager
def two_workers(repository: Path, log: Path, *args: str) -> Iterator[Served]:
    """``start`` with ``--workers 2``, once both listen.

    On leaving, a server still running (a test failed before stopping it) is
    killed with its workers.
    """
    process, next_line = start(repository, log, "--workers", "2", *args)
    try:
        grpc = None
        while True:
            line = next_line()
            assert line is not None, log.read_text()
            said = re.match(r"gRPC on (\S+) ", line)
            if said:
                grpc = said.group(1)
            # "1 of 2 workers (the others restart)": one stopped at start is not named.
            found = re.search(r"2 workers .*\(pids ([\d, ]+)\) listening on (\S+)", line)
            if found:
                break
        pids = [int(pid) for pid in found.group(1).split(", ")]
        yield Served(process, found.group(2), pids, log, next_line, grpc)
    finally:
        if process.poll() is None:
            workers = _children_of(process.pid)
            process.kill()
            process.wait()
            for pid in workers:
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with two_workers(repository, tmp_path_factory.mktemp("log") / "serve.log") as server:
        yield server


def _children_of(pid: int) -> list[int]:
    # Every process whose parent is *pid* (the supervisor starts workers from a
    # thread, so /proc/PID/task/PID/children does not list them).
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def fresh(
    method: str, url: str, **kwargs: Any
) -> httpx.Response:  # one request on its own connection
    with httpx.Client(timeout=WAIT_S, headers={"connection": "close"}) as client:
        return client.request(method, url, **kwargs)


def infer_digit(url: str) -> httpx.Response:
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": DIGIT}]}
    return fresh("POST", f"{url}/v2/models/digits/infer", json=body)


def infer_slow(url: str, seconds: float) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [seconds]}]}
    return fresh("POST", f"{url}/v2/models/slow/infer", json=body)


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = fresh("GET", f"{url}/metrics").text
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def worker_pids(url: str) -> dict[str, int]:
    return {
        labels["worker"]: int(labels["pid"])
        for labels, _ in samples(url, "trioinfer_worker_inference_requests_total")
    }


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not _holds(condition):
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        time.sleep(POLL_S)


def _holds(condition: Callable[[], bool]) -> bool:
    # A connection the kernel had queued on a worker just killed is reset (as its
    # in-flight requests are): while waiting for the restart, that is "not yet".
    try:
        return condition()
    except httpx.TransportError:
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_requests_spread_over_both_workers_and_metrics_add_up(served: Served) -> None:
    before = samples(served.url, "trioinfer_inference_requests_total")
    assert not any(labels["model"] == "digits" for labels, _ in before)
    for _ in range(40):
        response = infer_digit(served.url)
        assert response.status_code == 200, response.text
    per_worker = {
        labels["worker"]: (int(labels["pid"]), value)
        for labels, value in samples(served.url, "trioinfer_worker_inference_requests_total")
    }
    assert {w: pid for w, (pid, _) in per_worker.items()} == {
        "0": served.pids[0],
        "1": served.pids[1],
    }
    assert all(n > 0 for _, n in per_worker.values()), per_worker  # both took some
    assert sum(n for _, n in per_worker.values()) == 40
    # The server's own families add up across workers, histograms included.
    requests = dict(
        (labels["outcome"], value)
        for labels, value in samples(served.url, "trioinfer_inference_requests_total")
        if labels["model"] == "digits"
    )
    assert requests == {"success": 40}
    rows = samples(served.url, "trioinfer_inference_batch_rows_sum")
    assert [v for labels, v in rows if labels["model"] == "digits"] == [40]
    instances = samples(served.url, "trioinfer_instances")
    assert [v for labels, v in instances if labels["model"] == "digits"] == [2]  # one each
    # The machine is reported once, by the supervisor, not added up over the workers.
    if Path("/proc/meminfo").exists():
        ((labels, total),) = samples(served.url, "trioinfer_cpu_memory_total_bytes")
        meminfo = Path("/proc/meminfo").read_text().split("\n")[0]  # MemTotal: N kB
        assert (labels, total) == ({}, int(meminfo.split()[1]) * 1024)
        # Sampled by the supervisor's own task, from before the first scrape.
        assert [labels for labels, _ in samples(served.url, "trioinfer_cpu_utilization")] == [{}]
    stats = fresh("GET", f"{served.url}/v2/models/digits/stats").json()["model_stats"]
    assert len(stats) == 1
    assert stats[0]["inference_count"] == 40
    assert stats[0]["inference_stats"]["success"]["count"] == 40


def test_load_and_unload_reach_every_worker(served: Served) -> None:
    url = served.url
    assert fresh("POST", f"{url}/v2/repository/models/digits/unload").status_code == 200
    for _ in range(12):
        assert infer_digit(url).status_code == 404
    override = {"parameters": {"config": {"max_queue_size": 7}}}
    response = fresh("POST", f"{url}/v2/repository/models/digits/load", json=override)
    assert response.status_code == 200, response.text
    for _ in range(12):
        config = fresh("GET", f"{url}/v2/models/digits/config").json()
        assert own_setting(config, "max_queue_size") == 7
    # A change every worker refuses fails as it would on one server, and changes nothing.
    bad = {"parameters": {"config": {"max_queue_size": -1}}}
    response = fresh("POST", f"{url}/v2/repository/models/digits/load", json=bad)
    assert response.status_code == 400
    assert "max_queue_size must be a positive integer, got -1" in response.json()["error"]
    response = fresh("POST", f"{url}/v2/repository/models/nosuch/load")
    assert response.status_code == 404
    for _ in range(12):
        assert infer_digit(url).status_code == 200
    # A pipeline that a load override configures whole, loaded again without it: every
    # worker reloads it with its config (and one that restarts, below, loads it too).
    chain = {"parameters": {"config": CHAIN}}
    response = fresh("POST", f"{url}/v2/repository/models/chain/load", json=chain)
    assert response.status_code == 200, response.text
    response = fresh("POST", f"{url}/v2/repository/models/chain/load")
    assert response.status_code == 200, response.text
    for _ in range(12):
        assert fresh("POST", f"{url}/v2/models/chain/infer", json=chain_request()).is_success


def test_log_settings_reach_every_worker(served: Served) -> None:
    url = served.url
    response = fresh("POST", f"{url}/v2/logging", json={"log_info": False})
    assert response.status_code == 200, response.text
    for _ in range(12):
        assert fresh("GET", f"{url}/v2/logging").json()["log_info"] is False
    # Refused by the worker that got it, before any other changes.
    response = fresh("POST", f"{url}/v2/logging", json={"log_file": "x.log"})
    assert response.status_code == 400
    assert "log_file is not supported" in response.json()["error"]
    # A second, partial change: a worker that restarts later takes both (see below).
    response = fresh("POST", f"{url}/v2/logging", json={"log_format": "ISO8601"})
    assert response.status_code == 200, response.text
    for _ in range(12):
        settings = fresh("GET", f"{url}/v2/logging").json()
        assert (settings["log_info"], settings["log_format"]) == (False, "ISO8601")


def _succeeded(url: str) -> float:
    return sum(
        value
        for labels, value in samples(url, "trioinfer_inference_requests_total")
        if labels["outcome"] == "success"
    )


def test_a_killed_worker_is_restarted_and_its_requests_fail_cleanly(served: Served) -> None:
    url = served.url
    victim = worker_pids(url)["1"]
    for _ in range(12):
        assert infer_digit(url).status_code == 200
    counted = _succeeded(url)  # a scrape: every worker's counts, the victim's too
    digits = _digits_stats(url)  # so is a statistics request
    # Long enough for all of them to be seen in flight at once on a busy machine.
    seconds = [3.0 + i / 1000 for i in range(16)]
    with ThreadPoolExecutor(len(seconds)) as pool:
        futures = [pool.submit(_outcome, infer_slow, url, s) for s in seconds]
        wait_until(
            lambda: samples(url, "trioinfer_http_inference_in_flight")[0][1] == len(seconds),
            "every slow request is in flight",
        )
        os.kill(victim, signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    answered = [o for o in outcomes if isinstance(o, httpx.Response)]
    # The survivor's requests are answered, each with its own value; the victim's
    # connections close: none is answered by anyone else, nor wrongly.
    for response, s in zip(outcomes, seconds, strict=True):
        if isinstance(response, httpx.Response):
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [pytest.approx(s)]
    assert 0 < len(answered) < len(seconds)
    assert all(isinstance(o, httpx.TransportError) for o in outcomes if o not in answered)

    wait_until(lambda: worker_pids(url).get("1", victim) != victim, "worker 1 is back")
    assert not alive(victim)
    # What the victim had counted stays in the server's counters: none went down.
    assert _succeeded(url) >= counted + len(answered)
    assert _digits_stats(url) == digits  # every worker's, the victim's too, when asked
    assert f"worker 1 (pid {victim}) was killed by SIGKILL" in served.log.read_text()
    # It loaded digits once, with the override of its last load: not from the file,
    # then again (two copies at once) when the change was repeated to it.
    after = served.log.read_text().split(f"started worker 1 (pid {worker_pids(url)['1']})")[1]
    assert after.count("worker 1 trioinfer.server INFO loaded model 'digits'") == 1
    assert "worker 1 trioinfer.server INFO reloaded model 'digits'" not in after
    for _ in range(12):
        assert infer_digit(url).status_code == 200
        assert fresh("POST", f"{url}/v2/models/chain/infer", json=chain_request()).is_success
        # The restarted worker took the changes made before it started.
        config = fresh("GET", f"{url}/v2/models/digits/config").json()
        assert own_setting(config, "max_queue_size") == 7
        settings = fresh("GET", f"{url}/v2/logging").json()
        assert (settings["log_info"], settings["log_format"]) == (False, "ISO8601")


def _digits_stats(url: str) -> tuple[int, int, int]:
    """The server's statistics of digits: inferences, executions, successes."""
    [stats] = fresh("GET", f"{url}/v2/models/digits/stats").json()["model_stats"]
    success = stats["inference_stats"]["success"]["count"]
    return stats["inference_count"], stats["execution_count"], success


def _kept(log: Path, pid: int) -> int | None:
    """The inference requests of worker process *pid* that the supervisor last said it kept."""
    said = re.findall(
        rf"kept the counts of worker \d \(pid {pid}\): (\d+) inference", log.read_text()
    )
    return int(said[-1]) if said else None


def _kill_worker_1_after_40_requests(url: str, pids: list[int], log: Path) -> None:
    # 40 digits requests over both workers, reported by the workers themselves (no
    # statistics request nor scrape), then worker 1 killed and waited for back.
    for _ in range(40):
        assert infer_digit(url).status_code == 200
    wait_until(
        lambda: (_kept(log, pids[0]) or 0) + (_kept(log, pids[1]) or 0) == 40,
        "both workers reported their 40 requests",
    )
    assert 0 < (_kept(log, pids[1]) or 0) < 40, "worker 1 served none to lose"
    os.kill(pids[1], signal.SIGKILL)
    wait_until(lambda: worker_pids(url).get("1", pids[1]) != pids[1], "worker 1 is back")


def test_a_dead_workers_counts_stay_in_the_totals(repository: Path, tmp_path: Path) -> None:
    # Counts a worker reported (every REPORT_S while it answers requests) outlive
    # it: a SIGKILL takes neither requests nor durations out of the statistics,
    # nor the request counter of /metrics (which Prometheus would read as a reset).
    log = tmp_path / "serve.log"
    with two_workers(repository, log, "--log-level", "debug") as server:
        url, pids = server.url, server.pids
        _kill_worker_1_after_40_requests(url, pids, log)
        inferences, executions, succeeded = _digits_stats(url)
        assert inferences == succeeded == 40
        assert executions >= 2  # one per worker at least (batches may hold several)
        requests = [
            (labels, value)
            for labels, value in samples(url, "trioinfer_inference_requests_total")
            if labels["model"] == "digits"
        ]
        assert [(labels["outcome"], value) for labels, value in requests] == [("success", 40)]
        rows = samples(url, "trioinfer_inference_batch_rows_sum")
        assert [v for labels, v in rows if labels["model"] == "digits"] == [40]
        # The restarted worker adds to them, from zero.
        for _ in range(10):
            assert infer_digit(url).status_code == 200
        assert _digits_stats(url)[0] == 50
        # An unload takes its statistics (every worker's, the dead one's too) with it.
        assert fresh("POST", f"{url}/v2/repository/models/digits/unload").status_code == 200
        assert fresh("POST", f"{url}/v2/repository/models/digits/load").status_code == 200
        assert _digits_stats(url) == (0, 0, 0)


def test_a_version_the_policy_drops_takes_the_dead_workers_counts_of_it(tmp_path: Path) -> None:
    # Version 2 appears under latest = 1 and a load retires version 1: as at an unload
    # (and as on one server), version 1's statistics and engine series end, the dead
    # worker's share with them, and its requests by outcome stay.
    root = tmp_path / "repository"
    shutil.copytree(example_repository() / "digits", root / "digits")
    config = root / "digits" / "config.toml"
    config.write_text("version_policy = { latest = 1 }\n" + config.read_text())
    log = tmp_path / "serve.log"
    with two_workers(root, log, "--log-level", "debug") as server:
        url, pids = server.url, server.pids
        _kill_worker_1_after_40_requests(url, pids, log)
        shutil.copytree(root / "digits" / "1", root / "digits" / "2")
        assert fresh("POST", f"{url}/v2/repository/models/digits/load").status_code == 200
        stats = fresh("GET", f"{url}/v2/models/digits/stats").json()["model_stats"]
        assert [(e["version"], e["inference_count"]) for e in stats] == [("2", 0)]
        rows = samples(url, "trioinfer_inference_batch_rows_sum")
        assert [(lb["version"], v) for lb, v in rows if lb["model"] == "digits"] == [("2", 0)]
        requests = samples(url, "trioinfer_inference_requests_total")
        assert [(lb["version"], v) for lb, v in requests if lb["model"] == "digits"] == [("1", 40)]
        # Version 1 back (2 gone): it starts from zero, as a load does on one server.
        shutil.rmtree(root / "digits" / "2")
        assert fresh("POST", f"{url}/v2/repository/models/digits/load").status_code == 200
        stats = fresh("GET", f"{url}/v2/models/digits/stats").json()["model_stats"]
        assert [(e["version"], e["inference_count"]) for e in stats] == [("1", 0)]


def test_shared_memory_is_refused_with_several_workers(served: Served) -> None:
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        answer = fresh(
            "POST",
            f"{served.url}/v2/{kind}/region/r/register",
            json={"key": "/nope", "offset": 0, "byte_size": 8},
        )
        assert answer.status_code == 400
        assert "not supported with trioinfer serve --workers N" in answer.json()["error"]
    # Nor does the server say it has the extension (tritonclient's users read /v2).
    extensions = fresh("GET", f"{served.url}/v2").json()["extensions"]
    assert "system_shared_memory" not in extensions
    # Nor sequences: a stateful model is refused under --workers N.
    assert "sequence" not in extensions
    assert "model_repository" in extensions


def test_sigterm_drains_every_worker_and_leaves_nothing(served: Served) -> None:
    pids = list(worker_pids(served.url).values())
    directory = served.directory()
    assert directory.is_dir()
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(infer_slow, served.url, 2.0)
        wait_until(
            lambda: samples(served.url, "trioinfer_http_inference_in_flight")[0][1] == 1,
            "the slow request is in flight",
        )
        served.process.send_signal(signal.SIGTERM)
        assert slow.result().status_code == 200  # drained, not cut
    assert served.process.wait(timeout=WAIT_S) == 0
    assert not [pid for pid in pids if alive(pid)]
    assert not directory.exists()
    log = served.log.read_text()
    assert "all workers stopped" in log
    assert "Traceback" not in log


def test_a_worker_that_cannot_start_stops_serve_with_its_error(
    repository: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    process, next_line = start(repository, log, "--workers", "2", "--model", "nosuch")
    assert process.wait(timeout=WAIT_S) == 1
    assert next_line() is None  # nothing on stdout
    error = log.read_text().splitlines()[-1]
    assert error.startswith("Error: WorkerFailed: worker ")
    assert (
        "before it was ready: ModelNotFound: failed to load 'nosuch': no model 'nosuch' in the "
        "model repository" in error
    )
    started = [int(pid) for pid in re.findall(r"started worker \d \(pid (\d+)\)", log.read_text())]
    assert len(started) == 2
    assert not [pid for pid in started if alive(pid)]


def _outcome(
    fn: Callable[..., httpx.Response], *args: Any
) -> httpx.Response | httpx.TransportError:
    try:
        return fn(*args)
    except httpx.TransportError as exc:
        return exc


def test_merge_adds_up_samples_and_keeps_each_workers_own() -> None:
    one = (
        b"# HELP t_requests_total R.\n# TYPE t_requests_total counter\n"
        b't_requests_total{model="m"} 3.0\n'
        b"# HELP t_seconds S.\n# TYPE t_seconds histogram\n"
        b't_seconds_bucket{le="0.1"} 1.0\nt_seconds_bucket{le="+Inf"} 2.0\n'
        b"t_seconds_count 2.0\nt_seconds_sum 0.5\n"
        b"# HELP t_worker_total W.\n# TYPE t_worker_total counter\n"
        b't_worker_total{worker="0"} 3.0\n'
    )
    two = one.replace(b"3.0", b"4.0").replace(b'worker="0"', b'worker="1"')
    merged = merge_expositions([one, two]).decode()
    assert 't_requests_total{model="m"} 7.0' in merged
    assert 't_seconds_bucket{le="0.1"} 2.0' in merged
    assert 't_seconds_bucket{le="+Inf"} 4.0' in merged
    assert "t_seconds_sum 1.0" in merged
    assert 't_worker_total{worker="0"} 3.0' in merged
    assert 't_worker_total{worker="1"} 4.0' in merged


def _exposition(requests: float, in_flight: float, pid: int) -> bytes:
    return (
        "# HELP t_requests_total R.\n# TYPE t_requests_total counter\n"
        f't_requests_total{{model="m"}} {requests}\n'
        "# HELP t_in_flight F.\n# TYPE t_in_flight gauge\n"
        f't_in_flight{{model="m"}} {in_flight}\n'
        "# HELP t_worker_total W.\n# TYPE t_worker_total counter\n"
        f't_worker_total{{pid="{pid}"}} {requests}\n'
    ).encode()


def _value(text: bytes, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def test_the_ledger_never_lets_a_counter_go_down() -> None:
    # Prometheus reads a counter that went down as a reset, and the whole sum after
    # it as new requests: a worker that is slow to answer, dies or restarts must not
    # take its counts out of the server's.
    ledger = MetricsLedger()
    ledger.report(0, 100, _exposition(5, 1, 100))
    ledger.report(1, 101, _exposition(7, 2, 101))
    merged = ledger.merged(0)
    assert _value(merged, "t_requests_total", model="m") == 12
    assert _value(merged, "t_in_flight", model="m") == 3
    # Worker 1 does not answer the next scrape: counted as it last was.
    ledger.report(0, 100, _exposition(6, 0, 100))
    assert _value(ledger.merged(0), "t_requests_total", model="m") == 13
    # Two reports that crossed on their way: the later snapshot stays.
    ledger.report(1, 101, _exposition(7, 2, 101), taken=2)
    ledger.report(1, 101, _exposition(3, 2, 101), taken=1)
    assert _value(ledger.merged(0), "t_requests_total", model="m") == 13
    # Worker 1 dies and comes back as pid 102, from zero: its counts stay, its
    # gauges and its own (pid) series go.
    ledger.retire(1, 101)
    ledger.retire(1, 101)  # (once only)
    ledger.report(1, 102, _exposition(1, 4, 102))
    merged = ledger.merged(1)
    assert _value(merged, "t_requests_total", model="m") == 6 + 7 + 1
    assert _value(merged, "t_in_flight", model="m") == 0 + 4
    assert _value(merged, "t_worker_total", pid="101") is None
    assert _value(merged, "t_worker_total", pid="102") == 1
    # A retirement of a process that reported nothing since (or never) changes nothing.
    ledger.retire(0, 99)
    assert _value(ledger.merged(0), "t_requests_total", model="m") == 14
    # Unloaded: the dead workers' counts of the model go with it (as on one server),
    # other series stay.
    ledger.report(1, 102, _exposition(1, 4, 102).replace(b'model="m"', b'model="n"'))
    ledger.retire(1, 102)
    ledger.forget("m")
    ledger.report(0, 100, _exposition(0, 0, 100), taken=9)  # the unload's fresh counts
    merged = ledger.merged(0)
    assert _value(merged, "t_requests_total", model="m") == 0
    assert _value(merged, "t_requests_total", model="n") == 1


def test_the_stats_ledger_keeps_a_dead_workers_counts_until_its_model_is_unloaded() -> None:
    ledger = StatsLedger()
    ledger.report(0, 100, [_stats_entry(5, 1), _stats_entry(1, 1, "n")], taken=1)
    ledger.report(1, 101, [_stats_entry(7, 2), _stats_entry(2, 2, "n")], taken=1)
    assert ledger.merged(0) == [_stats_entry(12, 2), _stats_entry(3, 2, "n")]
    # Reports that crossed on their way: the later snapshot stays.
    ledger.report(1, 101, [_stats_entry(9, 3), _stats_entry(2, 2, "n")], taken=3)
    ledger.report(1, 101, [_stats_entry(8, 3), _stats_entry(2, 2, "n")], taken=2)
    assert ledger.merged(1, [("m", "1")]) == [_stats_entry(14, 3)]
    # Worker 1 dies and comes back from zero: what it reported stays in the totals
    # of the model versions still served (and once only).
    ledger.retire(1, 101)
    ledger.retire(1, 101)
    assert ledger.merged(0) == [_stats_entry(14, 3), _stats_entry(3, 2, "n")]
    ledger.report(1, 102, [_stats_entry(1, 4)], taken=1)
    assert ledger.merged(1, [("m", "1")]) == [_stats_entry(15, 4)]
    assert ledger.merged(1, [("m", "2")]) == []
    # Unloaded: its counts go, on every worker (as on one server, a load starts from zero).
    ledger.forget("n")
    ledger.report(0, 100, [_stats_entry(6, 5), _stats_entry(1, 5, "n")], taken=2)
    assert ledger.merged(0) == [_stats_entry(16, 5), _stats_entry(1, 5, "n")]
    ledger.retire(0, 99)  # a process that never reported: nothing changes
    assert ledger.merged(0) == [_stats_entry(16, 5), _stats_entry(1, 5, "n")]


def test_an_unload_keeps_the_dead_workers_request_counts_as_one_server_does() -> None:
    # One server counts a model's requests by outcome for its whole life, through an
    # unload (the HTTP layer's counter, not the engine's statistics, which go with the
    # model): the dead workers' share must stay too, or the sum goes down at an unload.
    from trioinfer.server._metrics import exposition_of

    def text(succeeded: int, pid: int) -> bytes:
        return exposition_of(_counts(pid, succeeded, [_version(succeeded, 1)])["counts"])

    ledger = MetricsLedger()
    ledger.report(0, 100, text(5, 100))
    ledger.retire(0, 100)  # worker 0 died, and came back as pid 101
    ledger.report(0, 101, text(2, 101))
    labels = {"model": "m", "version": "1", "outcome": "success"}
    assert _value(ledger.merged(0), "trioinfer_inference_requests_total", **labels) == 7
    # m unloaded: worker 0 reports its requests of m still (as one server's /metrics
    # shows them), and no more statistics of it.
    ledger.forget("m")
    unloaded: Counts = {
        "outcomes": [["m", "1", "success", 2]],
        "in_flight": 0,
        "in_flight_protocols": {"http": 0, "grpc": 0},
        "versions": [],
    }
    ledger.report(0, 101, exposition_of(unloaded), taken=9)
    merged = ledger.merged(0)
    assert _value(merged, "trioinfer_inference_requests_total", **labels) == 7
    assert _value(merged, "trioinfer_inferences_total", model="m", version="1") is None


def test_merge_stats_sums_counts_and_takes_the_last_inference() -> None:
    merged = merge_stats([[_stats_entry(2, 5)], [_stats_entry(3, 9)], []])
    assert merged == [
        {
            "name": "m",
            "version": "1",
            "last_inference": 9,
            "inference_count": 5,
            "execution_count": 5,
            "inference_stats": {"success": {"count": 5, "ns": 50}},
            "batch_stats": [],
        }
    ]


def test_serve_help_and_bad_worker_counts(tmp_path: Path) -> None:
    runner = CliRunner()
    help_text = runner.invoke(main, ["serve", "--help"]).output
    assert "--workers N" in help_text
    assert "SO_REUSEPORT" in help_text
    refused = runner.invoke(main, ["serve", "--workers", "0"])
    assert refused.exit_code == 2
    assert "Invalid value for '--workers'" in refused.output
    config = tmp_path / "server.toml"
    config.write_text("workers = 0\n")
    refused = runner.invoke(main, ["serve", "--config", str(config)])
    assert refused.exit_code == 2
    assert "workers = 0: 0 is not in the range 1<=x<=256" in refused.output
    # --workers 100000 (an extra zero or three) started processes until memory ran out.
    refused = runner.invoke(main, ["serve", "--workers", "100000"])
    assert refused.exit_code == 2
    assert "'--workers': 100000 is not in the range 1<=x<=256" in refused.output


async def test_a_change_some_workers_refuse_is_an_error_that_names_them(tmp_path: Path) -> None:
    """The supervisor's fan-out, against three stand-in workers (one of them gone)."""
    supervisor = _Supervisor(3, tmp_path, {})
    said: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    refuse: dict[int, str] = {0: "", 1: "no (worker 1)"}

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            said[index].append(message)
            if message["op"] == "counts":
                return _counts(100 + index, 3, [_version(3, index)])
            if refuse[index]:
                return {"error": {"type": "ConfigError", "message": refuse[index]}}
            return {"ok": True}

        return handle

    async with anyio.create_task_group() as tg:
        for index in (0, 1):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        for member in supervisor.workers:
            member.member = True  # worker 2 has no socket: it died meanwhile
        load = {"op": "load", "model": "m", "override": {"max_queue_size": 7}}
        reply = await supervisor.handle(load)
        assert said[0] == [load]
        assert said[1] == [load]
        error = reply["error"]
        assert error["type"] == "WorkersDisagree"
        assert "applied on worker(s) 0 and failed on worker(s) 1" in error["message"]
        assert "worker 1: no (worker 1)" in error["message"]
        assert supervisor.journal == {"m": load}  # worker 2 takes it when it restarts
        with pytest.raises(WorkersDisagree) as raised:
            _raise_error(error)
        assert status_for(raised.value) == 500
        assert "repeat the request" in error["message"]
        # The poll's change advises what a polled server can do (its API refuses loads).
        with pytest.raises(WorkersDisagree, match="changed again") as raised:
            await supervisor.poll_load("m")
        assert "repeat the request" not in str(raised.value)
        assert (await supervisor.handle(load))["error"]["type"] == "WorkersDisagree"

        # Refused alike by every worker that answered: the error as one server gives it,
        # and the journal keeps the last change that applied.
        refuse[0] = refuse[1] = "no"
        reply = await supervisor.handle({"op": "unload", "model": "m"})
        assert reply == {"error": {"type": "ConfigError", "message": "no"}}
        assert supervisor.journal == {"m": load}
        with pytest.raises(ConfigError, match=r"^no$"):
            _raise_error(reply["error"])

        # Statistics and metrics: the asker's own counts, and every other member's now.
        for member in supervisor.workers:
            member.process, member.pid = cast(Any, object()), 100 + member.index
        asked = {"op": "stats", "worker": 1, "only": None, **_counts(101, 2, [_version(2, 7)])}
        reply = await supervisor.handle(asked)
        assert said[0][-1] == {"op": "counts"}
        assert said[1][-1]["op"] == "unload"  # the asker is not asked again
        assert reply == {"stats": [triton_entry(_version(5, 7))]}
        metrics = (await supervisor.handle({**asked, "op": "metrics"}))["metrics"].encode()
        # The workers' counts, rendered by the supervisor as each worker renders its own.
        success = {"model": "m", "version": "1", "outcome": "success"}
        assert _value(metrics, "trioinfer_inference_requests_total", **success) == 5
        assert _value(metrics, "trioinfer_inferences_total", model="m", version="1") == 5
        assert _value(metrics, "trioinfer_worker_inference_requests_total", worker="0", pid="100")
        assert _value(
            metrics, "trioinfer_inference_request_duration_seconds_sum", model="m", version="1"
        ) == pytest.approx(2.5)
        # A word from a process that is not the worker's now (it died since) is not kept.
        await supervisor.handle({"op": "counts", "worker": 0, **_counts(99, 50, [])})
        assert supervisor.stats.merged(0) == [triton_entry(_version(5, 7))]
        tg.cancel_scope.cancel()


async def test_a_change_that_cannot_reach_a_live_worker_fails_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A socket error on the way to a worker read as a worker that died meanwhile: the
    # change was answered 200 and journaled for a restart that never came, while that
    # worker, alive, went on serving what it had.
    from trioinfer.server import _workers

    monkeypatch.setattr(_workers, "REACH_S", 0.3)
    supervisor = _Supervisor(2, tmp_path, {})
    said: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    drop = [0]  # connections to worker 1 that fail before it answers
    call = _workers._call

    async def flaky(path: Path, message: dict[str, Any]) -> dict[str, Any]:
        if path == worker_socket(tmp_path, 1) and drop[0] > 0:
            drop[0] -= 1
            raise _workers._Gone(f"{path.name}: BlockingIOError(11, 'Resource unavailable')")
        return await call(path, message)

    monkeypatch.setattr(_workers, "_call", flaky)

    @attrs.define
    class Running:
        returncode: int | None = None
        signals: list[int] = attrs.Factory(list)

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            said[index].append(message)
            return {"ok": True}

        return handle

    async with anyio.create_task_group() as tg:
        for index in (0, 1):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        processes = [Running(), Running()]
        for member, process in zip(supervisor.workers, processes, strict=True):
            member.member = True
            member.process, member.pid = cast(Any, process), 100 + member.index
        # A transient error: a fresh connection reaches it.
        load = {"op": "load", "model": "m", "override": None}
        drop[0] = 2
        assert await supervisor.handle(load) == {"ok": True}
        assert said[1] == [load]
        # One that cannot be reached while its process runs: not a success, and said.
        drop[0] = 10**6
        unload = {"op": "unload", "model": "m"}
        error = (await supervisor.handle(unload))["error"]
        assert error["type"] == "WorkersDisagree"
        assert "applied on worker(s) 0 and failed on worker(s) 1" in error["message"]
        assert "worker 1 (pid 101) is running but did not answer" in error["message"]
        assert "BlockingIOError" in error["message"]
        assert said[1] == [load]
        assert supervisor.journal == {"m": unload}  # worker 0 serves it
        # Whether it applied the change is unknown: it stayed a member for ever,
        # serving what the others may not. It is restarted now (it drains first), and
        # its restart loads what the journal says.
        assert "did not answer the unload of model 'm'" in error["message"]
        assert "and is restarted" in error["message"]
        assert not supervisor.workers[1].member
        assert processes[1].signals == [signal.SIGTERM]
        assert supervisor.workers[1].stopped_for == "it did not answer the unload of model 'm'"
        # With no other worker to apply it: the error as it is, and nothing journaled.
        supervisor.workers[0].member = False
        supervisor.workers[1].member = True  # as if its restart had joined
        error = (await supervisor.handle(load))["error"]
        assert error["type"] == "TrioInferError"
        assert error["message"].startswith("worker 1 (pid 101) is running but did not answer")
        assert supervisor.journal == {"m": unload}
        # A worker whose process has ended did die: it takes the change when it restarts.
        processes[1].returncode = -signal.SIGKILL
        assert await supervisor.handle(load) == {"ok": True}
        assert supervisor.journal == {"m": load}
        tg.cancel_scope.cancel()


async def test_a_change_to_a_worker_whose_event_loop_is_blocked_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker whose event loop is blocked (a model's code that never yields) takes the
    # connection (the kernel accepts it) and never answers: the change waited for ever,
    # and so did every change and joining worker after it. A worker that answers pings
    # meanwhile (a load that takes long) is waited for.
    from trioinfer.server import _workers

    monkeypatch.setattr(_workers, "PING_S", 0.05)
    monkeypatch.setattr(_workers, "REACH_S", 0.2)
    supervisor = _Supervisor(2, tmp_path, {})
    blocked = [False]
    release = anyio.Event()

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            if index == 1 and message["op"] == "ping" and blocked[0]:
                await release.wait()  # its loop never gets to answer
            if index == 1 and message["op"] == "load":
                if blocked[0]:
                    await release.wait()
                else:
                    await anyio.sleep(0.5)  # a slow load, several pings long
            return {"ok": True}

        return handle

    @attrs.define
    class Running:
        returncode: int | None = None
        signals: list[int] = attrs.Factory(list)

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

    processes = [Running(), Running()]
    async with anyio.create_task_group() as tg:
        for index in (0, 1):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        for member, process in zip(supervisor.workers, processes, strict=True):
            member.member = True
            member.process, member.pid = cast(Any, process), 100 + member.index
        load = {"op": "load", "model": "m", "override": None}
        with anyio.fail_after(WAIT_S):
            assert await supervisor.handle(load) == {"ok": True}  # slow, and alive
            assert processes[1].signals == []
            blocked[0] = True
            error = (await supervisor.handle(load))["error"]
        assert error["type"] == "WorkersDisagree"
        assert (
            "worker 1 (pid 101) is running but did not answer the load of model 'm'"
            in (error["message"])
        )
        assert "answered no ping on another connection within 0.2s" in error["message"]
        assert "and is restarted" in error["message"]
        assert processes[1].signals == [signal.SIGTERM]
        assert not supervisor.workers[1].member
        release.set()
        tg.cancel_scope.cancel()


async def test_a_change_a_worker_cannot_hand_its_supervisor_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other way: a worker that could not reach its (running) supervisor with a
    # client's load answered that it had lost it and was stopping; it was not.
    from trioinfer.server import _workers

    monkeypatch.setattr(_workers, "REACH_S", 0.3)
    drop = [2]
    call = _workers._call

    async def flaky(path: Path, message: dict[str, Any]) -> dict[str, Any]:
        if drop[0] > 0:
            drop[0] -= 1
            raise _workers._Gone(f"{path.name}: BlockingIOError(11, 'Resource unavailable')")
        return await call(path, message)

    monkeypatch.setattr(_workers, "_call", flaky)
    got: list[dict[str, Any]] = []

    async def supervisor(message: dict[str, Any]) -> dict[str, Any]:
        got.append(message)
        return {"ok": True}

    link = _workers.WorkerLink(0, tmp_path, os.getppid())
    async with anyio.create_task_group() as tg:
        await tg.start(_serve_calls, tmp_path / "supervisor.sock", supervisor)
        await link.load("m", None)  # a fresh connection got through
        assert got == [{"op": "load", "model": "m", "override": None}]
        drop[0] = 10**6
        with pytest.raises(TrioInferError) as raised:
            await link.unload("m")
        said = str(raised.value)
        assert said.startswith("could not reach the supervisor (pid ")
        assert "with the unload of model 'm'" in said
        assert "BlockingIOError" in said
        assert "stopping" not in said
        tg.cancel_scope.cancel()


async def test_a_worker_stopped_for_a_restart_that_does_not_exit_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A worker the supervisor stops to restart it (it did not answer a change, or it
    # started serving other things) got a SIGTERM, and nothing more: one whose event
    # loop was blocked never exited, so it was neither restarted nor a member, for ever.
    from trioinfer.server import _workers

    monkeypatch.setattr(_workers, "STOP_MARGIN_S", 0.05)
    monkeypatch.setattr(_workers, "RESTART_DELAY_S", 0.0)
    supervisor = _Supervisor(1, tmp_path, {"config": {"drain_period": 0.0}})
    supervisor.all_ready.set()
    worker = supervisor.workers[0]
    started = anyio.Event()

    class Held:
        def __init__(self) -> None:
            self.pid = 4242
            self.returncode: int | None = None
            self.signals: list[int] = []
            self.killed = anyio.Event()

        async def wait(self) -> int:
            if supervisor.stopping:
                return 0
            worker.ready = True
            started.set()
            await self.killed.wait()  # a SIGTERM changes nothing: its loop is blocked
            self.returncode = -signal.SIGKILL
            return self.returncode

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)
            if signum == signal.SIGKILL:
                self.killed.set()

    processes: list[Held] = []

    async def open_process(*args: Any, **kwargs: Any) -> Held:
        if processes:  # restarted: enough
            supervisor.stopping = True
            supervisor.stop.set()
        processes.append(Held())
        return processes[-1]

    monkeypatch.setattr(_workers.anyio, "open_process", open_process)
    with anyio.fail_after(WAIT_S), caplog.at_level(logging.INFO, "trioinfer.server"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run_worker, worker)
            await started.wait()
            worker.member = True
            supervisor._restart(worker, "it did not answer the load of model 'm'")
    assert processes[0].signals == [signal.SIGTERM, signal.SIGKILL]
    assert len(processes) == 2
    assert (
        "worker 0 (pid 4242), stopped because it did not answer the load of model 'm', is "
        "still running 0s later; killing it" in caplog.text
    )


async def test_workers_that_start_serving_different_things_are_noticed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Workers that started together were not compared: one whose load of a model failed
    # (a load that fails at random, or files changed between their starts) served without
    # it beside the others, and clients got one answer or another by the connection.
    supervisor = _Supervisor(3, tmp_path, {"models": None})
    digits = {"versions": {"1": [[1, 2, 3], None]}, "traffic": {}}
    flaky = {"versions": {"1": [[4, 5, 6], None]}, "traffic": {}}
    why = {"flaky": "failed to load 'flaky': at random"}
    served = {0: {"digits": digits}, 1: {"digits": digits, "flaky": flaky}, 2: {"digits": digits}}
    failed = {0: why, 1: {}, 2: why}

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            assert message["op"] == "served"
            return {"served": served[index], "failed": failed[index]}

        return handle

    @attrs.define
    class Running:
        returncode: int | None = None
        signals: list[int] = attrs.Factory(list)

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

    processes = [Running() for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for index in range(3):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        for member, process in zip(supervisor.workers, processes, strict=True):
            member.member = True  # as their hellos made them, before all were ready
            member.process, member.pid = cast(Any, process), 100 + member.index
        with caplog.at_level(logging.WARNING, "trioinfer.server"):
            for index in range(3):
                models = {name: [1] for name in served[index]}
                ready = {"op": "ready", "worker": index, "pid": 100 + index, "urls": ["u"]}
                ready.update({"models": models, "failed": list(failed[index]), "grpc": None})
                assert await supervisor.handle(ready) == {"ok": True}
        assert supervisor.all_ready.is_set()
        # The reference is the worker that serves the most (fewest failed loads): the
        # others restart, and join once they serve what it serves, as any restart does.
        assert supervisor.reference == 1
        assert [p.signals for p in processes] == [[signal.SIGTERM], [], [signal.SIGTERM]]
        assert [w.member for w in supervisor.workers] == [False, True, False]
        assert supervisor.spec["start_models"] == ["digits", "flaky"]
        assert (
            "worker 0 (pid 100) started serving other things than worker 1 (pid 101)" in caplog.text
        )
        assert "model 'flaky' is not served by it" in caplog.text
        # The banner named the pids of workers about to be restarted (another's soon).
        assert supervisor.listening().pids == (101,)
        tg.cancel_scope.cancel()


async def test_the_reference_at_start_is_the_worker_that_serves_the_most_models(
    tmp_path: Path,
) -> None:
    # A model added to the repository between two workers' starts: the later one serves
    # it, and neither failed a load. The reference was the one with the fewest failed
    # loads, then the lowest index: worker 0, serving less, so worker 1 was restarted
    # to serve without the model (the docs: the reference serves the most models).
    supervisor = _Supervisor(2, tmp_path, {"models": None})
    digits = {"versions": {"1": [[1, 2, 3], None]}, "traffic": {}}
    added = {"versions": {"1": [[4, 5, 6], None]}, "traffic": {}}
    served = {0: {"digits": digits}, 1: {"digits": digits, "added": added}}

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            assert message["op"] == "served"
            return {"served": served[index], "failed": {}}

        return handle

    @attrs.define
    class Running:
        returncode: int | None = None
        signals: list[int] = attrs.Factory(list)

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

    processes = [Running() for _ in range(2)]
    async with anyio.create_task_group() as tg:
        for index in range(2):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        for member, process in zip(supervisor.workers, processes, strict=True):
            member.member = True
            member.process, member.pid = cast(Any, process), 100 + member.index
        for index in range(2):
            models = {name: [1] for name in served[index]}
            ready = {"op": "ready", "worker": index, "pid": 100 + index, "urls": ["u"]}
            ready.update({"models": models, "failed": [], "grpc": None})
            assert await supervisor.handle(ready) == {"ok": True}
        assert supervisor.reference == 1
        assert [p.signals for p in processes] == [[signal.SIGTERM], []]
        assert supervisor.spec["start_models"] == ["added", "digits"]
        tg.cancel_scope.cancel()


async def test_a_joining_worker_that_serves_otherwise_waits_until_a_change_agrees(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted worker's hello, against stand-in workers: it joins once it serves alike."""
    supervisor = _Supervisor(2, tmp_path, {})
    supervisor.all_ready.set()
    old = {"digits": {"versions": {"1": [[1, 2, 3], None]}, "traffic": {}}}
    served = {0: old, 1: {}}  # worker 1 could not load digits as it is on disk now
    said: list[dict[str, Any]] = []

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            if message["op"] == "served":
                return {"served": served[index]}
            said.append({**message, "to": index})
            served[index] = {"digits": {"versions": {"1": [[4, 5, 6], None]}, "traffic": {}}}
            return {"ok": True}

        return handle

    joined: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:
        for index in (0, 1):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        first, joining = supervisor.workers
        first.member = True
        joining.process, joining.pid = cast(Any, object()), 201

        async def hello() -> None:
            joined.append(await supervisor.handle({"op": "hello", "worker": 1, "pid": 201}))

        with caplog.at_level(logging.WARNING, "trioinfer.server"):
            tg.start_soon(hello)
            with anyio.fail_after(WAIT_S):
                while "does not serve" not in caplog.text:  # noqa: ASYNC110
                    await anyio.sleep(POLL_S)
        assert "model 'digits' is not served by it" in caplog.text
        assert not joining.member
        # A reload that applies on the member is repeated to the joining worker, which
        # now serves the same files, and joins.
        load = {"op": "load", "model": "digits", "override": None}
        assert await supervisor.handle(load) == {"ok": True}
        with anyio.fail_after(WAIT_S):
            while not joined:  # noqa: ASYNC110
                await anyio.sleep(POLL_S)
        assert joined == [{"ok": True}]
        assert joining.member
        assert said == [{**load, "to": 0}, {**load, "to": 1}]

        # One that still differs is told to stop when the server stops.
        joining.member = False
        served[0] = old
        joined.clear()
        tg.start_soon(hello)
        with anyio.fail_after(WAIT_S):
            while caplog.text.count("does not serve") < 2:  # noqa: ASYNC110
                await anyio.sleep(POLL_S)
        assert "model 'digits' version 1: its files on disk are not those" in caplog.text
        supervisor.stop.set()
        with anyio.fail_after(WAIT_S):
            while not joined:  # noqa: ASYNC110
                await anyio.sleep(POLL_S)
        assert joined == [{"stopping": True}]
        assert not joining.member
        tg.cancel_scope.cancel()


async def test_a_joining_worker_that_never_agrees_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A restarted worker that serves otherwise than the members (files changed on disk
    # that no reload applies) waited to join for ever: loaded, never listening, and said
    # once. It gives up after JOIN_S: its hello fails, it exits and is started again.
    from trioinfer.server import _workers

    monkeypatch.setattr(_workers, "JOIN_S", 0.2)
    supervisor = _Supervisor(2, tmp_path, {})
    supervisor.all_ready.set()
    served = {0: {"digits": {"versions": {"1": [[1, 2, 3], None]}, "traffic": {}}}, 1: {}}

    def worker(index: int) -> Any:
        async def handle(message: dict[str, Any]) -> dict[str, Any]:
            return {"served": served[index]}

        return handle

    async with anyio.create_task_group() as tg:
        for index in (0, 1):
            await tg.start(_serve_calls, worker_socket(tmp_path, index), worker(index))
        first, joining = supervisor.workers
        first.member = True
        joining.process, joining.pid = cast(Any, object()), 201
        with anyio.fail_after(WAIT_S), caplog.at_level(logging.ERROR, "trioinfer.server"):
            reply = await supervisor.handle({"op": "hello", "worker": 1, "pid": 201})
        message = reply["error"]["message"]
        assert message.startswith(
            "worker 1 (pid 201) still does not serve what the others serve 0.2s after it "
            "asked to join (model 'digits' is not served by it"
        )
        assert "it stops, and is started again" in message
        assert message in caplog.text
        assert not joining.member
        tg.cancel_scope.cancel()


async def test_a_worker_that_fails_a_change_unexpectedly_is_no_worker_that_died(
    tmp_path: Path,
) -> None:
    # A worker whose handler raised something unexpected closed the call without an
    # answer, which the supervisor took for a worker that died meanwhile (it takes the
    # change when it restarts): the change was answered 200 and journaled, while that
    # worker, alive, went on serving what it had.
    supervisor = _Supervisor(2, tmp_path, {})

    async def fine(message: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    async def broken(message: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("a plugin's bug")

    async with anyio.create_task_group() as tg:
        await tg.start(_serve_calls, worker_socket(tmp_path, 0), fine)
        await tg.start(_serve_calls, worker_socket(tmp_path, 1), broken)
        for member in supervisor.workers:
            member.member = True
        load = {"op": "load", "model": "m", "override": None}
        reply = await supervisor.handle(load)
        assert reply["error"]["type"] == "WorkersDisagree"
        assert "failed on worker(s) 1" in reply["error"]["message"]
        assert "unexpected RuntimeError answering the 'load' call" in reply["error"]["message"]
        supervisor.workers[0].member = False  # every worker that answered failed alike
        reply = await supervisor.handle({"op": "unload", "model": "m"})
        assert reply["error"]["type"] == "TrioInferError"
        assert supervisor.journal == {"m": load}
        tg.cancel_scope.cancel()


async def test_a_report_taken_before_an_unload_does_not_bring_its_counts_back(
    tmp_path: Path,
) -> None:
    # A worker's periodic report of model m, taken before m's unload, may reach the
    # supervisor after it: the counts the worker answers the unload with (taken later)
    # are kept first, and the late report, numbered earlier, is ignored.
    supervisor = _Supervisor(1, tmp_path, {})

    async def handle(message: dict[str, Any]) -> dict[str, Any]:
        assert message["op"] == "unload"
        return {"ok": True, **_counts(100, 9, [_version(2, 5, name="other")], taken=8)}

    async with anyio.create_task_group() as tg:
        await tg.start(_serve_calls, worker_socket(tmp_path, 0), handle)
        (member,) = supervisor.workers
        member.member = True
        member.process, member.pid = cast(Any, object()), 100
        assert await supervisor.handle({"op": "unload", "model": "m"}) == {"ok": True}
        late = _counts(100, 7, [_version(7, 3), _version(1, 3, name="other")], taken=7)
        await supervisor.handle({"op": "counts", "worker": 0, **late})
        assert supervisor.stats.merged(0) == [triton_entry(_version(2, 5, name="other"))]
        tg.cancel_scope.cancel()


def _stats_entry(count: int, last: int, name: str = "m", version: str = "1") -> dict[str, Any]:
    return {
        "name": name,
        "version": version,
        "last_inference": last,
        "inference_count": count,
        "execution_count": count,
        "inference_stats": {"success": {"count": count, "ns": 10 * count}},
        "batch_stats": [],
    }


def _version(count: int, last: int, name: str = "m", version: str = "1") -> VersionCounts:
    """A model version's counts: *count* requests of half a second each, the last at *last*."""
    histogram = [[1.0], [count, 0], count, count * 0.5]
    return {
        "model": name,
        "version": version,
        "last_inference": last,
        "executions": count,
        "successful_executions": count,
        "inferences": count,
        "queued": 0,
        "in_flight": 0,
        "succeeded": count,
        "failed": 0,
        "replicas": [[0, "cpu", "serving", 0, 0, 0]],
        "fallbacks": {},
        "histograms": {
            name: histogram
            for name in ("queue_duration", "compute_duration", "request_duration", "batch_size")
        },
        "cache": None,
    }


def _counts(
    pid: int, requests: int, versions: list[VersionCounts], taken: int = 1
) -> dict[str, Any]:
    """A worker's report of its counts, as `WorkerLink` sends it."""
    counts: Counts = {
        "outcomes": [[v["model"], v["version"], "success", v["succeeded"]] for v in versions],
        "in_flight": 0,
        "in_flight_protocols": {"http": 0, "grpc": 0},
        "versions": versions,
    }
    return {"pid": pid, "taken": taken, "requests": requests, "counts": counts}


async def test_a_worker_that_dies_while_serve_stops_is_not_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A SIGTERM during a dead worker's restart delay started it anyway ("started
    # worker 0" after "stopping 2 workers"), only to be told to stop at once.
    from trioinfer.server import _workers

    supervisor = _Supervisor(1, tmp_path, {})
    supervisor.all_ready.set()
    started = []

    class Died:
        pid = 4242
        returncode = -signal.SIGKILL

        async def wait(self) -> int:
            supervisor.workers[0].ready = True
            supervisor.stop.set()  # the signal, while it was dying
            return self.returncode

    async def open_process(*args: Any, **kwargs: Any) -> Died:
        started.append(args)
        supervisor.stopping = len(started) > 1  # as stop_all would, a moment later
        return Died()

    monkeypatch.setattr(_workers.anyio, "open_process", open_process)
    with anyio.fail_after(WAIT_S):
        await supervisor.run_worker(supervisor.workers[0])
    assert len(started) == 1


@pytest.mark.parametrize("answered", [False, True])
async def test_a_worker_that_dies_while_the_first_workers_are_compared_is_restarted(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    answered: bool,
) -> None:
    # Once all first workers were ready, the supervisor compared what they served; a
    # worker that died then (after it had said it was ready) stopped the whole server
    # with "... before it was ready". It had been ready: it is restarted, as a worker
    # that dies later is, and the others serve. *answered*: it died just after it
    # answered, serving more than worker 0: it is not the reference, and worker 0 is
    # not stopped for serving otherwise than a worker that is gone.
    from trioinfer.server import _workers

    supervisor = _Supervisor(2, tmp_path, {"models": None})
    digits = {"digits": {"versions": {"1": [[1, 2, 3], None]}, "traffic": {}}}
    more = {**digits, "flaky": {"versions": {"1": [[4, 5, 6], None]}, "traffic": {}}}
    died, both_started, restarted = anyio.Event(), anyio.Event(), anyio.Event()
    started: list[int] = []

    class Process:
        def __init__(self, index: int) -> None:
            self.pid = 99 + len(started)
            self.returncode: int | None = None
            self.dies = index == 1 and started.count(1) == 1  # worker 1's first life
            self.signals: list[int] = []
            processes.append(self)

        async def wait(self) -> int:
            if self.dies:
                await died.wait()
                self.returncode = -signal.SIGKILL
                return self.returncode
            await anyio.sleep_forever()
            raise AssertionError  # pragma: no cover

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

    processes: list[Process] = []

    async def open_process(argv: list[str], **kwargs: Any) -> Process:
        started.append(int(argv[-1]))
        process = Process(int(argv[-1]))
        if len(started) > 1:
            (both_started if len(started) == 2 else restarted).set()
        return process

    async def worker_0(message: dict[str, Any]) -> dict[str, Any]:
        if answered:
            await restarted.wait()  # worker 1 has answered, died and started again
        return {"served": digits, "failed": {}}

    async def worker_1(message: dict[str, Any]) -> dict[str, Any]:
        died.set()  # killed while it is asked what it serves
        if answered:
            return {"served": more, "failed": {}}
        await anyio.sleep_forever()  # it never answers
        raise AssertionError  # pragma: no cover

    async def worker_1_listens(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as calls:
            if not answered:
                calls.start_soon(_first, died, calls.cancel_scope)  # its socket goes with it
            await calls.start(_serve_calls, worker_socket(tmp_path, 1), worker_1)
            task_status.started()

    monkeypatch.setattr(_workers.anyio, "open_process", open_process)
    async with anyio.create_task_group() as tg:
        await tg.start(_serve_calls, worker_socket(tmp_path, 0), worker_0)
        await tg.start(worker_1_listens)
        for worker in supervisor.workers:
            tg.start_soon(supervisor.run_worker, worker)
        with anyio.fail_after(WAIT_S), caplog.at_level(logging.INFO, "trioinfer.server"):
            await both_started.wait()
            pid = supervisor.workers[1].pid
            for index in range(2):
                worker = supervisor.workers[index]
                worker.member = True  # as its hello made it, before all were ready
                ready = {"op": "ready", "worker": index, "pid": worker.pid, "urls": ["u"]}
                ready.update({"models": {"digits": [1]}, "failed": [], "grpc": None})
                assert await supervisor.handle(ready) == {"ok": True}
            assert supervisor.all_ready.is_set()
            async with anyio.create_task_group() as waiting:  # a restart, or serve stops
                waiting.start_soon(_first, restarted, waiting.cancel_scope)
                waiting.start_soon(_first, supervisor.stop, waiting.cancel_scope)
        assert supervisor.failure is None, supervisor.failure
        assert not supervisor.stop.is_set()
        assert sorted(started) == [0, 1, 1]  # worker 1 again; worker 0 serves on
        assert supervisor.reference == 0
        assert [p.signals for p in processes if p.pid == supervisor.workers[0].pid] == [[]]
        assert "before it was ready" not in caplog.text
        assert f"worker 1 (pid {pid}) was killed by SIGKILL; its in-flight requests" in caplog.text
        tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("ModelNotFound", ModelNotFound), ("RequestError", TrioInferError), ("Nonsense", None)],
)
def test_a_workers_error_comes_back_as_its_class(kind: str, expected: type | None) -> None:
    with pytest.raises(TrioInferError, match=r"^said$") as raised:
        _raise_error({"type": kind, "message": "said"})
    if expected is None:
        assert type(raised.value) is TrioInferError  # unknown: a plain 500
    else:
        assert isinstance(raised.value, expected)


@pytest.mark.tracing
@pytest.mark.grpc
def test_workers_trace_with_the_servers_trace_settings(repository: Path, tmp_path: Path) -> None:
    # Each worker makes its own tracer provider from --trace-exporter/--trace-rate, and
    # /v2/trace/setting changes reach them all (a restarted one too).
    log = tmp_path / "serve.log"
    with two_workers(repository, log, "--trace-exporter", "console", "--trace-rate", "1") as server:
        process, url, victim = server.process, server.url, server.pids[1]
        # A trace settings change reaches every worker, as a repository change does.
        changed = fresh("POST", f"{url}/v2/trace/setting", json={"trace_rate": "0"})
        assert changed.status_code == 200, changed.text
        for _ in range(12):
            assert fresh("GET", f"{url}/v2/trace/setting").json()["trace_rate"] == "0"
        # ... and to a worker that restarts after it.
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: worker_pids(url).get("1", victim) != victim, "worker 1 is back")
        for _ in range(12):
            assert fresh("GET", f"{url}/v2/trace/setting").json()["trace_rate"] == "0"
            assert infer_digit(url).status_code == 200  # rate 0: not traced
        model = fresh("POST", f"{url}/v2/models/digits/trace/setting", json={"trace_rate": "1"})
        assert model.status_code == 200, model.text
        for _ in range(12):
            got = fresh("GET", f"{url}/v2/models/digits/trace/setting").json()
            assert got["trace_rate"] == "1"
        # So does one made over gRPC (any worker may take the call), seen over both.
        import tritonclient.grpc as triton_grpc

        assert server.grpc is not None
        with triton_grpc.InferenceServerClient(server.grpc) as c:
            c.update_trace_settings(settings={"trace_rate": "2"})
        for _ in range(12):
            assert fresh("GET", f"{url}/v2/trace/setting").json()["trace_rate"] == "2"
            with triton_grpc.InferenceServerClient(
                server.grpc, channel_args=[("grpc.use_local_subchannel_pool", 1)]
            ) as c:
                got = c.get_trace_settings(as_json=True)["settings"]["trace_rate"]
                assert got == {"value": ["2"]}
        # A change every worker refuses fails as on one server.
        refused = fresh("POST", f"{url}/v2/trace/setting", json={"trace_level": ["TENSORS"]})
        assert refused.status_code == 400
        assert "TENSORS is not supported" in refused.json()["error"]
        for _ in range(4):
            assert infer_digit(url).status_code == 200  # the model's own rate: traced
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0, log.read_text()
    printed = []
    while (line := server.next_line()) is not None:
        printed.append(line)
    # The console exporter prints each span as JSON on the workers' stdout at exit.
    names = re.findall(r'"name": "([^"]+)"', "".join(printed))
    assert names.count("infer digits.v1") == 4, names


def test_a_restarted_worker_serves_what_the_others_do_not_what_is_on_disk(
    tmp_path: Path,
) -> None:
    # A model added to the repository after start, and not loaded through the API,
    # was loaded by a worker that restarted (it read the whole repository again):
    # the workers then served different models, by connection.
    repository = tmp_path / "repository"
    shutil.copytree(example_repository() / "digits", repository / "digits")
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "1" / "model.onnx").write_bytes(b"not an ONNX file")
    log = tmp_path / "serve.log"
    with two_workers(repository, log) as server:
        process, url, victim = server.process, server.url, server.pids[1]
        shutil.copytree(repository / "digits", repository / "late")
        (repository / "late" / "config.toml").unlink()  # it names digits
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: worker_pids(url).get("1", victim) != victim, "worker 1 is back")
        for _ in range(12):
            rows = fresh("POST", f"{url}/v2/repository/index").json()
            assert [row["name"] for row in rows if row["state"] == "READY"] == ["digits"]
            # The model that failed at start says why on both, not "unloaded" on one.
            (broken,) = [row for row in rows if row["name"] == "broken"]
            assert broken["reason"].startswith("failed to load 'broken'"), broken
        # Loading it through the API serves it on both, the restarted one included.
        assert fresh("POST", f"{url}/v2/repository/models/late/load").status_code == 200
        for _ in range(12):
            assert fresh("GET", f"{url}/v2/models/late/ready").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0, log.read_text()


FLAKY_MODEL = """\
import os

# The first process to load it fails; every load after that succeeds.
try:
    os.close(os.open({marker!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
except FileExistsError:
    pass
else:
    raise RuntimeError("this load fails, the next succeed")


class Model:
    async def infer(self, inputs):
        return {{"y": inputs["x"]}}
"""


def test_a_worker_that_started_without_a_model_the_other_loaded_restarts_and_joins(
    tmp_path: Path,
) -> None:
    # Workers that start together each load the repository: a load that failed on one
    # only left it serving without the model beside the other, unnoticed.
    repository = tmp_path / "repository"
    shutil.copytree(example_repository() / "digits", repository / "digits")
    (repository / "flaky" / "1").mkdir(parents=True)
    (repository / "flaky" / "config.toml").write_text(SLOW_CONFIG)
    marker = tmp_path / "loaded-once"
    (repository / "flaky" / "1" / "model.py").write_text(FLAKY_MODEL.format(marker=str(marker)))
    log = tmp_path / "serve.log"
    with two_workers(repository, log) as server:
        wait_until(lambda: "started serving other things" in log.read_text(), "it is noticed")
        found = re.search(
            r"worker (\d) \(pid (\d+)\) started serving other things", log.read_text()
        )
        assert found is not None
        index, victim = found.group(1), int(found.group(2))
        assert "model 'flaky' is not served by it" in log.read_text()
        # Stopped before the banner: it names the worker that serves alone.
        assert len(server.pids) == 1
        assert victim not in server.pids
        # Its restart loads the model (only the first load fails) and joins the other.
        wait_until(lambda: worker_pids(server.url).get(index, victim) != victim, "it is back")
        for _ in range(12):
            assert fresh("GET", f"{server.url}/v2/models/flaky/ready").status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=WAIT_S) == 0, log.read_text()


def test_a_model_unloaded_and_removed_is_not_loaded_by_a_restarted_worker(
    tmp_path: Path,
) -> None:
    # A worker that restarted loaded every model the workers loaded at start, one
    # unloaded since too: its files gone, that load failed, the replayed unload found
    # nothing, and the failure stayed: under --strict-readiness that worker alone was
    # never ready again (and the repository index said "failed to load" on it alone).
    repository = tmp_path / "repository"
    shutil.copytree(example_repository() / "digits", repository / "digits")
    shutil.copytree(example_repository() / "digits" / "1", repository / "other" / "1")
    log = tmp_path / "serve.log"
    with two_workers(repository, log, "--strict-readiness") as server:
        process, url, victim = server.process, server.url, server.pids[1]
        assert fresh("POST", f"{url}/v2/repository/models/other/unload").status_code == 200
        shutil.rmtree(repository / "other")
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: worker_pids(url).get("1", victim) != victim, "worker 1 is back")
        for _ in range(12):
            answer = fresh("GET", f"{url}/v2/health/ready")
            assert answer.status_code == 200, answer.text
            assert infer_digit(url).status_code == 200
        after = log.read_text().split("was killed by SIGKILL")[1]
        assert "failed to load 'other'" not in after
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0, log.read_text()


def test_a_restarted_worker_starts_without_the_models_unloaded_since(tmp_path: Path) -> None:
    # With --model, a model that failed to load stopped the worker: one unloaded and
    # removed since would have kept a restarted worker from ever starting.
    supervisor = _Supervisor(1, tmp_path, {"models": ["digits", "other"]})
    supervisor.journal["other"] = {"op": "unload", "model": "other"}
    supervisor.journal["chain"] = {"op": "load", "model": "chain", "override": {"a": 1}}
    spec = supervisor._spec_for_a_start()
    assert spec["models"] == ["digits"]
    assert spec["start_overrides"] == {"chain": {"a": 1}}
    supervisor = _Supervisor(1, tmp_path, {"models": None, "start_models": ["digits", "other"]})
    supervisor.journal["other"] = {"op": "unload", "model": "other"}
    assert supervisor._spec_for_a_start()["start_models"] == ["digits"]


def test_a_stateful_model_is_refused_under_workers(tmp_path: Path) -> None:
    # Each worker would keep its own sequences. A request reaching another worker than
    # its sequence's failed, and the client, restarting the sequence over a new
    # connection, left it alive on both: its later requests were answered from either
    # sum, by connection (101, 102, 101, 103, ...), with no error. So it is not served.
    repository = tmp_path / "repository"
    (repository / "accumulator" / "1").mkdir(parents=True)
    (repository / "accumulator" / "config.toml").write_text(ACCUMULATOR_CONFIG)
    (repository / "accumulator" / "1" / "model.py").write_text(ACCUMULATOR_MODEL)
    shutil.copytree(example_repository() / "digits", repository / "digits")
    log = tmp_path / "serve.log"
    body = {
        "parameters": {"sequence_id": 7, "sequence_start": True},
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [1]}],
    }
    with two_workers(repository, log) as server:
        process, url = server.process, server.url
        for _ in range(8):  # on both workers
            answer = fresh("POST", f"{url}/v2/models/accumulator/infer", json=body)
            assert answer.status_code != 200
            assert infer_digit(url).status_code == 200  # the other models serve
        rows = fresh("POST", f"{url}/v2/repository/index").json()
        (row,) = [row for row in rows if row["name"] == "accumulator"]
        assert row["state"] != "READY"
        assert "cannot be served by 2 worker processes" in row["reason"]
        assert "serve it with --workers 1" in row["reason"]
        # Nor does a load through the API serve it.
        loaded = fresh("POST", f"{url}/v2/repository/models/accumulator/load")
        assert loaded.status_code == 400
        assert "cannot be served by 2 worker processes" in loaded.json()["error"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0, log.read_text()
    # Left out at start with a WARNING, not counted a failed load (as the bundled
    # repository's accumulator is, under the README's --workers 4).
    said = [line for line in log.read_text().splitlines() if "2 worker processes" in line]
    assert said, log.read_text()
    assert all("WARNING" in line and "ERROR" not in line for line in said), said
    assert "could not load" not in log.read_text()


async def test_a_report_renders_on_the_supervisor_as_the_worker_renders_it(
    tmp_path: Path,
) -> None:
    """A worker's counts, through JSON, give the supervisor its exposition and statistics.

    The supervisor renders what a worker reports (`exposition_of`, `triton_entry`)
    and adds it up: it must be the text and the statistics the worker itself
    serves, to the byte, or the sums over live and dead workers are off.
    """
    import types

    import numpy as np

    from trioinfer import open_engine
    from trioinfer.server._app import model_stats
    from trioinfer.server._metrics import InFlight, Metrics, exposition_of
    from trioinfer.server._models import ServedModels
    from trioinfer.server._repository import ModelRepository

    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    toml = repo / "digits" / "config.toml"
    toml.write_text("response_cache = true\n" + toml.read_text())
    async with open_engine(drain_period=0, cache_size=1 << 20) as engine:
        served = ServedModels(engine, ModelRepository(repo))
        await served.load("digits")
        metrics = Metrics(served, InFlight())
        version = served.resolve("digits")
        rows = np.random.default_rng(0).random((3, 64), dtype=np.float32)
        for row in (rows[0], rows[1], rows[0]):  # a miss, a miss, a hit
            await engine.infer(version.engine_name, {"input": row[None]})
            metrics.succeeded(version)
        metrics.count("nonesuch", None, ModelNotFound("no"))
        counts = json.loads(json.dumps(metrics.counts()))
        assert exposition_of(counts) == metrics.exposition()[0]
        entries = [triton_entry(v) for v in counts["versions"]]
        state = cast(Any, types.SimpleNamespace(models=served, metrics=metrics))
        assert entries == model_stats(state, None, None)
        assert entries[0]["inference_stats"]["cache_hit"]["count"] == 1


async def test_reports_go_as_lines_on_one_connection_without_answers(tmp_path: Path) -> None:
    # A worker's periodic reports: lines on a connection it keeps open, each handled
    # in order, none answered; a call on the same connection still gets its answer.
    from anyio.streams.buffered import BufferedByteReceiveStream

    seen: list[dict[str, Any]] = []

    async def handle(message: dict[str, Any]) -> dict[str, Any]:
        seen.append(message)
        return {"ok": len(seen)}

    async with anyio.create_task_group() as tg:
        await tg.start(_serve_calls, worker_socket(tmp_path, 0), handle)
        async with await anyio.connect_unix(worker_socket(tmp_path, 0)) as stream:
            for n in (1, 2):
                await stream.send(json.dumps({"op": "counts", "n": n, "reply": False}).encode())
                await stream.send(b"\n")
            await stream.send(b'{"op": "asked"}\n')
            line = await BufferedByteReceiveStream(stream).receive_until(b"\n", 1 << 16)
        assert json.loads(line) == {"ok": 3}
        assert [m.get("n", m["op"]) for m in seen] == [1, 2, "asked"]
        tg.cancel_scope.cancel()


def test_the_banner_names_only_the_workers_that_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from trioinfer.server import _workers

    async def serve_workers(
        repository: Path, *, task_status: anyio.abc.TaskStatus[Any], **options: Any
    ) -> None:
        task_status.started(_workers.WorkersListening(("http://h:1",), {"m": (1,)}, (), (101,)))

    monkeypatch.setattr(_workers, "serve_workers", serve_workers)
    result = CliRunner().invoke(main, ["serve", "--workers", "3"])
    assert result.exit_code == 0, result.output
    assert "1 of 3 workers (the others restart) (pids 101) listening on http://h:1" in result.output


LOADING_MODEL = """\
import os
import pathlib
import time


class Model:
    def __init__(self):
        # A constructor that reads weights for a while (on its thread): both workers
        # are still loading when the signal comes.
        (pathlib.Path(__file__).parent / f"loading-{os.getpid()}").touch()
        time.sleep(2)

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""
ONE_INSTANCE = SLOW_CONFIG.replace("count = 16", "count = 1")


def test_sigterm_while_the_workers_load_stops_them_and_exits_0(tmp_path: Path) -> None:
    # A SIGTERM during the start (an orchestrator's rollout while models load) ended the
    # command with "Error: WorkerFailed: stopped by a signal before every worker was
    # ready" and status 1; one process stops its start at once and exits 0, and so do
    # the workers now.
    repository = tmp_path / "repository"
    (repository / "loading" / "1").mkdir(parents=True)
    (repository / "loading" / "config.toml").write_text(ONE_INSTANCE)
    (repository / "loading" / "1" / "model.py").write_text(LOADING_MODEL)
    log = tmp_path / "serve.log"
    process, _next_line = start(repository, log, "--workers", "2")
    try:
        wait_until(
            lambda: len(list((repository / "loading" / "1").glob("loading-*"))) >= 2,
            "both workers load",
        )
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    said = log.read_text()
    assert code == 0, said
    assert "WorkerFailed" not in said
    assert "SIGTERM before serving started: stopping now" in said
    assert "all workers stopped" in said


async def test_a_signal_while_workers_are_started_starts_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `serve --workers 100000` kept starting workers for half an hour after a SIGTERM:
    # every worker's life had asked for its process at once, and each start waiting
    # for its turn (trio starts processes from threads, 40 at a time) still ran after
    # the signal, only to be told to stop. A start whose turn comes after the signal
    # is not made.
    from trioinfer.server import _workers

    count = 4 * _workers.STARTS_AT_ONCE
    supervisor = _Supervisor(count, tmp_path, {})
    started: list[int] = []

    class Stopped:
        returncode = -signal.SIGTERM

        def __init__(self) -> None:
            self.pid = 1000 + len(started)

        async def wait(self) -> int:
            await supervisor.stop.wait()  # it runs until serve stops
            return self.returncode

        def send_signal(self, signum: int) -> None:
            pass

    async def open_process(argv: list[str], **kwargs: Any) -> Stopped:
        started.append(int(argv[-1]))
        if len(started) == 2:
            supervisor.stop.set()  # the SIGTERM, while the first workers are started
        await anyio.lowlevel.checkpoint()  # a start takes a while, as a fork and exec does
        return Stopped()

    monkeypatch.setattr(_workers.anyio, "open_process", open_process)
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as lives:
            for worker in supervisor.workers:
                lives.start_soon(supervisor.run_worker, worker)
    # Those already being started when the signal came, and no more.
    assert 2 <= len(started) <= _workers.STARTS_AT_ONCE


async def test_a_signal_before_the_supervisor_watches_for_it_stops_the_start(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A SIGTERM just after "supervising N workers" (while the supervisor set up its
    # control socket, machine metrics or the repository's baseline) killed it outright
    # (exit status -15, its control directory left in /tmp); a SIGINT said "Aborted!"
    # with status 1. It stops the start as a signal during the models' load does.
    from trioinfer.server import _workers

    class Unwatched(Exception):
        pass

    def unwatched(signum: int, frame: object) -> None:
        raise Unwatched  # what the default action would be: the process ends

    def signalled(config: ServerConfig) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        return None

    async def open_process(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a worker was started after the signal")

    monkeypatch.setattr(_workers, "host_metrics_for", signalled)
    monkeypatch.setattr(_workers.anyio, "open_process", open_process)
    monkeypatch.setattr(_workers.tempfile, "tempdir", str(short_tmp_path))
    before = signal.signal(signal.SIGTERM, unwatched)
    try:
        with anyio.fail_after(WAIT_S):
            await _workers.serve_workers(
                example_repository(), workers=2, port=0, config=ServerConfig()
            )
    finally:
        signal.signal(signal.SIGTERM, before)
    # The control directory is gone.
    assert [p async for p in anyio.Path(short_tmp_path).iterdir()] == []


def test_a_long_temporary_directory_puts_the_control_sockets_in_tmp(
    tmp_path: Path, short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A socket's path may be 107 bytes at most: under a long TMPDIR the supervisor's
    # bind failed with "AF_UNIX path too long" before any worker started.
    from trioinfer.server import _workers

    long = tmp_path / ("d" * 90)
    long.mkdir()
    monkeypatch.setattr(_workers.tempfile, "tempdir", str(long))
    directory = _workers.control_directory(16)
    try:
        assert directory.parent == Path("/tmp")
        for path in (directory / "supervisor.sock", _workers.worker_socket(directory, 15)):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(str(path))  # fits
    finally:
        shutil.rmtree(directory)
    monkeypatch.setattr(_workers.tempfile, "tempdir", str(short_tmp_path))
    directory = _workers.control_directory(16)
    assert directory.parent == short_tmp_path  # where TMPDIR says, when it fits
