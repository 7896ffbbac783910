"""The ``trioinfer`` command line: the click group `main`, and one module per command.

``trioinfer demo`` (module ``demo``) shows the engine at work on the bundled
example model; ``trioinfer serve`` (``serve``) serves a model repository over
the KServe V2 HTTP protocol; ``trioinfer bench`` (``bench``) measures a V2
server or an engine under load; ``trioinfer plugins`` (``plugins``) lists the
installed plugins; ``trioinfer traffic`` (``traffic``) reads or changes a running
server's split of traffic between a model's versions. Each module defines its
command, which `main` adds here.
The console script ``trioinfer`` and ``python -m trioinfer`` both run `main()`.
"""

from __future__ import annotations

from typing import Any

import click

from .. import __version__
from . import bench, demo, plugins, serve, traffic


class _Main(click.Group):
    """The ``trioinfer`` group: Ctrl+C is click's ``Aborted!``, wherever it lands."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a KeyboardInterrupt that nurseries wrapped is re-raised bare.

        Ctrl+C before a command watches signals (``serve`` while its models load), or
        after it stops watching (a second one as the server finishes stopping), is Trio's
        KeyboardInterrupt, which each nursery it crosses wraps in a BaseExceptionGroup.
        click turns only a bare one into ``Aborted!`` (exit 1); a group made only of them
        would print a long traceback for the user's own keypress. A group with anything
        else in it is a failure and keeps its traceback.
        """
        try:
            return super().invoke(ctx)
        except BaseExceptionGroup as group:
            _, rest = group.split(KeyboardInterrupt)
            if rest is None:
                raise KeyboardInterrupt from None
            raise


@click.group(
    cls=_Main,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(
    __version__, "--version", prog_name="trioinfer", message="%(prog)s %(version)s"
)
def main() -> None:
    """trioinfer: structured-concurrency AI inference for Trio and anyio.

    trioinfer is a Python library: an engine opened with
    "async with trioinfer.open_engine()" owns every queue, batch loop and
    backend call, and "await engine.infer(...)" runs under the caller's own
    cancel scope, whose deadline travels with the request. Backends,
    schedulers, batchers and fallbacks are plugins found through entry points.

    This command shows the engine at work on a bundled example model (demo),
    serves a model repository over the KServe V2 HTTP and gRPC protocols
    (serve), measures a V2 server or an engine under load (bench), changes a
    running server's traffic split between a model's versions (traffic), and
    lists the installed plugins (plugins).
    """


# Each module defines its command. (Imported as modules, not as the commands, so
# that trioinfer.cli.bench and the others stay the modules.)
main.add_command(bench.bench)
main.add_command(demo.demo)
main.add_command(plugins.plugins)
main.add_command(serve.serve)
main.add_command(traffic.traffic)
