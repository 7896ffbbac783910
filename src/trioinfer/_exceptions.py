"""The errors trioinfer raises, all under one base class.

Every request that the engine accepts ends exactly once: with its outputs or
with one of these errors. Each message says what was given and what was
expected, so that a caller (or an HTTP client, once the server maps these to
status codes) can tell what to change.

```
TrioInferError
├── ConfigError            a ModelConfig, config.toml or plugin choice that cannot work (ValueError)
│   └── PluginError        no plugin of that name, or one that cannot be used as configured
│       └── PluginLoadError  a registered plugin that fails to import or refuses its options
├── PluginContractError    a plugin broke its contract: a fault of the server, not the caller
├── ModelNotFound          no model of that name is loaded   (also LookupError)
├── InvalidInput           inputs that do not fit the model  (also ValueError)
│   └── SequenceError      a request that does not fit its sequence (unknown, ended, released)
├── QueueFull              the model's queue is at its bound; retry later
├── CircuitOpen            every instance of the model is out of service; retry later
├── DeadlineExceeded       the request's deadline passed before it could run
├── BackendError           the backend failed while executing
│   └── BackendUnavailable the requested device or provider cannot be used
├── EngineClosed           the engine is shutting down or has shut down
├── InvalidMetric          a model's custom metric declared or updated as it cannot be (ValueError)
└── StreamClosed           a response stream iterated after its block ended
                           (also anyio.ClosedResourceError)
```

The class says whose fault it is: the caller's (``InvalidInput``,
``ModelNotFound``), the operator's (``ConfigError`` and its plugin errors), a
plugin's (``PluginContractError``) or the backend's (``BackendError``). The
HTTP layer maps classes, never messages, to status codes.
"""

from __future__ import annotations

import anyio


class TrioInferError(Exception):
    """Base class of every error trioinfer raises on purpose."""


class ConfigError(TrioInferError, ValueError):
    """A model or engine configuration that cannot work as written."""


class PluginError(ConfigError):
    """A plugin that cannot be used as configured: its name is not registered (or twice).

    The operator's fault, like any [`ConfigError`][trioinfer.ConfigError]: the
    message names the plugins that are known. A plugin that loads but then
    breaks its contract raises [`PluginContractError`][trioinfer.PluginContractError]
    instead.
    """


class PluginLoadError(PluginError):
    """A registered plugin that could not be imported or constructed with its options.

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


class PluginContractError(TrioInferError):
    """A plugin broke its contract: a fault of the server, not of the caller or the operator.

    A batcher that raised or returned an empty batch, a fallback that returned
    without answering, a scheduler whose ``push`` raised something other than
    a [`TrioInferError`][trioinfer.TrioInferError], a plugin that does not
    implement its Protocol. The engine logs each one (at error level, on the
    ``trioinfer`` logger) with the plugin's kind and name, and the distribution
    that declared it where it came through an entry point; the HTTP server
    answers 500. The plugin's own exception, if any, is the ``__cause__``.
    A model whose scheduler raised (or whose batcher broke its contract twice
    in a row) is out of service: its later requests are refused with one of
    these, saying so, until it is loaded again.

    Attributes:
        kind: The plugin's kind: ``"backends"``, ``"schedulers"``,
            ``"batchers"`` or ``"fallbacks"``.
        plugin: Its name, as the model's configuration gives it.
    """

    def __init__(self, message: str, *, kind: str, plugin: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.plugin = plugin


class ModelNotFound(TrioInferError, LookupError):
    """No model of the requested name is loaded in the engine."""


class InvalidInput(TrioInferError, ValueError):
    """Inputs that do not match the model's signature or the configured limits."""


class SequenceError(InvalidInput):
    """A request of a stateful model that does not fit its sequence; nothing was computed.

    No sequence of that id is in progress (its first request must set
    ``sequence_start``), the sequence was released after ``max_sequence_idle``
    without a request, it ended (``sequence_end``), or an earlier request of
    it ended without being computed (its instance failed, it was cancelled or
    expired), so the model's state no longer follows the requests. The message
    says which. Start a new sequence; a sequence is never restarted silently.
    A 400 over HTTP, like any [`InvalidInput`][trioinfer.InvalidInput].
    """


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


class InvalidMetric(TrioInferError, ValueError):
    """A model's custom metric declared or updated as it cannot be: the model's code is at fault.

    A name that is not a Prometheus name, one of trioinfer's own
    (``trioinfer_*``) or one declared already as another kind (see
    [`ModelMetrics`][trioinfer.ModelMetrics]); a series asked for with labels
    its family does not declare; a counter's negative increment. The
    ``python`` backend fails the load (raised in ``__init__``) or the
    execution (raised in ``infer``) with a ``BackendError`` naming the line, as
    for any bug of the model: a 500 over HTTP, not the client's fault.
    """


class StreamClosed(TrioInferError, anyio.ClosedResourceError):
    """A response stream was iterated after its ``async with`` block ended.

    [`Engine.infer_stream()`][trioinfer.Engine.infer_stream]'s stream lives
    as long as its block: leaving the block closes the model's generator, so
    nothing is left to read. Iterate the stream inside the block. The
    caller's mistake, like using any closed resource, hence also an
    ``anyio.ClosedResourceError`` (what was raised before this class).
    """
