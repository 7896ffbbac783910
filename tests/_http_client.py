"""The raw HTTP/1.1 response parsing that the HTTP server tests' socket clients share.

Each test file keeps its own transport (a trio stream, a plain non-blocking socket);
what they read is parsed here, so pipelined responses come apart the same way in both.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httptools


@attrs.define
class Response:
    """One response as the server sent it: status, headers in order, body in chunks."""

    status: int = 0
    headers: list[tuple[bytes, bytes]] = attrs.Factory(list)
    chunks: list[bytes] = attrs.Factory(list)

    @property
    def body(self) -> bytes:
        """The whole body, its chunks joined."""
        return b"".join(self.chunks)

    def header(self, name: bytes) -> bytes | None:
        """The first value of header *name* (lower case), or None if it is absent."""
        values = [v for k, v in self.headers if k.lower() == name]
        return values[0] if values else None

    def json(self) -> Any:
        """The body, decoded as JSON."""
        return json.loads(self.body)


class ResponseParser:
    """Feeds bytes to httptools and collects every complete response in ``responses``.

    A subclass adds the transport and calls ``self._parser.feed_data`` with what it reads.
    """

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._partial = Response()
        self.responses: list[Response] = []

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        """Called by httptools for each header line."""
        self._partial.headers.append((name, value))

    def on_headers_complete(self) -> None:
        """Called by httptools once the status line and headers are read."""
        self._partial.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        """Called by httptools for each piece of the body, chunked or not."""
        self._partial.chunks.append(body)

    def on_message_complete(self) -> None:
        """Called by httptools at a response's end: the next bytes start a new one."""
        self.responses.append(self._partial)
        self._partial = Response()
