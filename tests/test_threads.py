"""WorkerThread: results, errors, cancellation, closing; on Trio by its socket and by the token."""

from __future__ import annotations

import collections
import select
import socket
import sys
import threading
import time
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from trioinfer._threads import _Jobs
from trioinfer.lowlevel import WorkerThread


def _blocked(gate: threading.Event, value: object) -> object:
    if not gate.wait(10):
        raise TimeoutError("never released")
    return value


def _fail() -> None:
    raise ValueError("from the thread")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_results_and_errors_come_back(backend: str) -> None:
    async def main() -> None:
        worker = await WorkerThread.start("test-results")
        try:
            for i in range(50):  # back to back: no byte or event is left over
                assert await worker.run_sync(pow, i, 2) == i * i
            with pytest.raises(ValueError, match="from the thread"):
                await worker.run_sync(_fail)
            assert await worker.run_sync(len, "abc") == 3
        finally:
            await worker.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await worker.run_sync(len, "")

    anyio.run(main, backend=backend)


async def test_calls_at_once_each_get_their_own_result() -> None:
    # The first call waits on the worker's socket; the others come back through
    # the token (one waiter on a socket at a time). Each gets its own value.
    worker = await WorkerThread.start("test-at-once")
    gate = threading.Event()
    results: dict[int, object] = {}

    async def call(i: int) -> None:
        results[i] = await worker.run_sync(_blocked, gate, i)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(call, i)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    finally:
        await worker.aclose()
    assert results == {0: 0, 1: 1, 2: 2, 3: 3}


