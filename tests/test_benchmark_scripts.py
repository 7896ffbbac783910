"""The benchmark scripts share helpers: one script's options must fit the other's helpers.

No server is started and nothing is timed; this only catches a helper in
``bench_http.py`` growing an option that ``compare.py`` does not define.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_http
    import compare

    yield bench_http, compare
    for name in ("bench_http", "compare", "bench_batching"):
        sys.modules.pop(name, None)


def test_compare_options_fit_bench_http_repository(
    scripts: tuple[Any, Any], tmp_path: Path
) -> None:
    bench_http, compare = scripts
    args = compare.parse_args(
        ["--models", "digits", "--binary-models", "", "--pipeline-depth", "2"]
    )
    models = bench_http.write_repository(tmp_path, args)
    assert list(models) == ["digits"]
    config = (tmp_path / "digits" / "config.toml").read_text()
    assert "pipeline_depth = 2" in config
