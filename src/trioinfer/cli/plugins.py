"""``trioinfer plugins``: what the registry finds, and whether each plugin imports."""

from __future__ import annotations

from collections.abc import Sequence

import click

from .._registry import Registry


@click.command()
def plugins() -> None:
    """List the installed plugins and whether each one loads.

    Shows every backend, scheduler, batcher and fallback declared through the
    entry-point groups trioinfer.backends, trioinfer.schedulers,
    trioinfer.batchers and trioinfer.fallbacks: its kind, the name configs
    use, the module:attribute it points to, the distribution that declares it,
    and `ok` if it imports and has what it needs, the error if it does not
    import or cannot be a plugin of its kind (it names something not callable,
    or a class without its contract's methods), or what it lacks (Ray for the
    ray backend on an install without the ray extra) and how to install it.

    Exits with status 0 if every plugin loads, 1 if any fails to. A
    plugin that lacks a dependency is not a failure: an install without an
    extra is a normal one, and the plugin fails only when a model uses it.
    """
    registry = Registry()
    found = registry.plugins()
    if not found:
        click.echo("no plugins found in the trioinfer.* entry-point groups")
        return
    rows: list[Sequence[str]] = [("KIND", "NAME", "TARGET", "DISTRIBUTION", "STATUS")]
    failures = lacking = 0
    for info in found:
        error = registry.check(info)
        failures += error is not None
        if error is None and (missing := registry.missing(info)) is not None:
            lacking += 1
            error = missing
        status = "ok" if error is None else " ".join(error.split())
        rows.append((info.kind, info.name, info.target, info.distribution or "-", status))
    _table(rows)
    if lacking:
        click.echo(
            f"{lacking} of {len(found)} plugins lack a dependency: they fail when a model "
            "uses them until it is installed",
            err=True,
        )
    if failures:
        click.echo(f"{failures} of {len(found)} plugins failed to load", err=True)
        click.get_current_context().exit(1)


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, row[-1]]))