async def test_a_stray_byte_does_not_end_a_call_early() -> None:
    # A byte left on the socket (a cancelled call saw its result before its byte
    # came) wakes the next call's wait once: it must wait on until its own result.
    worker = await WorkerThread.start("test-stray-byte")
    gate = threading.Event()
    got: list[object] = []
    try:
        wake = worker._wake
        assert wake is not None, "on Trio a call waits on the worker's socket"
        wake[1].send(b"\0")

        async def call() -> None:
            got.append(await worker.run_sync(_blocked, gate, "mine"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # still waiting: the call has not returned
            gate.set()
    finally:
        await worker.aclose()
    assert got == ["mine"]


@pytest.mark.parametrize("at_once", [1, 2])
async def test_a_cancelled_call_is_aborted_and_waited_for(at_once: int) -> None:
    worker = await WorkerThread.start("test-cancel")
    gates = [threading.Event() for _ in range(at_once)]
    aborted: list[int] = []
    returned: list[int] = []

    async def call(i: int) -> None:
        try:
            await worker.run_sync(_blocked, gates[i], i, abort=lambda: aborted.append(i))
        finally:
            returned.append(i)

    async def calls(scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for i in range(at_once):
                    nursery.start_soon(call, i)

    try:
        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(calls, scope)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            # Aborted at once, and still waiting: the calls have not ended in the thread.
            assert sorted(aborted) == list(range(at_once))
            assert returned == []
            for gate in gates:
                gate.set()
        assert scope.cancelled_caught
        assert sorted(returned) == list(range(at_once))
        assert await worker.run_sync(pow, 3, 2) == 9  # and the worker serves on
    finally:
        await worker.aclose()


async def test_closing_while_a_call_waits_lets_it_finish_then_closes_the_socket() -> None:
    worker = await WorkerThread.start("test-close")
    gate = threading.Event()
    got: list[Any] = []

    async def call() -> None:
        got.append(await worker.run_sync(_blocked, gate, "done"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        wake = worker._wake
        assert wake is not None
        nursery.start_soon(worker.aclose)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert got == ["done"]
    assert worker._wake is None
    assert all(end.fileno() == -1 for end in wake)  # both ends closed
    await worker.aclose()  # idempotent


async def _one_round(worker: WorkerThread) -> list[str]:
    gate = threading.Event()
    order: list[str] = []
    parked: list[Any] = []

    async def call() -> None:
        await worker.run_sync(_blocked, gate, None)
        order.append("call")

    async def other() -> None:
        parked.append(trio.lowlevel.current_task())
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)
        order.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        nursery.start_soon(other)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        wake = worker._wake
        assert wake is not None
        # The byte is there before the loop looks again; then the other task
        # becomes runnable, and the next pass sees both.
        assert select.select([wake[0]], [], [], 10)[0]
        trio.lowlevel.reschedule(parked[0])
    return order


async def test_a_call_returns_after_tasks_made_runnable_while_its_byte_came() -> None:
    # The socket's wake-up resumes the caller one scheduling pass later, as the
    # token's did: tasks made runnable in the pass where the byte is seen run
    # first (Trio runs one pass's tasks in a random order). The engine's turn
    # to form a batch relies on it (tutorials/failover.md: the bigger instance,
    # back from its execution, takes the next request).
    worker = await WorkerThread.start("test-order")
    try:
        for _ in range(20):  # each round would go wrong half the time without it
            assert await _one_round(worker) == ["other", "call"]
    finally:
        await worker.aclose()


def _serve_jobs(jobs: _Jobs, done: list[int]) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        done.append(item)


def test_jobs_wake_a_worker_that_went_to_sleep() -> None:
    # Each job is put after the worker has emptied the queue and (mostly) gone
    # to sleep on its socket: put() must wake it every time.
    jobs = _Jobs()
    done: list[int] = []
    thread = threading.Thread(target=_serve_jobs, args=(jobs, done), daemon=True)
    thread.start()
    try:
        for i in range(200):
            jobs.put(i)
            deadline = time.monotonic() + 10
            while len(done) <= i and time.monotonic() < deadline:
                time.sleep(0.0001)
            assert done == list(range(i + 1)), f"job {i} never ran: the worker slept on"
    finally:
        jobs.put(None)
        thread.join(10)
        jobs.close()
    assert not thread.is_alive()


def test_jobs_put_while_the_worker_goes_idle_are_never_lost() -> None:
    # Jobs put at any moment of the worker's way to sleep (a tiny switch interval
    # interleaves the two threads' steps): each runs exactly once, in order.
    jobs = _Jobs()
    done: list[int] = []
    thread = threading.Thread(target=_serve_jobs, args=(jobs, done), daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread.start()
    try:
        for i in range(3000):
            jobs.put(i)
            if i % 3 == 0:
                time.sleep(0)
        jobs.put(None)
        thread.join(10)
    finally:
        sys.setswitchinterval(interval)
        if thread.is_alive():
            jobs.put(None)
        jobs.close()
    assert not thread.is_alive(), f"the worker sleeps with jobs queued after {len(done)}"
    assert done == list(range(3000))


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_closing_the_worker_closes_its_job_queue(backend: str) -> None:
    async def main() -> None:
        worker = await WorkerThread.start("test-close-jobs")
        assert await worker.run_sync(pow, 2, 5) == 32
        jobs = worker._jobs
        await worker.aclose()
        assert not worker._thread.is_alive()
        assert jobs._receiver.fileno() == -1
        assert jobs._sender.fileno() == -1

    anyio.run(main, backend=backend)


def test_a_job_put_just_as_the_worker_finds_the_queue_empty_still_runs() -> None:
    # The race that put() and get() close: the loop puts a job after the worker
    # found the queue empty and before it sleeps. Played here deterministically:
    # the queue itself puts the next job at the moment it reports being empty.
    jobs = _Jobs()
    pending = [None, 2, 1]

    class Racing(collections.deque[Any]):
        def popleft(self) -> Any:
            if not self and pending:
                jobs.put(pending.pop())  # lands, then the worker learns it was empty
                raise IndexError("pop from an empty deque")
            return super().popleft()

    jobs._items = Racing()
    done: list[int] = []
    thread = threading.Thread(target=_serve_jobs, args=(jobs, done), daemon=True)
    thread.start()
    thread.join(10)
    alive = thread.is_alive()
    if alive:
        jobs.put(None)
        thread.join(10)
    jobs.close()
    assert not alive, f"the worker slept with a job queued (ran {done})"
    assert done == [1, 2]


async def test_a_thread_that_cannot_start_leaves_no_sockets_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[_Jobs] = []
    original = _Jobs.__init__

    def record(self: _Jobs) -> None:
        original(self)
        made.append(self)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_Jobs, "__init__", record)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await WorkerThread.start("test-no-thread")
    [jobs] = made
    assert jobs._receiver.fileno() == -1
    assert jobs._sender.fileno() == -1


async def test_sockets_that_cannot_be_made_leave_no_thread_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worker's own wake-up socket pair failing (too many open files) must not
    # leave a started thread, nor the job queue's sockets, behind.
    made: list[_Jobs] = []
    original = _Jobs.__init__

    def record(self: _Jobs) -> None:
        original(self)
        made.append(self)

    real = socket.socketpair
    calls = 0

    def second_fails(*args: Any) -> Any:
        # _Jobs makes its pair first (recorded above); the worker's own pair fails.
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(24, "Too many open files")
        return real(*args)

    monkeypatch.setattr(_Jobs, "__init__", record)
    monkeypatch.setattr(socket, "socketpair", second_fails)
    before = {thread.ident for thread in threading.enumerate()}
    with pytest.raises(OSError, match="Too many open files"):
        await WorkerThread.start("test-no-sockets")
    [jobs] = made
    assert jobs._receiver.fileno() == -1
    assert jobs._sender.fileno() == -1
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert not [t for t in started if t.name == "test-no-sockets"]


async def test_a_thread_that_cannot_start_closes_the_workers_own_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pairs: list[tuple[socket.socket, socket.socket]] = []
    real = socket.socketpair

    def record(*args: Any) -> Any:
        pair = real(*args)
        pairs.append(pair)
        return pair

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(socket, "socketpair", record)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await WorkerThread.start("test-no-thread")
    assert len(pairs) == 2  # the job queue's and, on Trio, the worker's own
    assert all(end.fileno() == -1 for pair in pairs for end in pair)
