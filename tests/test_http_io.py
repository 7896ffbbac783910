"""The HTTP server's I/O shim: the same waits on Trio and asyncio, with a socket pair."""

from __future__ import annotations

import asyncio
import socket

import anyio
import pytest

from trioinfer.server import _io

BACKENDS = ["trio", "asyncio"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_waits_and_clocks(backend: str) -> None:
    async def main() -> None:
        io = _io.open_io()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        try:
            await io.wait_writable(a)
            a.send(b"x")
            with anyio.fail_after(5):
                await io.wait_readable(b)
            assert b.recv(10) == b"x"
            before = io.current_time()
            await io.checkpoint()
            assert io.current_time() >= before
            assert io.wall_time() > 1e9
        finally:
            for sock in (a, b):
                io.notify_closing(sock)
                sock.close()

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_a_socket_wakes_its_waiter_with_an_error(backend: str) -> None:
    async def main() -> None:
        io = _io.open_io()
        a, b = socket.socketpair()
        b.setblocking(False)
        failure: list[BaseException] = []

        async def wait() -> None:
            try:
                await io.wait_readable(b)
            except Exception as exc:  # Trio's ClosedResourceError, or ours
                failure.append(exc)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                io.notify_closing(b)
        finally:
            a.close()
            b.close()
        assert len(failure) == 1

    anyio.run(main, backend=backend)


def test_asyncio_keeps_a_socket_registered_only_while_it_is_waited_on() -> None:
    async def main() -> None:
        io = _io.open_io()
        assert isinstance(io, _io._AsyncioIO)
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        b.setblocking(False)
        try:
            a.send(b"1")
            await io.wait_readable(b)
            b.recv(10)
            entry = io._registered[b.fileno()]
            assert entry.reading  # still registered: the next wait costs no system call
            # The selector may report the socket once more after its waiter read
            # it (in the turn the waiter woke): that does not drop the registration.
            a.send(b"1")
            await io.wait_readable(b)
            b.recv(10)
            for _ in range(5):
                await asyncio.sleep(0)
            assert entry.reading
            # Data arrives while nobody waits: the selector would call back every
            # turn (level-triggered), so the registration is dropped.
            a.send(b"2")
            for _ in range(5):
                await asyncio.sleep(0)
            assert not entry.reading
            await io.wait_readable(b)  # and made again for the next wait
            assert entry.reading
            assert b.recv(10) == b"2"
            async with anyio.create_task_group() as tg:
                tg.start_soon(io.wait_readable, b)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(RuntimeError, match="already waiting"):
                    await io.wait_readable(b)
                tg.cancel_scope.cancel()
        finally:
            io.notify_closing(b)
            assert b.fileno() not in io._registered
            a.close()
            b.close()
        assert loop.is_running()

    anyio.run(main, backend="asyncio")
