"""trioinfer bench: against a real V2 server in a thread, in-process, and its pure parts."""

from __future__ import annotations

import csv
import itertools
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio
from click.testing import CliRunner, Result

from trioinfer import _bench
from trioinfer._cli import main
from trioinfer._examples import digits_samples, example_repository
from trioinfer.server import Limits, serve_http
from trioinfer.server._codec import decode_infer_request

SHORT = ("--warmup", "0.05", "--window", "0.2", "--windows", "2")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The bundled repository served on a free loopback port, from a thread of its own."""
    started = threading.Event()
    found: dict[str, object] = {}

    async def serve() -> None:
        stop = trio.Event()
        found["stop"], found["token"] = stop, trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            listening = await nursery.start(
                lambda task_status: serve_http(
                    example_repository(),
                    port=0,
                    handle_signals=False,
                    shutdown=stop,
                    task_status=task_status,
                )
            )
            found["url"] = listening.urls[0]
            started.set()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    assert started.wait(30), "the server did not start"
    yield str(found["url"])
    stop = found["stop"]
    assert isinstance(stop, trio.Event)
    trio.from_thread.run_sync(stop.set, trio_token=found["token"])  # type: ignore[arg-type]
    thread.join(30)


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args], prog_name="trioinfer")


def rows(path: Path) -> list[dict[str, object]]:
    results = json.loads(path.read_text())["results"]
    assert isinstance(results, list)
    return results


# -- pure parts ---------------------------------------------------------------------------------


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = list(itertools.islice(_bench.iter_arrivals(1000, "constant"), 5))
    assert times == [0, 1_000_000, 2_000_000, 3_000_000, 4_000_000]


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    def take(seed: int) -> list[int]:
        return list(itertools.islice(_bench.iter_arrivals(2000, "poisson", seed), 20_000))

    first = take(7)
    assert first == take(7)
    assert first != take(8)
    gaps = np.diff([0, *first])
    assert (gaps >= 0).all()
    assert abs(gaps.mean() - 500_000) < 0.03 * 500_000  # mean gap 1/rate, for this seed
    # Exponential gaps: the standard deviation equals the mean (constant ones have none).
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05


def test_arrivals_refuse_a_bad_rate() -> None:
    with pytest.raises(ValueError, match="rate"):
        next(_bench.iter_arrivals(0, "constant"))


def test_stability_needs_three_close_windows() -> None:
    assert not _bench.is_stable([(100, 1.0), (100, 1.0)], 10)
    assert _bench.is_stable([(50, 9.0), (100, 1.0), (105, 1.05), (98, 1.0)], 10)
    assert not _bench.is_stable([(100, 1.0), (100, 1.0), (100, 2.0)], 10)
    assert not _bench.is_stable([(0, 1.0), (0, 1.0), (0, 1.0)], 10)


@pytest.mark.parametrize("binary", [False, True])
def test_encoded_requests_decode_with_the_servers_codec(binary: bool) -> None:
    specs = [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "n", "datatype": "INT64", "shape": [2]},
        {"name": "s", "datatype": "BYTES", "shape": [2]},
    ]
    tensors = _bench.random_inputs(specs, {"x": [2, 3]}, seed=1)
    body, header = _bench.encode_request(tensors, binary=binary)
    assert (header is not None) == binary
    decoded = decode_infer_request(body, header, Limits())
    for t in tensors:
        got = decoded.inputs[t.name]
        assert got.shape == t.array.shape
        assert got.tolist() == t.array.tolist()
    assert decoded.binary_output == binary


def test_random_inputs_refuse_an_unknown_shape_name() -> None:
    with pytest.raises(_bench.BenchError, match="'y'"):
        _bench.random_inputs([{"name": "x", "datatype": "FP32", "shape": [1]}], {"y": [1]})


# -- against a server -------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_closed_loop_sweep(url: str, tmp_path: Path, encoding: str) -> None:
    out = tmp_path / "out.json"
    args = ["--url", url, "-m", "digits", "--concurrency", "1,4", "--encoding", encoding]
    result = bench(*args, *SHORT, "--json", str(out))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].split()[:3] == ["concurrency", "req/s", "p50"]
    got = rows(out)
    assert [r["value"] for r in got] == [1, 4]
    for r in got:
        assert r["load"] == "concurrency"
        assert r["completed"] > 0  # type: ignore[operator]
        assert r["errors"] == 0
        assert r["windows"] == 2
        assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]  # type: ignore[operator]
        assert r["cpu_us_per_request"] > 0  # type: ignore[operator]
    assert json.loads(out.read_text())["encoding"] == encoding


@pytest.mark.parametrize("arrivals", ["constant", "poisson"])
def test_open_loop(url: str, tmp_path: Path, arrivals: str) -> None:
    out = tmp_path / "out.csv"
    result = bench(
        "--url", url, "-m", "digits", "--request-rate", "100,200", "--arrivals", arrivals,
        "--seed", "3", "--max-connections", "4", *SHORT, "--csv", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "late" in result.output.splitlines()[0]
    with out.open() as f:
        got = list(csv.DictReader(f))
    assert [(r["load"], float(r["value"])) for r in got] == [("rate", 100.0), ("rate", 200.0)]
    for r in got:
        assert int(r["completed"]) > 0
        assert int(r["errors"]) == 0


def test_in_process(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench(
        "--in-process", "--model-repository", str(example_repository()), "-m", "digits",
        "--concurrency", "2", *SHORT, "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["completed"] > 0  # type: ignore[operator]
    assert json.loads(out.read_text())["target"] == "in-process"


def test_inputs_from_an_npz_file(url: str, tmp_path: Path) -> None:
    images, _ = digits_samples()
    data = tmp_path / "inputs.npz"
    np.savez(data, input=images[:1])
    out = tmp_path / "out.json"
    result = bench(
        "--url", url, "-m", "digits", "--input-data", str(data), *SHORT, "--json", str(out)
    )
    assert result.exit_code == 0, result.output
    assert rows(out)[0]["errors"] == 0


def test_wrong_inputs_count_400s_and_fail(url: str, tmp_path: Path) -> None:
    data = tmp_path / "bad.json"
    request = {
        "inputs": [{"name": "input", "shape": [1, 32], "datatype": "FP32", "data": [0] * 32}]
    }
    data.write_text(json.dumps(request))
    out = tmp_path / "out.json"
    result = bench(
        "--url", url, "-m", "digits", "--input-data", str(data), *SHORT, "--json", str(out)
    )
    assert result.exit_code == 1
    assert "requests failed" in result.output
    assert "first 400 answer" in result.output
    (row,) = rows(out)
    assert row["completed"] == 0
    assert row["errors"] > 0  # type: ignore[operator]
    assert str(row["errors_by_status"]).startswith("400:")


def test_unknown_model_is_a_clear_error(url: str) -> None:
    result = bench("--url", url, "-m", "nope", *SHORT)
    assert result.exit_code == 1
    assert "404" in result.output
    assert "'nope'" in result.output


def test_refused_connection_is_a_clear_error() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = bench("--url", f"http://127.0.0.1:{port}", "-m", "digits", *SHORT)
    assert result.exit_code == 1
    assert "cannot connect" in result.output


def test_usage_errors() -> None:
    assert bench("-m", "d", "--concurrency", "2", "--request-rate", "5").exit_code == 2
    assert bench("-m", "d", "--concurrency", "0").exit_code == 2
    assert bench("--in-process", "-m", "d").exit_code == 2


def test_plot(url: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    result = bench("--url", url, "-m", "digits", "--concurrency", "1,2", *SHORT, "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"\x89PNG")
