"""Tracing settings: ``--trace-*`` options, ``OTEL_*`` variables, Triton's trace settings JSON.

Nothing here imports ``opentelemetry`` at module level, so that the server
can answer ``/v2/trace/setting`` (tracing off) without it; the spans are in
`trioinfer._tracing`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._exceptions import ConfigError

if TYPE_CHECKING:
    from ._tracing import Tracing


def check_rate(rate: object, what: str = "trace rate") -> float:
    """*rate* as a sampling ratio in [0, 1], or `ConfigError` saying what was expected."""
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or math.isnan(rate)
        or not 0 <= rate <= 1
    ):
        raise ConfigError(
            f"{what} must be a ratio between 0 and 1 (0.001 = 1 in 1000), got {rate!r}"
        )
    return float(rate)


def check_trace_settings(
    exporter: str | None,
    rate: float | None,
    *,
    environ: Mapping[str, str],
) -> tuple[str, float] | None:
    """The exporter and rate that ``--trace-*`` options and ``OTEL_*`` variables ask for.

    None when tracing is off. Checks everything `provider_from_settings`
    would, and builds nothing: the supervisor of ``serve --workers`` checks
    the settings once, before each worker builds its own provider.

    *exporter* (``otlp``, ``console`` or ``none``) and *rate* win over
    ``OTEL_TRACES_EXPORTER``, ``OTEL_TRACES_SAMPLER`` and
    ``OTEL_TRACES_SAMPLER_ARG``; ``OTEL_SDK_DISABLED=true`` turns tracing off.
    Tracing is off unless an exporter is named one way or the other.

    Raises:
        ConfigError: A setting that cannot be followed, said plainly.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if exporter is None:
        exporter = environ.get("OTEL_TRACES_EXPORTER", "none").split(",")[0].strip().lower()
    if exporter not in ("otlp", "console", "none"):
        raise ConfigError(f"trace exporter must be one of otlp, console, none; got {exporter!r}")
    if exporter == "none":
        return None
    if rate is None:
        rate = _env_rate(environ)
    rate = check_rate(rate, "--trace-rate")
    if exporter == "otlp":
        protocol = environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
        )
        if protocol.strip().lower() not in ("", "http/protobuf"):
            raise ConfigError(
                f"the otlp trace exporter here sends http/protobuf (port 4318), but "
                f"OTEL_EXPORTER_OTLP_PROTOCOL asks for {protocol!r}; set it to http/protobuf "
                "or leave it unset, and point OTEL_EXPORTER_OTLP_ENDPOINT at the collector's "
                "HTTP port"
            )
    return exporter, rate


def provider_from_settings(
    exporter: str | None,
    rate: float | None,
    *,
    environ: Mapping[str, str],
) -> tuple[Any, float] | None:
    """A tracer provider and rate from ``--trace-*`` options and ``OTEL_*`` variables.

    None when tracing is off; the provider is OpenTelemetry SDK's, exporting
    in batches (call its ``shutdown()`` at exit to flush). The settings are
    read as `check_trace_settings` reads them. The OTLP exporter reads its
    endpoint, headers and protocol settings from the standard
    ``OTEL_EXPORTER_OTLP_*`` variables itself.
    """
    checked = check_trace_settings(exporter, rate, environ=environ)
    if checked is None:
        return None
    exporter, rate = checked
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
    except ImportError as exc:  # pragma: no cover - the otel extra is installed in tests
        raise ConfigError("tracing needs the otel extra: pip install 'trioinfer[otel]'") from exc
    span_exporter: SpanExporter
    if exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        span_exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - the otel extra is installed in tests
            raise ConfigError(
                "the otlp trace exporter needs the otel extra: pip install 'trioinfer[otel]'"
            ) from exc
        span_exporter = OTLPSpanExporter()
    attributes = {} if "OTEL_SERVICE_NAME" in environ else {"service.name": "trioinfer"}
    # trioinfer samples where a trace starts (so that the rate can change at run
    # time); the provider keeps what it is given.
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON), resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    return provider, rate


def _env_rate(environ: Mapping[str, str]) -> float:
    sampler = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler in ("always_on", "parentbased_always_on"):
        return 1.0
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            return check_rate(float(arg), "OTEL_TRACES_SAMPLER_ARG")
        except ValueError:
            raise ConfigError(
                f"OTEL_TRACES_SAMPLER_ARG must be a ratio between 0 and 1, got {arg!r}"
            ) from None
    raise ConfigError(
        f"OTEL_TRACES_SAMPLER={sampler!r} is not one trioinfer can follow; use always_on, "
        "always_off, traceidratio or their parentbased_ forms (or --trace-rate)"
    )


