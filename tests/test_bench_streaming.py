"""Smoke run of benchmarks/bench_streaming.py's sse and grpc ways: they run, and print.

The benchmark measures; this only checks that a small run finishes and prints
a rate and a CPU time per response for each way asked. No figure is compared
with a threshold.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.grpc, pytest.mark.streaming]

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_streaming.py"


def test_bench_streaming_prints_rate_and_cpu_per_response_of_each_way() -> None:
    args = ["--ways", "sse,grpc", "--responses", "20", "--duration", "0.2", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        if found := re.match(r"(sse|grpc)\s+([\d,]+)\s+(\d+\.\d)\s+(.+)$", line):
            rows[found[1]] = found[4].split(", ")
    assert set(rows) == {"sse", "grpc"}, done.stdout
    assert all(len(rounds) == 2 for rounds in rows.values()), done.stdout


def test_bench_streaming_refuses_an_unknown_way() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--ways", "grpc,carrier-pigeon"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2
    assert "carrier-pigeon" in done.stderr
    assert "the ways are generator, engine/trio" in done.stderr
