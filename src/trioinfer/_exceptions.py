"""The errors trioinfer raises, all under one base class.

Every request that the engine accepts ends exactly once: with its outputs or
with one of these errors. Each message says what was given and what was
expected, so that a caller (or an HTTP client, once the server maps these to
status codes) can tell what to change.

```
TrioInferError
├── ConfigError            a ModelConfig or config.toml that cannot work
├── PluginError            an unknown plugin name, or a plugin that misbehaves
│   └── PluginLoadError    a plugin that fails to import or to construct
├── ModelNotFound          no model of that name is loaded   (also LookupError)
├── InvalidInput           inputs that do not fit the model  (also ValueError)
├── QueueFull              the model's queue is at its bound; retry later
├── DeadlineExceeded       the request's deadline passed before it could run
├── BackendError           the backend failed while executing
│   └── BackendUnavailable the requested device or provider cannot be used
└── EngineClosed           the engine is shutting down or has shut down
```
"""

from __future__ import annotations


class TrioInferError(Exception):
    """Base class of every error trioinfer raises on purpose."""


class ConfigError(TrioInferError, ValueError):
    """A model or engine configuration that cannot work as written."""


class PluginError(TrioInferError):
    """A plugin name that is not registered, or a plugin that breaks its contract."""


class PluginLoadError(PluginError):
    """A registered plugin that could not be imported or constructed.

    Attributes:
        group: The entry-point group, e.g. ``"trioinfer.backends"``.
        name: The plugin's name in that group.
        distribution: The installed distribution that declared it, if known.
    """

    def __init__(self, message: str, *, group: str, name: str, distribution: str | None) -> None:
        super().__init__(message)
        self.group = group
        self.name = name
        self.distribution = distribution


class ModelNotFound(TrioInferError, LookupError):
    """No model of the requested name is loaded in the engine."""


class InvalidInput(TrioInferError, ValueError):
    """Inputs that do not match the model's signature or the configured limits."""


class QueueFull(TrioInferError):
    """The model's queue holds ``max_queue_size`` requests; this one was refused at once.

    Attributes:
        retry_after: A hint, in seconds, of when capacity is likely to be free again.
    """

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(TrioInferError):
    """The request's deadline passed before it reached a backend; nothing was computed."""


class BackendError(TrioInferError):
    """The backend failed while executing a request; the cause is chained as ``__cause__``.

    Attributes:
        transient: Whether the same call may well succeed if tried again (a
            device briefly out of memory, a timeout), as opposed to a fault that
            will repeat (a malformed model, a dead session). Retry policies
            retry only transient errors. Backends set it; it defaults to false.
    """

    transient: bool = False

    def __init__(self, *args: object, transient: bool | None = None) -> None:
        super().__init__(*args)
        if transient is not None:
            self.transient = transient


class BackendUnavailable(BackendError):
    """The requested device or execution provider is not usable, and no fallback was allowed."""


class CircuitOpen(TrioInferError):
    """Every instance of the model is taken out of service, so the request was refused at once.

    A fallback plugin's circuit breaker takes out an instance that keeps
    failing and probes it in the background until it recovers.

    Attributes:
        retry_after: A hint, in seconds, of when an instance is likely to be back.
    """

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosed(TrioInferError):
    """The engine is closing or closed, so it accepts no new work."""
