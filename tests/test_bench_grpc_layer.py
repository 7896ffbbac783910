"""Smoke runs of benchmarks/bench_grpc_layer.py and bench_grpc_bytes.py: they run, and print.

The benchmarks measure; these only check that a small run of each finishes
and prints a figure for each row. No figure is compared with a threshold.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.grpc]

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: A row's median and minimum, then each round's figure.
ROW = r"\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+((?:\d+\.\d\d ?)+)$"


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_grpc_layer_prints_trio_and_asyncio_per_tree() -> None:
    here = str(BENCHMARKS.parent)
    out = run(
        "bench_grpc_layer.py",
        *("--calls", "300", "--rounds", "2", "--tree", f"a={here}", "--tree", f"b={here}"),
    )
    rows = {}
    for line in out.splitlines():
        if found := re.match(r"(\w+)\s+(trio|asyncio)" + ROW, line):
            rows[found[1], found[2]] = [float(t) for t in found[5].split()]
    assert set(rows) == {("a", "trio"), ("a", "asyncio"), ("b", "trio"), ("b", "asyncio")}
    assert all(len(each) == 2 and all(t > 0 for t in each) for each in rows.values())


def test_bench_grpc_bytes_prints_each_model() -> None:
    out = run("bench_grpc_bytes.py", "--calls", "200", "--rounds", "2")
    models = [line.split()[0] for line in out.splitlines()[1:]]
    assert models == ["digits", "wide"]
