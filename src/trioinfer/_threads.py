"""Leaving the event loop for blocking compute, and coming back, on Trio or asyncio.

Backends use these so that the event loop never waits on compute, and so that
a cancelled caller aborts the computation (where the runtime can) instead of
leaving it running with nobody waiting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import math
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar, TypeVarTuple, final

import anyio
import anyio.lowlevel
import outcome
import sniffio
import trio.lowlevel as _trio  # a core dependency; used only when Trio runs

_trio_run: Any
try:  # for _trio_effective_deadline, checked at use; a Trio that moved it gets Trio's own
    from trio._core import _run as _trio_run
except ImportError:  # pragma: no cover - depends on the installed Trio
    _trio_run = None

T = TypeVar("T")
Args = TypeVarTuple("Args")


@final
class BatchDeadlines:
    """A batch's latest deadline, and its callers' own when some came from ``queue_timeouts``.

    Held by ``_batch_deadline`` only for such a batch (rare): any other holds
    the one float, which is both.
    """

    __slots__ = ("callers", "latest")

    def __init__(self, latest: float, callers: float) -> None:
        self.latest = latest
        self.callers = callers


# The latest deadline among the rows of the batch a backend instance is executing (a
# BatchDeadlines when the callers' own latest is not that: see current_callers_deadline).
_batch_deadline: contextvars.ContextVar[float | BatchDeadlines] = contextvars.ContextVar(
    "trioinfer_batch_deadline", default=math.inf
)

#: Runs a callable on the event loop's thread, soon; callable from any thread.
Waker = Callable[[Callable[[], object]], None]


class EventLike(Protocol):
    """What trio.Event, asyncio.Event and anyio.Event have in common."""

    def set(self) -> None:
        """Wake every waiter."""

    async def wait(self) -> Any:
        """Wait until set."""


def native_event_factory() -> Callable[[], EventLike]:
    """Return the running event loop's own Event class.

    anyio's portable Event wraps it at several times the cost; hot paths that
    need only ``set`` and ``wait`` use the native one.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.Event
    return asyncio.Event


def native_waiter_factory() -> Callable[[], EventLike]:
    """Return an event class for exactly one waiter at a time, the cheapest the loop allows.

    On Trio, `set()` reschedules the one waiting task directly, without the
    parking lot behind ``trio.Event``: one wake-up per request is the request
    path's biggest fixed cost. Elsewhere, the loop's own Event.
    """
    if sniffio.current_async_library() == "trio":
        return _TrioWaiter
    return asyncio.Event


@final
class _TrioWaiter:
    # trio.Event for one waiter: the same semantics (wait() on a set event is a
    # checkpoint; a cancelled wait leaves the event as it was), less machinery.
    __slots__ = ("_flag", "_task")

    def __init__(self) -> None:
        self._flag = False
        self._task: Any = None

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        task = self._task
        if task is not None:
            self._task = None
            _trio.reschedule(task, WOKEN)

    def wait(self) -> Coroutine[Any, Any, Any]:
        # Not a coroutine itself: it hands back Trio's, so that a caller's await
        # runs one frame fewer each time its task is suspended and resumed.
        if self._flag:
            return _trio.checkpoint()  # noqa: ASYNC105  # the caller awaits it
        assert self._task is None, "a waiter event has one waiter at a time"
        self._task = _trio.current_task()
        return _trio.wait_task_rescheduled(self._abort)  # noqa: ASYNC105  # the caller awaits it

    def _abort(self, _raise_cancel: object) -> _trio.Abort:
        self._task = None
        return _trio.Abort.SUCCEEDED


