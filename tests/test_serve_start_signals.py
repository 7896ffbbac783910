"""A signal at any moment of `trioinfer serve`'s start stops it: status 0, nothing left behind.

Before the server's signal receiver was open (the first second or two: trioinfer's
imports, the server's), Python's own handling applied: SIGTERM killed the process
with status -15, SIGINT printed a KeyboardInterrupt traceback. The moments are
found without timing: ``-X importtime`` writes a line as each module finishes
importing, and the signal goes right after the line of the module named.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _serve import WAIT_S

#: Modules whose import marks a moment of the start, earliest first: trioinfer's first
#: own module (which holds the signals), the core, the command line, the server.
MOMENTS = ["trioinfer._start_signals", "trioinfer._config", "trioinfer.cli", "trioinfer.server"]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _signalled_at(
    moment: str,
    signum: int,
    *args: str,
    env: dict[str, str] | None = None,
    ignore_sigint: bool = False,
    run: tuple[str, ...] = ("-m", "trioinfer"),
) -> str:
    command = [sys.executable, "-X", "importtime", *run, "serve", "--port", "0"]
    process = subprocess.Popen(
        [*command, "--no-grpc", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # As a shell script's `trioinfer serve &` starts it: SIGINT ignored (inherited).
        preexec_fn=_ignore_sigint if ignore_sigint else None,
    )
    assert process.stderr is not None
    seen: list[str] = []
    for line in process.stderr:
        seen.append(line)
        if line.startswith("import time:") and line.split("|")[-1].strip() == moment:
            process.send_signal(signum)
            break
    else:  # pragma: no cover  # the module was never imported: say what ran
        process.wait(WAIT_S)
        pytest.fail(f"{moment} was never imported:\n{''.join(seen[-20:])}")
    _, rest = process.communicate(timeout=WAIT_S)
    said = "".join(line for line in rest.splitlines(keepends=True) if "import time:" not in line)
    assert process.returncode == 0, (process.returncode, said)
    return said


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_signal_during_the_imports_stops_the_start_with_status_0(
    moment: str, signum: int
) -> None:
    said = _signalled_at(moment, signum)
    name = signal.Signals(signum).name
    assert f"{name} before serving started: stopping now" in said, said
    assert "Traceback" not in said, said
    assert "Aborted!" not in said, said


def test_a_sigterm_during_the_imports_is_held_where_sigint_is_ignored() -> None:
    # A non-interactive shell starts `trioinfer serve &` with SIGINT ignored; SIGTERM,
    # the signal a script then sends (`kill $pid`), was not held, and killed it (-15).
    said = _signalled_at("trioinfer._config", signal.SIGTERM, ignore_sigint=True)
    assert "SIGTERM before serving started: stopping now" in said, said


def test_a_signal_during_the_imports_of_python_mtrioinfer_serve_is_held() -> None:
    # `-mtrioinfer` (no space) was not taken for `-m trioinfer`: nothing was held.
    said = _signalled_at("trioinfer._config", signal.SIGTERM, run=("-mtrioinfer",))
    assert "SIGTERM before serving started: stopping now" in said, said


@pytest.mark.parametrize(
    ("argv", "orig_argv", "serve"),
    [
        (
            ["/venv/bin/trioinfer", "serve"],
            ["/venv/bin/python", "/venv/bin/trioinfer", "serve"],
            True,
        ),
        (
            ["-m", "serve", "-p", "0"],
            ["python", "-X", "dev", "-m", "trioinfer", "serve", "-p", "0"],
            True,
        ),
        (["-m", "serve"], ["python", "-mtrioinfer", "serve"], True),
        (["-m", "serve"], ["python", "-Imtrioinfer", "serve"], True),
        # An application's package that imports trioinfer while Python finds its module.
        (["-m", "serve"], ["python", "-m", "app", "serve"], False),
        (["-m", "serve"], ["python", "-mapp", "serve"], False),
        (["-m", "serve"], ["python", "-m", "trioinfer.server._workers", "serve"], False),
        (["-m", "demo"], ["python", "-m", "trioinfer", "demo"], False),
        (["-c", "serve"], ["python", "-c", "import trioinfer", "serve"], False),
        (["app.py", "serve"], ["python", "app.py", "serve"], False),
    ],
)
def test_what_is_taken_for_trioinfer_serve(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], orig_argv: list[str], serve: bool
) -> None:
    from trioinfer import _start_signals

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert _start_signals._launched_as_serve() is serve


def test_the_hold_starts_before_any_import_that_takes_time() -> None:
    # Held by trioinfer's first module, whose own imports are what the interpreter's start
    # imported already: importlib.metadata (a tenth of a second) came first, and `signal`,
    # `typing` and `threading` took tens of milliseconds more with no signal held yet.
    def imported(code: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=True,
        )
        return [
            line.split("|")[-1].strip()
            for line in done.stderr.splitlines()
            if line.startswith("import time:")
        ]

    at_start = set(imported("pass"))
    names = imported("import sys; sys.argv = ['trioinfer', 'serve']; import trioinfer")
    before = names[: names.index("trioinfer._start_signals")]
    assert set(before) - at_start <= {"__future__"}, before


@pytest.mark.workers
def test_a_signal_during_the_imports_stops_a_supervisor_leaving_nothing(
    short_tmp_path: Path,
) -> None:
    # (A TMPDIR short enough for the control sockets: a longer one puts them in /tmp.)
    env = {**os.environ, "TMPDIR": str(short_tmp_path)}
    said = _signalled_at("trioinfer._config", signal.SIGTERM, "--workers", "2", env=env)
    assert "Traceback" not in said, said
    assert list(short_tmp_path.iterdir()) == []  # no control directory left in /tmp


def test_a_signal_after_the_server_stopped_watching_is_handled_as_python_would() -> None:
    # The early handler stays installed under the server's receiver, which gives it
    # back when it closes: past the start, a signal must do what it did before.
    code = (
        "import sys; sys.argv = ['trioinfer', 'serve']\n"
        "import trioinfer._start_signals as s, signal, os\n"
        "s.replay()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "import time; time.sleep(60)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=WAIT_S, check=False)
    assert done.returncode == -signal.SIGTERM


#: ``trioinfer serve`` that gets a SIGINT as its event loop starts, before any of its tasks runs.
AS_THE_LOOP_STARTS = """\
import os
import signal
import sys

