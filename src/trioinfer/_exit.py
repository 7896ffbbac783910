"""The bounded exit of a server that stops on SIGINT and SIGTERM (``serve_http``, the CLI).

Here, not in ``server``, so that the command line reads its defaults without the server's
imports.

The first signal stops serving (a drain), and the whole exit (the drain, then
cancelling what still runs and closing the engine) may take the exit timeout;
past it the process ends, naming in the log what still ran: an execution on a
thread cannot be interrupted nor abandoned, and would hold the process for
ever. A second signal cancels at once, a third ends the process at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Final, NoReturn

import anyio
import anyio.abc

from . import _start_signals

log = logging.getLogger("trioinfer.server")

#: What the log calls the exit timeout when it ends the process: ``serve_http``'s
#: parameter, which an application embedding it set; ``trioinfer serve`` (and its
#: workers) set their flag, ``--exit-timeout-secs``, before calling it.
EXIT_TIMEOUT_SAID: Final = contextvars.ContextVar("exit_timeout_said", default="exit_timeout")

#: With no --exit-timeout-secs, how long past the drain period the exit may take (cancelling
#: what still runs, closing the models) before serve ends the process anyway. The same as
#: the margin the --workers supervisor gives a worker (`_workers.STOP_MARGIN_S`).
EXIT_MARGIN_S: Final = 10.0
#: After a second SIGINT or SIGTERM, how long the exit (cancelled at once, without draining)
#: may take before serve ends the process anyway.
SECOND_SIGNAL_S: Final = 1.0
#: At the exit timeout, how long the last cancel of what serves may take to be seen (the
#: listeners closed) before the process ends.
LAST_CANCEL_S: Final = 0.5
#: The exit status of a process that serve ended because its exit was held past its bound.
EXIT_HELD_STATUS: Final = 1
#: How long past a bound the exit may be held with the event loop's thread blocked (so
#: that no task of the loop keeps the bound) before a watchdog thread ends the process.
BACKSTOP_S: Final = 1.0


@contextlib.asynccontextmanager
async def bounded_exit(
    stop: anyio.Event, started: anyio.Event, exit_timeout: float
) -> AsyncIterator[None]:
    """Run the body (a server) with its exit bounded: see `_watch_the_exit`.

    *stop* is set by the first signal once *started* is (the server drains);
    before that, the body is cancelled. The body is cancelled by a second
    signal, and when a bound passes; the process ends if the body still has
    not returned.
    """
    serving = anyio.CancelScope()
    # Read here, in the caller's task: the backstop's signal handler runs in no task's.
    said = EXIT_TIMEOUT_SAID.get()
    async with anyio.create_task_group() as watch:
        await watch.start(_watch_the_exit, stop, serving, started, exit_timeout, said)
        with serving:
            yield
        watch.cancel_scope.cancel()  # the exit ended in its bound: nothing more to watch


async def _watch_the_exit(
    stop: anyio.Event,
    serving: anyio.CancelScope,
    started: anyio.Event,
    exit_timeout: float,
    said: str,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Stop on SIGINT or SIGTERM, and end the process if its exit is held past its bound.

    The first signal starts the drain (*stop*; before the server serves, there is
    nothing to drain: *serving* is cancelled at once) and allows the exit
    *exit_timeout* seconds from then; a second cancels *serving* and allows it
    `SECOND_SIGNAL_S`; a third ends the process at once. *said* names the exit
    timeout in the log (`EXIT_TIMEOUT_SAID`).
    """
    with (
        anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        _backstop(exit_timeout, said),
    ):
        _start_signals.replay()  # a signal during the imports: as if it came now
        task_status.started()
        async with anyio.create_task_group() as bounds:
            count = 0
            async for signum in signals:
                count += 1
                name = signal.Signals(signum).name
                if count == 1:
                    if started.is_set():
                        log.info("%s: stopping", name)
                        stop.set()
                    else:
                        log.info("%s before serving started: stopping now", name)
                        serving.cancel()
                    bounds.start_soon(
                        _end_after,
                        exit_timeout,
                        serving,
                        _timed_out(exit_timeout, name, said),
                    )
                elif count == 2:
                    log.info("second signal (%s): stopping now", name)
                    serving.cancel()
                    bounds.start_soon(
                        _end_after,
                        SECOND_SIGNAL_S,
                        serving,
                        f"the exit, cancelled by a second signal ({name}), has not ended "
                        f"{SECOND_SIGNAL_S:.1f}s after it",
                    )
                else:
                    end_the_process(f"a third signal ({name}) during the exit")


