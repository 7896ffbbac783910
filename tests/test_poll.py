"""``trioinfer serve --repository-poll-secs N``: the repository read again (Triton's poll mode).

The poll itself over a real directory with recording load/unload functions, then
real servers on 127.0.0.1: one process, and ``--workers 2`` (every worker follows).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from test_server import run_server
from test_workers import fresh, infer_digit, two_workers, wait_until, worker_pids
from trioinfer import ConfigError, ModelNotFound, example_repository
from trioinfer.server import ServerConfig
from trioinfer.server._poll import fingerprint, poll_repository, snapshot
from trioinfer.server._repository import ModelRepository

DIGITS = example_repository() / "digits"
POLL_S = 0.05
WAIT_S = 60.0


def test_a_fingerprint_sees_files_change_and_ignores_caches(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text("a")
    before = fingerprint(tmp_path)
    assert [path for path, *_ in before] == [os.path.join("1", "model.py")]
    # What loading a Python model may write, and hidden files, change nothing.
    (tmp_path / "1" / "__pycache__").mkdir()
    (tmp_path / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"x")
    (tmp_path / ".swp").write_text("x")
    assert fingerprint(tmp_path) == before
    (tmp_path / "1" / "model.py").write_text("ab")  # another size
    assert fingerprint(tmp_path) != before
    changed = fingerprint(tmp_path)
    os.utime(tmp_path / "1" / "model.py", ns=(1, 1))  # same size, another time
    assert fingerprint(tmp_path) != changed


async def test_the_poll_loads_what_appeared_or_changed_and_unloads_what_went(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repository = ModelRepository(tmp_path)
    (tmp_path / "kept" / "1").mkdir(parents=True)
    calls: list[tuple[str, str]] = []
    refuse = {"broken"}

    async def load(name: str) -> None:
        calls.append(("load", name))
        if name in refuse:
            raise ConfigError(f"{name} does not load")

    async def unload(name: str) -> None:
        calls.append(("unload", name))
        if name == "broken":
            raise ModelNotFound("not served")

    async def until(condition: Callable[[], bool]) -> None:
        with trio.fail_after(WAIT_S):
            while not condition():  # noqa: ASYNC110  # polls what the poll did
                await trio.sleep(POLL_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: poll_repository(repository, POLL_S, load, unload, baseline=snapshot(repository))
        )
        (tmp_path / "new" / "1").mkdir(parents=True)
        await until(lambda: ("load", "new") in calls)
        (tmp_path / "new" / "config.toml").write_text("max_queue_size = 3\n")
        await until(lambda: calls.count(("load", "new")) == 2)
        with caplog.at_level(logging.WARNING, "trioinfer.server"):
            (tmp_path / "broken" / "1").mkdir(parents=True)
            await until(lambda: ("load", "broken") in calls)
            await trio.sleep(POLL_S * 4)  # unchanged: not tried again
            assert calls.count(("load", "broken")) == 1
        assert "could not load broken: broken does not load" in caplog.text
        shutil.rmtree(tmp_path / "new")
        shutil.rmtree(tmp_path / "broken")
        await until(lambda: ("unload", "new") in calls and ("unload", "broken") in calls)
        nursery.cancel_scope.cancel()
    assert ("load", "kept") not in calls  # in the baseline, unchanged


def copy_digits(directory: Path) -> None:
    # Its version directory only: the bundled config.toml names the model "digits".
    shutil.copytree(DIGITS / "1", directory / "1")


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        time.sleep(0.1)


def ready(url: str, model: str) -> bool:
    return fresh("GET", f"{url}/v2/models/{model}/ready").status_code == 200


def max_queue_size(url: str, model: str) -> int:
    config = fresh("GET", f"{url}/v2/models/{model}/config").json()
    return int(config["parameters"]["trioinfer.max_queue_size"]["string_value"])


def follow_the_repository(url: str, repository: Path) -> None:
    """What a polled server does as its repository changes, as a client sees it."""
    assert ready(url, "digits")
    copy_digits(repository / "added")
    wait_for(lambda: ready(url, "added"), "the new model is served")
    assert max_queue_size(url, "added") == 1024
    (repository / "added" / "config.toml").write_text("max_queue_size = 7\n")
    wait_for(lambda: max_queue_size(url, "added") == 7, "the changed config is served")
    # A change that does not load leaves the model serving as it was.
    (repository / "added" / "config.toml").write_text("max_queue_size = -1\n")
    time.sleep(1.0)
    assert max_queue_size(url, "added") == 7
    shutil.rmtree(repository / "added")
    wait_for(lambda: not ready(url, "added"), "the removed model is gone")
    # The API's load and unload are refused meanwhile, with Triton's words.
    for action in ("load", "unload"):
        answer = fresh("POST", f"{url}/v2/repository/models/digits/{action}")
        assert answer.status_code == 400
        assert (
            "explicit model load / unload is not allowed if polling is enabled"
            in (answer.json()["error"])
        )
    assert ready(url, "digits")


def test_a_polled_server_follows_its_repository(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    copy_digits(repository / "digits")
    with run_server(repository, "--repository-poll-secs", "0.2", log=tmp_path / "log") as server:
        follow_the_repository(server.url, repository)
    log = (tmp_path / "log").read_text()
    assert "model repository poll: added appeared; loading it" in log
    assert "could not load added" in log


@pytest.mark.workers
def test_every_worker_follows_the_polled_repository(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    copy_digits(repository / "digits")
    with two_workers(repository, tmp_path / "log", "--repository-poll-secs", "0.2") as server:
        follow_the_repository(server.url, repository)
        copy_digits(repository / "again")
        wait_for(lambda: ready(server.url, "again"), "the new model is served")
        for _ in range(8):  # fresh connections: both workers serve it
            assert fresh("GET", f"{server.url}/v2/models/again/ready").status_code == 200
            assert infer_digit(server.url).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=WAIT_S) == 0


@pytest.mark.workers
def test_a_worker_restarted_after_a_failed_reload_serves_what_the_others_serve(
    tmp_path: Path,
) -> None:
    # A poll reload that failed leaves the workers serving the old version. A worker
    # that died then loaded the repository as it was on disk (broken), served nothing
    # of the model, and clients got 200 or 404 by the connection's worker.
    repository = tmp_path / "repository"
    copy_digits(repository / "digits")
    log = tmp_path / "log"
    with two_workers(repository, log, "--repository-poll-secs", "0.2") as server:
        url, victim = server.url, server.pids[1]
        (repository / "digits" / "config.toml").write_text("max_queue_size = -1\n")
        wait_for(lambda: "could not load digits" in log.read_text(), "the reload failed")
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: (
                worker_pids(url).get("1", victim) != victim
                or "does not serve what the others serve" in log.read_text()
            ),
            "worker 1 is back, or the supervisor says why it is not",
        )
        for _ in range(12):  # fresh connections: whichever worker listens answers alike
            assert infer_digit(url).status_code == 200
            assert max_queue_size(url, "digits") == 1024
        text = log.read_text()
        assert (
            "model 'digits' is not served by it" in text.split("does not serve what the others")[1]
        )
        # Once a reload applies on the others, the restarted worker takes it and joins.
        (repository / "digits" / "config.toml").write_text("max_queue_size = 7\n")
        wait_until(lambda: worker_pids(url).get("1", victim) != victim, "worker 1 joins")
        assert "serves what the others serve now; it joins them" in log.read_text()
        for _ in range(12):
            assert infer_digit(url).status_code == 200
            assert max_queue_size(url, "digits") == 7
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=WAIT_S) == 0, log.read_text()


@pytest.mark.workers
def test_a_worker_restarted_after_a_failed_load_is_as_ready_as_the_others(
    tmp_path: Path,
) -> None:
    # A model that appeared broken failed to load on every worker: under
    # --strict-readiness none was ready. A worker that restarted did not try it (it
    # loads what the workers loaded at start) and was ready, alone.
    repository = tmp_path / "repository"
    copy_digits(repository / "digits")
    log = tmp_path / "log"
    with two_workers(
        repository, log, "--repository-poll-secs", "0.2", "--strict-readiness"
    ) as server:
        url, victim = server.url, server.pids[1]
        (repository / "bad" / "1").mkdir(parents=True)
        (repository / "bad" / "1" / "model.onnx").write_bytes(b"not an ONNX file")
        wait_for(lambda: "could not load bad" in log.read_text(), "the load failed")
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: worker_pids(url).get("1", victim) != victim, "worker 1 is back")
        for _ in range(12):
            assert fresh("GET", f"{url}/v2/health/ready").status_code == 503
            rows = fresh("POST", f"{url}/v2/repository/index").json()
            (bad,) = [row for row in rows if row["name"] == "bad"]
            assert bad["reason"].startswith("failed to load 'bad'"), bad
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=WAIT_S) == 0, log.read_text()


def test_poll_settings_are_checked(tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)

    said = serve("--repository-poll-secs", "1", "--model", "digits")
    assert said.returncode == 2
    assert "--model and --repository-poll-secs do not go together" in said.stderr
    said = serve("--repository-poll-secs", "-1")
    assert said.returncode == 2
    assert "must be a number of seconds from 1e-06" in said.stderr
    config = tmp_path / "serve.toml"
    config.write_text('repository_poll_secs = "often"\n')
    said = serve("--config", str(config))
    assert said.returncode == 2
    assert "repository_poll_secs" in said.stderr
    with pytest.raises(ConfigError, match="repository_poll_secs must be a number of seconds"):
        ServerConfig(repository_poll_s=float("inf"))


async def test_a_pipeline_loads_after_its_steps_and_unloads_before_them(tmp_path: Path) -> None:
    # read_digit names scale_image as a step: by name it comes first, but loaded first
    # it would fail (its step not served yet), and nothing would load it again.
    for name in ("read_digit", "scale_image", "digits", "digit_names"):
        shutil.copytree(example_repository() / name, tmp_path / name)
    repository = ModelRepository(tmp_path)
    calls: list[tuple[str, str]] = []

    async def load(name: str) -> None:
        calls.append(("load", name))

    async def unload(name: str) -> None:
        calls.append(("unload", name))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: poll_repository(repository, POLL_S, load, unload, baseline={}))
        with trio.fail_after(WAIT_S):
            while len(calls) < 4:  # noqa: ASYNC110  # polls what the poll did
                await trio.sleep(POLL_S)
        loaded = [name for _, name in calls]
        assert loaded.index("read_digit") > loaded.index("scale_image")
        for name in ("read_digit", "scale_image", "digits", "digit_names"):
            (tmp_path / name).rename(tmp_path / f".{name}")  # hidden: gone at once
        with trio.fail_after(WAIT_S):
            while len(calls) < 8:  # noqa: ASYNC110  # polls what the poll did
                await trio.sleep(POLL_S)
        nursery.cancel_scope.cancel()
    unloaded = [name for _, name in calls[4:]]
    assert unloaded.index("read_digit") < unloaded.index("scale_image")
