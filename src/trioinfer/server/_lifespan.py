"""The ASGI lifespan protocol, as the HTTP server runs it around serving."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final, final

import anyio

from ._cycle import ASGI_VERSION, ASGI3App, Message, Scope

__all__ = ["Lifespan"]

log = logging.getLogger("trioinfer.server")

_LIFESPAN_SPEC_VERSION: Final = "2.0"


@final
class Lifespan:
    """The ASGI lifespan protocol, in "auto" mode: an app that raises has none.

    `run` runs in a task of the server's; `wait_started` and `shutdown`
    are called from the serve loop.

    Attributes:
        state: The lifespan state the app filled in at startup (``scope["state"]``).
        failure: The message of a failed startup, or None.
    """

    __slots__ = (
        "_app",
        "_scope",
        "_shutdown_done",
        "_shutdown_requested",
        "_started",
        "_startup_sent",
        "_supported",
        "failure",
        "state",
    )

    def __init__(self, app: ASGI3App) -> None:
        self._app = app
        self.state: dict[str, Any] = {}
        self._started = anyio.Event()
        self._shutdown_requested = anyio.Event()
        self._shutdown_done = anyio.Event()
        self._startup_sent = False
        self._supported = False
        self.failure: str | None = None
        self._scope = anyio.CancelScope()

    async def run(self) -> None:
        """Run the app's lifespan scope until it returns or `shutdown` ends it."""
        scope: Scope = {
            "type": "lifespan",
            "asgi": {"version": ASGI_VERSION, "spec_version": _LIFESPAN_SPEC_VERSION},
            "state": self.state,
        }
        with self._scope:
            try:
                await self._app(scope, self._receive, self._send)
            except Exception as exc:
                if self._started.is_set():
                    log.exception("the ASGI lifespan task failed")
                else:  # like uvicorn's lifespan="auto"
                    log.info("the ASGI app does not support lifespan (%r); serving without it", exc)
            finally:
                self._started.set()
                self._shutdown_done.set()

    async def wait_started(self) -> bool:
        """Wait for the startup to complete; False if the app said it failed."""
        await self._started.wait()
        if self.failure is not None:
            self._scope.cancel()
            return False
        return True

    async def shutdown(self) -> None:
        """Run the app's lifespan shutdown, if it has a lifespan."""
        if self._supported:
            self._shutdown_requested.set()
            await self._shutdown_done.wait()
            if self.failure is not None:
                log.error("ASGI lifespan shutdown failed: %s", self.failure)
                self.failure = None  # logged; only a failed startup makes serve_asgi raise
        self._scope.cancel()

    async def _receive(self) -> Message:
        if not self._startup_sent:
            self._startup_sent = True
            return {"type": "lifespan.startup"}
        await self._shutdown_requested.wait()
        return {"type": "lifespan.shutdown"}

    async def _send(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self._supported = True
            self._started.set()
        elif kind == "lifespan.startup.failed":
            self.failure = message.get("message", "") or "(no message)"
            self._started.set()
        elif kind == "lifespan.shutdown.complete":
            self._shutdown_done.set()
        elif kind == "lifespan.shutdown.failed":
            self.failure = message.get("message", "") or "(no message)"
            self._shutdown_done.set()
        else:
            raise RuntimeError(f"expected a lifespan.* message, got {kind!r}")
