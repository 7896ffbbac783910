"""``serve --strict-readiness`` and ``--exit-on-error`` (Triton's flags of those names).

A repository holding the digits model and a broken one, served on 127.0.0.1.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient

from test_grpc import run_server
from trioinfer import example_repository

WAIT_S = 60.0


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repository"
    shutil.copytree(example_repository() / "digits", root / "digits")
    (root / "broken" / "1").mkdir(parents=True)
    shutil.copy(example_repository() / "digits" / "1" / "model.onnx", root / "broken" / "1")
    (root / "broken" / "config.toml").write_text("max_queue_size = -1\n")
    return root


def test_exit_on_error_stops_when_a_model_fails_to_load(repository: Path) -> None:
    command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--no-grpc"]
    command += ["--model-repository", str(repository), "--exit-on-error"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--exit-on-error: model(s) 'broken' failed to load at start" in done.stderr
    assert "max_queue_size" in done.stderr  # the log said why


@pytest.mark.grpc
def test_strict_readiness_waits_for_every_model(repository: Path, tmp_path: Path) -> None:
    with run_server(repository, "--strict-readiness", log=tmp_path / "log") as server:
        ready = httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S)
        assert ready.status_code == 503
        assert "model(s) 'broken' failed to load" in ready.json()["error"]
        with grpcclient.InferenceServerClient(server.grpc) as client:
            assert client.is_server_live()
            assert not client.is_server_ready()
            # The others serve meanwhile.
            assert client.is_model_ready("digits")
            (repository / "broken" / "config.toml").write_text("max_queue_size = 8\n")
            client.load_model("broken")
            assert client.is_server_ready()
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        # A reload that fails leaves the served version serving: still ready.
        (repository / "broken" / "config.toml").write_text("max_queue_size = -1\n")
        failed = httpx.post(f"{server.url}/v2/repository/models/broken/load", timeout=WAIT_S)
        assert failed.status_code == 400
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        # A load of a model the repository does not hold is a 404, not a model that
        # failed to load: Triton's readiness counts the models it found and tried (its
        # LiveModelStates), and this one never was.
        missing = httpx.post(f"{server.url}/v2/repository/models/nosuch/load", timeout=WAIT_S)
        assert missing.status_code == 404
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        index = httpx.post(f"{server.url}/v2/repository/index", timeout=WAIT_S).json()
        assert "nosuch" not in {row["name"] for row in index}


def test_without_the_flags_a_failed_model_leaves_the_server_ready(
    repository: Path, tmp_path: Path
) -> None:
    with run_server(repository, "--no-grpc", log=tmp_path / "log", want_grpc=False) as server:
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