@contextlib.contextmanager
def _backstop(exit_timeout: float, said: str) -> Iterator[None]:
    """Keep the exit's bounds from a thread too, for while the event loop's thread is blocked.

    `_watch_the_exit` keeps them with tasks of the event loop, which cannot run
    while code blocks the loop's thread (a Python model's ``async def load`` or
    inline ``infer`` that sleeps or loads for minutes without yielding): the process outlived
    the bound, and every later signal. Python runs signal handlers on the main
    thread between bytecodes, in such code too, so the handlers the loop
    installed (trio's, asyncio's) are wrapped: each signal also arms a watchdog
    thread that ends the process `BACKSTOP_S` after the bound the loop keeps
    (the exit timeout after the first, `SECOND_SIGNAL_S` after the second, at
    once after the third), unless the exit has ended by then. The loop, blocked,
    may not have closed the listeners: connections the kernel queued are reset,
    which is still better than a process that no signal ends.
    """
    signums = (signal.SIGINT, signal.SIGTERM)
    inner = {signum: signal.getsignal(signum) for signum in signums}
    done = threading.Event()
    arm = threading.Condition()
    held: list[tuple[float, str]] = []  # the earliest (deadline, why) armed so far

    def watch() -> None:
        with arm:
            while not done.is_set():
                left = held[0][0] - time.monotonic()
                if left <= 0:
                    break
                # An infinite bound (math.inf: none) waits for the next signal's.
                arm.wait(min(left, threading.TIMEOUT_MAX))
        if not done.is_set():
            end_the_process(
                f"{held[0][1]}; the event loop's thread was blocked (by code running on it, "
                "a model's code that never yields, say), so a watchdog thread ends it"
            )

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        signals.append(signum)
        if len(signals) == 1:
            bound, why = exit_timeout, _timed_out(exit_timeout, name, said)
        elif len(signals) == 2:
            bound, why = (
                SECOND_SIGNAL_S,
                f"the exit, cancelled by a second signal ({name}), has not ended "
                f"{SECOND_SIGNAL_S:.1f}s after it",
            )
        else:
            bound, why = 0.0, f"a third signal ({name}) during the exit"
        deadline = time.monotonic() + bound + BACKSTOP_S
        with arm:
            first = not held
            if first or deadline < held[0][0]:
                held[:] = [(deadline, why)]
            arm.notify()
        if first:
            threading.Thread(target=watch, name="trioinfer-exit-backstop", daemon=True).start()
        chained = inner[signal.Signals(signum)]
        if callable(chained):  # the loop's own handler: it sees the signal as before
            chained(signum, frame)

    signals: list[int] = []  # those received, in order
    for signum in signums:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        done.set()
        with arm:
            arm.notify()
        for signum in signums:
            if signal.getsignal(signum) is handler:
                signal.signal(signum, inner[signum])


def _timed_out(exit_timeout: float, signame: str, said: str) -> str:
    return f"the exit timeout ({exit_timeout:.1f}s after {signame}, {said}) has passed"


async def _end_after(delay: float, serving: anyio.CancelScope, why: str) -> None:
    # Cancelled (with the whole watch) as soon as serving returns: the exit ended in time.
    await anyio.sleep(delay)
    if not serving.cancel_called:
        # Whatever can still be cancelled is: a listener not closed yet closes, the
        # engine's waits end. If that ends the exit, this task is cancelled meanwhile.
        serving.cancel()
        await anyio.sleep(LAST_CANCEL_S)
    end_the_process(why)


def end_the_process(why: str) -> NoReturn:
    """Log why and what still runs, flush the logs, and end the process with `EXIT_HELD_STATUS`.

    An execution on a thread (a Python model's plain ``def infer``, a hung native
    call) cannot be interrupted nor abandoned: the engine's close waits for it,
    and so would the interpreter's own exit. ``sys.exit`` would raise into the
    event loop and unwind through that same wait. ``os._exit`` ends the process
    without running ``finally`` blocks or ``atexit`` handlers: acceptable here only
    because the listeners closed already (the first signal closed them, and the
    last cancel ran before this: no connection is accepted into a dying process)
    and the logs are flushed just before, so that the reason is on record. The
    kernel closes what is left (sockets, shared memory mappings); spans still
    buffered by a tracer are lost. The processes it started, which the kernel
    would leave running, are killed first (`end_descendants`).
    """
    from .server._serve import still_executing

    try:
        running = still_executing()
    except Exception:  # read from the watchdog thread while the loop changes it: say nothing
        running = []
    log.error(
        "%s: ending the process now (exit status %d) without waiting for what still runs: "
        "%s. An execution on a thread cannot be interrupted; a backend must let "
        "cancellation end its work",
        why,
        EXIT_HELD_STATUS,
        "; ".join(running)
        or "no execution or load the engine knows of (an instance's close, say, or a "
        "plugin's own thread)",
    )
    ended = end_descendants()
    if ended:
        log.error(
            "ended the %d processes this one started (and theirs), which would outlive it: %s",
            len(ended),
            ", ".join(f"{pid} ({name})" for pid, name in ended),
        )
    logging.shutdown()  # flushes and closes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to flush to
            stream.flush()
    os._exit(EXIT_HELD_STATUS)


def end_descendants() -> list[tuple[int, str]]:
    """Kill (SIGKILL) every process this one started, and theirs; return their pids and names.

    For a process about to end with ``os._exit``, which runs no ``atexit``
    handler: a local Ray started by a load that the exit cut short (``ray.init``
    on a thread; Ray stops what it started in an ``atexit`` handler) left its
    two agents behind, reparented to init, for ever, where its head processes
    died with their parent. Each found process is
    stopped (SIGSTOP) before the tree is read again, so that none forks a
    child that escapes, then all are killed. Read from ``/proc`` (Linux);
    elsewhere nothing is done.
    """
    me = os.getpid()
    found: dict[int, str] = {}
    for _ in range(3):  # until a reading finds no new process
        new = [p for p in _descendants(me) if p[0] not in found]
        if not new:
            break
        for pid, name in new:
            found[pid] = name
            with contextlib.suppress(OSError):  # gone already, or not ours to signal
                os.kill(pid, signal.SIGSTOP)
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return list(found.items())


def _descendants(root: int) -> list[tuple[int, str]]:
    # The processes under *root* (children first, then theirs), with their names.
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:  # no /proc here
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # "pid (name) state ppid ...": the name may hold spaces and parentheses.
        name = stat[stat.find(b"(") + 1 : stat.rfind(b")")].decode(errors="replace")
        fields = stat[stat.rfind(b")") + 2 :].split()
        with contextlib.suppress(IndexError, ValueError):
            children.setdefault(int(fields[1]), []).append((int(entry), name))
    found: list[tuple[int, str]] = []
    parents = [root]
    while parents:
        for child in children.get(parents.pop(), ()):
            found.append(child)
            parents.append(child[0])
    return found