@final
class LoopClock:
    """The running event loop's clock and cancellation checks, looked up once.

    anyio's portable functions find the backend on every call; the request
    path calls these several times per request, so it binds the backend's own.
    """

    __slots__ = (
        "checkpoint",
        "checkpoint_if_cancelled",
        "current_effective_deadline",
        "current_time",
    )

    def __init__(self) -> None:
        self.current_time: Callable[[], float]
        self.current_effective_deadline: Callable[[], float]
        self.checkpoint_if_cancelled: Callable[[], Awaitable[None]]
        # A yield to the loop (anyio's finds the backend first: 1-2 us a call more).
        self.checkpoint: Callable[[], Awaitable[None]]
        if sniffio.current_async_library() == "trio":
            import trio

            # The running clock's own method: trio.current_time() reaches it
            # through two more calls (0.18 against 0.07 us), and a run keeps
            # its clock (SystemClock, or a test's MockClock) from start to end.
            self.current_time = trio.lowlevel.current_clock().current_time
            self.current_effective_deadline = _trio_deadline_reader()
            self.checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
            self.checkpoint = trio.lowlevel.checkpoint
        else:
            self.current_time = anyio.current_time
            self.current_effective_deadline = anyio.current_effective_deadline
            self.checkpoint_if_cancelled = anyio.lowlevel.checkpoint_if_cancelled
            self.checkpoint = anyio.lowlevel.checkpoint


def _trio_effective_deadline() -> float:
    # trio.current_effective_deadline() without its cost: Trio recurses through
    # every enclosing cancel status, reading each scope's deadline through a
    # property and taking a min() per level (1.9 us two levels deep, and a
    # server nests about ten); this is one loop over the same private fields.
    # Its result is Trio's exactly: -inf when a cancellation is in effect (an
    # effectively cancelled status has only effectively cancelled statuses
    # above it up to the nearest shield), else the least deadline up to and
    # including the nearest shielded scope. An entered scope's relative
    # deadline is already absolute in ``_deadline``.
    status: Any = _trio_run.GLOBAL_RUN_CONTEXT.task._cancel_status
    if status.effectively_cancelled:
        return -math.inf
    deadline = math.inf
    while status is not None:
        scope = status._scope
        if scope._deadline < deadline:
            deadline = scope._deadline
        if scope._shield:
            break
        status = status._parent
    return deadline


def _trio_deadline_reader() -> Callable[[], float]:
    # The fast reader if this Trio has the fields it reads and it agrees with
    # Trio's own function in scopes built here for the purpose (deadlines,
    # relative and absolute, a shield, a cancellation not yet delivered);
    # Trio's own function otherwise (a Trio that changed them).
    import trio

    def agrees() -> bool:
        now = trio.current_time()
        cancelled = trio.CancelScope()
        scopes = [
            trio.CancelScope(deadline=now + 30.0),
            trio.CancelScope(relative_deadline=20.0),
            trio.CancelScope(shield=True, deadline=now + 40.0),
            cancelled,  # cancelled, never delivered: nothing checkpoints in here
        ]
        with contextlib.ExitStack() as stack:
            for scope in scopes:
                stack.enter_context(scope)
                if scope is cancelled:
                    scope.cancel()
                if _trio_effective_deadline() != trio.current_effective_deadline():
                    return False
        return _trio_effective_deadline() == trio.current_effective_deadline()

    if _trio_run is not None:
        try:
            if agrees():
                return _trio_effective_deadline
        except AttributeError:
            pass
    return trio.current_effective_deadline


@final
class _Woken(outcome.Outcome[None]):
    # What a parked task is woken with: a value of None, like the outcome.Value(None)
    # that Trio's reschedule makes when given nothing, but one object for every
    # wake-up: a Value is single-use (unwrap() marks it), and making one costs
    # more than the rest of a reschedule (0.4-0.9 us with its unwrap, against
    # 0.05). Trio hands it to the parked task, whose wait_task_rescheduled (or
    # the engine's own park, which does the same) calls unwrap().
    __slots__ = ()

    def unwrap(self) -> None:
        return None

    def send(self, gen: Any) -> Any:
        return gen.send(None)

    async def asend(self, agen: Any) -> Any:
        return await agen.asend(None)


#: Wakes a task parked in Trio's ``wait_task_rescheduled`` with ``None``:
#: ``reschedule(task, WOKEN)``, any number of times (see `_Woken`).
WOKEN: outcome.Outcome[None] = _Woken()


