"""``trioinfer bench``: the command line of the load tool `trioinfer.bench`.

The tool is the ``bench`` extra's and is imported only when the command runs,
so that ``trioinfer bench --help`` works without it and the command can say
what to install.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import trio
from click.core import ParameterSource

from .._bounds import MAX_RATE, MIN_RATE, RATE_RANGE
from .._exceptions import TrioInferError
from ._params import TAKES_NO_ARGUMENTS, Seconds, no_arguments

if TYPE_CHECKING:
    from collections.abc import Callable

    from .. import bench as tool

_T = TypeVar("_T")


def _numbers(kind: type[int] | type[float], expected: str, low: float, high: float) -> Any:
    # A comma-separated list of levels, each from low to high; the error says what
    # one level may be ("0" was "not a positive number", with no word of the range).
    def parse(_ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return ()
        try:
            numbers = tuple(kind(part) for part in value.split(",") if part.strip())
        except ValueError:
            numbers = ()
        if not numbers or not all(low <= n <= high for n in numbers):
            raise click.BadParameter(f"expected {expected}, separated by commas; got {value!r}")
        return numbers

    return parse


def _output_file(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Any:
    # Checked before the run, which may take minutes: a file that cannot be written
    # was found only after it, the figures of the whole run lost with it.
    if value is None:
        return None
    folder = value.parent
    if not folder.is_dir():
        raise click.BadParameter(f"cannot write {str(value)!r}: no directory {str(folder)!r}")
    if not os.access(value if value.exists() else folder, os.W_OK):
        raise click.BadParameter(f"cannot write {str(value)!r}: permission denied")
    return value


def _shapes(_ctx: click.Context, _param: click.Parameter, value: Sequence[str]) -> dict[str, Any]:
    shapes: dict[str, list[int]] = {}
    for item in value:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise click.BadParameter(f"expected NAME=D1,D2,..., got {item!r}") from None
    return shapes


def _input_data(
    _ctx: click.Context, _param: click.Parameter, value: Sequence[str]
) -> tuple[str, tuple[Path, ...]]:
    # perf_analyzer's --input-data: 'random', 'zero', or files (here .npz or .json).
    modes = [v for v in value if v in ("random", "zero")]
    if modes and len(value) > 1:
        raise click.BadParameter(
            f"{modes[0]!r} goes alone; give it once, or give only files (a file named "
            f"{modes[0]!r}: write ./{modes[0]})"
        )
    if modes:
        return modes[0], ()
    files = tuple(Path(v) for v in value)
    for path in files:
        if not path.is_file():
            raise click.BadParameter(
                f"expected 'random', 'zero' or an .npz or .json file; {str(path)!r} is no file"
            )
    return "random", files


def _id_range(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, int | None]:
    # perf_analyzer's --sequence-id-range START:END, END excluded and optional.
    start, _, end = value.partition(":")
    try:
        first, last = int(start), int(end) if end else None
    except ValueError:
        first, last = 0, None
    if first < 1 or (last is not None and last <= first):
        raise click.BadParameter(
            f"expected START or START:END, whole numbers with 1 <= START < END, got {value!r}"
        )
    return first, last


def _intervals(
    _ctx: click.Context, _param: click.Parameter, value: Path | None
) -> tuple[Path, tuple[int, ...]] | None:
    # perf_analyzer's --request-intervals FILE: one gap in microseconds per line; the
    # file and its gaps in ns.
    if value is None:
        return None
    try:
        lines = value.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {str(value)!r}: {exc}") from None
    gaps = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            gap = int(line)
        except ValueError:
            gap = -1
        if gap < 0:
            raise click.BadParameter(
                f"{value}, line {number}: expected a whole number of microseconds (0 or "
                f"more), got {line.strip()[:40]!r}"
            )
        gaps.append(gap * 1000)
    if not sum(gaps):
        raise click.BadParameter(
            f"{value} holds no interval above 0 microseconds: requests would all be due at once"
        )
    return value, tuple(gaps)


_REFUSED_INPUTS = (
    "400",  # HTTP: the server's answer to inputs it refuses
    "INVALID_ARGUMENT",  # gRPC: the same
    "InvalidInput",  # in-process: the engine's error
    "SequenceError",  # in-process: an InvalidInput too
)


@click.command(
    short_help="Load-test a KServe V2 server (or an engine in-process) and report.",
    context_settings=TAKES_NO_ARGUMENTS,
)
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    metavar="URL",
    help="The V2 server (trioinfer, Triton, MLServer, KServe): http://HOST:PORT, or with "
    "--protocol grpc, grpc://HOST:PORT (default 127.0.0.1:8001); HOST:PORT alone, as "
    "perf_analyzer's -u, is either. No TLS (https).",
)
@click.option(
    "--protocol",
    type=click.Choice(["http", "grpc"]),
    default="http",
    show_default=True,
    help="V2 over HTTP/1.1, or V2 gRPC (Triton's inference.GRPCInferenceService; raw tensor "
    "contents; needs the 'grpc' extra).",
)
@click.option(
    "--grpc-client",
    type=click.Choice(["raw", "aio"]),
    default="raw",
    show_default=True,
    help="With --protocol grpc: the lean client (HTTP/2 over plain sockets, 16 calls in flight "
    "per connection) or grpcio's grpc.aio client (several times its CPU per request), to "
    "compare.",
)
@click.option("-m", "--model", default=None, metavar="NAME", help="The model to load-test.")
@click.option(
    "--model-version",
    default=None,
    metavar="VERSION",
    help="A model version (default: the server's; in-process: the highest its version "
    "policy serves).",
)
@click.option(
    "--concurrency",
    callback=_numbers(int, "whole numbers of 1 or more", 1, math.inf),
    default="1",
    show_default=True,
    metavar="C1,C2,...",
    help="Closed loop: this many requests in flight, one per connection; one level each.",
)
@click.option(
    "--request-rate",
    callback=_numbers(float, f"rates from {RATE_RANGE}", MIN_RATE, MAX_RATE),
    default=None,
    metavar="R1,R2,...",
    help="Open loop instead: requests per second offered (0.001 to 1000000), one level "
    "each; latency counts from when each request was due, and the rate sent and how late "
    "requests left are reported beside it. Every protocol and mode.",
)
@click.option(
    "--request-intervals",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    callback=_intervals,
    default=None,
    metavar="FILE",
    help="Open loop instead: the gaps between requests, in microseconds, one per line, in "
    "turn and cycled (perf_analyzer's); one level, at their mean rate.",
)
@click.option(
    "--arrivals",
    type=click.Choice(["poisson", "constant"]),
    default="poisson",
    show_default=True,
    help="Open loop: random (Poisson) or evenly spaced arrivals.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Open loop: the most connections (in-process: workers; gRPC: calls in flight, 16 "
    "per connection) to open; over HTTP more open as requests find all busy, up to N (0, "
    "the default: 1024).",
)
@click.option(
    "--input-data",
    "input_data",
    multiple=True,
    callback=_input_data,
    metavar="random|zero|FILE",
    help="Inputs: 'random' (the default: integers 0-99, floats 0-1, strings of 8 letters), "
    "'zero' (zeros, false, and '0' for strings), or a .npz (one array per input) or .json (a "
    "V2 infer request) file; repeat FILE to cycle through several. Generated data is shaped "
    "from the model's metadata. A model that checks its values (the bundled read_digit takes "
    "0-16) refuses random data: use zero or a file.",
)
@click.option(
    "--shape",
    multiple=True,
    callback=_shapes,
    metavar="NAME=D1,D2",
    help="Generated data (random or zero): the shape of input NAME (default: its metadata, "
    "-1 taken as 1). Not with --input-data FILE, whose requests give their own shapes.",
)
@click.option(
    "--encoding",
    type=click.Choice(["json", "binary"]),
    default="json",
    show_default=True,
    help="Tensors as JSON data, or Triton's binary tensor extension.",
)
@click.option(
    "--warmup",
    type=Seconds(zero=True),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Load before measuring each level, not counted.",
)
@click.option(
    "--window",
    type=Seconds(),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="The length of one measurement window.",
)
@click.option(
    "--stability",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    metavar="PERCENT",
    help="Measure until the last 3 windows' throughput and p99 are within PERCENT of their mean.",
)
@click.option(
    "--max-windows",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    metavar="N",
    help="Give up on stability after N windows (the last 3 count).",
)
@click.option(
    "--windows",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help=(
        "Measure exactly N windows and count them all, instead of waiting for stability "
        "(0, the default: wait for stability)."
    ),
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds random inputs and arrivals."
)
@click.option(
    "--streaming",
    is_flag=True,
    default=False,
    help="Decoupled (streaming) models: each request is an HTTP generate_stream request "
    "(server-sent events), one of a worker's requests on its gRPC ModelStreamInfer stream "
    "(--protocol grpc) or engine.infer_stream (--in-process); latency runs to its last "
    "response, and responses/s and the time to the first response are reported too.",
)
@click.option(
    "--sequence-length",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Stateful (sequence) models: each closed-loop worker sends sequences of about N "
    "requests (sequence_id, sequence_start, sequence_end), so concurrency is sequences in "
    "flight (default for a stateful model: 20, as perf_analyzer's).",
)
@click.option(
    "--sequence-length-variation",
    type=click.FloatRange(min=0, max=100),
    default=20.0,
    show_default=True,
    metavar="PERCENT",
    help="Sequences: each one's length is drawn within this percent of --sequence-length.",
)
@click.option(
    "--sequence-id-range",
    callback=_id_range,
    default="1",
    show_default=True,
    metavar="START[:END]",
    help="Sequences: their ids, START up to END (excluded; none: no end), each new sequence "
    "the next; a range smaller than the concurrency is refused (ids would collide).",
)
@click.option(
    "--num-of-sequences",
    "open_sequences",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    metavar="N",
    help="Sequences, open loop (--request-rate): this many sequences in flight, each on a "
    "connection of its own taking due requests in turn, one request at a time.",
)
@click.option(
    "--shared-memory",
    type=click.Choice(["none", "system", "cuda"]),
    default="none",
    show_default=True,
    help="system: inputs and outputs in a system shared-memory region per connection "
    "(registered with the server, unregistered at the end; an open loop's connections are "
    "then a fixed pool); cuda is not supported.",
)
@click.option(
    "--output-shared-memory-size",
    type=click.IntRange(min=1),
    default=102_400,
    show_default=True,
    metavar="BYTES",
    help="--shared-memory: the room for each output in a region; larger than the largest "
    "output the model answers.",
)
@click.option(
    "--in-process",
    is_flag=True,
    default=False,
    help="Drive an engine in this process (no HTTP): needs --model-file, or "
    "--model-repository and --model.",
)
@click.option(
    "--model-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    metavar="FILE",
    help="In-process: an ONNX model, loaded with default settings.",
)
@click.option(
    "--model-repository",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    metavar="DIR",
    help=(
        "In-process: a model repository; --model is loaded as 'trioinfer serve' loads it "
        "(config.toml or config.pbtxt, version policy), a pipeline after its steps' models."
    ),
)
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_output_file,
    default=None,
    metavar="FILE",
    help="Also write the results as JSON.",
)
@click.option(
    "--csv",
    "csv_file",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_output_file,
    default=None,
    metavar="FILE",
    help="Also write the results as CSV.",
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_output_file,
    default=None,
    metavar="FILE.png",
    help="Plot latency percentiles against throughput (needs the bench extra's matplotlib).",
)
def bench(**options: Any) -> None:
    """Load-test a model on a KServe V2 server, or on an engine in-process, and report.

    Over HTTP it speaks only the V2 protocol (model metadata and infer), so it
    works against trioinfer, Triton, MLServer or KServe. Inputs are random data
    shaped from the model's metadata (GET /v2/models/NAME), zeros
    (--input-data zero), or read from files; each distinct request is encoded
    once, before the run. A model that checks its values may refuse random
    data (the bundled read_digit takes 0-16): the tool then says to use
    --input-data zero or a file. With
    --protocol grpc it speaks V2 gRPC (Triton's inference.GRPCInferenceService)
    from a lean HTTP/2 client over plain sockets, 16 calls in flight per
    connection; a call counts as done when it ends with grpc-status
    0 and one whole answer message, else as an error named by its gRPC status.

    Closed loop (--concurrency 1,16,64): C keep-alive connections, each sending
    its next request when the last is answered. Open loop (--request-rate
    500,1000): requests are due at Poisson (or constant) times whatever the
    server does, and latency counts from when each was due; a request that
    finds every connection busy goes out on a new one, up to --max-connections,
    then waits (counted "late"; with too many waiting, new ones are
    "dropped"), so an overloaded server shows as latency, not as a politely
    slower client; the rate sent and how late requests left are reported
    beside the rate asked. --request-intervals FILE gives the gaps between
    requests instead (microseconds, one per line, cycled). Open loops run
    over HTTP, gRPC and --in-process, in every mode below.

    Each level warms up (not counted), then measures windows until the last
    three agree within --stability (or --windows N). The table (on stdout)
    gives throughput, latency percentiles of successful requests, errors, and
    the tool's own CPU time per request and cores used, progress display
    included (in-process: the whole process, engine included). While it runs,
    a progress bar shows on stderr when stderr is a terminal (drawn by rich
    when installed, as the bench extra installs it).

    Streaming (--streaming, for decoupled models such as the bundled
    repeat_int32; over HTTP generate_stream, gRPC or in-process): each request runs until
    its last response; the table adds responses per second and the time to
    the first response. Sequences (stateful models; --sequence-length N,
    --sequence-id-range START:END): each closed-loop worker sends sequences
    of about N requests with sequence_id, sequence_start and sequence_end, so
    --concurrency counts sequences in flight (open loop: --num-of-sequences
    of them). Shared memory (--shared-memory
    system): each connection's inputs and outputs lie in a region
    of its own, registered before the run and unregistered after it, also
    on an error or Ctrl-C. The model's config says which it needs: a
    decoupled model without --streaming, or --streaming for one that is not,
    is refused with the flag to use.

    In-process (--in-process --model-repository DIR -m NAME) the model is
    loaded as 'trioinfer serve' loads it, a pipeline after the models of its
    steps, e.g. -m read_digit --input-data zero over the bundled repository.

    Exits with status 1 when the server cannot be reached or does not serve
    the model, or when any request failed (errors by status are printed).
    """
    # `trioinfer bench digits`: the model is an option.
    no_arguments(click.get_current_context(), "the model is -m {arg}")
    try:
        from .. import bench as tool
    except ImportError as exc:  # the bench package's own message names the extra
        raise click.ClickException(str(exc)) from None

    loads = [
        flag
        for flag, given in (
            ("--concurrency", options["concurrency"] != (1,)),
            ("--request-rate", bool(options["request_rate"])),
            ("--request-intervals", options["request_intervals"] is not None),
        )
        if given
    ]
    if len(loads) > 1:
        raise click.UsageError(f"give one of {', '.join(loads)}, not several")
    _check_unused_flags(options)
    local = options["model_file"] is not None or options["model_repository"] is not None
    if options["in_process"] and not local:
        raise click.UsageError("--in-process needs --model-file, or --model-repository and --model")
    if local and not options["in_process"]:
        raise click.UsageError("--model-file and --model-repository go with --in-process")
    if options["model_file"] is not None and options["model_repository"] is not None:
        # (The file was loaded, and the repository silently left unread.)
        raise click.UsageError(
            "give one of --model-file (an ONNX file, default settings) and --model-repository "
            "(with --model: loaded as trioinfer serve loads it), not both"
        )
    _check_model_version(options["model_version"], in_process=options["in_process"])
    if options["shared_memory"] == "cuda":
        raise click.UsageError(
            "--shared-memory cuda is not supported by trioinfer bench: use --shared-memory system"
        )
    fields: dict[str, Any] = dict(
        concurrency=options["concurrency"],
        arrivals=options["arrivals"],
        seed=options["seed"],
        max_connections=options["max_connections"],
        settings=tool.Settings(
            warmup_s=options["warmup"],
            window_s=options["window"],
            stability=options["stability"],
            max_windows=options["max_windows"],
            windows=options["windows"],
        ),
        modes=tool.Modes(
            streaming=options["streaming"],
            sequence_length=options["sequence_length"],
            sequence_variation=options["sequence_length_variation"],
            sequence_ids=options["sequence_id_range"],
            open_sequences=options["open_sequences"],
            shared_memory=options["shared_memory"],
            output_shm_size=options["output_shared_memory_size"],
        ),
    )
    if options["request_intervals"] is not None:
        path, gaps = options["request_intervals"]
        try:
            plan = tool.Plan.from_intervals(gaps, **fields)
        except tool.BenchError as exc:
            raise click.BadParameter(f"{path}: {exc}", param_hint="--request-intervals") from None
    else:
        plan = tool.Plan(rates=options["request_rate"], **fields)
    try:
        with tool.open_progress() as progress:
            run = trio.run(functools.partial(_bench_run, options, plan, progress))
    except TrioInferError as exc:
        raise click.ClickException(str(exc)) from exc
    tool.print_table(run.results)
    about = {
        "target": "in-process" if options["in_process"] else options["url"],
        "model": options["model"] or (options["model_file"] and str(options["model_file"])),
        "model_version": options["model_version"],
        "input_data": options["input_data"][0]
        if not options["input_data"][1]
        else [str(p) for p in options["input_data"][1]],
        "encoding": None
        if options["in_process"] or options["protocol"] == "grpc"
        else options["encoding"],
        "protocol": None if options["in_process"] else options["protocol"],
        "grpc_client": options["grpc_client"]
        if options["protocol"] == "grpc" and not options["in_process"]
        else None,
        "arrivals": options["arrivals"] if plan.rates and not plan.intervals else None,
        "request_intervals": str(options["request_intervals"][0])
        if options["request_intervals"] is not None
        else None,
        "streaming": options["streaming"],
        "sequence_length": options["sequence_length"],
        "shared_memory": options["shared_memory"],
        "window_s": options["window"],
        "warmup_s": options["warmup"],
    }
    try:
        if options["json_file"]:
            tool.write_json(options["json_file"], run.results, about)
        if options["csv_file"]:
            tool.write_csv(options["csv_file"], run.results)
        if options["plot_file"]:
            tool.write_plot(
                options["plot_file"], run.results, f"{about['model']} @ {about['target']}"
            )
    except (OSError, TrioInferError) as exc:
        raise click.ClickException(str(exc)) from exc
    failed = sum(sum(r.errors.values()) for r in run.results)
    if failed:
        for status, text in run.first_errors.items():
            click.echo(f"first {status} answer: {' '.join(text.split())[:300]}", err=True)
        data, files = options["input_data"]
        if not files and set(run.first_errors) & set(_REFUSED_INPUTS):
            # Their shape may be what it refused (a --shape of 0 rows): the answer says.
            shaped = " (of the --shape given)" if options["shape"] else ""
            click.echo(
                f"the model refused the {data} inputs{shaped}: "
                + ("check --shape against the answer above, or " if shaped else "")
                + ("try --input-data zero, or " if data == "random" else "")
                + "give your own with --input-data FILE (.json: a V2 infer request; .npz: one "
                "array per input)",
                err=True,
            )
        raise click.ClickException(f"{failed} requests failed (see the errors column)")


def _given(*flags: str) -> list[str]:
    # Those of *flags* given, not left at their default.
    ctx = click.get_current_context()
    names = {opt: param.name for param in ctx.command.params for opt in param.opts}
    return [
        flag
        for flag in flags
        if ctx.get_parameter_source(str(names[flag])) is not ParameterSource.DEFAULT
    ]


def _check_unused_flags(options: dict[str, Any]) -> None:
    # Flags that nothing would use were taken without a word: `--num-of-sequences 3
    # --concurrency 2` ran 2 sequences, and `--in-process --protocol grpc` measured no gRPC.
    server = _given("--url", "--protocol", "--grpc-client", "--encoding")
    if options["in_process"] and server:
        raise click.UsageError(
            f"{', '.join(server)}: for a server; --in-process drives an engine in this "
            "process, with no HTTP or gRPC"
        )
    if options["protocol"] != "grpc" and _given("--grpc-client"):
        raise click.UsageError("--grpc-client: for --protocol grpc")
    if options["protocol"] == "grpc" and _given("--encoding"):
        raise click.UsageError(
            "--encoding: for HTTP; over gRPC the tensors go as raw_input_contents, as "
            "tritonclient sends them"
        )
    if options["shape"] and options["input_data"][1]:
        # The files' own shapes were sent, and --shape silently left unused.
        raise click.UsageError(
            "--shape: for generated inputs (--input-data random or zero); the requests of "
            "--input-data FILE give their own shapes"
        )
    given = _given("--arrivals", "--max-connections", "--num-of-sequences")
    if options["request_intervals"] is not None and "--arrivals" in given:
        raise click.UsageError(
            "--arrivals does not go with --request-intervals: the file gives the gaps "
            "between requests"
        )
    if given and not options["request_rate"] and options["request_intervals"] is None:
        raise click.UsageError(
            f"{', '.join(given)}: for an open loop (--request-rate or --request-intervals); "
            "in a closed loop, --concurrency alone sets the requests (or sequences) in flight"
        )


def _check_model_version(version: str | None, *, in_process: bool) -> None:
    # '' asked the server for /v2/models/NAME/versions/, and in-process '' or 'abc' was a
    # ValueError traceback. A server's versions may be any name (MLServer's "v1"); the
    # engine's are numbers.
    if version is None:
        return
    if in_process and not (version.isdecimal() and int(version) >= 1):
        raise click.BadParameter(
            f"expected a version number (1 or more) with --in-process, got {version!r}",
            param_hint="--model-version",
        )
    if not version.strip() or version != version.strip() or "/" in version:
        raise click.BadParameter(
            f"expected a version (as the server names it: 1, 2, ...), got {version!r}",
            param_hint="--model-version",
        )


def _url(parse: Callable[[str, str, str | None], _T], url: str, options: dict[str, Any]) -> _T:
    # A --url of the wrong form is a bad flag value (exit 2), not a server that cannot be
    # reached (exit 1), which the bench error it raises would make it.
    from ..bench import BenchError

    try:
        return parse(url, options["model"], options["model_version"])
    except BenchError as exc:
        raise click.BadParameter(str(exc), param_hint="--url") from None


async def _bench_run(
    options: dict[str, Any],
    plan: tool.Plan,
    progress: Callable[[tool.Progress], None] | None,
) -> tool.Run:
    from .. import bench as tool

    if options["in_process"]:
        version = options["model_version"]
        async with tool.open_local_model(
            model_file=options["model_file"],
            repository=options["model_repository"],
            model=options["model"],
            version=int(version) if version is not None else None,
        ) as (engine, name, specs):
            return await tool.run_in_process(
                engine,
                name,
                specs,
                plan,
                input_files=options["input_data"][1],
                input_data=options["input_data"][0],
                shapes=options["shape"],
                progress=progress,
            )
    if not options["model"]:
        raise click.UsageError("--model is required (or --in-process with --model-file)")
    if options["protocol"] == "grpc":
        url = options["url"]
        if url == "http://127.0.0.1:8000":  # the HTTP default: take gRPC's
            url = "127.0.0.1:8001"
        grpc_target = _url(tool.GrpcTarget.from_url, url, options)
        return await tool.run_grpc(
            grpc_target,
            plan,
            input_files=options["input_data"][1],
            input_data=options["input_data"][0],
            shapes=options["shape"],
            progress=progress,
            client=options["grpc_client"],
        )
    target = _url(tool.HttpTarget.from_url, options["url"], options)
    return await tool.run_http(
        target,
        plan,
        input_files=options["input_data"][1],
        input_data=options["input_data"][0],
        shapes=options["shape"],
        binary=options["encoding"] == "binary",
        progress=progress,
    )
