#!/usr/bin/env python
"""trioinfer beside its peers over HTTP: same machine, same models, same load, one after another.

Issue 6, section 2 (peers: MLServer, Triton). Systems, each started on its own, measured, stopped:

  trioinfer   ``trioinfer serve`` with its default HTTP layer (lean, Trio)
  t-asyncio   ``trioinfer serve --loop asyncio`` (uvicorn)
  mlserver    MLServer (``--mlserver-version``, default 1.7.1) with a custom runtime this
              script writes: a ``mlserver.MLModel`` whose ``load`` opens an ONNX Runtime
              session and whose ``predict`` decodes the V2 input to numpy, runs the session
              and encodes the outputs
  triton      NVIDIA Triton through PyTriton (``nvidia-pytriton``, its bundled tritonserver
              on the CPU): a script this file writes binds, per model, a ``@batch`` Python
              callable around an ONNX Runtime session, with ``ModelConfig(max_batch_size=32,
              batcher=DynamicBatcher(max_queue_delay_microseconds=5000))``; inputs and
              outputs named like the ONNX model's, so the same V2 JSON body works on
              ``/v2/models/{name}/infer``. Triton listens on 127.0.0.1 (HTTP and gRPC on free
              ports; metrics off: ``allow_metrics=False``). A batching Triton model needs at
              least one dimension per row, so a [N] output (digits' ``label``) comes back as
              [N, 1]; the answer check allows that reshape and nothing else. Its Python stub
              needs ``LD_LIBRARY_PATH`` at this interpreter's lib folder, which the script sets

Every system serves the same ONNX files with the same settings: dynamic (adaptive) batching
of at most 32 requests / 5 ms, one model instance, ONNX Runtime on the CPU with
``intra_op_num_threads=1``, sequential execution, graph optimisation all. trioinfer runs its
instance on a dispatch thread (``bench_http.py``'s config.toml). MLServer runs with
``parallel_workers = 0``: inference in the server's own process, like trioinfer's one
process (``1`` would add a worker process and a queue hop between it and the HTTP process);
its ``predict`` runs ``session.run`` on one dedicated thread so that, as in trioinfer, the
event loop keeps parsing requests while a batch runs (``--mlserver-predict inline``: on the
event loop itself, as MLServer's own runtimes do). MLServer listens on 127.0.0.1 only
(HTTP and gRPC on free ports; its metrics server is off: ``metrics_endpoint = null``);
its debug mode is off; its other settings are its defaults (gzip middleware on; wrk asks
no compression).

MLServer lives in a virtual environment of its own under ``--peers-dir`` (default
``$TMPDIR/trioinfer-peers``), created on first use and reused: ``pip install mlserver==1.7.1
onnxruntime==X uvloop==0.21.0``, X this interpreter's ONNX Runtime version (any version when
pip has not that one; the footer says which ran). uvloop 0.23 makes MLServer 1.7.1's workers
fail at start with "There is no current event loop in thread 'MainThread'"; 0.21 works.
Triton likewise: ``triton-venv`` under ``--peers-dir``, ``pip install nvidia-pytriton
onnxruntime==X numpy``. If a peer's install or start fails (no network, no wheel), the
script says why, skips that peer and runs the others.

Models: ``digits`` (the bundled example, float32 [-1, 64]) and ``wide`` (the 1024 -> 4096 ->
4096 -> 1000 MLP of ``trioinfer.testing.models.write_wide_mlp``, seed 0; needs ``onnx``).
Each request is one row as a JSON body, the same Lua script (``bench_http.py``'s) for every
system: ``wrk -t1 -cC -dD --latency``. Before measuring, each system's answer for each model
is checked against ONNX Runtime's. Each window warms up for ``--warmup`` seconds (a wrk run
of its own), waits for the server to go idle, then measures. The server's CPU time is read
from ``/proc/<pid>/stat`` for the server and every process below it, around the window.
``--repeat`` repeats everything; the order of the systems rotates from one repeat to the
next. The table gives medians and each repeat's value, then trioinfer over each peer
(MLServer, Triton) per model and concurrency (median of the per-repeat ratios).

Usage:  .venv/bin/python benchmarks/compare.py
        .venv/bin/python benchmarks/compare.py --duration 3 --repeat 2
        .venv/bin/python benchmarks/compare.py --systems trioinfer,mlserver --models wide
        .venv/bin/python benchmarks/compare.py --systems trioinfer,triton
        .venv/bin/python benchmarks/compare.py --peers-dir ~/.cache/trioinfer-peers
See benchmarks/README.md ("compare.py") for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Sibling scripts: bench_http's model repository, request check, Lua and wrk helpers.
import bench_http
import onnxruntime as ort
from bench_engine import versions
from bench_http import CLK_TCK, MAX_BATCH, MAX_QUEUE_DELAY, Row

SYSTEMS = ("trioinfer", "t-asyncio", "mlserver", "triton")
PEERS = ("mlserver", "triton")
TRIOINFER_ARGS = {"trioinfer": "", "t-asyncio": "--loop asyncio"}
ENCODING = "json"
UVLOOP = "uvloop==0.21.0"
READY_TIMEOUT_S = 180.0
LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")  # MLServer's gRPC shows the middle one
PYTRITON = "nvidia-pytriton"

MLSERVER_RUNTIME = '''\
"""Written by benchmarks/compare.py: an ONNX Runtime model for MLServer."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri

