"""Triton's log settings (``/v2/logging``, gRPC ``LogSettings``) on trioinfer's Python loggers.

Triton switches its info, warning and error logs on and off one by one and
sets a verbose level; trioinfer logs through Python's ``logging`` under the
``trioinfer`` logger, whose level is a threshold. So the settings map onto
that level: ``log_verbose_level`` >= 1 is ``DEBUG``; otherwise the lowest of
info, warning, error that is on (``CRITICAL`` when all are off). A mix that
is no threshold (info on, warning off) is refused, as is what the server
cannot honour: ``log_file`` (logs go to stderr; the process's owner routes
them) and, when the server does not own the log handler (``serve_http``
embedded in an application), ``log_format``. ``log_format`` is ``default``
(local time) or ``ISO8601`` (UTC, ``2026-12-04T20:33:25Z``), as in Triton, or
``json`` (trioinfer's: one JSON object per line, see `JsonFormatter`).

``access_log`` (trioinfer's key) switches the request log on and off: one
INFO line per HTTP request and gRPC call on the ``trioinfer.access`` logger
(see `log_request`). Triton's ``log_verbose_level`` does not: here it only
lowers the level to DEBUG.

With ``serve --workers N`` a change goes through the supervisor to every
worker (and to a worker that restarts later), as repository changes do.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any, Final

import orjson

from .._exceptions import ConfigError

__all__ = [
    "FORMATS",
    "REQUESTS",
    "JsonFormatter",
    "install_handler",
    "log_request",
    "log_settings",
    "update_log_settings",
]

#: The logger whose level the settings set: every trioinfer logger is below it.
LOGGER: Final = "trioinfer"
_FORMAT: Final = "%(asctime)s {prefix}%(name)s %(levelname)s %(message)s"
#: The values of ``--log-format`` and of ``log_format``.
FORMATS: Final = ("default", "ISO8601", "json")
_KEYS: Final = (
    "log_file",
    "log_info",
    "log_warning",
    "log_error",
    "log_verbose_level",
    "log_format",
    "access_log",
)
#: The request log's logger: below ``trioinfer``, so that its level applies.
ACCESS_LOGGER: Final = "trioinfer.access"
_access = logging.getLogger(ACCESS_LOGGER)

# The stderr handler `trioinfer serve` installed, whose format log_format sets.
_handler: logging.Handler | None = None
_format = "default"
_prefix = ""
_worker: int | None = None


class _Switch:
    """Whether the request log is on: one attribute the request paths test."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


#: ``REQUESTS.on``: the request log is on (``--access-log``, ``access_log``).
REQUESTS: Final = _Switch()

