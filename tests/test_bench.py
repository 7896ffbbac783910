"""trioinfer bench: against a real V2 server in a thread, in-process, and its pure parts."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from click.testing import CliRunner, Result

import trioinfer
import trioinfer.bench as tool
from _serve import start_serving
from trioinfer._examples import digits_samples, example_repository
from trioinfer.cli import main
from trioinfer.server import Limits, decode_infer_request, encode_infer_request

pytestmark = pytest.mark.bench

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
            listening = await start_serving(nursery, example_repository(), shutdown=stop)
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


class _Handler(socketserver.StreamRequestHandler):
    """A V2 server stand-in that misbehaves on purpose, as ``server.mode`` says.

    ``close``: answers every infer request, then closes the connection
    (``Connection: close``). ``drop``: closes every other connection after
    reading the request, without an answer. ``silent``: never answers an infer
    request. ``slow``: answers every infer request after ``SLOW_S``, each
    connection on a thread of its own. Metadata (any GET) is always answered.
    """

    SLOW_S = 0.05

    METADATA = json.dumps(
        {"name": "digits", "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]}
    ).encode()
    ANSWER = b'{"model_name":"digits","outputs":[]}'

    def handle(self) -> None:
        server = self.server
        assert isinstance(server, _MisbehavingServer)
        with server.lock:
            server.connections += 1
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = self.rfile.readline()
                if not line:
                    return
                head += line
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            self.rfile.read(length)
            if head.startswith(b"GET"):
                self._answer(self.METADATA, close=False)
                continue
            with server.lock:
                server.requests += 1
                n = server.requests
            if server.mode == "silent":
                self.rfile.read()  # until the client goes
                return
            if server.mode == "drop" and n % 2:
                return
            if server.mode == "slow":
                time.sleep(self.SLOW_S)
            self._answer(self.ANSWER, close=server.mode == "close")
            if server.mode == "close":
                return

    def _answer(self, body: bytes, *, close: bool) -> None:
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.wfile.flush()


class _MisbehavingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, mode: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.requests = 0
        self.connections = 0
        self.lock = threading.Lock()


@pytest.fixture
def misbehaving(request: pytest.FixtureRequest) -> Iterator[str]:
    """A stand-in server on a free loopback port, in the mode the test is parametrized with."""
    server = _MisbehavingServer(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()
    thread.join(30)


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args], prog_name="trioinfer")


def rows(path: Path) -> list[dict[str, object]]:
    results = json.loads(path.read_text())["results"]
    assert isinstance(results, list)
    return results


# -- pure parts ---------------------------------------------------------------------------------


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = list(itertools.islice(tool.iter_arrivals(1000, "constant"), 5))
    assert times == [0, 1_000_000, 2_000_000, 3_000_000, 4_000_000]


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    def take(seed: int) -> list[int]:
        return list(itertools.islice(tool.iter_arrivals(2000, "poisson", seed), 20_000))

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
        next(tool.iter_arrivals(0, "constant"))


@pytest.mark.parametrize("rate", [1e-300, 1e300])
def test_arrivals_refuse_a_rate_the_schedule_cannot_keep(rate: float) -> None:
    # 1e300/s: every request due at 0 ns, for ever; 1e-300/s: times past int64's
    # nanoseconds. Each hung `trioinfer bench --request-rate` before its first window.
    with pytest.raises(ValueError, match="rate"):
        next(tool.iter_arrivals(rate, "poisson"))


@pytest.mark.parametrize("rate", ["1e-300", "1e300", "100,1e7", "0", "-5", "abc", "nan"])
def test_a_request_rate_out_of_range_is_a_usage_error(rate: str) -> None:
    # (0, a negative or no number was "expected positive numbers", with no range.)
    result = bench("-m", "d", "--request-rate", rate)
    assert result.exit_code == 2, result.output
    assert "0.001 to 1000000 requests per second" in result.output, result.output


@pytest.mark.parametrize("levels", ["0", "1.5", "4,0", "x"])
def test_a_concurrency_that_is_not_whole_numbers_is_a_usage_error(levels: str) -> None:
    result = bench("-m", "d", "--concurrency", levels)
    assert result.exit_code == 2, result.output
    assert "expected whole numbers of 1 or more, separated by commas" in result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--num-of-sequences", "3", "--concurrency", "2"), "--num-of-sequences: for an open"),
        (("--arrivals", "constant"), "--arrivals: for an open loop"),
        (("--max-connections", "4"), "--max-connections: for an open loop"),
        (("--request-intervals", "{gaps}", "--arrivals", "poisson"), "does not go with"),
    ],
)
def test_open_loop_flags_are_refused_where_nothing_uses_them(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    # A closed loop took them and ran as if they were not there: 2 sequences in flight
    # for --num-of-sequences 3.
    gaps = tmp_path / "gaps.txt"
    gaps.write_text("1000\n2000\n")
    result = bench("-m", "d", *(arg.format(gaps=gaps) for arg in args))
    assert result.exit_code == 2, result.output
    assert said in result.output


def test_a_model_file_and_a_repository_are_not_both_taken(tmp_path: Path) -> None:
    # The file was loaded and the repository left unread, without a word.
    result = bench(
        "--in-process", "--model-file", __file__, "--model-repository", str(tmp_path), "-m", "d"
    )
    assert result.exit_code == 2, result.output
    assert "give one of --model-file" in result.output
    assert "not both" in result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--in-process", "--protocol", "grpc"), "--protocol: for a server; --in-process"),
        (("--in-process", "--url", "http://h:1", "--encoding", "binary"), "--url, --encoding:"),
        (("--grpc-client", "aio"), "--grpc-client: for --protocol grpc"),
        (("--protocol", "grpc", "--encoding", "binary"), "--encoding: for HTTP; over gRPC"),
    ],
)
def test_server_flags_are_refused_where_nothing_uses_them(args: tuple[str, ...], said: str) -> None:
    # `--in-process --protocol grpc` measured the engine alone, and said nothing of it.
    result = bench("--model-file", __file__, "-m", "d", *args)
    assert result.exit_code == 2, result.output
    assert said in result.output


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, flag: str
) -> None:
    # It was found after the run ("[Errno 2] No such file or directory"): minutes of
    # figures lost. No server here: the refusal comes before any connection.
    result = bench("-m", "d", flag, str(tmp_path / "missing" / "out"))
    assert result.exit_code == 2, result.output
    assert f"cannot write '{tmp_path / 'missing' / 'out'}': no directory" in result.output


def test_stability_needs_three_close_windows() -> None:
    assert not tool.is_stable([(100, 1.0), (100, 1.0)], 10)
    assert tool.is_stable([(50, 9.0), (100, 1.0), (105, 1.05), (98, 1.0)], 10)
    assert not tool.is_stable([(100, 1.0), (100, 1.0), (100, 2.0)], 10)
    assert not tool.is_stable([(0, 1.0), (0, 1.0), (0, 1.0)], 10)


@pytest.mark.parametrize("binary", [False, True])
def test_random_inputs_encode_and_decode_with_the_codec(binary: bool) -> None:
    specs = [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "n", "datatype": "INT64", "shape": [2]},
        {"name": "s", "datatype": "BYTES", "shape": [2]},
    ]
    tensors = tool.random_inputs(specs, {"x": [2, 3]}, seed=1)
    body, header = encode_infer_request({t.name: t.array for t in tensors}, binary=binary)
    assert (header is not None) == binary
    decoded = decode_infer_request(body, header, Limits())
    for t in tensors:
        got = decoded.inputs[t.name]
        assert got.shape == t.array.shape
        want = t.array
        if binary and want.dtype == object:
            # Binary BYTES decode to the bytes sent (the engine gives a model its type).
            want = np.array([v.encode() for v in want.ravel()], dtype=object)
        assert got.tolist() == want.tolist()
    assert decoded.binary_output == binary


def test_random_inputs_refuse_an_unknown_shape_name() -> None:
    with pytest.raises(tool.BenchError, match="'y'"):
        tool.random_inputs([{"name": "x", "datatype": "FP32", "shape": [1]}], {"y": [1]})


def test_zero_inputs_are_zeros_of_each_datatype() -> None:
    specs = [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "n", "datatype": "UINT8", "shape": [2]},
        {"name": "b", "datatype": "BOOL", "shape": [1]},
        {"name": "s", "datatype": "BYTES", "shape": [2]},
    ]
    tensors = {t.name: t.array for t in tool.zero_inputs(specs, {"x": [2, 3]})}
    assert tensors["x"].dtype == np.float32
    assert tensors["x"].shape == (2, 3)
    assert not tensors["x"].any()
    assert tensors["n"].dtype == np.uint8
    assert tensors["n"].tolist() == [0, 0]
    assert tensors["b"].tolist() == [False]
    assert tensors["s"].tolist() == ["0", "0"]  # a string a model reading numbers accepts
    body, header = encode_infer_request(tensors, binary=True)
    assert decode_infer_request(body, header, Limits()).inputs["s"].tolist() == [b"0", b"0"]


@pytest.mark.parametrize("make", [tool.random_inputs, tool.zero_inputs])
def test_generated_inputs_refuse_a_negative_shape(make: Any) -> None:
    # --shape IN=-1,4 crashed with numpy's traceback; -1 is a wildcard, not a size.
    with pytest.raises(tool.BenchError, match=r"--shape x=-1,3: a dimension is negative"):
        make([{"name": "x", "datatype": "FP32", "shape": [-1, 3]}], {"x": [-1, 3]})


@pytest.mark.parametrize("make", [tool.random_inputs, tool.zero_inputs])
def test_generated_inputs_refuse_a_shape_no_server_takes(make: Any) -> None:
    # --shape IN=99999999999,4 was numpy's MemoryError traceback (46 TiB), and one of
    # 10**8 rows allocated gigabytes for requests a default server refuses (past 2**26).
    spec = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    with pytest.raises(
        tool.BenchError,
        match=r"--shape x=99999999999,4 is 399999999996 elements; a server with default "
        r"limits takes at most 67108864 per input",
    ):
        make(spec, {"x": [99_999_999_999, 4]})
    with pytest.raises(tool.BenchError, match=r"is 67108868 elements"):  # one row past it
        make(spec, {"x": [(1 << 24) + 1, 4]})


@pytest.mark.parametrize("shape", [[2, 3], [4], [1, 4, 1]])
def test_generated_inputs_refuse_a_shape_the_model_cannot_take(shape: list[int]) -> None:
    # The server refused every request, and the tool blamed its random values.
    spec = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    with pytest.raises(tool.BenchError, match=r"does not fit input 'x', whose shape is \[-1, 4\]"):
        tool.random_inputs(spec, {"x": shape})
    (tensor,) = tool.random_inputs(spec, {"x": [8, 4]})
    assert tensor.array.shape == (8, 4)


def test_zero_inputs_refuse_an_unknown_shape_name() -> None:
    with pytest.raises(tool.BenchError, match="'y'"):
        tool.zero_inputs([{"name": "x", "datatype": "FP32", "shape": [1]}], {"y": [1]})


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
        assert r["stable"] is None  # two fixed windows: nothing to compare, no verdict
        assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]  # type: ignore[operator]
        assert r["cpu_us_per_request"] > 0  # type: ignore[operator]
    assert json.loads(out.read_text())["encoding"] == encoding
    assert "not stable" not in result.output


def test_max_windows_below_three_gives_no_stability_verdict(url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench(
        "--url", url, "-m", "digits", "--warmup", "0.05", "--window", "0.2",
        "--max-windows", "2", "--stability", "0", "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["windows"] == 2
    assert row["stable"] is None
    assert "not stable" not in result.output


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
        # What was sent and how late, beside what was asked (perf_analyzer's send rate).
        assert float(r["sent_per_s"]) > 0
        assert 0 <= float(r["send_delay_p50_ms"]) <= float(r["send_delay_max_ms"])
    header = result.output.splitlines()[0].split()
    assert header[:2] == ["rate/s", "sent/s"]
    assert "delay" in header


def test_request_intervals_are_due_in_turn_and_cycled() -> None:
    due = tool.iter_intervals([10, 20, 30])
    assert [next(due) for _ in range(7)] == [0, 10, 30, 60, 70, 90, 120]
    plan = tool.Plan.from_intervals([1_000_000, 3_000_000], seed=3)
    assert plan.rates == (500.0,)  # two requests per 4 ms
    assert plan.seed == 3
    assert list(itertools.islice(plan.schedule(500.0), 3)) == [0, 1_000_000, 4_000_000]
    for bad in ([], [0, 0], [5, -1]):
        with pytest.raises(tool.BenchError, match="whole numbers of nanoseconds"):
            tool.Plan.from_intervals(bad)
    # A mean rate --request-rate would refuse: the rate printed as 2e-23/s.
    for bad, mean in (([10**32], "1e\\+23 s"), ([1, 0], "5e-10 s")):
        with pytest.raises(tool.BenchError, match=f"average from 1 µs to 1000 s.*mean of {mean}"):
            tool.Plan.from_intervals(bad)


def test_open_loop_from_request_intervals(url: str, tmp_path: Path) -> None:
    # perf_analyzer's --request-intervals: microseconds, one per line; a blank line is none.
    intervals = tmp_path / "intervals.txt"
    intervals.write_text("2000\n\n8000\n")
    out = tmp_path / "out.json"
    result = bench(
        "--url", url, "-m", "digits", "--request-intervals", str(intervals), *SHORT,
        "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert (row["load"], row["value"]) == ("rate", 200.0)  # two requests per 10 ms
    assert row["completed"] > 0  # type: ignore[operator]
    assert row["sent_per_s"] > 0  # type: ignore[operator]
    assert json.loads(out.read_text())["request_intervals"] == str(intervals)


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        ("100\nfast\n", (), "line 2: expected a whole number of microseconds"),
        ("-5\n", (), "line 1: expected a whole number of microseconds"),
        ("0\n0\n", (), "no interval above 0"),
        ("100000000000000000000000000\n", (), "intervals.txt: request intervals must average"),
        ("100\n", ("--request-rate", "5"), "--request-rate, --request-intervals, not several"),
    ],
)
def test_bad_request_intervals_are_usage_errors(
    tmp_path: Path, text: str, extra: tuple[str, ...], message: str
) -> None:
    intervals = tmp_path / "intervals.txt"
    intervals.write_text(text)
    result = bench("-m", "digits", "--request-intervals", str(intervals), *extra)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_an_open_loop_that_cannot_keep_up_says_how_late_requests_left() -> None:
    latency = {"p50": 1.0, "p90": 2.0, "p95": 3.0, "p99": 4.0, "max": 5.0}
    delays = {"p50": 0.5, "p90": 9.0, "p95": 10.0, "p99": 12.5, "max": 20.0}
    behind = tool.Result(
        "rate", 1000, 640.0, latency, 640, {}, 300, 50, 3, True, 10.0, 0.5,
        sent_per_s=700.0, send_delay_ms=delays,
    )  # fmt: skip
    table = tool.format_table([behind])
    header, row = table.splitlines()[:2]
    assert header.split()[:3] == ["rate/s", "sent/s", "req/s"]
    assert row.split()[:3] == ["1000", "700", "640"]
    assert "12.50" in row
    assert "700/s sent" in table
    assert "p99 send delay 12.50 ms" in table
    assert behind.row()["sent_per_s"] == 700.0
    assert behind.row()["send_delay_p99_ms"] == 12.5
    # A closed loop has neither.
    assert "sent_per_s" not in _result(4).row()


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


def test_in_process_pipeline_loads_its_steps_first(tmp_path: Path) -> None:
    # read_digit's steps (scale_image, digits, digit_names) are other models of the
    # repository; its intensities run 0-16, so random data (0-99) would be refused.
    out = tmp_path / "out.json"
    result = bench(
        "--in-process", "--model-repository", str(example_repository()), "-m", "read_digit",
        "--input-data", "zero", "--concurrency", "2", *SHORT, "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["completed"] > 0  # type: ignore[operator]
    assert row["errors"] == 0
    assert json.loads(out.read_text())["input_data"] == "zero"


def _repository_with(tmp_path: Path, name: str, steps: str) -> Path:
    """The bundled repository, copied, with one more pipeline model *name* over *steps*."""
    root = tmp_path / "repository"
    shutil.copytree(example_repository(), root)
    (root / name).mkdir()
    (root / name / "config.toml").write_text(
        'backend = "pipeline"\n[backend_options]\n'
        'inputs = [{ name = "IMAGE", dtype = "uint8", shape = ["batch", 8, 8] }]\n'
        'outputs = [{ name = "NAME", dtype = "string", shape = ["batch"] }]\n' + steps
    )
    return root


def test_in_process_pipeline_of_pipelines_loads_every_step(tmp_path: Path) -> None:
    root = _repository_with(
        tmp_path,
        "outer",
        '[[backend_options.steps]]\nmodel = "read_digit"\n'
        'input_map = { IMAGE = "IMAGE" }\noutput_map = { NAME = "NAME" }\n',
    )
    out = tmp_path / "out.json"
    result = bench(
        "--in-process", "--model-repository", str(root), "-m", "outer",
        "--input-data", "zero", *SHORT, "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["completed"] > 0  # type: ignore[operator]
    assert row["errors"] == 0


def test_in_process_pipeline_with_a_missing_step_names_it(tmp_path: Path) -> None:
    root = _repository_with(
        tmp_path,
        "broken",
        '[[backend_options.steps]]\nmodel = "nowhere"\n'
        'input_map = { image = "IMAGE" }\noutput_map = { name = "NAME" }\n',
    )
    result = bench("--in-process", "--model-repository", str(root), "-m", "broken", *SHORT)
    assert result.exit_code == 1
    assert "cannot bench 'broken'" in result.output
    assert "'nowhere'" in result.output
    assert "not in the repository" in result.output
    assert "Traceback" not in result.output


def test_in_process_model_version_must_be_served(tmp_path: Path) -> None:
    result = bench(
        "--in-process", "--model-repository", str(example_repository()), "-m", "digits",
        "--model-version", "7", *SHORT,
    )  # fmt: skip
    assert result.exit_code == 1
    assert "no served version '7'" in result.output


def test_in_process_refused_random_inputs_suggest_zero() -> None:
    result = bench(
        "--in-process", "--model-repository", str(example_repository()), "-m", "read_digit",
        *SHORT,
    )  # fmt: skip
    assert result.exit_code == 1
    assert "first InvalidInput answer" in result.output
    assert "'read_digit' (version 1)" in result.output  # as people name it, not read_digit.v1
    assert "try --input-data zero" in result.output


def test_in_process_requests_refused_at_once_do_not_hold_the_loop(tmp_path: Path) -> None:
    # A 0-row --shape is refused by the engine before any checkpoint: the closed loop's
    # worker, failing on each request in turn, held the event loop, and the run never
    # ended. In a process of its own, so that such a hang fails the test.
    out = tmp_path / "out.json"
    result = subprocess.run(
        [
            sys.executable, "-m", "trioinfer", "bench", "--in-process", "--model-repository",
            str(example_repository()), "-m", "digits", "--shape", "input=0,64", *SHORT,
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "has 0 rows; send at least one" in result.stderr
    # Not only random values are refused: the hint names --shape too.
    assert "refused the random inputs (of the --shape given): check --shape" in result.stderr
    (row,) = rows(out)
    assert row["completed"] == 0
    assert row["errors"] > 0  # type: ignore[operator]


def test_shape_is_refused_with_input_files(tmp_path: Path) -> None:
    # The files' requests were sent as they are, and --shape silently left unused.
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "inputs": [
                    {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}
                ]
            }
        )
    )
    result = bench(
        "--in-process", "--model-repository", str(example_repository()), "-m", "digits",
        "--input-data", str(request), "--shape", "input=2,64", *SHORT,
    )  # fmt: skip
    assert result.exit_code == 2
    assert "--shape: for generated inputs" in result.output
    zero = bench(
        "--in-process", "--model-repository", str(example_repository()), "-m", "digits",
        "--input-data", "zero", "--shape", "input=2,64", *SHORT,
    )  # fmt: skip
    assert zero.exit_code == 0, zero.output


def test_served_pipeline_refusing_random_inputs_suggests_zero(url: str, tmp_path: Path) -> None:
    refused = bench("--url", url, "-m", "read_digit", *SHORT)
    assert refused.exit_code == 1
    assert "first 400 answer" in refused.output
    assert "intensity" in refused.output
    assert "try --input-data zero, or give your own with --input-data FILE" in refused.output
    out = tmp_path / "out.json"
    zero = bench(
        "--url", url, "-m", "read_digit", "--input-data", "zero", *SHORT, "--json", str(out)
    )
    assert zero.exit_code == 0, zero.output
    assert rows(out)[0]["errors"] == 0


def test_input_data_usage_errors(tmp_path: Path) -> None:
    both = bench("-m", "d", "--input-data", "zero", "--input-data", "random")
    assert both.exit_code == 2
    assert "goes alone" in both.output
    missing = bench("-m", "d", "--input-data", str(tmp_path / "nope.json"))
    assert missing.exit_code == 2
    assert "'random', 'zero' or an .npz or .json file" in missing.output


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


def test_an_npz_that_is_not_one_is_a_clear_error(tmp_path: Path) -> None:
    # A lone .npy array named .npz was a TypeError traceback; text, numpy's "pickled" note.
    npy = tmp_path / "array.npz"
    with npy.open("wb") as f:
        np.save(f, np.zeros((1, 64), np.float32))
    text = tmp_path / "text.npz"
    text.write_text("x")
    for path in (npy, text):
        with pytest.raises(tool.BenchError, match=r"it is not an \.npz archive; write one with"):
            tool.load_inputs(path)


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


def test_a_grpc_url_over_http_names_protocol_grpc() -> None:
    with pytest.raises(tool.BenchError, match=r"add --protocol grpc"):
        tool.HttpTarget.from_url("grpc://127.0.0.1:8001", "digits")
    with pytest.raises(tool.BenchError, match=r"got 'ftp://x'$"):
        tool.HttpTarget.from_url("ftp://x", "digits")


def test_refused_connection_is_a_clear_error() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = bench("--url", f"http://127.0.0.1:{port}", "-m", "digits", *SHORT)
    assert result.exit_code == 1
    assert "cannot connect" in result.output


def test_a_server_gone_mid_run_is_retried_without_spinning() -> None:
    from trioinfer.bench._load import _LoadLoop
    from trioinfer.bench._stats import _Recorder

    # The server accepts one connection, closes it and goes away: every reconnect is
    # refused, which a non-blocking connect reports as a poll event, not at once.
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = server.getsockname()
        client = socket.create_connection(address)
        client.setblocking(False)
        server.accept()[0].close()
    recorder = _Recorder()
    load = _LoadLoop(address, [b"GET / HTTP/1.1\r\n\r\n"], recorder, [client])
    worker = threading.Thread(target=load.run)
    worker.start()
    time.sleep(0.2)
    load.stop()
    worker.join()
    load.close()
    assert set(recorder.window.errors) == {"conn"}
    # One attempt per 10 ms retry at most, not a busy loop (thousands before).
    assert 1 <= recorder.window.errors["conn"] <= 0.2 / 0.01 + 10


def test_usage_errors() -> None:
    assert bench("-m", "d", "--concurrency", "2", "--request-rate", "5").exit_code == 2
    assert bench("-m", "d", "--concurrency", "0").exit_code == 2
    assert bench("--in-process", "-m", "d").exit_code == 2


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--url", "ftp://h:1"), "--url must look like http://HOST:PORT, got"),
        # A port that is no port was a ValueError traceback.
        (("--url", "h:x"), "--url must look like http://HOST:PORT, got 'h:x'"),
        (("--url", "http://h:99999"), "--url must look like http://HOST:PORT, got"),
        (("--url", "https://h:1"), "(the tool speaks no TLS: use a plain-HTTP port)"),
        (("--url", "grpc://h:1"), "(for V2 gRPC, add --protocol grpc)"),
        (("--protocol", "grpc", "--url", "http://h:1"), "--url must be grpc://HOST:PORT"),
    ],
)
def test_a_url_of_the_wrong_form_is_a_usage_error(args: tuple[str, ...], said: str) -> None:
    # A bad flag value exited 1, as an unreachable server does, not 2 as every other one.
    result = bench("-m", "d", *args)
    assert result.exit_code == 2, result.output
    assert "Invalid value for --url: " in result.output
    assert said in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("args", "said"),
    [
        # In-process these were a ValueError traceback (int('abc')).
        (("--in-process", "--model-version", "abc"), "expected a version number (1 or more)"),
        (("--in-process", "--model-version", ""), "expected a version number (1 or more)"),
        # Over HTTP, '' asked for /v2/models/digits/versions/.
        (("--model-version", ""), "expected a version (as the server names it: 1, 2, ...)"),
    ],
)
def test_a_model_version_that_is_none_is_a_usage_error(args: tuple[str, ...], said: str) -> None:
    local = ("--model-repository", str(example_repository())) if "--in-process" in args else ()
    result = bench("-m", "digits", *local, *args, *SHORT)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for --model-version: {said}" in " ".join(result.output.split())


def test_a_url_may_be_host_and_port_as_perf_analyzers() -> None:
    # perf_analyzer's -u and tritonclient take "localhost:8000"; --url refused it (while
    # --protocol grpc took "HOST:PORT").
    target = tool.HttpTarget.from_url("localhost:8000", "digits")
    assert (target.host, target.port) == ("localhost", 8000)
    assert tool.HttpTarget.from_url("[::1]:8000", "digits").host == "::1"


@pytest.fixture
def without_httptools(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after ``pip install trioinfer`` without the bench extra: httptools cannot be imported."""
    monkeypatch.setitem(sys.modules, "httptools", None)  # None in sys.modules: import fails
    for name in list(sys.modules):
        if name == "trioinfer.bench" or name.startswith("trioinfer.bench."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(trioinfer, "bench")


@pytest.mark.usefixtures("without_httptools")
def test_importing_without_the_extra_says_what_to_install() -> None:
    with pytest.raises(ImportError, match=r"needs the 'bench' extra.*'httptools'.*\[cpu,bench\]"):
        import trioinfer.bench  # noqa: F401


@pytest.mark.usefixtures("without_httptools")
def test_the_command_without_the_extra_says_what_to_install() -> None:
    result = bench("-m", "digits", *SHORT)
    assert result.exit_code == 1
    assert "needs the 'bench' extra" in result.output
    assert "no module named 'httptools'" in result.output
    assert "pip install -e '.[cpu,bench]'" in result.output
    assert "Traceback" not in result.output


def test_plot(url: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    result = bench("--url", url, "-m", "digits", "--concurrency", "1,2", *SHORT, "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"\x89PNG")


def test_model_version(url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench("--url", url, "-m", "digits", "--model-version", "1", *SHORT, "--json", str(out))
    assert result.exit_code == 0, result.output
    assert rows(out)[0]["errors"] == 0
    assert json.loads(out.read_text())["model_version"] == "1"
    missing = bench("--url", url, "-m", "digits", "--model-version", "7", *SHORT)
    assert missing.exit_code == 1
    assert "version 7" in missing.output


# -- connections that close, drop and stall ---------------------------------------------------


@pytest.mark.parametrize("misbehaving", ["close"], indirect=True)
def test_a_server_closing_each_connection_is_no_error(misbehaving: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = bench(
        "--url", misbehaving, "-m", "digits", "--concurrency", "2", *SHORT, "--json", str(out)
    )
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["completed"] > 0  # type: ignore[operator]
    assert row["errors"] == 0


@pytest.mark.parametrize("misbehaving", ["drop"], indirect=True)
@pytest.mark.parametrize("load", [("--concurrency", "2"), ("--request-rate", "200")])
def test_answers_never_sent_count_as_conn_errors(
    misbehaving: str, tmp_path: Path, load: tuple[str, str]
) -> None:
    out = tmp_path / "out.json"
    result = bench("--url", misbehaving, "-m", "digits", *load, *SHORT, "--json", str(out))
    assert result.exit_code == 1
    assert "first conn answer" in result.output
    (row,) = rows(out)
    assert row["completed"] > 0  # type: ignore[operator]
    assert str(row["errors_by_status"]).startswith("conn:")


@pytest.mark.parametrize("misbehaving", ["silent"], indirect=True)
def test_open_loop_against_a_stalled_server_waits_then_drops(
    misbehaving: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    result = bench(
        "--url", misbehaving, "-m", "digits", "--request-rate", "200", "--max-connections", "2",
        *SHORT, "--json", str(out),
    )  # fmt: skip
    (row,) = rows(out)
    assert row["completed"] == 0
    # 2 requests in flight, 16 (8 per connection) waiting, and every later one dropped.
    assert row["dropped"] > 0  # type: ignore[operator]
    assert "could not keep up" in result.output


def test_open_loop_opens_connections_as_requests_find_all_busy(tmp_path: Path) -> None:
    # 1,000 requests a second that each take 50 ms need about 50 connections; the
    # run starts with 32 (no probe with --max-connections) and must open the rest
    # as requests fall due, not make them wait for a connection.
    server = _MisbehavingServer("slow")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    out = tmp_path / "out.json"
    try:
        result = bench(
            "--url", f"http://{host}:{port}", "-m", "digits", "--request-rate", "1000",
            "--max-connections", "300", *SHORT, "--json", str(out),
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)
    assert result.exit_code == 0, result.output
    (row,) = rows(out)
    assert row["late"] == 0
    assert row["dropped"] == 0
    assert 32 < server.connections <= 300


# -- progress display and table -----------------------------------------------------------------


async def test_progress_reports_warmup_and_each_window(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    target = tool.HttpTarget(host, int(port), "digits")
    settings = tool.Settings(warmup_s=0.05, window_s=0.3, windows=2)
    reports: list[tool.Progress] = []
    plan = tool.Plan(concurrency=(1, 2), settings=settings)
    run = await tool.run_http(target, plan, progress=reports.append)
    assert len(run.results) == 2
    assert {(p.index, p.levels, p.level) for p in reports} == {
        (0, 2, "concurrency 1"),
        (1, 2, "concurrency 2"),
    }
    # Each phase reports as it starts and as it ends, whole.
    for index in (0, 1):
        phases = [(p.window, p.fraction) for p in reports if p.index == index]
        assert [w for w, f in phases if f == 1.0] == [0, 1, 2]
        assert all(0 <= f <= 1 for _, f in phases)
    assert math.isnan(reports[0].p99_ms)
    assert all(p.windows == 2 for p in reports)


def test_no_progress_display_off_a_terminal() -> None:
    with tool.open_progress() as show:
        assert show is None


SAMPLE = tool.Progress("concurrency 16", 0, 2, 3, 10, 0.5, 19_780.0, 1.25)


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich")
    err, out = _Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    with tool.open_progress() as show:
        assert show is not None
        show(SAMPLE)
    drawn = err.getvalue()
    assert "[1/2] concurrency 16" in drawn
    assert "window 3/10  19,780 req/s  last p99 1.25 ms" in drawn
    assert out.getvalue() == ""


def test_progress_line_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # import fails
    with tool.open_progress() as show:
        assert show is not None
        show(SAMPLE)
    assert err.getvalue() == (
        "\r\x1b[K[1/2] concurrency 16: window 3/10  19,780 req/s  last p99 1.25 ms\r\x1b[K"
    )


def test_progress_shows_no_rate_before_it_can_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    # At the start of a window a few answers over microseconds read as absurd rates.
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    with tool.open_progress() as show:
        assert show is not None
        show(attrs.evolve(SAMPLE, throughput=math.nan, fraction=0.0))
    assert "window 3/10  - req/s  last p99 1.25 ms" in err.getvalue()


async def test_a_window_reports_no_rate_in_its_first_refresh_interval(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    target = tool.HttpTarget(host, int(port), "digits")
    settings = tool.Settings(warmup_s=0.05, window_s=0.6, windows=1)
    shown: list[tool.Progress] = []
    await tool.run_http(
        target, tool.Plan(concurrency=(2,), settings=settings), progress=shown.append
    )
    first, *rest = [p for p in shown if p.window == 1]
    assert math.isnan(first.throughput)
    assert rest[-1].fraction == 1.0
    assert not math.isnan(rest[-1].throughput)


def _result(value: float) -> tool.Result:
    latency = {"p50": 1.0, "p90": 2.0, "p95": 3.0, "p99": 4.0, "max": 5.0}
    return tool.Result(
        "concurrency", value, 1234.0, latency, 100, {"503": 2}, 0, 0, 3, False, 21.5, 0.02
    )


def test_reports_of_a_level_where_every_request_failed_are_valid_json_and_csv(
    tmp_path: Path,
) -> None:
    # No latency to measure: the JSON held NaN (which JSON has not: jq and browsers refuse
    # it) and the CSV "nan"; they hold null and an empty cell, as "stable" does.
    latency = dict.fromkeys(["p50", "p90", "p95", "p99", "max"], math.nan)
    failed = tool.Result(
        "concurrency", 1, 0.0, latency, 0, {"500": 5}, 0, 0, 1, None, math.nan, 0.01
    )
    tool.write_json(tmp_path / "out.json", [failed], {"model": "m"})
    text = (tmp_path / "out.json").read_text()
    row = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert row["results"][0]["p99_ms"] is None
    assert row["results"][0]["cpu_us_per_request"] is None
    tool.write_csv(tmp_path / "out.csv", [failed])
    with (tmp_path / "out.csv").open(newline="") as f:
        (got,) = list(csv.DictReader(f))
    assert got["p50_ms"] == got["max_ms"] == got["cpu_us_per_request"] == ""
    assert got["errors"] == "5"


def test_table_is_plain_text_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    tool.print_table([_result(4)])
    out = capsys.readouterr().out
    assert out == tool.format_table([_result(4)]) + "\n"
    assert "errors by status: 503 x 2" in out
    assert "* not stable" in out


def test_table_with_rich_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich")
    out = _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setenv("COLUMNS", "160")  # rich wraps to the terminal's width
    tool.print_table([_result(4), _result(16)])
    text = out.getvalue()
    for cell in ("concurrency", "CPU us/req", "1,234", "21.5", "3*", "errors by status: 503 x 4"):
        assert cell in text


def test_table_on_a_narrow_terminal_keeps_every_digit(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich")
    out = _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setenv("COLUMNS", "80")
    tool.print_table([_result(4)])
    assert out.getvalue() == tool.format_table([_result(4)]) + "\n"
