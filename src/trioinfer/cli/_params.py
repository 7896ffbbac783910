"""What more than one command uses: parameter callbacks, the missing-extra error."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._bounds import check_seconds
from .._exceptions import ConfigError

T = TypeVar("T", float, float | None)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}  # fmt: skip


def not_nan(expected: str) -> Callable[[click.Context, click.Parameter, T], T]:
    """A callback refusing NaN for a float option (or None), saying it must be *expected*.

    FloatRange lets NaN through (every comparison with it is false).
    """

    def check(_ctx: click.Context, _param: click.Parameter, value: T) -> T:
        if isinstance(value, float) and math.isnan(value):
            raise click.BadParameter(f"must be {expected}, not nan")
        return value

    return check


class Seconds(click.types.FloatParamType):
    """A duration in seconds, in the range every duration of trioinfer takes.

    The range and its message are `trioinfer.lowlevel.check_seconds`'s, as for a
    config file's durations: FloatRange(min=0) took ``1e-300`` (a busy loop for
    --repository-poll-secs), ``1e300`` and NaN.
    """

    name = "seconds"

    def __init__(self, *, zero: bool = False, never: bool = False) -> None:
        """Accept 0 too where *zero*, ``inf`` where *never* (see ``check_seconds``)."""
        self.zero = zero
        self.never = never

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        """The duration as a float; a usage error naming the range otherwise."""
        number = super().convert(value, param, ctx)
        try:
            return check_seconds("it", number, zero=self.zero, never=self.never)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def needs_extra(extra: str, exc: ModuleNotFoundError) -> click.ClickException:
    """The one-line error of a command whose extra is not installed.

    A missing module of trioinfer itself is a bug, not a missing extra: it is
    raised as it is.
    """
    top = (exc.name or "trioinfer").partition(".")[0]
    if top == "trioinfer":
        raise exc
    return click.ClickException(
        f"trioinfer {extra} needs the {extra!r} extra, which is not installed (no module "
        f"named {top!r}): install trioinfer with it, e.g. pip install -e '.[cpu,{extra}]' "
        "in a clone"
    )


# For commands that take options only: their extra arguments reach the command, which
# says which option was meant (click's own "Got unexpected extra argument" does not).
TAKES_NO_ARGUMENTS: dict[str, Any] = {"allow_extra_args": True}


def no_arguments(ctx: click.Context, meant: str) -> None:
    """Refuse arguments given to a command of options only, naming the option meant.

    *meant* completes "did you mean ..." for the first argument, ``{arg}`` standing
    for it. Used with `TAKES_NO_ARGUMENTS` as the command's context settings.
    """
    if ctx.args:
        arg = ctx.args[0]
        raise click.UsageError(
            f"trioinfer {ctx.info_name} takes no arguments, got "
            f"{', '.join(map(repr, ctx.args))}: {meant.format(arg=arg)}",
            ctx,
        )


class ByteSize(click.ParamType):  # type: ignore[type-arg]  # generic only in stubs
    """A size in bytes: ``1048576``, ``512KiB``, ``256MiB``, ``1GB``."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """The size as an int of bytes; a usage error saying the forms accepted otherwise."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            self.fail(
                f"{value!r} is not a size: write bytes, or a number with KB, MB, GB, KiB, MiB "
                "or GiB (e.g. 256MiB)",
                param,
                ctx,
            )
        return int(match.group(1)) * _UNITS[unit]