# What every LogRecord has: the rest of its attributes came from a call's ``extra``.
_STANDARD: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: for Loki, ELK, Cloud Logging.

    Keys: ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``,
    ``message``, ``pid``; ``worker`` (its index) in a ``serve --workers``
    worker; the fields the call passed as ``extra`` (the request log's
    ``model``, ``status``, ...; not one named as a key above); ``trace_id``
    and ``span_id`` (hex) when the record is logged inside an OpenTelemetry
    span; ``exc_info``, the
    traceback's text, when there is one; and, when the call's %-args do not
    fit its message, the message unformatted with ``args`` and
    ``format_error`` (the call's file and line, the error).
    """

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        seconds = time.gmtime(record.created)
        fields: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": "",
            "pid": record.process,
        }
        try:
            fields["message"] = record.getMessage()
        except Exception as exc:
            # A call's %-args that do not fit its message (someone's bug): logging would
            # write its error as text lines and drop the record; it stays one JSON line.
            fields["message"] = str(record.msg)
            fields["args"] = repr(record.args)
            fields["format_error"] = _format_error(record, exc)
        if self._worker is not None:
            fields["worker"] = self._worker
        for key, value in vars(record).items():
            # The line's own keys win: an extra named `level` or `time` would misfile it.
            if key not in _STANDARD and key not in fields and not key.startswith("_"):
                fields[key] = value
        fields.update(_trace_ids())
        if record.exc_info:
            fields["exc_info"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            fields["exc_info"] = record.exc_text
        if record.stack_info:
            fields["stack_info"] = record.stack_info
        try:
            return orjson.dumps(fields, default=str).decode()
        except orjson.JSONEncodeError:  # what orjson refuses (an int past 64 bits) json takes
            return json.dumps(fields, default=str, ensure_ascii=False)


def _trace_ids() -> dict[str, str]:
    # Only where OpenTelemetry is imported already (tracing is on): never imported here.
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


def _format_error(record: logging.LogRecord, exc: Exception) -> str:
    # Where the call whose %-args do not fit its message is, and what formatting it raised.
    return f"{record.pathname}:{record.lineno}: {type(exc).__name__}: {exc}"


class _TextFormatter(logging.Formatter):
    r"""A text line whose control characters are escaped: one record stays one line.

    A message may carry what a client sent (a URL path with ``%0A``, a request
    id): a newline in it would start a line that reads as the server's own
    (log injection), an ANSI escape would rewrite the operator's terminal.
    They are written as ``\n``, ``\x1b``, as in a Python string. A traceback
    after the line keeps its lines. A call whose %-args do not fit its message
    is still one line, as in `JsonFormatter`: it says so, with the message and
    the args unformatted (quoted as the request log's values are).
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record as a line (and its traceback's lines, if it has one)."""
        if record.args:  # without args, the message is the text as it is: nothing to fit
            try:
                record.getMessage()
            except Exception as exc:
                # logging would write "--- Logging error ---" and a traceback on stderr, and
                # drop the record. A copy, so that another handler sees the record as it is.
                record = logging.makeLogRecord(vars(record))
                record.msg = (
                    f"message could not be formatted ({_format_error(record, exc)}): "
                    f"message={_word(str(record.msg))} args={_word(repr(record.args))}"
                )
                record.args = None
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line, with every character that is not printable escaped."""
        line = super().formatMessage(record)
        return line if line.isprintable() else _printable(line)


def _printable(text: str) -> str:
    # repr's escapes (\n, \x1b, \u2028) for what is not printable; rare, so no table.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _formatter(kind: str) -> logging.Formatter:
    if kind == "json":
        return JsonFormatter(_worker)
    text = _FORMAT.format(prefix=_prefix)
    if kind == "ISO8601":
        formatter = _TextFormatter(text, datefmt="%Y-%m-%dT%H:%M:%SZ")
        formatter.converter = time.gmtime
        return formatter
    return _TextFormatter(text)


def install_handler(
    level: str,
    *,
    log_format: str = "default",
    requests: bool = False,
    worker: int | None = None,
) -> None:
    """Log to stderr at *level* (``"info"``, ...): what ``trioinfer serve`` and its workers do.

    The handler is the root logger's, as ``logging.basicConfig`` would make
    it (and, like it, nothing is done when the root logger has handlers
    already), and the one whose format ``log_format`` changes later.
    *log_format* is one of `FORMATS`; *requests* turns the request log on.
    *worker*: this process is that ``serve --workers`` worker, which its
    lines say (``worker 2`` before the logger's name; a ``worker`` field in
    JSON).
    """
    global _handler, _prefix, _worker, _format
    if log_format not in FORMATS:
        raise ConfigError(f"log_format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    REQUESTS.on = requests
    root = logging.getLogger()
    if root.handlers:
        # Someone else owns logging here (an application, a test runner): leave it to
        # them, as logging.basicConfig does; log_format is then refused.
        return
    _prefix = "" if worker is None else f"worker {worker} "
    _worker = worker
    _format = log_format
    handler = logging.StreamHandler()
    handler.setFormatter(_formatter(_format))
    root.addHandler(handler)
    root.setLevel(level.upper())
    _handler = handler


def log_settings() -> dict[str, Any]:
    """The settings as Triton answers ``GET /v2/logging``."""
    level = logging.getLogger(LOGGER).getEffectiveLevel()
    return {
        "log_file": "",
        "log_info": level <= logging.INFO,
        "log_warning": level <= logging.WARNING,
        "log_error": level <= logging.ERROR,
        "log_verbose_level": 1 if level <= logging.DEBUG else 0,
        "log_format": _format,
        "access_log": REQUESTS.on,
    }


def check_log_settings(settings: Mapping[str, Any]) -> tuple[int, str, bool]:
    """The level, format and request log *settings* ask for, over the current ones.

    Nothing changes.

    Raises:
        ConfigError: An unknown key, a value of the wrong type, a setting the
            server cannot honour (``log_file``; ``log_format`` without the
            server's own handler), or switches that are no level threshold.
    """
    unknown = sorted(set(settings) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown log setting {', '.join(map(repr, unknown))}; the log settings are "
            f"{', '.join(_KEYS)}"
        )
    merged = {**log_settings(), **settings}
    for key in ("log_info", "log_warning", "log_error", "access_log"):
        if not isinstance(merged[key], bool):
            raise ConfigError(f"{key} must be true or false, got {merged[key]!r}")
    verbose = merged["log_verbose_level"]
    if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose < 0:
        raise ConfigError(f"log_verbose_level must be an integer >= 0, got {verbose!r}")
    if merged["log_file"] != "":
        raise ConfigError(
            f"log_file is not supported (got {merged['log_file']!r}): trioinfer logs to "
            "stderr, and whoever runs the server routes it; send an empty string or leave "
            "log_file out"
        )
    kind = merged["log_format"]
    if kind not in FORMATS:
        raise ConfigError(
            f"log_format must be 'default', 'ISO8601' or 'json' (trioinfer's), got {kind!r}"
        )
    if kind != _format and _handler is None:
        raise ConfigError(
            "log_format cannot be changed here: the server does not own the log handler "
            "(it is embedded in an application, which formats its own logs)"
        )
    info, warning, error = merged["log_info"], merged["log_warning"], merged["log_error"]
    if (verbose and not info) or (info and not warning) or (warning and not error):
        raise ConfigError(
            "trioinfer's logs have one level threshold: log_verbose_level needs log_info, "
            "log_info needs log_warning, and log_warning needs log_error (got "
            f"log_verbose_level={verbose}, log_info={_js(info)}, log_warning={_js(warning)}, "
            f"log_error={_js(error)})"
        )
    if verbose:
        level = logging.DEBUG
    elif info:
        level = logging.INFO
    elif warning:
        level = logging.WARNING
    elif error:
        level = logging.ERROR
    else:
        level = logging.CRITICAL
    return level, kind, merged["access_log"]


def update_log_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Apply Triton's log *settings* (a partial update); return them all, as after it.

    Raises:
        ConfigError: See `check_log_settings`; then nothing changed.
    """
    global _format
    level, kind, requests = check_log_settings(settings)
    logging.getLogger(LOGGER).setLevel(level)
    if kind != _format and _handler is not None:
        _handler.setFormatter(_formatter(kind))
    _format = kind
    REQUESTS.on = requests
    return log_settings()


def log_request(
    method: str,
    path: str,
    status: int,
    started: float,
    *,
    model: str | None = None,
    version: str | None = None,
    request_id: str | None = None,
    peer: str | None = None,
    bytes_in: int | None = None,
    bytes_out: int | None = None,
    protocol: str = "http",
) -> None:
    """Log one request of the request log (callers test `REQUESTS` ``.on`` first).

    *method* is the HTTP method or ``"grpc"``; *path* the URL path or the gRPC
    method (``/inference.GRPCInferenceService/ModelInfer``); *status* the HTTP
    status or the gRPC status code; *started* the ``time.monotonic()``
    when the request arrived. The text line reads as an access log's; the
    same values are fields of the JSON line (``--log-format json``). A string
    past `LONGEST` characters is cut there (``...`` after it).
    """
    if not _access.isEnabledFor(logging.INFO):
        return
    duration = round((time.monotonic() - started) * 1000, 3)
    path = _cut(path)
    fields: dict[str, Any] = {
        "protocol": protocol,
        "method": method,
        "path": path,
        "status": status,
        "duration_ms": duration,
    }
    words = [f"{_word(method)} {_word(path)} {status} {duration:.3f}ms"]
    for key, value in (
        ("model", model),
        ("version", version),
        ("request_id", request_id),
        ("peer", peer),
        ("bytes_in", bytes_in),
        ("bytes_out", bytes_out),
    ):
        if value is not None and value != "":
            if isinstance(value, str):
                value = _cut(value)
                words.append(f"{key}={_word(value)}")
            else:
                words.append(f"{key}={value}")
            fields[key] = value
    # The record made here, as `Logger.info(..., extra=fields)` would make it, without
    # its search of the stack for the caller (a sixth of a line's cost; no one reads it).
    record = logging.LogRecord(
        ACCESS_LOGGER, logging.INFO, __file__, 0, " ".join(words), None, None
    )
    record.__dict__.update(fields)
    _access.handle(record)


#: The longest value (a path, a request id) the request log writes whole: what a client
#: sends is cut there, so that a line stays short of a log driver's limit (Docker: 16 KiB).
LONGEST: Final = 256


def _cut(value: str) -> str:
    return value if len(value) <= LONGEST else value[:LONGEST] + "..."


#: A value the text line shows as is: printable ASCII, no space, quote or backslash.
_BARE: Final = re.compile(r"[!#-\[\]-~]+")


def _word(value: str) -> str:
    # Anything else is quoted, as a JSON string: a client's space cannot make a field of
    # its own (`request_id=a peer=...`), nor a quote end the value early.
    return value if _BARE.fullmatch(value) else json.dumps(value, ensure_ascii=False)


def _js(flag: bool) -> str:
    return "true" if flag else "false"