# -- Triton's trace settings ---------------------------------------------------------------

_FIXED = {"trace_count": "-1", "log_frequency": "0", "trace_file": ""}


def trace_settings(tracing: Tracing | None, model: str | None) -> dict[str, Any]:
    """Triton's trace settings JSON for the server, or for *model*."""
    if tracing is None or not tracing.enabled:
        level = ["OFF"]
        rate = tracing.rate if tracing is not None else 0.0
    else:
        level = ["TIMESTAMPS"]
        rate = tracing.rate
    if tracing is not None and model is not None:
        rate = tracing.model_rates.get(model, rate)
    return {
        "trace_level": level,
        "trace_rate": _one_in(rate),
        **_FIXED,
        "trace_mode": "opentelemetry",
    }


def _one_in(rate: float) -> str:
    # Triton says "1 in N"; a ratio of 0 is sent as 0 (no request sampled).
    return "0" if rate <= 0 else str(round(1 / rate))


def update_trace_settings(
    tracing: Tracing | None, model: str | None, settings: Mapping[str, Any]
) -> None:
    """Apply a Triton trace settings request; `ConfigError` for what cannot be done.

    Only what changes something real is accepted: ``trace_rate`` (1 in N; for
    a model, ``null``, or a request with no settings, returns it to the global
    rate) and ``trace_level`` (``OFF`` or ``TIMESTAMPS``, server-wide). The
    other Triton settings keep the values `trace_settings` reports, since spans
    go to an OpenTelemetry exporter, not to a file.
    """
    if not isinstance(settings, Mapping):
        raise ConfigError("a trace settings request must be a JSON object")
    if model is not None and not settings and tracing is not None:
        # Triton: a model's request with no settings removes the model's own.
        tracing.model_rates.pop(model, None)
        return
    known = {"trace_rate", "trace_level", "trace_mode", *_FIXED}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(
            f"unknown trace setting {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    for name, fixed in {**_FIXED, "trace_mode": "opentelemetry"}.items():
        value = settings.get(name)
        if value is not None and _scalar(value) != fixed:
            raise ConfigError(
                f"{name} cannot be changed here: spans go to the OpenTelemetry exporter set "
                f"at start (trioinfer serve --trace-exporter), and {name} stays {fixed!r}"
            )
    if tracing is None:
        if settings.get("trace_rate") is not None or settings.get("trace_level") not in (
            None,
            ["OFF"],
            "OFF",
        ):
            raise ConfigError(
                "tracing is not configured on this server: start it with "
                "--trace-exporter otlp|console (or OTEL_TRACES_EXPORTER) to change trace settings"
            )
        return
    level = settings.get("trace_level")
    enabled: bool | None = None
    if level is not None:
        levels = [level] if isinstance(level, str) else level
        if not isinstance(levels, list) or not all(isinstance(v, str) for v in levels):
            raise ConfigError(f"trace_level must be a list of strings, got {level!r}")
        upper = {v.upper() for v in levels}
        if "TENSORS" in upper:
            raise ConfigError(
                "trace_level TENSORS is not supported: spans carry times and attributes, "
                "never tensor contents; use TIMESTAMPS or OFF"
            )
        if not upper <= {"OFF", "TIMESTAMPS"} or not upper:
            raise ConfigError(f"trace_level must be OFF or TIMESTAMPS, got {level!r}")
        if "OFF" in upper and len(upper) > 1:
            raise ConfigError(
                f'trace_level OFF goes alone: ["OFF"] stops tracing, ["TIMESTAMPS"] traces; '
                f"got {level!r}"
            )
        if model is not None:
            raise ConfigError(
                "trace_level is server-wide here: set it on /v2/trace/setting; a model "
                "can change its trace_rate"
            )
        enabled = upper != {"OFF"}
    rate: float | None = None
    clear = False
    if "trace_rate" in settings:
        value = settings["trace_rate"]
        if value is None:
            clear = True
        else:
            try:
                one_in = int(_scalar(value))
            except (TypeError, ValueError):
                one_in = -1
            if one_in < 0:
                raise ConfigError(
                    f"trace_rate must be a whole number N >= 0 (one request in N traced; 0 "
                    f"for none), got {value!r}"
                )
            rate = 1.0 / one_in if one_in else 0.0
    # Checked everything: now change.
    if enabled is not None:
        tracing.enabled = enabled
    if model is None:
        if clear:
            tracing.rate = tracing.initial_rate
        elif rate is not None:
            tracing.rate = rate
    elif clear:
        tracing.model_rates.pop(model, None)
    elif rate is not None:
        tracing.model_rates[model] = rate


def _scalar(value: Any) -> str:
    # Triton's values are strings, or lists of one string (the gRPC form).
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return str(value)
