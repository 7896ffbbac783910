"""System shared memory against binary bodies: one client, large tensors, over loopback HTTP.

A ``trioinfer serve`` process serves an identity model (``float32[1, N]`` in and
out); tritonclient sends the same tensor as a binary body (and gets the output
binary), or leaves input and output in registered ``/dev/shm`` regions. The two
ways alternate request by request, so that the machine's drift hits both alike.
Prints the median and p90 latency of each and the ratio.

Usage:  .venv/bin/python benchmarks/bench_shm.py [--mib 4] [--requests 100]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from trioinfer.testing import models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=4.0, help="tensor size in MiB")
    parser.add_argument("--requests", type=int, default=100, help="requests of each kind")
    args = parser.parse_args()
    width = int(args.mib * (1 << 20) / 4)
    with tempfile.TemporaryDirectory() as root:
        models.write_identity(Path(root) / "identity" / "1" / "model.onnx", shape=(1, width))
        command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0"]
        server = subprocess.Popen(
            [*command, "--model-repository", root, "--config", _config(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert server.stdout is not None
            for line in server.stdout:
                match = re.search(r"listening on http://(\S+)", line)
                if match:
                    break
            else:
                raise SystemExit("the server did not start")
            measure(match.group(1), width, args.requests)
        finally:
            server.terminate()
            server.wait()


def _config(root: str) -> str:
    # The default body limit is below the larger tensors measured here.
    path = Path(root) / "server.toml"
    path.write_text("[limits]\nmax_body_bytes = 1073741824\n")
    return str(path)


def measure(address: str, width: int, requests: int) -> None:
    data = np.random.default_rng(0).standard_normal((1, width), dtype=np.float32)
    size = data.nbytes
    key = f"/trioinfer_bench_{os.getpid()}"
    client = httpclient.InferenceServerClient(address, connection_timeout=120, network_timeout=120)
    region = shm.create_shared_memory_region("bench", key, 2 * size)
    try:
        shm.set_shared_memory_region(region, [data])
        client.register_system_shared_memory("bench", key, 2 * size)
        body_in = httpclient.InferInput("x", [1, width], "FP32")
        body_in.set_data_from_numpy(data)
        body_out = httpclient.InferRequestedOutput("y", binary_data=True)
        shm_in = httpclient.InferInput("x", [1, width], "FP32")
        shm_in.set_shared_memory("bench", size)
        shm_out = httpclient.InferRequestedOutput("y")
        shm_out.set_shared_memory("bench", size, offset=size)
        times: dict[str, list[float]] = {"binary body": [], "shared memory": []}
        for i in range(requests + 5):
            for name, inputs, outputs in (
                ("binary body", [body_in], [body_out]),
                ("shared memory", [shm_in], [shm_out]),
            ):
                start = time.perf_counter()
                result = client.infer("identity", inputs, outputs=outputs)
                if name == "binary body":
                    out = result.as_numpy("y")
                else:
                    out = shm.get_contents_as_numpy(region, np.float32, [1, width], offset=size)
                elapsed = time.perf_counter() - start
                if i >= 5:  # the first few warm up the connection and the session
                    times[name].append(elapsed)
                assert out is not None
                assert out[0, -1] == data[0, -1]
        print(
            f"identity float32[1, {width}] ({size / (1 << 20):.1f} MiB each way), "
            f"{requests} requests of each kind, load average {os.getloadavg()[0]:.1f}"
        )
        print(f"{'':16}{'p50 ms':>10}{'p90 ms':>10}")
        p50 = {}
        for name, values in times.items():
            values.sort()
            p50[name] = statistics.median(values)
            p90 = values[int(0.9 * (len(values) - 1))]
            print(f"{name:16}{p50[name] * 1e3:10.2f}{p90 * 1e3:10.2f}")
        print(f"shared memory / binary body, p50: {p50['shared memory'] / p50['binary body']:.2f}")
        client.unregister_system_shared_memory()
    finally:
        shm.destroy_shared_memory_region(region)
        client.close()


if __name__ == "__main__":
    main()
