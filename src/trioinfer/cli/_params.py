"""What more than one command uses: parameter callbacks, the missing-extra error."""

from __future__ import annotations

import math

import click


def _not_nan(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    # FloatRange lets NaN through (every comparison with it is false).
    if math.isnan(value):
        raise click.BadParameter("must be a number of seconds > 0, not nan")
    return value


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
