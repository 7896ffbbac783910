"""Polling the model repository for changes (Triton's ``--model-control-mode=poll``).

``trioinfer serve --repository-poll-secs N`` reads the repository every N
seconds: a model directory that appeared is loaded, one whose files changed
(its config, a version directory, a model file, labels, warm-up data) is
loaded again, and one that went away is unloaded, as the repository API's
load and unload would (so a reload that fails leaves the served model
serving, and says why in the log). A directory is compared by what it holds:
each file's path, size and modification time; ``__pycache__`` and hidden
entries are left out, since loading a Python model may write them. While the
server polls, the repository API's load and unload are refused, as Triton
refuses them in poll mode: two writers of what is served would undo each
other.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import anyio

from .._exceptions import ModelNotFound, TrioInferError
from ._models import in_dependency_order, steps_named
from ._repository import ModelRepository

log = logging.getLogger("trioinfer.server")

#: What a model directory holds: (path within it, size, mtime in ns) of each file, sorted.
Fingerprint = tuple[tuple[str, int, int], ...]

#: How deep a model directory is read (<model>/<version>/<file> is 2): deeper files,
#: a symlink loop's included, are not looked at.
_DEPTH: Final = 4
#: The most files of one model directory looked at (a stray dataset is not walked whole).
_FILES: Final = 10_000

#: Triton's word for it, which its clients may look for.
REFUSED: Final = "explicit model load / unload is not allowed if polling is enabled"


def fingerprint(directory: Path) -> Fingerprint:
    """What *directory* holds now, for telling whether it changed (blocking I/O)."""
    found: list[tuple[str, int, int]] = []
    for top, dirs, files in os.walk(directory, followlinks=True):
        relative = os.path.relpath(top, directory)
        depth = 0 if relative == "." else relative.count(os.sep) + 1
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        if depth >= _DEPTH:
            dirs.clear()
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(top, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue  # removed while we looked: the next poll sees the rest
            found.append((os.path.relpath(path, directory), stat.st_size, stat.st_mtime_ns))
            if len(found) >= _FILES:
                return tuple(found)
    return tuple(found)


def snapshot(repository: ModelRepository) -> dict[str, Fingerprint]:
    """Every model directory's fingerprint, by model name (blocking I/O).

    Raises:
        ConfigError: The repository cannot be listed.
    """
    return {name: fingerprint(repository.root / name) for name in repository.names()}


async def poll_repository(
    repository: ModelRepository,
    interval: float,
    load: Callable[[str], Awaitable[None]],
    unload: Callable[[str], Awaitable[None]],
    *,
    baseline: dict[str, Fingerprint] | None,
) -> None:
    """Every *interval* seconds, *load* the models that appeared or changed, *unload* the gone.

    *baseline* is the `snapshot` taken before the server loaded its models
    (what changed while they loaded is loaded again at the first poll).
    Runs until cancelled. A load or unload that fails is logged and not
    retried until the directory changes again.
    """
    previous = baseline
    steps: dict[str, list[str]] = {}  # each model's pipeline steps as last read

    def known(name: str) -> list[str]:
        return steps.get(name, [])

    while True:
        await anyio.sleep(interval)
        read = await anyio.to_thread.run_sync(
            _snapshot_or_none, repository, previous or {}, set(steps)
        )
        if read is None:
            continue
        current, now_steps = read
        # A model gone from disk keeps the steps it had: its unload is ordered by them.
        steps.update(now_steps)
        if previous is None:
            previous = current
            continue
        changed = [name for name in current if previous.get(name) != current[name]]
        # A pipeline loads after its steps (loaded first, it would fail for want of
        # them, and nothing would load it again), and unloads before them.
        for name in in_dependency_order(sorted(changed), known):
            what = "appeared" if name not in previous else "changed"
            log.info("model repository poll: %s %s; loading it", name, what)
            try:
                await load(name)
            except TrioInferError as exc:
                log.warning("model repository poll: could not load %s: %s", name, exc)
        gone = sorted(previous.keys() - current.keys())
        for name in reversed(in_dependency_order(gone, known)):
            log.info("model repository poll: %s is gone; unloading it", name)
            try:
                await unload(name)
            except ModelNotFound:
                pass  # it was not served (its load had failed)
            except TrioInferError as exc:
                log.warning("model repository poll: could not unload %s: %s", name, exc)
            steps.pop(name, None)
        previous = current


def _snapshot_or_none(
    repository: ModelRepository, previous: dict[str, Fingerprint], read: set[str]
) -> tuple[dict[str, Fingerprint], dict[str, list[str]]] | None:
    # Every model's fingerprint, and the steps each pipeline names, read again only
    # where its directory changed since *previous* or they were never *read* (blocking
    # I/O: a config is parsed, and a repository may hold many).
    try:
        current = snapshot(repository)
    except TrioInferError as exc:  # the repository directory itself went away
        log.warning("model repository poll: %s", exc)
        return None
    return current, {
        name: _steps(repository, name)
        for name, found in current.items()
        if name not in read or previous.get(name) != found
    }


def _steps(repository: ModelRepository, name: str) -> list[str]:
    try:
        return steps_named(repository.entry(name).settings)
    except TrioInferError:
        return []  # its load says what is wrong with it
