"""A smoke run of benchmarks/bench_chaos.py: it runs, and its figures add up.

The benchmark measures; this only checks that a small run of it finishes and
that what it prints is self-consistent. No figure is compared with a threshold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_chaos.py"


def test_a_small_run_accounts_for_every_request(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    args = ["--requests", "500", "--calibrate", "0.3", "--seed", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "outcomes: " in done.stdout
    assert "crash of instance 0: " in done.stdout
    figures = json.loads(out.read_text())
    outcomes = figures["outcomes"]
    # Every caller got exactly one outcome, and each answer was its row's label.
    assert sum(outcomes.values()) == 500
    assert set(outcomes) <= {"ok", "cancelled", "QueueFull", "CircuitOpen", "BackendError"}
    assert figures["wrong_outputs"] == 0
    assert figures["ledger"] == {"calls": 500, "pending": 0}
    engine = figures["engine"]
    # A caller whose scope fires just as its request succeeds sees Cancelled,
    # while the engine counts a success: that is the only way the two may differ.
    ok, cancelled = outcomes.get("ok", 0), outcomes.get("cancelled", 0)
    assert ok <= engine["succeeded"] <= ok + cancelled
    assert len(engine["replicas"]) == 3
    # Whether the killed instance was re-created by then depends on the real
    # clock; tests/test_chaos.py checks re-creation on virtual time.
