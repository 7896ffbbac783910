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
(local time) or ``ISO8601`` (UTC, ``2026-12-04T20:33:25Z``), as in Triton.

With ``serve --workers N`` a change goes through the supervisor to every
worker (and to a worker that restarts later), as repository changes do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from .._exceptions import ConfigError

__all__ = ["install_handler", "log_settings", "update_log_settings"]

#: The logger whose level the settings set: every trioinfer logger is below it.
LOGGER: Final = "trioinfer"
_FORMAT: Final = "%(asctime)s {prefix}%(name)s %(levelname)s %(message)s"
_FORMATS: Final = ("default", "ISO8601")
_KEYS: Final = (
    "log_file",
    "log_info",
    "log_warning",
    "log_error",
    "log_verbose_level",
    "log_format",
)

# The stderr handler `trioinfer serve` installed, whose format log_format sets.
_handler: logging.Handler | None = None
_format = "default"
_prefix = ""


def _formatter(kind: str) -> logging.Formatter:
    text = _FORMAT.format(prefix=_prefix)
    if kind == "ISO8601":
        formatter = logging.Formatter(text, datefmt="%Y-%m-%dT%H:%M:%SZ")
        formatter.converter = time.gmtime
        return formatter
    return logging.Formatter(text)


def install_handler(level: str, *, prefix: str = "") -> None:
    """Log to stderr at *level* (``"info"``, ...): what ``trioinfer serve`` and its workers do.

    The handler is the root logger's, as ``logging.basicConfig`` would make
    it (and, like it, nothing is done when the root logger has handlers
    already), and the one whose format ``log_format`` changes later. *prefix* goes
    before each record's logger name (``"worker 2 "``).
    """
    global _handler, _prefix
    root = logging.getLogger()
    if root.handlers:
        # Someone else owns logging here (an application, a test runner): leave it to
        # them, as logging.basicConfig does; log_format is then refused.
        return
    _prefix = prefix
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
    }


def check_log_settings(settings: Mapping[str, Any]) -> tuple[int, str]:
    """The level and format *settings* ask for, over the current ones; nothing changes.

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
    for key in ("log_info", "log_warning", "log_error"):
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
    if kind not in _FORMATS:
        raise ConfigError(f"log_format must be 'default' or 'ISO8601', got {kind!r}")
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
    return level, kind


def update_log_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Apply Triton's log *settings* (a partial update); return them all, as after it.

    Raises:
        ConfigError: See `check_log_settings`; then nothing changed.
    """
    global _format
    level, kind = check_log_settings(settings)
    logging.getLogger(LOGGER).setLevel(level)
    if kind != _format and _handler is not None:
        _handler.setFormatter(_formatter(kind))
    _format = kind
    return log_settings()


def _js(flag: bool) -> str:
    return "true" if flag else "false"
