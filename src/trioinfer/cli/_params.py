"""Parameter callbacks that more than one command uses."""

from __future__ import annotations

import math

import click


def _not_nan(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    # FloatRange lets NaN through (every comparison with it is false).
    if math.isnan(value):
        raise click.BadParameter("must be a number of seconds > 0, not nan")
    return value
