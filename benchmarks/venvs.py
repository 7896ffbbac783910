"""Virtual environments of their own for what a benchmark runs beside trioinfer.

``compare.py``'s peers (MLServer, Triton, Ray Serve) and ``minilm.py``'s exporter
(torch, sentence-transformers) each need packages that must not enter the
project's venv: each gets a venv under ``--peers-dir``, created on first use
and reused while it imports.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def peer_venv(
    venv: Path,
    probe: str,
    fields: int,
    current: Callable[[list[str]], bool],
    package_sets: Sequence[Sequence[str]],
    what: str,
) -> tuple[list[str] | None, str]:
    """Make sure *venv* holds a peer: (what *probe* printed, split, or None; why not).

    *probe* prints *fields* words when the peer imports; *current* says whether
    they are the versions wanted. Otherwise each package set is tried in turn
    until pip installs one.
    """
    python = venv / "bin" / "python"

    def installed() -> list[str] | None:
        if not python.exists():
            return None
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        found = done.stdout.split()
        return found if done.returncode == 0 and len(found) == fields else None

    found = installed()
    if found is not None and current(found):
        return found, ""
    try:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                capture_output=True,
                text=True,
            )
        for packages in package_sets:
            print(f"installing {' '.join(packages)} into {venv} ...", flush=True)
            done = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", *packages],
                capture_output=True,
                text=True,
                timeout=1200,
            )
            if done.returncode == 0:
                break
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not create {venv}: {exc}"
    if done.returncode != 0:
        lines = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
        errors = [x for x in lines if "error" in x.lower()] or lines
        reason = " | ".join(e if len(e) < 200 else e[:200] + "..." for e in errors[-2:])
        return None, f"pip install {what} failed: {reason}"
    found = installed()
    if found is None:
        return None, f"{what} installed, but it does not import in {venv}"
    return found, ""
