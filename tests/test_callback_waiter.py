"""CallbackWaiter: reports from other threads, its socket on Trio, fallback, cancel, close."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer._threads as threads_module
from trioinfer import Device, ModelConfig
from trioinfer.lowlevel import CallbackWaiter, Placement

Resolve = Callable[[Any, BaseException | None], None]


def _later(resolve: Resolve, value: object = None, error: BaseException | None = None) -> None:
    # Report from another thread, as a runtime's own thread would.
    threading.Thread(target=resolve, args=(value, error)).start()


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_results_and_errors_come_back_from_another_thread(backend: str) -> None:
    async def main() -> None:
        waiter = CallbackWaiter()
        try:
            for i in range(50):  # back to back: no byte or event is left over
                assert await waiter.wait_on_callback(lambda r, i=i: _later(r, i * i)) == i * i
            with pytest.raises(ValueError, match="from the callback"):
                await waiter.wait_on_callback(
                    lambda r: _later(r, None, ValueError("from the callback"))
                )
            assert await waiter.wait_on_callback(lambda r: r("at once", None)) == "at once"
        finally:
            waiter.close()

    anyio.run(main, backend=backend)


async def test_on_trio_one_wait_at_a_time_uses_the_socket_not_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waiter = CallbackWaiter()

    def no_token() -> Any:
        raise AssertionError("went through TrioToken.run_sync_soon")

    monkeypatch.setattr(threads_module, "current_waker", no_token)
    try:
        assert await waiter.wait_on_callback(lambda r: _later(r, 7)) == 7
    finally:
        waiter.close()


async def test_a_second_wait_at_once_goes_through_the_token() -> None:
    waiter = CallbackWaiter()
    resolvers: list[Resolve] = []
    results: dict[str, object] = {}

    async def wait(name: str) -> None:
        own: list[Resolve] = []

        def start(resolve: Resolve) -> None:
            own.append(resolve)
            resolvers.append(resolve)

        # Cancelled (the other wait failed, say): reported at once, so nothing hangs.
        results[name] = await waiter.wait_on_callback(
            start, abort=lambda: _later(own[0], "aborted")
        )

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, "first")
            nursery.start_soon(wait, "second")
            await trio.testing.wait_all_tasks_blocked()
            assert len(resolvers) == 2
            # Reported in the other order than they started, from other threads.
            _later(resolvers[1], "b")
            _later(resolvers[0], "a")
        assert sorted(results.values()) == ["a", "b"]
        assert await waiter.wait_on_callback(lambda r: _later(r, 3)) == 3  # free again
    finally:
        waiter.close()


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_cancelled_wait_aborts_then_waits_for_the_report(backend: str) -> None:
    async def main() -> None:
        waiter = CallbackWaiter()
        resolvers: list[Resolve] = []
        aborted = threading.Event()
        order: list[str] = []

        def abort() -> None:
            order.append("abort")
            aborted.set()

        def report_once_aborted() -> None:
            aborted.wait(2)  # without an abort the report still comes, late: nothing hangs
            order.append("report")
            resolvers[0]("too late", None)

        try:
            with anyio.move_on_after(0.05) as scope:
                await waiter.wait_on_callback(
                    lambda r: (
                        resolvers.append(r),
                        threading.Thread(target=report_once_aborted).start(),
                    ),
                    abort=abort,
                )
                order.append("returned")  # never: the wait ends cancelled
            assert scope.cancelled_caught
            assert order == ["abort", "report"]  # cancelled only after the report came
            # The byte of the cancelled call is not taken for the next call's report.
            for i in range(5):
                assert await waiter.wait_on_callback(lambda r, i=i: _later(r, i)) == i
        finally:
            waiter.close()

    anyio.run(main, backend=backend)


async def test_start_that_raises_leaves_the_waiter_usable() -> None:
    waiter = CallbackWaiter()

    def refuse(_resolve: Resolve) -> None:
        raise RuntimeError("bad input")

    try:
        with pytest.raises(RuntimeError, match="bad input"):
            await waiter.wait_on_callback(refuse)
        assert await waiter.wait_on_callback(lambda r: _later(r, 1)) == 1
    finally:
        waiter.close()


async def test_close_waits_for_the_wait_in_progress_and_refuses_new_ones() -> None:
    waiter = CallbackWaiter()
    resolvers: list[Resolve] = []
    result: list[object] = []

    async def wait() -> None:
        result.append(await waiter.wait_on_callback(resolvers.append))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert len(resolvers) == 1
        wake = waiter._wake
        assert wake is not None
        waiter.close()
        waiter.close()  # idempotent
        assert wake[0].fileno() != -1  # still open: a wait is in progress
        _later(resolvers[0], "done")
    assert result == ["done"]
    assert wake[0].fileno() == -1
    assert wake[1].fileno() == -1
    with pytest.raises(anyio.ClosedResourceError):
        await waiter.wait_on_callback(lambda r: r(None, None))


async def test_an_ort_async_instance_is_woken_through_its_waiter(
    add_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trioinfer_onnxruntime import OnnxRuntimeBackend

    config = ModelConfig(name="add", path=add_model, backend_options={"dispatch": "ort_async"})
    instance = await OnnxRuntimeBackend().load(config, Placement(Device("cpu"), 0, threads=2))

    def no_token() -> Any:
        raise AssertionError("went through TrioToken.run_sync_soon")

    try:
        monkeypatch.setattr(threads_module, "current_waker", no_token)
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        for _ in range(3):
            out = await instance.execute({"a": a, "b": np.ones_like(a)})
            np.testing.assert_array_equal(out["sum"], a + 1)
    finally:
        monkeypatch.undo()  # closing joins the worker thread through the token
        await instance.aclose()


async def test_a_wait_cancelled_before_it_starts_starts_nothing_and_frees_the_waiter() -> None:
    waiter = CallbackWaiter()
    started: list[Resolve] = []
    try:
        with trio.CancelScope() as scope:
            scope.cancel()
            await waiter.wait_on_callback(started.append)
        assert scope.cancelled_caught
        assert started == []
        assert await waiter.wait_on_callback(lambda r: _later(r, 2)) == 2
    finally:
        waiter.close()
