"""Errors of the HTTP layer itself, shared by the app (statuses) and the metrics (outcomes)."""

from __future__ import annotations

from .._exceptions import TrioInferError


class Unauthorized(TrioInferError):
    """A request without the bearer token an endpoint requires (HTTP 401)."""


class NotReady(TrioInferError):
    """The server is shutting down and takes no new inference (HTTP 503)."""


class ClientLeft(TrioInferError):
    """The client disconnected before the request was answered: nobody to answer."""
