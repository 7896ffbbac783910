"""``trioinfer serve --workers 2`` over gRPC: every worker serves it, on one port, as HTTP.

The server runs as a real subprocess on 127.0.0.1 (``--port 0``: the
supervisor picks one HTTP port and one gRPC port, and every worker binds
both), started and stopped by pid as in ``test_workers``. Each gRPC call
that should be able to land on either worker goes over a client of its own
with a private subchannel pool (grpcio would otherwise share one connection
among a process's channels to the same address), so that the kernel spreads
them over both workers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
from click.testing import CliRunner
from tritonclient.utils import InferenceServerException

from _triton_config import own_setting
from test_workers import (
    DIGIT,
    Served,
    alive,
    fresh,
    repository,  # noqa: F401  # the module's model repository fixture
    samples,
    two_workers,
    wait_until,
    worker_pids,
)
from trioinfer.cli import main

pytestmark = [pytest.mark.workers, pytest.mark.grpc]

#: How many fresh connections a check makes, so that both workers are asked.
TRIES = 12


@pytest.fixture(scope="module")
def served(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # noqa: F811
    with two_workers(repository, tmp_path_factory.mktemp("log") / "serve.log") as server:
        assert server.grpc is not None
        assert server.grpc.startswith("127.0.0.1:")
        yield server


@contextlib.contextmanager
def client(served: Served) -> Iterator[triton.InferenceServerClient]:
    """A gRPC client on a connection of its own (see the module's docstring)."""
    assert served.grpc is not None
    c = triton.InferenceServerClient(
        served.grpc, channel_args=[("grpc.use_local_subchannel_pool", 1)]
    )
    try:
        yield c
    finally:
        c.close()


def infer_digit(served: Served) -> np.ndarray[Any, Any]:
    with client(served) as c:
        image = triton.InferInput("input", [1, 64], "FP32")
        image.set_data_from_numpy(np.array([DIGIT], dtype=np.float32))
        result = c.infer("digits", [image])
        output = result.get_response().outputs[0].name
        answer: np.ndarray[Any, Any] = result.as_numpy(output)
        return answer


def infer_slow(served: Served, seconds: float) -> float:
    with client(served) as c:
        x = triton.InferInput("x", [1, 1], "FP32")
        x.set_data_from_numpy(np.array([[seconds]], dtype=np.float32))
        return float(c.infer("slow", [x], client_timeout=60).as_numpy("y")[0, 0])


def per_worker(served: Served) -> dict[str, float]:
    """Each worker's inference requests (HTTP and gRPC), as /metrics says."""
    return {
        labels["worker"]: value
        for labels, value in samples(served.url, "trioinfer_worker_inference_requests_total")
    }


def grpc_stats(served: Served, model: str) -> dict[str, Any]:
    """*model*'s statistics over gRPC, in the HTTP answer's shape (proto3 JSON drops zeros)."""
    with client(served) as c:
        [entry] = c.get_inference_statistics(model, as_json=True)["model_stats"]
    durations = entry.get("inference_stats", {})
    return {
        "inference_count": int(entry.get("inference_count", 0)),
        "execution_count": int(entry.get("execution_count", 0)),
        "last_inference": int(entry.get("last_inference", 0)),
        "success": {k: int(v) for k, v in durations.get("success", {}).items()},
    }


def http_stats(served: Served, model: str) -> dict[str, Any]:
    [entry] = fresh("GET", f"{served.url}/v2/models/{model}/stats").json()["model_stats"]
    success = {k: v for k, v in entry["inference_stats"]["success"].items() if v}
    return {
        "inference_count": entry["inference_count"],
        "execution_count": entry["execution_count"],
        "last_inference": entry["last_inference"],
        "success": success,
    }


def test_every_worker_listens_on_loopback_only_for_both_protocols(served: Served) -> None:
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("needs ss (iproute2) to list listening sockets")
    assert served.grpc is not None
    grpc_port, http_port = served.grpc.rsplit(":", 1)[1], served.url.rsplit(":", 1)[1]
    listed = subprocess.run([ss, "-tlnpH"], capture_output=True, text=True, check=True).stdout
    pids = worker_pids(served.url).values()
    ours = [line.split() for line in listed.splitlines() if any(f"pid={p}," in line for p in pids)]
    assert sorted(row[3] for row in ours) == sorted(
        f"127.0.0.1:{port}" for port in (http_port, http_port, grpc_port, grpc_port)
    ), listed


def test_grpc_calls_spread_over_both_workers_and_statistics_add_up(served: Served) -> None:
    before = per_worker(served)
    for _ in range(40):
        assert int(np.argmax(infer_digit(served))) == 0
    after = per_worker(served)
    took = {w: after[w] - before.get(w, 0) for w in after}
    assert set(took) == {"0", "1"}
    assert all(n > 0 for n in took.values()), took  # both answered some calls
    assert sum(took.values()) == 40
    # gRPC's statistics are the server's, every worker's added up, as HTTP's are.
    over_grpc = grpc_stats(served, "digits")
    assert over_grpc["inference_count"] == over_grpc["success"]["count"] == 40
    for _ in range(TRIES):  # whichever worker answers, it gathers the others' counts
        assert grpc_stats(served, "digits") == over_grpc
        assert http_stats(served, "digits") == over_grpc


def test_grpc_load_and_unload_reach_every_worker(served: Served) -> None:
    with client(served) as c:
        c.unload_model("digits")
    for _ in range(TRIES):
        assert fresh("GET", f"{served.url}/v2/models/digits/ready").status_code != 200
        with client(served) as c:
            assert not c.is_model_ready("digits")
    with client(served) as c:
        c.load_model("digits", config='{"max_queue_size": 7}')
    for _ in range(TRIES):
        config = fresh("GET", f"{served.url}/v2/models/digits/config").json()
        assert own_setting(config, "max_queue_size") == 7
        with client(served) as c:
            assert c.is_model_ready("digits")
        assert int(np.argmax(infer_digit(served))) == 0
    # A load every worker refuses fails as on one server, with the gRPC status for it.
    with client(served) as c, pytest.raises(InferenceServerException) as refused:
        c.load_model("digits", config='{"max_queue_size": -1}')
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "max_queue_size must be a positive integer, got -1" in refused.value.message()
    with client(served) as c, pytest.raises(InferenceServerException) as missing:
        c.load_model("nosuch")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    # The unload took the statistics with it, on every worker (as over HTTP).
    assert grpc_stats(served, "digits")["inference_count"] == TRIES


def test_grpc_log_settings_reach_every_worker(served: Served) -> None:
    # (Trace settings over gRPC: test_workers' tracing test, which serves with an exporter.)
    with client(served) as c:
        c.update_log_settings({"log_verbose_level": 1})
    for _ in range(TRIES):
        assert fresh("GET", f"{served.url}/v2/logging").json()["log_verbose_level"] == 1
        with client(served) as c:
            got = c.get_log_settings(as_json=True)["settings"]["log_verbose_level"]
            assert got == {"uint32_param": 1}


def test_grpc_shared_memory_registration_is_refused_clearly(served: Served) -> None:
    # INVALID_ARGUMENT, as HTTP's 400 for the same error: no retry can succeed
    # (UNAVAILABLE would tell clients with a retry policy to try again).
    for _ in range(4):
        with client(served) as c:
            with pytest.raises(InferenceServerException) as system:
                c.register_system_shared_memory("r", "/nope", 8)
            with pytest.raises(InferenceServerException) as cuda:
                c.register_cuda_shared_memory("r", b"\0" * 64, 0, 8)
        for refused in (system.value, cuda.value):
            assert refused.status() == "StatusCode.INVALID_ARGUMENT"
            assert "not supported with trioinfer serve --workers N" in refused.message()
    with client(served) as c:
        extensions = c.get_server_metadata(as_json=True)["extensions"]
    assert "system_shared_memory" not in extensions
    # Nor sequences: a stateful model is refused under --workers N.
    assert "sequence" not in extensions
    assert "model_repository" in extensions


def test_a_killed_worker_is_restarted_and_serves_grpc(served: Served) -> None:
    victim = worker_pids(served.url)["1"]
    counted = grpc_stats(served, "digits")["inference_count"]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: worker_pids(served.url).get("1", victim) != victim, "worker 1 is back")
    assert not alive(victim)
    before = per_worker(served)
    for _ in range(TRIES * 2):
        assert int(np.argmax(infer_digit(served))) == 0
    after = per_worker(served)
    assert after["1"] > before.get("1", 0), "the restarted worker answered no gRPC call"
    # What the victim counted stays in the server's statistics.
    assert grpc_stats(served, "digits")["inference_count"] == counted + TRIES * 2
    for _ in range(TRIES):  # it took the override loaded over gRPC before it started
        config = fresh("GET", f"{served.url}/v2/models/digits/config").json()
        assert own_setting(config, "max_queue_size") == 7