INLINE = {inline}


class OnnxModel(MLModel):
    async def load(self) -> bool:
        uri = await get_model_uri(self._settings)
        options = ort.SessionOptions()
        options.intra_op_num_threads = {threads}
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(
            uri, options, providers=["CPUExecutionProvider"]
        )
        self._outputs = [o.name for o in self._session.get_outputs()]
        # One thread runs every batch, like trioinfer's dispatch thread.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="onnx")
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {{i.name: NumpyCodec.decode_input(i) for i in payload.inputs}}
        if INLINE:  # on the event loop, as MLServer's own runtimes do
            results = self._session.run(self._outputs, feeds)
        else:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(
                self._executor, self._session.run, self._outputs, feeds
            )
        outputs = []
        for name, value in zip(self._outputs, results):
            output = NumpyCodec.encode_output(name, value)
            output.shape = list(value.shape)  # the codec makes a 1-d [N] into [N, 1]
            outputs.append(output)
        return InferenceResponse(
            model_name=self.name, model_version=self.version, id=payload.id, outputs=outputs
        )
'''

TRITON_SERVER = '''\
"""Written by benchmarks/compare.py: ONNX Runtime behind Triton's dynamic batcher (PyTriton)."""

import json
import signal
import sys

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

SPEC = json.loads(sys.argv[1])
DTYPES = {{"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(double)": np.float64,
           "tensor(int32)": np.int32}}


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = {threads}
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def tensors(args):
    # Triton's shapes leave out the batch dimension (max_batch_size > 0) and need at least
    # one dimension: a [N] tensor becomes [N, 1].
    return [
        Tensor(
            name=a.name,
            dtype=DTYPES[a.type],
            shape=tuple(d if isinstance(d, int) else -1 for d in a.shape[1:]) or (1,),
        )
        for a in args
    ]


def infer_function(sess):
    outputs = [o.name for o in sess.get_outputs()]

    @batch
    def infer(**inputs):
        results = sess.run(outputs, inputs)
        return {{n: r.reshape(-1, 1) if r.ndim == 1 else r for n, r in zip(outputs, results)}}

    return infer