def trio_rescheduler() -> Callable[[Any, outcome.Outcome[Any]], object]:
    """Trio's ``reschedule`` for the running Trio loop, the cheapest way this Trio allows.

    The running runner's own method: the public function reaches it through
    a frame of its own and a run-context lookup on every call (0.75 against
    0.9 us), and the engine reschedules one parked caller per request. Call
    it from a frame marked with ``trio.lowlevel.enable_ki_protection`` (the
    public function is; the method is not), and fetch it per batch, on the
    loop's thread, inside ``trio.run``. A Trio without that method gets its
    public function.
    """
    if _trio_run is not None:
        try:
            method: Callable[[Any, outcome.Outcome[Any]], object] = (
                _trio_run.GLOBAL_RUN_CONTEXT.runner.reschedule
            )
        except AttributeError:
            pass
        else:
            return method
    return _trio.reschedule


def current_waker() -> Waker:
    """Return a function that schedules a callable on the running event loop from any thread.

    It never blocks the calling thread: Trio's ``TrioToken.run_sync_soon`` or
    asyncio's ``loop.call_soon_threadsafe``.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    loop = asyncio.get_running_loop()

    def wake(fn: Callable[[], object]) -> None:
        loop.call_soon_threadsafe(fn)

    return wake


@final
class _Resolver(Generic[T]):
    # Carries one result from a foreign thread back to the waiting task.
    __slots__ = ("_event", "_waker", "error", "ready", "value")

    def __init__(self, waker: Waker, event: EventLike) -> None:
        self._event = event
        self._waker = waker
        self.value: T | None = None
        self.error: BaseException | None = None
        self.ready = False

    def __call__(self, value: T | None, error: BaseException | None = None) -> None:
        self.value, self.error, self.ready = value, error, True
        # RuntimeError: the event loop has finished, so nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            self._waker(self._event.set)

    async def wait(self, abort: Callable[[], object] | None) -> T:
        try:
            await self._event.wait()
        except anyio.get_cancelled_exc_class():
            if abort is not None and not self.ready:
                abort()
            # The operation still holds our buffers (and the instance): wait it out.
            with anyio.CancelScope(shield=True):
                await self._event.wait()
            raise
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def current_batch_deadline() -> float:
    """The latest deadline among the rows a backend instance's ``execute`` is computing.

    On the engine's clock (``math.inf`` when a row has none, or outside an
    execution). Past it nobody waits for the batch, so a backend that sends
    work elsewhere (another process, another machine) can send the time left
    with it and refuse the work there once it has passed, before it starts.
    The engine does not cancel the execution at this deadline itself: it
    cancels it when the last caller leaves. A row whose caller set no deadline
    but whose model has ``queue_timeouts`` counts with that timeout, which
    bounds only its wait to start: its caller still waits for a run begun
    before it, so do not cut a running execution short at this deadline.
    """
    deadline = _batch_deadline.get()
    return deadline.latest if isinstance(deadline, BatchDeadlines) else deadline


def current_callers_deadline() -> float:
    """The latest deadline the callers of the rows being executed set themselves.

    As `current_batch_deadline`, but a row whose deadline came from its
    model's ``queue_timeouts`` (its caller set none) counts as having none
    (``math.inf``): such a timeout bounds only the wait to start, and its
    caller waits for the run. Past this time nobody waits for the execution,
    so work done for it elsewhere may end then: a request to another model
    of the engine (`infer_follow_up` gives it this deadline), a call that
    carries a timeout.
    """
    deadline = _batch_deadline.get()
    return deadline.callers if isinstance(deadline, BatchDeadlines) else deadline


async def wait_on_callback(
    start: Callable[[Callable[[T | None, BaseException | None], None]], object],
    *,
    abort: Callable[[], object] | None = None,
) -> T:
    """Start an operation that reports through a callback, and wait for the report.

    ``start(resolve)`` must launch the operation and return at once; the
    operation then calls ``resolve(value, None)`` or ``resolve(None, error)``
    exactly once, from any thread. If the waiting task is cancelled, *abort* is
    called (to ask the operation to stop early), the task still waits for the
    report, and then ``Cancelled`` propagates, so nothing is left running.
    """
    await anyio.lowlevel.checkpoint_if_cancelled()
    resolver: _Resolver[T] = _Resolver(current_waker(), native_event_factory()())
    start(resolver)
    return await resolver.wait(abort)


@final
class CallbackWaiter:
    """`wait_on_callback` for one caller at a time, woken through a socket pair of its own.

    For a backend whose runtime reports each execution through a callback
    from a thread of its own (ONNX Runtime's ``run_async``). On Trio the
    callback writes one byte to this object's socket, which the waiting task
    waits on itself, as `WorkerThread` does: `wait_on_callback` goes through
    ``TrioToken.run_sync_soon``, whose entry queue's task, lock and event cost
    the loop about 15-20 us more a call. A second wait while one is in
    progress, and every wait on asyncio, goes through `wait_on_callback`.
    Create it on the event loop's thread, inside the loop it serves; `close()`
    it when done.
    """

    __slots__ = ("_busy", "_closed", "_wake")

    def __init__(self) -> None:
        self._busy = False
        self._closed = False
        self._wake: tuple[socket.socket, socket.socket] | None = None  # (receiver, sender)
        if sniffio.current_async_library() == "trio":
            self._wake = socket.socketpair()
            for end in self._wake:
                end.setblocking(False)

    async def wait_on_callback(
        self,
        start: Callable[[Callable[[T | None, BaseException | None], None]], object],
        *,
        abort: Callable[[], object] | None = None,
    ) -> T:
        """What `wait_on_callback` does, with the same contract for *start* and *abort*.

        Raises:
            anyio.ClosedResourceError: After `close()`.
        """
        if self._closed:
            raise anyio.ClosedResourceError("the callback waiter is closed")
        wake = self._wake
        if wake is None or self._busy:
            return await wait_on_callback(start, abort=abort)
        self._busy = True  # before any await: a second caller must not share the socket
        try:
            await _trio.checkpoint_if_cancelled()
            signal: _Signal[T] = _Signal(wake[1].send)
            start(signal)
            return await _wait_on_socket(wake[0], signal, abort)
        finally:
            self._busy = False
            if self._closed:
                self._close_socket()

    def close(self) -> None:
        """Close the socket pair (at once, or when the wait in progress ends). Idempotent."""
        self._closed = True
        if not self._busy:
            self._close_socket()

    def _close_socket(self) -> None:
        if self._wake is not None:
            for end in self._wake:
                end.close()
            self._wake = None


@final
class _Signal(Generic[T]):
    # Carries one result from the worker thread back to a Trio task that waits on
    # the worker's own socket: one byte written once the result is there.
    __slots__ = ("_send", "error", "ready", "value")

    def __init__(self, send: Callable[[bytes], object]) -> None:
        self._send = send
        self.value: T | None = None
        self.error: BaseException | None = None
        self.ready = False

    def __call__(self, value: T | None, error: BaseException | None = None) -> None:
        self.value, self.error, self.ready = value, error, True
        # OSError: the socket is closed (nobody is left to wake), or its buffer is
        # full (BlockingIOError: bytes are already there to wake the reader).
        with contextlib.suppress(OSError):
            self._send(b"\0")


@final
class WorkerThread:
    """A dedicated OS thread that runs blocking calls, one at a time, for async code.

    Cheaper per call than a thread pool (no per-call thread hand-out), and
    lets a backend pin its compute to chosen CPUs. Create it with
    `start()`; stop it with `aclose()`, which joins the thread.
    """

    __slots__ = (
        "_checkpoint_if_cancelled",
        "_closed",
        "_jobs",
        "_new_event",
        "_socket_busy",
        "_thread",
        "_wake",
        "_waker",
    )

    def __init__(self, thread: threading.Thread, jobs: _Jobs) -> None:
        self._thread = thread
        self._jobs = jobs
        self._closed = False
        # Looked up once: the thread serves the event loop it was started from.
        # (anyio's portable checkpoint finds the backend on every call: 0.9 us
        # against Trio's own 0.2, paid per execution.)
        self._waker = current_waker()
        self._new_event = native_waiter_factory()  # each call's event has one waiter
        self._checkpoint_if_cancelled = LoopClock().checkpoint_if_cancelled
        # On Trio, a call's result wakes its task through a socket of the worker's
        # own, which the task waits on itself: TrioToken.run_sync_soon goes through
        # Trio's wake-up socket too, and then through its entry queue's task, a
        # lock and an event (a round trip cost the loop 26-41 us of CPU, against
        # 16-27 this way). One call at a time waits there; a second call in flight
        # at once (pipeline depth 2) comes back through run_sync_soon.
        self._wake: tuple[socket.socket, socket.socket] | None = None  # (receiver, sender)
        self._socket_busy = False
        if sniffio.current_async_library() == "trio":
            self._wake = socket.socketpair()
            for end in self._wake:
                end.setblocking(False)

    @classmethod
    async def start(cls, name: str, *, cpu_affinity: tuple[int, ...] | None = None) -> WorkerThread:
        """Start a worker thread called *name*, pinned to *cpu_affinity* if given (Linux).

        Raises:
            OSError: If the affinity cannot be applied (no such CPU, or not Linux),
                or the worker's wake-up sockets cannot be made (out of file
                descriptors, on Trio); nothing is left running.
            RuntimeError: If the thread cannot be started (``threading``'s own
                error); its sockets are closed.
        """
        jobs = _Jobs()
        ready: _Resolver[None] = _Resolver(current_waker(), anyio.Event())
        thread = _OSThread(target=_serve, args=(jobs, cpu_affinity, ready), name=name, daemon=True)
        # The worker (and its wake-up socket pair) before the thread: if the sockets
        # cannot be made (EMFILE), no thread is running yet to be left behind.
        try:
            worker = cls(thread, jobs)
        except BaseException:
            jobs.close()  # no thread to close them
            raise
        try:
            thread.start()
        except BaseException:
            jobs.close()
            worker._close_socket()
            raise
        try:
            await ready.wait(None)
        except BaseException:
            # Cancelled (or failed) while starting: the thread must not outlive us.
            await worker.aclose()
            raise
        return worker

    @property
    def name(self) -> str:
        """The thread's name."""
        return self._thread.name

    async def run_sync(
        self,
        fn: Callable[[*Args], T],
        *args: *Args,
        abort: Callable[[], object] | None = None,
    ) -> T:
        """Run ``fn(*args)`` in the thread and return its result (or raise its exception).

        On cancellation, *abort* is called from the event loop's thread, the call
        is waited for, then ``Cancelled`` propagates.

        Raises:
            anyio.ClosedResourceError: After `aclose()`.
        """
        if self._closed:
            raise anyio.ClosedResourceError(f"worker thread {self.name!r} is closed")
        await self._checkpoint_if_cancelled()
        wake = self._wake
        if wake is not None and not self._socket_busy:
            self._socket_busy = True
            try:
                signal: _Signal[T] = _Signal(wake[1].send)
                self._jobs.put((fn, args, signal))
                return await _wait_on_socket(wake[0], signal, abort)
            finally:
                self._socket_busy = False
                if self._closed:
                    self._close_socket()
        resolver: _Resolver[T] = _Resolver(self._waker, self._new_event())
        self._jobs.put((fn, args, resolver))
        return await resolver.wait(abort)

    def _close_socket(self) -> None:
        if self._wake is not None:
            for end in self._wake:
                end.close()
            self._wake = None

    async def aclose(self) -> None:
        """Let the thread finish its current call, then stop and join it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        done: _Resolver[None] = _Resolver(self._waker, self._new_event())
        self._jobs.put((None, (), done))
        with anyio.CancelScope(shield=True):
            await done.wait(None)
        self._thread.join()
        if not self._socket_busy:  # else the call waiting on it closes it when it ends
            self._close_socket()


class _OSThread(threading.Thread):
    """The OS thread under a `WorkerThread`.

    A type of its own, so that ``check_backend`` can tell one that an instance
    left running after ``aclose``.
    """


@final
class _Jobs:
    # The worker's job queue: a deque, and a socket pair that wakes the worker when
    # it sleeps. SimpleQueue's futex wake-up preempted the loop at once to run a
    # worker that then waited for the GIL the loop held (2.6 involuntary switches of
    # the loop per round trip); a byte on a local socket wakes its reader with the
    # kernel's synchronous hint, which lets the loop run on until it releases the
    # GIL (1.0 a round trip, and the loop's CPU per round trip 22-24 -> 19 us: see
    # benchmarks/RESULTS.md, "Thread dispatch, sixth round").
    __slots__ = ("_idle", "_items", "_receiver", "_sender")

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._idle = False
        self._receiver, self._sender = socket.socketpair()
        self._sender.setblocking(False)

    def put(self, job: Any) -> None:
        # Called with the GIL held, as get()'s checks are: either the worker sees
        # the job before it sleeps, or this sees it idle and wakes it.
        self._items.append(job)
        if self._idle:
            # OSError: the buffer is full (bytes are there to wake it), or closed.
            with contextlib.suppress(OSError):
                self._sender.send(b"\0")

    def get(self) -> Any:
        items = self._items
        while True:
            try:
                job = items.popleft()
            except IndexError:
                pass
            else:
                self._idle = False
                return job
            if self._idle:
                self._receiver.recv(4096)  # a byte left over wakes one loop early
            self._idle = True

    def close(self) -> None:
        self._receiver.close()
        self._sender.close()


async def _wait_on_socket(
    sock: socket.socket, signal: _Signal[T], abort: Callable[[], object] | None
) -> T:
    # The byte comes after `ready` is set, so one wait always ends; a byte left
    # from an earlier call (its task saw `ready` before the byte came) makes one
    # wait end early: drained, then waited again.
    try:
        while True:
            await _trio.wait_readable(sock)
            _drain(sock)
            if signal.ready:
                break
    except anyio.get_cancelled_exc_class():
        if abort is not None and not signal.ready:
            abort()
        # The call still holds our arguments (and the instance): wait it out.
        with anyio.CancelScope(shield=True):
            while not signal.ready:
                await _trio.wait_readable(sock)
                _drain(sock)
        raise
    # Resume one scheduling pass later, as a wake-up through TrioToken.run_sync_soon
    # does (its entry-queue task runs first). Else this task can resume in the same
    # pass as tasks made runnable while it waited, in Trio's random order: an
    # instance back from its execution could find a smaller one that was handed the
    # turn to form a batch but has not run yet, and the smaller one then takes the
    # next request (which tutorials/failover.md shows going to the bigger one).
    await _trio.cancel_shielded_checkpoint()
    if signal.error is not None:
        raise signal.error
    return signal.value  # type: ignore[return-value]


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        sock.recv(4096)


def _serve(
    jobs: _Jobs,
    cpu_affinity: tuple[int, ...] | None,
    ready: _Resolver[None],
) -> None:
    try:
        if cpu_affinity is not None:
            os.sched_setaffinity(0, cpu_affinity)
    except (OSError, AttributeError) as exc:
        # start() closes us after reporting this; serve until then.
        ready(None, OSError(f"cannot pin a thread to CPUs {list(cpu_affinity or ())}: {exc}"))
    else:
        ready(None)
    while True:
        fn, args, resolve = jobs.get()
        if fn is None:
            resolve(None)
            jobs.close()
            return
        try:
            resolve(fn(*args))
        except BaseException as exc:
            resolve(None, exc)
        # Drop references so that this frame keeps no inputs or outputs alive while idle.
        del fn, args, resolve