sys.argv = ["trioinfer", "serve", "--port", "0", "--no-grpc", "--loop", sys.argv[1]]
import anyio

starting = anyio.run


def run(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return starting(*args, **kwargs)


anyio.run = run
from trioinfer.cli import main

main()
"""


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_a_sigint_as_the_event_loop_starts_is_held_too(loop: str) -> None:
    # The loop starts over Python's default SIGINT handler (which it replaces with its own
    # only then): the SIGINT waits, blocked, for the hold, not a KeyboardInterrupt.
    done = subprocess.run(
        [sys.executable, "-c", AS_THE_LOOP_STARTS, loop],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "SIGINT before serving started: stopping now" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


#: ``trioinfer serve`` whose exit, once the server's signal receiver closed, waits for a
#: second signal. The moment is told on stdout, not guessed with a sleep: once the event
#: loop's thread waits for events (in the loop's own code), as it does for most of an exit.
AFTER_THE_RECEIVER = """\
import contextlib
import sys
import threading
import time

sys.argv = ["trioinfer", "serve", "--port", "0", "--no-grpc", "--loop", sys.argv[1]]
import anyio
from trioinfer import _exit

watching = _exit.bounded_exit


def tell_once_the_loop_waits():
    main = threading.main_thread().ident
    # Trio's epoll wait, asyncio's selector.
    while sys._current_frames()[main].f_code.co_name not in ("get_events", "select"):
        time.sleep(0.001)
    print("receiver closed", flush=True)


@contextlib.asynccontextmanager
async def bounded_exit(*args):
    async with watching(*args):
        yield
    threading.Thread(target=tell_once_the_loop_waits, daemon=True).start()
    try:
        await anyio.sleep(60)  # the rest of the exit, long enough for a second Ctrl+C
    except BaseException as exc:
        print(f"the exit got {type(exc).__name__}", flush=True)
        raise


_exit.bounded_exit = bounded_exit
from trioinfer.cli import main

main()
"""


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_a_second_ctrl_c_after_the_server_stopped_watching_is_the_loops_own(loop: str) -> None:
    # The early handler stood where the loop installs its own (only over Python's default),
    # so the loop left SIGINT to it: past the server's receiver, a Ctrl+C was a
    # KeyboardInterrupt raised wherever the loop's own code ran (Trio's internals: a
    # TrioInternalError traceback, or a run abandoned without unwinding its tasks).
    process = subprocess.Popen(
        [sys.executable, "-c", AFTER_THE_RECEIVER, loop],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "listening on" in line:
                process.send_signal(signal.SIGINT)
            elif line.startswith("receiver closed"):
                process.send_signal(signal.SIGINT)
                break
        out, said = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "SIGINT: stopping" in said, said
    assert "Traceback" not in said, said
    # The loop's own Ctrl+C: click's "Aborted!" (exit 1), as before the server watched.
    assert process.returncode == 1, (process.returncode, said)
    assert "Aborted!" in said, said
    if loop == "trio":
        # Trio's handler raises it in the waiting task (at its checkpoint), not in Trio's code.
        assert "the exit got KeyboardInterrupt" in out, (out, said)
