"""trioinfer bench's perf_analyzer modes: --streaming, sequences, --shared-memory.

Against a real ``trioinfer serve`` (HTTP and gRPC) on a repository of a plain
ONNX model, the stateful accumulator of test_sequence and the bundled decoupled
repeat_int32, and in-process where the mode applies. Nothing here is timed.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from click.testing import CliRunner

import test_sequence
import trioinfer
import trioinfer.bench as tool
from test_grpc import Server, run_server
from trioinfer.bench._client import _Connection
from trioinfer.bench._modes import SHM_DIR, Modes, _Sequencer
from trioinfer.bench._stats import _Recorder
from trioinfer.cli import main
from trioinfer.testing import models

pytestmark = pytest.mark.bench

SHORT = ("--warmup", "0.05", "--window", "0.3", "--windows", "2")
#: repeat_int32's inputs for three responses per request, none delayed.
REPEAT_3 = {
    "inputs": [
        {"name": "IN", "shape": [3], "datatype": "INT32", "data": [4, 5, 6]},
        {"name": "DELAY", "shape": [3], "datatype": "UINT32", "data": [0, 0, 0]},
        {"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]},
    ]
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench_modes") / "repository"
    models.write_add(root / "add" / "1" / "model.onnx")
    (root / "simple_sequence" / "1").mkdir(parents=True)
    (root / "simple_sequence" / "1" / "model.py").write_text(test_sequence.MODEL_PY)
    (root / "simple_sequence" / "config.toml").write_text(test_sequence.CONFIG_TOML)
    shutil.copytree(
        Path(trioinfer.__file__).parent / "examples/repository/repeat_int32", root / "repeat_int32"
    )
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("grpc")
    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(repository, log=log) as running:
        yield running


@pytest.fixture
def repeat_3(tmp_path: Path) -> Path:
    path = tmp_path / "repeat3.json"
    path.write_text(json.dumps(REPEAT_3))
    return path


def bench(*args: str, json_file: Path | None = None) -> tuple[int, str, dict[str, Any]]:
    """Run ``trioinfer bench``; its exit code, output, and the JSON it wrote."""
    extra = ["--json", str(json_file)] if json_file is not None else []
    result = CliRunner().invoke(main, ["bench", *args, *extra])
    doc = json.loads(json_file.read_text()) if json_file is not None and json_file.exists() else {}
    return result.exit_code, result.output, doc


def registered(server: Server) -> list[Any]:
    """The server's registered system shared-memory regions."""
    answer: list[Any] = httpx.get(f"{server.url}/v2/systemsharedmemory/status").json()
    return answer


def leftover_regions() -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith("trioinfer_bench_")]


def target(server: Server, protocol: str) -> tuple[str, ...]:
    """The options that reach *server* over *protocol*."""
    if protocol == "grpc":
        return ("--protocol", "grpc", "--url", f"grpc://{server.grpc}")
    return ("--url", server.url)


BOTH = pytest.mark.parametrize("protocol", ["http", pytest.param("grpc", marks=pytest.mark.grpc)])


# -- streaming -------------------------------------------------------------------------------