def test_sigterm_drains_an_in_flight_grpc_call(served: Served) -> None:
    pids = list(worker_pids(served.url).values())
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(infer_slow, served, 2.0)
        wait_until(
            lambda: samples(served.url, "trioinfer_http_inference_in_flight")[0][1] == 1,
            "the slow call is in flight",
        )
        served.process.send_signal(signal.SIGTERM)
        assert slow.result() == pytest.approx(2.0)  # drained, not cut
    assert served.process.wait(timeout=30) == 0
    assert not [pid for pid in pids if alive(pid)]
    log = served.log.read_text()
    assert log.count("stopped serving gRPC") == 2
    assert "Traceback" not in log


@pytest.mark.parametrize("from_file", [False, True])
def test_a_grpc_port_in_use_is_said_before_any_worker_starts(
    tmp_path: Path, from_file: bool
) -> None:
    # The port given on the command line, or as grpc_port in --config beside workers.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "server.toml"
        config.write_text(f"workers = 2\ngrpc_port = {port}\n")
        given = (
            ["--config", str(config)] if from_file else ["--workers", "2", "--grpc-port", str(port)]
        )
        result = CliRunner().invoke(main, ["serve", "--host", "127.0.0.1", "--port", "0", *given])
    assert result.exit_code == 1, result.output
    assert f"cannot listen for gRPC on 127.0.0.1:{port}" in result.output
