#!/usr/bin/env python
"""The HTTP infer route's per-request steps, timed alone in two or more source trees, alternating.

On a machine others keep busy a whole server's CPU per request moves by
10-30% between windows, more than a step's saving; a step timed alone
(``timeit``, the minimum of 300 repeats of 1,000 calls) moves by a few
percent. Each tree (``LABEL=PATH``: a ``git archive`` export, this
checkout) runs in its own process with ``PATH/src`` first on the path, in
turn, ``--rounds`` times. The steps, without sockets, engine or model:

- ``headers``: the infer route's header mapping and its four lookups;
- ``cycle``: a request cycle made (subtracted from the next three);
- ``scope``: the ASGI scope of a request;
- ``read_body``: ``_read_body`` of a 349-byte body already received;
- ``respond``: the response (status, headers, a 352-byte body) through the
  cycle as the route sends it: ``trioinfer.respond`` where the tree has it,
  else two ``send`` messages;
- ``encode_json``: ``encode_infer_response`` of two float32 outputs of 10.

Usage:  .venv/bin/python benchmarks/bench_http_steps.py main=/tmp/main here=. --rounds 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import sys, timeit
sys.path.insert(0, sys.argv[1] + "/src")
import numpy as np
from trioinfer.server import _app, _cycle
from trioinfer.server._codec import Limits, decode_infer_request, encode_infer_response

raw = [(b"host", b"127.0.0.1:8000"), (b"content-length", b"349"),
       (b"content-type", b"application/json")]
class IO:
    def wall_time(self): return 1e9
class Shared:
    closing = False
class Conn:
    gone = False
    shared = Shared()
    io = IO()
    server_addr = ("127.0.0.1", 8000)
    client = ("127.0.0.1", 5555)
    lifespan_state = {}
    async def send_all(self, data): return True
conn = Conn()
body = b'{"model_name":"digits","model_version":"1","outputs":[' + b"x" * 300 + b"]}"
limits = Limits()
hd = _app._Headers(raw)
json_headers = getattr(_app, "_JSON_HEADERS", None)
rng = np.random.default_rng(0)
request = decode_infer_request(
    b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1,2]}]}', None, limits)
outputs = {"logits": rng.random((1, 10), dtype=np.float32),
           "probabilities": rng.random((1, 10), dtype=np.float32)}
order = ("logits", "probabilities")

def run(coro):
    try:
        coro.send(None)
    except StopIteration:
        pass
def cycle():
    c = _cycle.RequestCycle(conn); c.method = b"POST"
    return c
def headers():
    h = _app._Headers(raw)
    h.get("trioinfer-routing-key"); h.get("content-length")
    h.get("content-encoding"); h.get("inference-header-content-length")
def scope():
    c = cycle(); c.url = b"/v2/models/digits/infer"; c.scope()
def read_body():
    c = cycle(); c.body = [b"x" * 349]; c.complete = True
    run(_app._read_body({}, c.receive, hd, limits))
def respond():
    c = cycle()
    if json_headers is not None:
        run(c.respond(200, json_headers, body))
        return
    extra = [(b"content-type", b"application/json")]
    run(c.send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode()), *extra]}))
    run(c.send({"type": "http.response.body", "body": body}))
def encode_json():
    encode_infer_response(model_name="digits", model_version="1", request=request,
                          outputs=outputs, output_order=order)
def best(f):
    return min(timeit.repeat(f, number=1000, repeat=300)) / 1000 * 1e6
base = best(cycle)
print("cycle", f"{base:.3f}")
for f in (headers, scope, read_body, respond, encode_json):
    t = best(f) - (base if f in (scope, read_body, respond) else 0.0)
    print(f.__name__, f"{t:.3f}")
"""


def main(argv: list[str] | None = None) -> int:
    """Time each tree's steps, alternating, and print a table of the minima."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trees", nargs="+", help="LABEL=PATH of each source tree")
    parser.add_argument("--rounds", type=int, default=2, help="alternations (default 2)")
    args = parser.parse_args(argv)
    trees = [tuple(t.split("=", 1)) for t in args.trees]
    best: dict[tuple[str, str], float] = {}
    steps: list[str] = []
    for r in range(args.rounds):
        for label, path in trees if r % 2 == 0 else trees[::-1]:
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(Path(path).resolve())],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for line in out.splitlines():
                step, value = line.split()
                if step not in steps:
                    steps.append(step)
                key = (step, label)
                best[key] = min(best.get(key, float("inf")), float(value))
    labels = [label for label, _ in trees]
    print(f"{'step (us, min)':16}" + "".join(f"{label:>12}" for label in labels))
    for step in steps:
        print(f"{step:16}" + "".join(f"{best[(step, label)]:12.3f}" for label in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
