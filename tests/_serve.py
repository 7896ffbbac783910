"""Running trioinfer's server for the tests that talk to a real one.

In this process, ``start_serving`` starts ``serve_http`` in the caller's nursery, on
127.0.0.1 and a free port; cancelling the nursery stops it.

As a child process, test_server (HTTP) and test_grpc (HTTP and gRPC) start
``trioinfer serve`` the same way: a free port, stdout read on a thread until it says where
it listens, SIGTERM and exit code 0 at the end, and a kill if anything goes wrong, so that
no process is ever left behind.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.abc
import attrs
import pytest
import trio

if TYPE_CHECKING:
    from trioinfer.server import Listening

#: Bounds against hangs only; nothing asserts how long anything took.
START_S = 120.0
STOP_S = 120.0
WAIT_S = 60.0
POLL_S = 0.01


async def start_serving(
    nursery: trio.Nursery | anyio.abc.TaskGroup, repository: Path, **options: Any
) -> Listening:
    """Start ``serve_http(repository, **options)`` in *nursery* (a trio nursery or an anyio
    task group) on 127.0.0.1 and a free port, without signal handlers; once it listens,
    return where."""
    # Imported here: test files that serve only in some tests import no server otherwise.
    from trioinfer.server import serve_http

    listening: Listening = await nursery.start(
        partial(serve_http, repository, host="127.0.0.1", port=0, handle_signals=False, **options)
    )
    return listening


@attrs.frozen
class Started:
    """A server process that said where it listens, and what it printed until then."""

    url: str
    process: subprocess.Popen[str]
    #: Its stdout lines up to and including the 'listening on' one.
    lines: list[str]


def log_tail(log: Path, chars: int = 4000) -> str:
    """The end of the server's log, for a failure message."""
    return log.read_text(encoding="utf-8", errors="replace")[-chars:]


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    # Drains the server's stdout for its whole life, so that it never blocks on a full pipe.
    for line in stream:
        lines.put(line)
    lines.put(None)


@contextlib.contextmanager
def running_server(
    command: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None
) -> Iterator[Started]:
    """Run *command* (a ``trioinfer serve --port 0``) until it listens, and yield it; kill it
    by its pid if it is still running at the end (a failed test leaves nothing behind).

    Its stderr goes to *log*; its environment is this one without TRIOINFER_ADMIN_TOKEN,
    updated with *env*. How it ends is the caller's to check.
    """
    environment = {k: v for k, v in os.environ.items() if k != "TRIOINFER_ADMIN_TOKEN"}
    environment.update(env or {})
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            env=environment,
            text=True,
        )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True)
    reader.start()
    try:
        yield _wait_listening(process, lines, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=STOP_S)
        assert process.stdout is not None
        process.stdout.close()


@contextlib.contextmanager
def serve_process(
    command: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None
) -> Iterator[Started]:
    """`running_server`, and on exit SIGTERM it unless it has exited already, and require
    exit code 0."""
    with running_server(command, log=log, env=env) as started:
        yield started
        process = started.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit after SIGTERM; log:\n{log_tail(log)}")
        assert code == 0, f"the server exited with {code}; log:\n{log_tail(log)}"


def _wait_listening(
    process: subprocess.Popen[str], lines: queue.Queue[str | None], log: Path
) -> Started:
    seen: list[str] = []
    deadline = time.monotonic() + START_S
    while True:
        left = deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(left, 0.0))
        except queue.Empty:
            line = None
            process.kill()
        if line is None:
            process.wait()
            pytest.fail(
                f"the server did not say 'listening on' (exit code {process.returncode}); "
                f"log:\n{log_tail(log)}"
            )
        seen.append(line)
        match = re.search(r"listening on (https?://\S+)", line)
        if match:
            return Started(match.group(1), process, seen)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll *predicate* until it holds; fail, saying *what* was awaited, after *timeout*."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(POLL_S)