@pytest.mark.streaming
@pytest.mark.python_model
@BOTH
def test_streaming_counts_every_response(
    server: Server, repeat_3: Path, tmp_path: Path, protocol: str
) -> None:
    # gRPC: one ModelStreamInfer stream per worker; HTTP: a generate_stream request (SSE).
    code, output, doc = bench(
        *target(server, protocol),
        "-m",
        "repeat_int32",
        *("--streaming", "--input-data", str(repeat_3), "--concurrency", "1,4", *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    assert "resp/s" in output
    assert doc["streaming"] is True
    for row in doc["results"]:
        assert row["completed"] > 0
        assert row["errors"] == 0
        # Three responses per request, counted in the same windows as the requests.
        assert math.isclose(row["responses_per_s"], 3 * row["throughput"], rel_tol=0.01)
        assert row["first_p50_ms"] <= row["max_ms"]


@pytest.mark.grpc
@pytest.mark.streaming
@pytest.mark.python_model
def test_grpc_streaming_keeps_one_stream_per_worker(server: Server, repeat_3: Path) -> None:
    # perf_analyzer's way: each worker sends request after request on one
    # ModelStreamInfer stream, and trioinfer's server ends each request's
    # responses with the empty final response the requests ask for.
    from trioinfer.bench._grpc_raw import _RawGrpcLoop

    grpc_target = tool.GrpcTarget(server.grpc, "repeat_int32")
    recorder = _Recorder()
    loop = _RawGrpcLoop(
        grpc_target.host_port,
        grpc_target.address,
        grpc_target.requests([tool.load_inputs(repeat_3)]),
        recorder,
        3,
        streams_per_connection=2,
        streaming=True,
    )
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(recorder.window.latencies) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
        thread.join(30)
        loop.close()
    assert not recorder.window.errors, recorder.first_error
    assert len(recorder.window.latencies) >= 30
    assert recorder.window.responses == 3 * len(recorder.window.latencies)
    # Stream ids go 1, 3, 5...: two connections, with two and one stream opened.
    assert [conn.next_id for conn in loop.connections] == [5, 3]


@pytest.mark.streaming
@pytest.mark.python_model
def test_streaming_in_process(repository: Path, repeat_3: Path, tmp_path: Path) -> None:
    code, output, doc = bench(
        *("--in-process", "--model-repository", str(repository)),
        *("-m", "repeat_int32", "--streaming", "--input-data", str(repeat_3), *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    (row,) = doc["results"]
    assert row["completed"] > 0
    assert math.isclose(row["responses_per_s"], 3 * row["throughput"], rel_tol=0.01)


@pytest.mark.streaming
@pytest.mark.python_model
def test_an_open_loop_stream_s_first_response_counts_from_when_it_was_due(
    repository: Path, tmp_path: Path
) -> None:
    """A request that waited for a free worker waited on its clock, as perf_analyzer counts.

    One worker, requests due every 10 ms, each 30 ms to its first response: they leave
    late, and each one's time to its first response is its send delay and 30 ms more.
    (It counted from when the request left: 30 ms, whatever the delay.)
    """
    slow = tmp_path / "slow.json"
    doc = json.loads(json.dumps(REPEAT_3))
    doc["inputs"][0].update(shape=[1], data=[4])
    doc["inputs"][1].update(shape=[1], data=[0])
    doc["inputs"][2].update(data=[30])
    slow.write_text(json.dumps(doc))
    intervals = tmp_path / "intervals.txt"
    intervals.write_text("10000\n")
    code, output, doc = bench(
        *("--in-process", "--model-repository", str(repository), "-m", "repeat_int32"),
        *("--streaming", "--input-data", str(slow), "--request-intervals", str(intervals)),
        *("--max-connections", "1", *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    (row,) = doc["results"]
    assert row["completed"] > 0
    # Each request's first response came at least its send delay after it was due (and
    # 30 ms more, of which a window's edge may cut a few requests' pairs).
    assert row["first_p50_ms"] >= row["send_delay_p50_ms"] > 0


@pytest.mark.grpc
@pytest.mark.streaming
@pytest.mark.python_model
def test_a_streamed_error_message_is_counted(server: Server, tmp_path: Path) -> None:
    # DELAY shorter than IN: refused, and the stream answers with its error_message.
    bad = tmp_path / "bad.json"
    doc = json.loads(json.dumps(REPEAT_3))
    doc["inputs"][1].update(shape=[1], data=[0])
    bad.write_text(json.dumps(doc))
    code, output, _ = bench(
        *("--protocol", "grpc", "--url", f"grpc://{server.grpc}", "-m", "repeat_int32"),
        *("--streaming", "--input-data", str(bad), *SHORT),
    )
    assert code == 1
    assert "stream-error" in output
    assert "'DELAY'" in output


@pytest.mark.grpc
@pytest.mark.streaming
@pytest.mark.python_model
def test_the_wrong_streaming_flag_is_a_usage_error_naming_the_right_one(
    server: Server, repeat_3: Path
) -> None:
    grpc_url = ("--protocol", "grpc", "--url", f"grpc://{server.grpc}")
    code, output, _ = bench(*grpc_url, "-m", "repeat_int32", "--input-data", str(repeat_3))
    assert code == 1
    assert "decoupled" in output
    assert "add --streaming" in output
    code, output, _ = bench(*grpc_url, "-m", "add", "--streaming")
    assert code == 1
    assert "not decoupled" in output
    code, output, _ = bench("--url", server.url, "-m", "repeat_int32")
    assert code == 1
    assert "add --streaming" in output


def test_server_sent_events_are_counted_across_chunks() -> None:
    conn = _Connection(_Recorder(), streaming=True)
    conn.status = 200
    conn.events, conn.first, conn.stream_error = 0, 0, None
    for chunk in [b'data: {"OUT": 1}\n', b'\ndata: {"OUT"', b': 2}\n\ndata: {"error":"cut"}\n\n']:
        conn._events(chunk)
    assert conn.events == 2
    assert conn.first > 0
    assert conn.stream_error == '{"error":"cut"}'


# -- sequences -------------------------------------------------------------------------------


def test_sequences_take_ids_in_turn_with_start_and_end() -> None:
    sequencer = _Sequencer(Modes(sequence_length=3, sequence_variation=0), seed=0)
    first, second = sequencer.slot(), sequencer.slot()
    steps = [next(first) for _ in range(4)]
    assert [(s.id, s.start, s.end) for s in steps] == [
        (1, True, False),
        (1, False, False),
        (1, False, True),
        (2, True, False),  # after the first slot's first sequence: the next id
    ]
    assert next(second).id == 3
    assert steps[0].parameters() == {
        "sequence_id": 1,
        "sequence_start": True,
        "sequence_end": False,
    }


def test_sequence_lengths_vary_within_the_bound() -> None:
    sequencer = _Sequencer(Modes(sequence_length=10, sequence_variation=20), seed=1)
    slot = sequencer.slot()
    lengths, length = [], 0
    while len(lengths) < 50:
        step = next(slot)
        length += 1
        if step.end:
            lengths.append(length)
            length = 0
    assert all(8 <= n <= 12 for n in lengths)
    assert len(set(lengths)) > 1


def test_ids_come_in_turn_from_the_range() -> None:
    ids = _Sequencer(Modes(sequence_length=1, sequence_ids=(5, 7)), seed=0).slot()
    assert [next(ids).id for _ in range(3)] == [5, 6, 5]


@pytest.mark.sequence
@pytest.mark.python_model
@BOTH
@pytest.mark.parametrize("length", [None, "4"])
def test_sequences(server: Server, tmp_path: Path, protocol: str, length: str | None) -> None:
    # A request of a sequence never started, or started twice, is refused (400): no
    # errors means every sequence went out with its start and end, in order.
    code, output, doc = bench(
        *target(server, protocol),
        *("-m", "simple_sequence", "--input-data", "zero"),
        *(("--sequence-length", length) if length else ()),
        *("--sequence-id-range", "100:200", "--concurrency", "1,3", *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in doc["results"])


@pytest.mark.sequence
@pytest.mark.python_model
def test_sequences_in_process(repository: Path, tmp_path: Path) -> None:
    code, output, doc = bench(
        *("--in-process", "--model-repository", str(repository), "-m", "simple_sequence"),
        *("--input-data", "zero", "--sequence-length", "3", "--concurrency", "2", *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in doc["results"])


@pytest.mark.sequence
def test_sequence_flags_for_a_model_that_is_not_stateful(server: Server) -> None:
    code, output, _ = bench("--url", server.url, "-m", "add", "--sequence-length", "3")
    assert code == 1
    assert "not stateful" in output
    code, output, _ = bench("--url", server.url, "-m", "add", "--sequence-id-range", "5:9")
    assert code == 1
    assert "not stateful" in output


# -- open loop (--request-rate) in every mode --------------------------------------------------


OPEN = ("--request-rate", "40", "--arrivals", "constant")


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("streaming", marks=[pytest.mark.streaming, pytest.mark.python_model]),
        pytest.param("sequence", marks=[pytest.mark.sequence, pytest.mark.python_model]),
        pytest.param("shm", marks=pytest.mark.shm),
    ],
)
@BOTH
def test_open_loop_in_every_mode(
    server: Server, repeat_3: Path, tmp_path: Path, mode: str, protocol: str
) -> None:
    args = {
        "streaming": ("-m", "repeat_int32", "--streaming", "--input-data", str(repeat_3)),
        # Two sequences in flight need only two ids: none collide.
        "sequence": (
            *("-m", "simple_sequence", "--input-data", "zero", "--sequence-length", "3"),
            *("--num-of-sequences", "2", "--sequence-id-range", "100:102"),
        ),
        "shm": ("-m", "add", "--shared-memory", "system", "--output-shared-memory-size", "64"),
    }[mode]
    code, output, doc = bench(
        *target(server, protocol), *args, *OPEN, *SHORT, json_file=tmp_path / "run.json"
    )
    assert code == 0, output
    assert "sent/s" in output.splitlines()[0]
    (row,) = doc["results"]
    assert row["load"] == "rate"
    assert row["completed"] > 0
    assert row["errors"] == 0
    # The rate achieved and how late requests left, beside the rate asked.
    assert row["sent_per_s"] > 0
    assert row["send_delay_p50_ms"] <= row["send_delay_max_ms"]
    if mode == "streaming":
        assert math.isclose(row["responses_per_s"], 3 * row["throughput"], rel_tol=0.01)
    if mode == "shm":
        assert registered(server) == []
        assert leftover_regions() == []


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("streaming", marks=pytest.mark.streaming),
        pytest.param("sequence", marks=pytest.mark.sequence),
    ],
)
@pytest.mark.python_model
def test_open_loop_in_process(repository: Path, repeat_3: Path, tmp_path: Path, mode: str) -> None:
    args = {
        "streaming": ("-m", "repeat_int32", "--streaming", "--input-data", str(repeat_3)),
        "sequence": ("-m", "simple_sequence", "--input-data", "zero", "--sequence-length", "3"),
    }[mode]
    code, output, doc = bench(
        *("--in-process", "--model-repository", str(repository), *args, *OPEN, *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    (row,) = doc["results"]
    assert row["completed"] > 0
    assert row["errors"] == 0
    assert row["sent_per_s"] > 0


@pytest.mark.sequence
@pytest.mark.python_model
@pytest.mark.parametrize(
    ("load", "flag"),
    [
        (("--concurrency", "1,3"), "at --concurrency 3;"),
        (("--num-of-sequences", "3", *OPEN), "at --num-of-sequences 3;"),
    ],
)
def test_sequences_in_flight_need_an_id_each(
    server: Server, load: tuple[str, ...], flag: str
) -> None:
    # Refused before any connection opens (the level's sockets were left to the
    # garbage collector, a ResourceWarning each) and before any level runs, naming
    # the flag that set the sequences in flight (an open loop's was said to be
    # "concurrency 3", a flag it does not take).
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, output, _ = bench(
            *("--url", server.url, "-m", "simple_sequence", "--sequence-id-range", "100:102"),
            *load,
            *SHORT,
        )
        gc.collect()
    assert code == 1
    assert f"has 2 ids, fewer than the 3 sequences in flight {flag} ids would collide" in output
    assert "widen the range (to 100:103 or more)" in output
    assert "p99" not in output  # no level ran
    assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []


@pytest.mark.sequence
def test_the_number_of_open_loop_sequences_is_for_stateful_models(server: Server) -> None:
    code, output, _ = bench("--url", server.url, "-m", "add", "--num-of-sequences", "3", *OPEN)
    assert code == 1
    assert "not stateful" in output


@pytest.mark.grpc
def test_grpc_open_loop_workers_are_a_fixed_pool(server: Server, tmp_path: Path) -> None:
    # One call in flight at most: at 20,000/s some requests wait (late) or are dropped,
    # and the table says the server (or the tool) could not keep up.
    code, output, doc = bench(
        *target(server, "grpc"), "-m", "add", "--max-connections", "1",
        *("--request-rate", "20000", "--arrivals", "constant", *SHORT),
        json_file=tmp_path / "run.json",
    )  # fmt: skip
    assert code == 0, output
    (row,) = doc["results"]
    assert row["completed"] > 0
    assert row["late"] + row["dropped"] > 0
    assert row["sent_per_s"] < 20000
    assert "could not keep up" in output


@pytest.mark.grpc
def test_grpc_open_loop_needs_the_raw_client(server: Server) -> None:
    code, output, _ = bench(
        *target(server, "grpc"), "-m", "add", "--grpc-client", "aio", *OPEN, *SHORT
    )
    assert code == 1
    assert "--grpc-client raw" in output


def test_a_bad_id_range_is_a_usage_error() -> None:
    code, output, _ = bench("-m", "x", "--sequence-id-range", "9:3")
    assert code == 2
    assert "START:END" in output


# -- shared memory ---------------------------------------------------------------------------


@pytest.mark.shm
@BOTH
def test_shared_memory_leaves_nothing_registered(
    server: Server, tmp_path: Path, protocol: str
) -> None:
    # Over gRPC, 20 workers: two connections, so two regions.
    code, output, doc = bench(
        *target(server, protocol),
        *("-m", "add", "--shared-memory", "system", "--output-shared-memory-size", "64"),
        *("--concurrency", "1,3" if protocol == "http" else "1,20", *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    assert doc["shared_memory"] == "system"
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in doc["results"])
    assert registered(server) == []
    assert leftover_regions() == []


@pytest.mark.shm
@BOTH
def test_outputs_too_big_for_the_region_are_the_servers_error(
    server: Server, protocol: str
) -> None:
    # 'add' answers 4 FP32s (16 bytes) per output: 8 bytes cannot hold them.
    code, output, _ = bench(
        *target(server, protocol),
        *("-m", "add", "--shared-memory", "system", "--output-shared-memory-size", "8", *SHORT),
    )
    assert code == 1
    assert ("400" if protocol == "http" else "INVALID_ARGUMENT") in output
    assert registered(server) == []
    assert leftover_regions() == []


@pytest.mark.shm
def test_an_interrupted_run_unregisters_its_regions(server: Server) -> None:
    seen: list[list[Any]] = []

    def interrupt(_progress: tool.Progress) -> None:
        seen.append(registered(server))
        raise KeyboardInterrupt

    target = tool.HttpTarget.from_url(server.url, "add")
    plan = tool.Plan(concurrency=(2,), modes=Modes(shared_memory="system"))
    # (Ctrl-C reaches the run the same way: raised where the run's task is.)
    with pytest.RaisesGroup(KeyboardInterrupt, flatten_subgroups=True):
        trio.run(lambda: tool.run_http(target, plan, progress=interrupt))
    assert len(seen[0]) == 2  # one region per connection, registered while it ran
    assert registered(server) == []
    assert leftover_regions() == []


@pytest.mark.sequence
@pytest.mark.python_model
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("-m", "simple_sequence"), "every request to a stateful model is part of one"),
        (("-m", "repeat_int32", "--streaming"), "does not go with --streaming"),
    ],
)
def test_shared_memory_says_why_it_does_not_go_with_a_model(
    server: Server, args: tuple[str, ...], said: str
) -> None:
    # A stateful model benched with --shared-memory alone was told "--shared-memory goes
    # with neither sequences nor --streaming", sequences it had not asked for.
    code, output, _ = bench(
        *("--url", server.url, *args, "--input-data", "zero", "--shared-memory", "system")
    )
    assert code == 1
    assert said in output


def test_cuda_shared_memory_is_refused() -> None:
    code, output, _ = bench("-m", "add", "--shared-memory", "cuda")
    assert code == 2
    assert "not supported" in output


@pytest.mark.shm
@pytest.mark.workers
def test_a_server_that_takes_no_regions_says_why(repository: Path, tmp_path: Path) -> None:
    with run_server(repository, "--workers", "2", log=tmp_path / "log") as workers:
        code, output, _ = bench(
            "--url", workers.url, "-m", "add", "--shared-memory", "system", *SHORT
        )
    assert code == 1
    assert "--workers" in output
    assert leftover_regions() == []


# -- the bundled stateful model ----------------------------------------------------------------


@pytest.mark.sequence
@pytest.mark.python_model
def test_the_docs_sequence_command_runs_on_the_bundled_repository(tmp_path: Path) -> None:
    # docs/how-to/benchmarking.md's command, on the bundled repository (in-process
    # here: the model is loaded as `trioinfer serve` loads it).
    page = (Path(__file__).parent.parent / "docs/how-to/benchmarking.md").read_text()
    command = "trioinfer bench -m accumulator --input-data zero --concurrency 1,8 \\\n"
    assert command in page
    code, output, doc = bench(
        *("--in-process", "--model-repository", str(trioinfer.example_repository())),
        *("-m", "accumulator", "--input-data", "zero", "--concurrency", "1,8"),
        *("--sequence-length", "20", "--sequence-id-range", "1000:2000", *SHORT),
        json_file=tmp_path / "run.json",
    )
    assert code == 0, output
    assert [r["value"] for r in doc["results"]] == [1, 8]
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in doc["results"])


@pytest.mark.sequence
@pytest.mark.python_model
async def test_the_bundled_accumulator_sums_each_sequence_apart() -> None:
    from trioinfer.server import ModelRepository
    from trioinfer.server._models import ServedModels

    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(trioinfer.example_repository()))
        await served.load_with_steps("accumulator")
        name = served.resolve("accumulator", None).info.name
        sums: dict[int, list[int]] = {1: [], 2: []}
        for i, (a, b) in enumerate([(3, 100), (4, -1), (5, -2)]):
            for sequence_id, value in ((1, a), (2, b)):
                flags = trioinfer.SequenceFlags(sequence_id, start=i == 0, end=i == 2)
                outputs = await engine.infer(
                    name, {"INPUT": np.array([[value]], np.int32)}, sequence=flags
                )
                sums[sequence_id].append(int(outputs["OUTPUT"][0][0]))
    assert sums == {1: [3, 7, 12], 2: [100, 99, 97]}
