"""``trioinfer bench``: a load generator for any KServe V2 server, or for an engine in-process.

Two load shapes, both measured the same way:

* closed loop (``--concurrency 1,16,64``): C workers, each on its own keep-alive
  connection, send their next request as soon as the last one is answered;
* open loop (``--request-rate 500,1000``): requests are due at fixed (constant)
  or random (Poisson) times and latency runs from the time a request was *due*,
  not from when it went out, so a server that falls behind cannot hide it
  (no coordinated omission).

Each level warms up (excluded), then measures windows of ``--window`` seconds
until the last three agree on throughput and p99 within ``--stability`` percent
(or a fixed ``--windows`` count). The HTTP client speaks only the V2 protocol
(model metadata and infer) over plain non-blocking sockets; ``--protocol grpc``
speaks V2 gRPC instead (``_grpc``, closed loop; its lean HTTP/2 client is
``_grpc_raw``, grpcio's ``grpc.aio`` the other choice). A level's connections
are all driven by one loop in a worker thread (`_LoadLoop`): one ``epoll`` wait
returns every answer that arrived and one timeout serves every request due before
it, with no Trio task switch or timer per request; every request's bytes are
encoded once before the run and answers are parsed by httptools. So the tool costs
little CPU per request; it measures its own CPU time and reports it. Trio runs the
rest: metadata, windows, the progress display, and in-process levels.

The command line is the interface most people need; from Python, `run_http` or
`run_in_process` with a `Plan` give a `Run`, which `print_table` and
`write_json` report. The modules, by job: ``_inputs`` (request inputs),
``_client`` (the HTTP client), ``_load`` (the load loops and arrivals),
``_modes`` (streaming, sequences and shared memory: perf_analyzer's modes),
``_stats`` (windows, stability, results), ``_run`` (levels over HTTP or
in-process) and ``_report`` (table, progress, files).

It needs what the ``bench`` extra installs (from a clone, ``pip install -e
'.[cpu,bench]'``): importing it without them raises `ImportError` saying so. rich (the table and
progress bar) and matplotlib (``--plot``) are optional even then, and are
imported only when used.
"""

from __future__ import annotations

try:
    # What every level needs: the client's response parser and the server's V2 codec.
    import httptools  # noqa: F401

    from .. import server  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"trioinfer bench needs the 'bench' extra, which is not installed (no module named "
        f"{exc.name or '?'!r}): install trioinfer with it, e.g. pip install -e '.[cpu,bench]' "
        "in a clone",
        name=exc.name,
    ) from exc

from ._client import HttpTarget as HttpTarget
from ._grpc import GrpcTarget as GrpcTarget
from ._inputs import BenchError as BenchError
from ._inputs import Tensor as Tensor
from ._inputs import load_inputs as load_inputs
from ._inputs import random_inputs as random_inputs
from ._inputs import zero_inputs as zero_inputs
from ._load import iter_arrivals as iter_arrivals
from ._load import iter_intervals as iter_intervals
from ._modes import Modes as Modes
from ._report import format_table as format_table
from ._report import open_progress as open_progress
from ._report import print_table as print_table
from ._report import write_csv as write_csv
from ._report import write_json as write_json
from ._report import write_plot as write_plot
from ._run import DEFAULT_MAX_CONNECTIONS as DEFAULT_MAX_CONNECTIONS
from ._run import Plan as Plan
from ._run import Run as Run
from ._run import open_local_model as open_local_model
from ._run import run_grpc as run_grpc
from ._run import run_http as run_http
from ._run import run_in_process as run_in_process
from ._stats import PERCENTILES as PERCENTILES
from ._stats import STABLE_WINDOWS as STABLE_WINDOWS
from ._stats import Progress as Progress
from ._stats import Result as Result
from ._stats import Settings as Settings
from ._stats import is_stable as is_stable

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "PERCENTILES",
    "STABLE_WINDOWS",
    "BenchError",
    "GrpcTarget",
    "HttpTarget",
    "Modes",
    "Plan",
    "Progress",
    "Result",
    "Run",
    "Settings",
    "Tensor",
    "format_table",
    "is_stable",
    "iter_arrivals",
    "iter_intervals",
    "load_inputs",
    "open_local_model",
    "open_progress",
    "print_table",
    "random_inputs",
    "run_grpc",
    "run_http",
    "run_in_process",
    "write_csv",
    "write_json",
    "write_plot",
    "zero_inputs",
]
