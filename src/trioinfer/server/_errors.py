"""Errors of the HTTP layer itself, shared by the app (statuses) and the metrics (outcomes)."""

from __future__ import annotations

import re
from typing import Final

from .._exceptions import TrioInferError

# An absolute POSIX path: a "/" that does not continue a word, a relative path
# or a URL ("a/b", "./x", "http://h/p"), then at least one more segment. The
# server's own endpoints ("/v2/..."), which messages name to say what to call,
# are not host paths: cutting them left "(POST <path><name>/register)".
_ABSOLUTE_PATH: Final = re.compile(r"(?<![\w.:/~-])/(?!v2/)(?:[\w.+~@-]+/)+([\w.+~@-]*)")


def without_host_paths(message: str, root: str | None = None) -> str:
    """*message* with no absolute host path left in it, fit for an HTTP client to read.

    Paths under *root* (the model repository) become relative to it (and
    *root* itself ``<repository>``); any other absolute path - one a library
    put in its message, of a file outside the repository or of the library's
    own source - is cut to its last segment, which still says which file
    was meant without saying where the host keeps it.
    """
    if root:
        root = root.rstrip("/")
        message = message.replace(root + "/", "").replace(root, "<repository>")
    return _ABSOLUTE_PATH.sub(lambda match: match.group(1) or "<path>", message)


class Unauthorized(TrioInferError):
    """A request without the bearer token an endpoint requires (HTTP 401)."""


class NotReady(TrioInferError):
    """The server is shutting down and takes no new inference (HTTP 503)."""


class ClientLeft(TrioInferError):
    """The client disconnected before the request was answered: nobody to answer."""