def stop(*_):
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, stop)
config = TritonConfig(
    http_address="127.0.0.1",
    http_port=SPEC["http_port"],
    grpc_address="127.0.0.1",
    grpc_port=SPEC["grpc_port"],
    allow_metrics=False,
    allow_cpu_metrics=False,
    allow_gpu_metrics=False,
)
with Triton(config=config) as triton:
    for name, path in SPEC["models"].items():
        sess = session(path)
        triton.bind(
            model_name=name,
            infer_func=infer_function(sess),
            inputs=tensors(sess.get_inputs()),
            outputs=tensors(sess.get_outputs()),
            config=ModelConfig(
                max_batch_size={max_batch},
                batcher=DynamicBatcher(max_queue_delay_microseconds={delay_us}),
            ),
        )
    print("serving", flush=True)
    triton.serve()
'''


# -- servers ------------------------------------------------------------------------------


def tree_pids(root: int) -> list[int]:
    """*root* and every process below it (from ``/proc/*/stat``'s parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def tree_cpu_s(root: int) -> float:
    """User + system CPU time of *root* and its descendants, all threads, plus reaped children."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited in between
        # utime, stime, cutime, cstime: fields 14-17 of proc(5); the split drops the first two.
        total += sum(int(x) for x in fields[11:15])
    return total / CLK_TCK


@dataclasses.dataclass
class Server:
    """What ``bench_http.run_http`` needs of a server, for any system."""

    system: str
    process: subprocess.Popen[bytes]
    base: str
    log: Path
    counted: bool  # whether it has trioinfer's /v2/models/{m}/stats

    def cpu_s(self) -> float:
        return tree_cpu_s(self.process.pid)

    def wait_idle(self, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        last = self.cpu_s()
        while time.monotonic() < end:
            time.sleep(0.1)
            now = self.cpu_s()
            if now - last <= 1 / CLK_TCK:
                return
            last = now

    def counts(self, model: str) -> tuple[int, int]:
        return bench_http.Server.counts(self, model)  # type: ignore[arg-type]

    def listening(self) -> list[str]:
        """The sockets the server's processes listen on (``ss -tlnp``)."""
        pids = set(tree_pids(self.process.pid))
        done = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True)
        found = []
        for line in done.stdout.splitlines():
            if any(f"pid={p}," in line for p in pids):
                found.append(line.split()[3])
        return found


def stop(server: Server) -> None:
    """SIGTERM the server, wait; then SIGKILL whatever of its process tree is left."""
    pids = tree_pids(server.process.pid) if server.process.poll() is None else []
    bench_http.stop_server(server.process)
    for pid in pids[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_trioinfer(system: str, repository: Path, args: argparse.Namespace, log: Path) -> Server:
    opts = copy.copy(args)
    opts.server_args = TRIOINFER_ARGS[system]
    inner = bench_http.start_server(repository, opts, log)
    return Server(system, inner.process, inner.base, log, counted=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_mlserver_repository(
    root: Path, models: dict[str, bench_http.Model], threads: int, predict: str
) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, model in models.items():
        folder = root / name
        folder.mkdir()
        (folder / "onnx_runtime.py").write_text(
            MLSERVER_RUNTIME.format(threads=threads, inline=predict == "inline")
        )
        onnx_path = model.config_path.parent / "1" / "model.onnx"
        settings = {
            "name": name,
            "implementation": "onnx_runtime.OnnxModel",
            "max_batch_size": MAX_BATCH,
            "max_batch_time": MAX_QUEUE_DELAY,
            "parameters": {"uri": str(onnx_path)},
        }
        (folder / "model-settings.json").write_text(json.dumps(settings, indent=2))


def start_mlserver(mlserver: Path, repository: Path, args: argparse.Namespace, log: Path) -> Server:
    http_port, grpc_port = free_port(), free_port()
    settings = {
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_endpoint": None,
        "parallel_workers": args.mlserver_workers,
        "debug": False,
        "load_models_at_startup": True,
    }
    (repository / "settings.json").write_text(json.dumps(settings, indent=2))
    command = [str(mlserver), "start", str(repository)]
    print(f"server: {shlex.join(command)}  (settings.json: {json.dumps(settings)})")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=repository, env=env
        )
    server = Server("mlserver", process, f"http://127.0.0.1:{http_port}", log, counted=False)
    try:
        problem = wait_models(server, args.models)
    except BaseException:
        stop(server)
        raise
    if problem:
        stop(server)
        raise RuntimeError(f"{problem}: {tail(log)}")
    return server


def start_triton(
    python: Path, models: dict[str, bench_http.Model], args: argparse.Namespace, log: Path
) -> Server:
    """Run the generated PyTriton script with the Triton venv's python; wait for the models."""
    http_port, grpc_port = free_port(), free_port()
    spec = {
        "http_port": http_port,
        "grpc_port": grpc_port,
        "models": {n: str(m.config_path.parent / "1" / "model.onnx") for n, m in models.items()},
    }
    script = log.parent / "triton_server.py"
    script.write_text(
        TRITON_SERVER.format(
            threads=args.threads, max_batch=MAX_BATCH, delay_us=round(MAX_QUEUE_DELAY * 1e6)
        )
    )
    command = [str(python), str(script), json.dumps(spec)]
    print(f"server: {shlex.join(command)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    # Triton's Python backend stub links libpython: point it at this interpreter's lib folder
    # (the venv's python is this one).
    libdir = sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        x for x in (libdir, env.get("LD_LIBRARY_PATH", "")) if x
    )
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            env=env,
        )
    server = Server("triton", process, f"http://127.0.0.1:{http_port}", log, counted=False)
    try:
        problem = wait_models(server, list(models))
    except BaseException:
        stop(server)
        raise
    if problem:
        stop(server)
        raise RuntimeError(f"{problem}: {tail(log)}")
    return server


def wait_models(server: Server, names: Sequence[str]) -> str | None:
    """Wait until every model answers ready; None, or what went wrong."""
    end = time.monotonic() + READY_TIMEOUT_S
    pending = list(names)
    while pending and time.monotonic() < end:
        if server.process.poll() is not None:
            return f"{server.system} exited with status {server.process.returncode}"
        try:
            url = f"{server.base}/v2/models/{pending[0]}/ready"
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    return f"{server.system} never had {pending} ready" if pending else None


def tail(path: Path, lines: int = 20) -> str:
    return bench_http.tail(path, lines)


# -- MLServer's environment ----------------------------------------------------------------


def peer_venv(
    venv: Path,
    probe: str,
    fields: int,
    current: Callable[[list[str]], bool],
    package_sets: Sequence[Sequence[str]],
    what: str,
) -> tuple[list[str] | None, str]:
    """Make sure *venv* holds a peer: (what *probe* printed, split, or None; why not).

    *probe* prints *fields* words when the peer imports; *current* says whether
    they are the versions wanted. Otherwise each package set is tried in turn
    until pip installs one.
    """
    python = venv / "bin" / "python"

    def installed() -> list[str] | None:
        if not python.exists():
            return None
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        found = done.stdout.split()
        return found if done.returncode == 0 and len(found) == fields else None

    found = installed()
    if found is not None and current(found):
        return found, ""
    try:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                capture_output=True,
                text=True,
            )
        for packages in package_sets:
            print(f"installing {' '.join(packages)} into {venv} ...", flush=True)
            done = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", *packages],
                capture_output=True,
                text=True,
                timeout=1200,
            )
            if done.returncode == 0:
                break
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not create {venv}: {exc}"
    if done.returncode != 0:
        lines = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
        errors = [x for x in lines if "error" in x.lower()] or lines
        reason = " | ".join(e if len(e) < 200 else e[:200] + "..." for e in errors[-2:])
        return None, f"pip install {what} failed: {reason}"
    found = installed()
    if found is None:
        return None, f"{what} installed, but it does not import in {venv}"
    return found, ""


def mlserver_env(args: argparse.Namespace) -> tuple[Path | None, str, str]:
    """(the ``mlserver`` executable or None, its version or the reason it is missing, ORT's)."""
    venv = Path(args.peers_dir) / "mlserver-venv"
    mlserver = venv / "bin" / "mlserver"
    wanted = f"mlserver=={args.mlserver_version}"
    probe = (
        "import importlib.metadata as m; "
        "print(m.version('mlserver'), m.version('onnxruntime'), m.version('uvloop'))"
    )
    # The same ONNX Runtime as this interpreter's, when pip has it; any other if not.
    ort_pin = f"onnxruntime=={ort.__version__}"
    found, why = peer_venv(
        venv,
        probe,
        3,
        lambda f: f[0] == args.mlserver_version and f[1] == ort.__version__,
        ([wanted, ort_pin, UVLOOP], [wanted, "onnxruntime", UVLOOP]),
        wanted,
    )
    if found is None or not mlserver.exists():
        return None, why or f"no mlserver executable in {venv}", "?"
    return mlserver, found[0], f"{found[1]}, uvloop {found[2]}"


def triton_env(args: argparse.Namespace) -> tuple[Path | None, str, str]:
    """(the Triton venv's python or None, PyTriton's version or why it is missing, ORT's)."""
    venv = Path(args.peers_dir) / "triton-venv"
    probe = (
        "import importlib.metadata as m, pytriton.triton; "
        "print(m.version('nvidia-pytriton'), m.version('onnxruntime'))"
    )
    ort_pin = f"onnxruntime=={ort.__version__}"
    found, why = peer_venv(
        venv,
        probe,
        2,
        lambda f: f[1] == ort.__version__,
        ([PYTRITON, ort_pin, "numpy"], [PYTRITON, "onnxruntime", "numpy"]),
        PYTRITON,
    )
    if found is None:
        return None, why, "?"
    return venv / "bin" / "python", found[0], found[1]


# -- the run ------------------------------------------------------------------------------


def triton_view(model: bench_http.Model) -> bench_http.Model:
    """The model as Triton answers it: a batching model's [N] output comes back as [N, 1]."""
    reference = {k: v.reshape(-1, 1) if v.ndim == 1 else v for k, v in model.reference.items()}
    return dataclasses.replace(model, reference=reference)


def verify(
    server: Server,
    models: dict[str, bench_http.Model],
    lua_dir: Path,
    scripts: dict[str, Path],
    checked: set[tuple[str, str]],
) -> None:
    """Check each model's answer against ONNX Runtime's (SystemExit if it differs).

    The first system checked also writes the Lua script every system is measured with.
    """
    for name, model in models.items():
        if server.system == "triton":
            model = triton_view(model)
        if name not in scripts:
            script = bench_http.write_script(lua_dir, model, ENCODING, server)  # type: ignore[arg-type]
            scripts[name] = script.path
        else:
            body, headers = bench_http.request_body(model, ENCODING)
            bench_http.check_answer(server.base, model, ENCODING, body, headers)
        if (server.system, name) not in checked:
            print(f"  {server.system}/{name}: the answer matches ONNX Runtime's")
            checked.add((server.system, name))


def measure(
    server: Server, model: str, conc: int, script: Path, args: argparse.Namespace, rep: int
) -> Row:
    return bench_http.run_http(
        server,  # type: ignore[arg-type]
        f"/v2/models/{model}/infer",
        script,
        conc,
        args,
        rep,
        model=model,
        how=server.system,
        counted=server.counted,
    )


def fmt_each(values: Sequence[float], spec: str) -> str:
    return "/".join(format(v, spec) for v in values)


def cell(values: Sequence[float], spec: str) -> str:
    """The median, then each repeat's value in brackets."""
    return f"{format(med(values), spec)} ({fmt_each(values, spec)})"


def med(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def print_table(rows: Sequence[Row], systems: Sequence[str], args: argparse.Namespace) -> None:
    print("\nmedians over repeats (each repeat's value in brackets); JSON bodies, one row each")
    header = (
        f"{'system':<10} {'model':<6} {'C':>3} {'req/s':>22} {'p50 ms':>18} {'p99 ms':>20} "
        f"{'errors':>6} {'CPU us/req':>20}"
    )
    print(header)
    for model in args.models:
        for conc in args.concurrency:
            for system in systems:
                chosen = sorted(
                    (r for r in rows if (r.how, r.model, r.concurrency) == (system, model, conc)),
                    key=lambda r: r.rep,
                )
                if not chosen:
                    continue
                rate = [r.rate for r in chosen]
                p50 = [r.p50_ms for r in chosen]
                p99 = [r.p99_ms for r in chosen]
                cpu = [r.cpu_us for r in chosen]
                errors = sum(r.error_count for r in chosen)
                print(
                    f"{system:<10} {model:<6} {conc:>3} {cell(rate, ',.0f'):>22} "
                    f"{cell(p50, '.1f'):>18} {cell(p99, '.1f'):>20} "
                    f"{f'{errors}!' if errors else '0':>6} {cell(cpu, ',.0f'):>20}"
                )
            print()
    for peer in (p for p in PEERS if p in systems):
        ours = [s for s in systems if s not in PEERS]
        if not ours:
            continue
        print(f"ratios over {peer}, req/s (median of the per-repeat ratios; each repeat's value)")
        for system in ours:
            for model in args.models:
                for conc in args.concurrency:
                    ratios = []
                    for rep in range(1, args.repeat + 1):
                        a = bench_http.find(rows, model, system, conc, rep)
                        b = bench_http.find(rows, model, peer, conc, rep)
                        if a and b and b.rate:
                            ratios.append(a.rate / b.rate)
                    if ratios:
                        print(
                            f"  {system:<10} / {peer:<8}  {model:<6} C={conc:<3} "
                            f"{med(ratios):5.2f}x  ({fmt_each(ratios, '.2f')})"
                        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="which of " + ",".join(SYSTEMS)
    )
    parser.add_argument("--models", default="digits,wide", help="which of digits,wide to run")
    parser.add_argument("--concurrency", default="16,64", help="wrk connections, comma-separated")
    parser.add_argument("--duration", type=int, default=5, help="whole seconds measured per window")
    parser.add_argument("--warmup", type=int, default=1, help="whole seconds of warm-up per window")
    parser.add_argument("--repeat", type=int, default=2, help="repeats; the system order rotates")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads of every ORT session (default 1)"
    )
    parser.add_argument(
        "--peers-dir",
        default=str(Path(tempfile.gettempdir()) / "trioinfer-peers"),
        help="where the peers' virtual environments are created and reused",
    )
    parser.add_argument("--mlserver-version", default="1.7.1")
    parser.add_argument(
        "--mlserver-workers",
        type=int,
        default=0,
        help="MLServer's parallel_workers (0: inference in the server process, the default here)",
    )
    parser.add_argument(
        "--mlserver-predict",
        choices=("thread", "inline"),
        default="thread",
        help="where MLServer's predict runs session.run: on one dedicated thread (default, "
        "like trioinfer's dispatch thread) or inline on its event loop",
    )
    parser.add_argument("--wrk", default="wrk", help="the wrk executable")
    parser.add_argument("--timeout", type=int, default=10, help="wrk's request timeout, seconds")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    if not args.models or set(args.models) - set(bench_http.MODELS):
        parser.error(f"--models: choose from {', '.join(bench_http.MODELS)}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency takes integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1 or args.repeat < 1:
        parser.error("--concurrency and --repeat must be >= 1")
    if args.duration < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--duration and --threads must be >= 1, --warmup >= 0")
    args.encodings = [ENCODING]
    args.server_args = ""
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    found = shutil.which(args.wrk)
    if found is None:
        print(f"{args.wrk!r} is not installed; see bench_http.py ('sudo apt-get install wrk')")
        return 2
    args.wrk = found
    started = time.perf_counter()
    systems = list(args.systems)
    mlserver_exe: Path | None = None
    mlserver_version = mlserver_ort = "not used"
    if "mlserver" in systems:
        mlserver_exe, mlserver_version, mlserver_ort = mlserver_env(args)
        if mlserver_exe is None:
            print(f"MLServer SKIPPED: {mlserver_version}", flush=True)
            systems.remove("mlserver")
    triton_python: Path | None = None
    triton_version = triton_ort = "not used"
    if "triton" in systems:
        triton_python, triton_version, triton_ort = triton_env(args)
        if triton_python is None:
            print(f"Triton SKIPPED: {triton_version}", flush=True)
            systems.remove("triton")
    if not systems:
        return 1
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="trioinfer-compare-") as tmp:
        root = Path(tmp)
        repository = root / "models"
        models = bench_http.write_repository(repository, args)
        ml_repository = root / "mlserver"
        if mlserver_exe is not None:
            write_mlserver_repository(ml_repository, models, args.threads, args.mlserver_predict)
        lua_dir = root / "lua"
        lua_dir.mkdir()
        scripts: dict[str, Path] = {}
        checked: set[tuple[str, str]] = set()
        for rep in range(1, args.repeat + 1):
            shift = (rep - 1) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                if system in skipped:
                    continue
                log = root / f"{system}-{rep}.log"
                try:
                    if system == "mlserver":
                        assert mlserver_exe is not None
                        server = start_mlserver(mlserver_exe, ml_repository, args, log)
                    elif system == "triton":
                        assert triton_python is not None
                        server = start_triton(triton_python, models, args, log)
                    else:
                        server = start_trioinfer(system, repository, args, log)
                except (RuntimeError, SystemExit) as exc:
                    skipped[system] = str(exc)
                    print(f"{system} SKIPPED: could not start: {exc}", flush=True)
                    continue
                try:
                    sockets = server.listening()
                    print(f"{system} (pid {server.process.pid}) listens on {', '.join(sockets)}")
                    if any(not s.startswith(LOOPBACK) for s in sockets):
                        raise SystemExit(f"{system} listens beyond loopback: {sockets}")
                    try:
                        verify(server, models, lua_dir, scripts, checked)
                    except SystemExit as exc:
                        if system not in PEERS:
                            raise
                        skipped[system] = f"its answer is wrong: {exc}"
                        print(f"{system} SKIPPED: {skipped[system]}", flush=True)
                        continue  # the finally below stops it
                    for name in models:
                        for conc in args.concurrency:
                            row = measure(server, name, conc, scripts[name], args, rep)
                            rows.append(row)
                            print(
                                f"  rep {rep} {system:<10} {name:<6} C={conc:<3} "
                                f"{row.rate:8.0f} req/s  p50 {row.p50_ms:7.1f} ms  "
                                f"p99 {row.p99_ms:7.1f} ms  errors {row.error_count}  "
                                f"CPU {row.cpu_us:6.0f} us/req  load "
                                f"{os.getloadavg()[0]:.2f}",
                                flush=True,
                            )
                finally:
                    stop(server)
    print_table(rows, [s for s in systems if s not in skipped], args)
    for system, reason in skipped.items():
        print(f"{system} SKIPPED: {reason}")
    if "mlserver" in args.systems and mlserver_exe is None:
        print(f"mlserver SKIPPED: {mlserver_version}")
    if "triton" in args.systems and triton_python is None:
        print(f"triton SKIPPED: {triton_version}")
    print()
    print(versions())
    if mlserver_exe is not None:
        print(f"mlserver {mlserver_version} (its venv: onnxruntime {mlserver_ort})")
    if triton_python is not None:
        print(f"nvidia-pytriton {triton_version} (its venv: onnxruntime {triton_ort})")
    print(
        f"every ONNX Runtime session: intra_op_num_threads={args.threads}, sequential, CPU; "
        f"batching max {MAX_BATCH} / {MAX_QUEUE_DELAY * 1e3:g} ms; one instance; "
        f"MLServer parallel_workers={args.mlserver_workers}, predict {args.mlserver_predict}"
    )
    print(
        f"wrk -t1 -cC -d{args.duration}s --latency, warm-up {args.warmup}s; repeats {args.repeat}"
    )
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at the end: {load}; the run took {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
