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
) -> str:
    command = [sys.executable, "-X", "importtime", "-m", "trioinfer", "serve", "--port", "0"]
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


@pytest.mark.workers
def test_a_signal_during_the_imports_stops_a_supervisor_leaving_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    said = _signalled_at("trioinfer._config", signal.SIGTERM, "--workers", "2", env=env)
    assert "Traceback" not in said, said
    assert list(tmp_path.iterdir()) == []  # no control directory left in /tmp


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
