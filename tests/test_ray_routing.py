"""Routing over 100 simulated remote instances with churn, on virtual time (no Ray).

The simulation is benchmarks/ray_routing.py (which runs 100,000 requests); here
a few thousand, twice, to show it is deterministic.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def routing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ray_routing

    yield ray_routing
    sys.modules.pop("ray_routing", None)


def test_no_request_lost_or_doubled_under_churn(routing: Any) -> None:
    out = routing.simulate(2500, rate=500.0, seed=3)
    assert out.leaves > 0  # nodes did come and go
    assert out.joins > 0
    assert out.lost == 0
    assert out.doubled == 0
    assert out.wrong == 0
    assert sum(out.outcomes.values()) == out.requests
    # Reported, not a speed claim: most requests make their deadline despite the churn.
    assert 0.5 < out.within_deadline <= 1.0
    again = routing.simulate(2500, rate=500.0, seed=3)
    assert (again.outcomes, again.leaves, again.joins) == (out.outcomes, out.leaves, out.joins)
