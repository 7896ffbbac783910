"""``trioinfer serve --log-format json`` and ``--access-log``: the lines a real server writes.

Each test starts ``trioinfer serve`` on loopback, sends requests, stops it, and
reads its stderr back line by line.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from _serve import STOP_S, log_tail, serve_process
from trioinfer.server._grpc_h2 import _string_fields
from trioinfer.server._logging import JsonFormatter, _formatter

#: RFC 3339, UTC, with milliseconds.
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
_INFER = {
    "id": "req-7",
    "inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}],
}

#: Run before the CLI: /v2/health/live fails with a bug, whose traceback the log carries.
_BROKEN_LIVE = """
import trioinfer.server._app as app

async def _live(request, state):
    raise RuntimeError("boom in live")

app._live = _live
"""


def _command(*args: str, prelude: str = "") -> list[str]:
    code = f"{prelude}\nfrom trioinfer.cli import main\nmain()"
    return [sys.executable, "-c", code, "serve", "--port", "0", *args]


def _json_lines(log: Path) -> list[dict[str, Any]]:
    """Every line of *log* as JSON (a line that is not fails the test, naming it)."""
    records = []
    for line in log.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}\nlog:\n{log_tail(log)}")
    return records


def _access(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["logger"] == "trioinfer.access"]


def test_json_lines_carry_time_level_logger_message_fields_and_tracebacks(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    command = _command(
        "--no-grpc", "--log-format", "json", "--access-log", "--model", "digits",
        prelude=_BROKEN_LIVE,
    )  # fmt: skip
    with serve_process(command, log=log) as started, httpx.Client(base_url=started.url) as client:
        assert client.post("/v2/models/digits/infer", json=_INFER).status_code == 200
        assert client.post("/v2/models/nosuch/infer", json=_INFER).status_code == 404
        settings = client.get("/v2/logging").json()
        assert (settings["log_format"], settings["access_log"]) == ("json", True)
        # The connection closes after it (the app raised): last on this one.
        assert client.get("/v2/health/live").status_code == 500
        # Off at run time: the next request is not logged.
        off = httpx.post(f"{started.url}/v2/logging", json={"access_log": False})
        assert off.status_code == 200
        assert httpx.get(f"{started.url}/v2/health/ready").status_code == 200
        # On again: from the next request too (the one that switches it is not logged).
        on = httpx.post(f"{started.url}/v2/logging", json={"access_log": True})
        assert on.status_code == 200
        assert httpx.get(f"{started.url}/v2/models/digits/ready").status_code == 200
    records = _json_lines(log)
    for record in records:
        assert _TIME.fullmatch(record["time"]), record
        assert record["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), record
        assert record["logger"].startswith("trioinfer"), record
        assert isinstance(record["message"], str)
        assert record["pid"] == started.process.pid
    assert any(r["message"] == "loaded model 'digits' version 1 on cpu" for r in records)
    broken = next(r for r in records if r["message"] == "unexpected error")
    assert broken["level"] == "ERROR"
    assert broken["exc_info"].startswith("Traceback (most recent call last):")
    assert broken["exc_info"].endswith("RuntimeError: boom in live")
    ok, missing, logging_get, failed, logging_post, ready = _access(records)
    assert ok["message"].startswith("POST /v2/models/digits/infer 200 ")
    assert {k: ok[k] for k in ("protocol", "method", "path", "status")} == {
        "protocol": "http",
        "method": "POST",
        "path": "/v2/models/digits/infer",
        "status": 200,
    }
    assert (ok["model"], ok["version"], ok["request_id"]) == ("digits", "1", "req-7")
    assert ok["peer"].startswith("127.0.0.1:")
    assert ok["bytes_in"] > 0
    assert ok["bytes_out"] > 0
    assert ok["duration_ms"] >= 0
    # Refused before its body was read: no version, no request id.
    assert (missing["status"], missing["model"]) == (404, "nosuch")
    assert "version" not in missing
    assert "request_id" not in missing
    assert (failed["path"], failed["status"]) == ("/v2/health/live", 500)
    assert (logging_get["path"], logging_post["method"]) == ("/v2/logging", "POST")
    assert not any(r.get("path") == "/v2/health/ready" for r in records)
    assert ready["path"] == "/v2/models/digits/ready"


def test_a_bug_answered_500_closes_the_connection_and_is_logged_once(tmp_path: Path) -> None:
    # Starlette sends its 500, then raises the bug again: a keep-alive client was not told
    # that the connection closes after it, and its next request on it failed; and the
    # traceback was logged twice.
    log = tmp_path / "serve.log"
    command = _command("--no-grpc", "--log-format", "json", prelude=_BROKEN_LIVE)
    with serve_process(command, log=log) as started, httpx.Client(base_url=started.url) as client:
        broken = client.get("/v2/health/live")
        assert broken.status_code == 500
        assert broken.headers["connection"] == "close"
        assert client.get("/v2/health/ready").status_code == 200
    tracebacks = [r for r in _json_lines(log) if "boom in live" in r.get("exc_info", "")]
    assert [(r["level"], r["message"]) for r in tracebacks] == [("ERROR", "unexpected error")]


@pytest.mark.grpc
def test_the_request_log_names_grpc_calls(tmp_path: Path) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    log = tmp_path / "serve.log"
    command = _command("--grpc-port", "0", "--access-log", "--model", "digits")
    with serve_process(command, log=log) as started:
        [address] = [
            m.group(1) for line in started.lines if (m := re.search(r"gRPC on (\S+)", line))
        ]
        with grpcclient.InferenceServerClient(address) as client:
            tensor = grpcclient.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(np.zeros((1, 64), np.float32))
            client.infer("digits", [tensor], model_version="1", request_id="call-3")
            with pytest.raises(InferenceServerException):
                client.infer("nosuch", [tensor])
    lines = [line for line in log.read_text().splitlines() if " trioinfer.access INFO " in line]
    ok, missing = (line.split(" trioinfer.access INFO ", 1)[1] for line in lines)
    assert re.fullmatch(
        r"grpc /inference\.GRPCInferenceService/ModelInfer 0 [\d.]+ms model=digits version=1 "
        r"request_id=call-3 peer=127\.0\.0\.1:\d+ bytes_in=\d+",
        ok,
    ), ok
    # NOT_FOUND: gRPC's status code 5.
    assert missing.startswith("grpc /inference.GRPCInferenceService/ModelInfer 5 "), missing
    assert "model=nosuch" in missing


@pytest.mark.workers
def test_under_workers_every_process_logs_json_and_the_workers_log_requests(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    command = [
        *(sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--no-grpc"),
        *("--workers", "2", "--model", "digits", "--log-format", "json", "--access-log"),
    ]
    with serve_process(command, log=log) as started, httpx.Client(base_url=started.url) as client:
        for _ in range(4):
            assert client.post("/v2/models/digits/infer", json=_INFER).status_code == 200
        # Back to text at run time, on the supervisor and every worker.
        assert client.post("/v2/logging", json={"log_format": "ISO8601"}).status_code == 200
        assert client.post("/v2/models/digits/infer", json=_INFER).status_code == 200
    lines = log.read_text().splitlines()
    # JSON until the change, text after it (each process switches on its own).
    records = [json.loads(line) for line in lines if line.startswith("{")]
    text = [line for line in lines if not line.startswith("{")]
    assert len(records) > 10
    assert text
    supervisor = [r for r in records if "worker" not in r]
    workers = [r for r in records if "worker" in r]
    assert {r["pid"] for r in supervisor} == {started.process.pid}
    assert {r["worker"] for r in workers} == {0, 1}
    assert started.process.pid not in {r["pid"] for r in workers}
    requests = [r for r in _access(records) if r["path"] == "/v2/models/digits/infer"]
    assert len(requests) == 4
    assert all("worker" in r and r["model"] == "digits" for r in requests)
    assert any(re.match(r"\S+Z trioinfer\.server INFO ", line) for line in text), text
    assert any(re.match(r"\S+Z worker \d trioinfer\.access INFO POST ", line) for line in text)


def test_the_config_file_sets_the_format_and_the_request_log(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('log_format = "json"\naccess_log = true\nmodels = ["digits"]\n')
    log = tmp_path / "serve.log"
    with serve_process(_command("--no-grpc", "--config", str(config)), log=log) as started:
        assert httpx.get(f"{started.url}/v2/health/ready").status_code == 200
    [ready] = [r for r in _access(_json_lines(log)) if r["path"] == "/v2/health/ready"]
    assert (ready["method"], ready["status"]) == ("GET", 200)


def test_a_bad_log_format_names_the_choices() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trioinfer", "serve", "--log-format", "syslog"],
        capture_output=True,
        text=True,
        timeout=STOP_S,
        check=False,
    )
    assert result.returncode == 2
    assert "'syslog' is not one of 'default', 'ISO8601', 'json'" in result.stderr


def test_json_formatter_fields_extra_and_exception() -> None:
    record = logging.LogRecord("trioinfer.x", logging.ERROR, __file__, 1, "a %s", ("b",), None)
    record.model = "digits"
    error = ValueError("bad")
    record.exc_info = (ValueError, error, None)
    line = JsonFormatter(worker=3).format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert _TIME.fullmatch(fields["time"])
    assert (fields["level"], fields["logger"], fields["message"]) == ("ERROR", "trioinfer.x", "a b")
    assert (fields["model"], fields["worker"]) == ("digits", 3)
    assert fields["exc_info"].endswith("ValueError: bad")
    record.model = 2**70  # past orjson's integers: still one line of JSON
    assert json.loads(JsonFormatter().format(record))["model"] == 2**70


@pytest.mark.grpc
def test_request_fields_are_read_off_the_wire() -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2

    tensor = grpcclient.InferInput("input", [1, 64], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 64), np.float32))
    message = service_pb2.ModelInferRequest(model_name="m", model_version="2", id="x")
    message.inputs.append(tensor._get_tensor())
    message.raw_input_contents.append(tensor._get_content())
    wanted = {1: "model", 2: "version", 3: "request_id"}
    data = message.SerializeToString()
    assert _string_fields(data, wanted) == {"model": "m", "version": "2", "request_id": "x"}
    assert _string_fields(data[:3], wanted) == {"model": "m"}  # cut short: what was read
    assert _string_fields(b"\xff", wanted) == {}


@pytest.mark.tracing
def test_json_lines_inside_a_span_carry_its_trace_and_span_ids() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    record = logging.LogRecord("trioinfer.server", logging.INFO, __file__, 1, "in", None, None)
    assert "trace_id" not in json.loads(JsonFormatter().format(record))
    with TracerProvider().get_tracer("test").start_as_current_span("request") as span:
        fields = json.loads(JsonFormatter().format(record))
    context = span.get_span_context()
    assert fields["trace_id"] == f"{context.trace_id:032x}"
    assert fields["span_id"] == f"{context.span_id:016x}"


#: The start of a text line (`--log-format default`).
_TEXT_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (worker \d+ )?trioinfer[.\w]* [A-Z]+ "
)


def test_a_path_or_request_id_cannot_forge_a_text_line_or_a_field(tmp_path: Path) -> None:
    # A newline in the URL (%0A) or in the V2 request's id was written as is: the rest of
    # it read as a line of the server's own, and a space as a field of the request log.
    forged = "\n2026-12-06 19:00:00,000 trioinfer.server INFO forged"
    log = tmp_path / "serve.log"
    command = _command("--no-grpc", "--access-log", "--model", "digits")
    with serve_process(command, log=log) as started, httpx.Client(base_url=started.url) as client:
        request = {**_INFER, "id": f'r-1 peer=6.6.6.6:1 "{forged}\u2028\x85\x1b[31m'}
        assert client.post("/v2/models/digits/infer", json=request).status_code == 200
        assert client.get("/v2/health/live%0A2026-12-06%20forged%20peer=x").status_code == 404
    lines = log.read_text().split("\n")
    assert all(_TEXT_LINE.match(line) or line.startswith(" ") for line in lines if line), lines
    assert not any(line.startswith("2026-12-06 19:00:00,000") for line in lines)
    [ok, missing] = [line for line in lines if " trioinfer.access INFO " in line]
    # Quoted as a JSON string; what JSON leaves (U+2028, NEL) escaped as in Python.
    quoted = json.dumps(request["id"], ensure_ascii=False)
    quoted = quoted.replace("\u2028", "\\u2028").replace("\x85", "\\x85")
    assert re.search(f" request_id={re.escape(quoted)} peer=127\\.0\\.0\\.1:\\d+ bytes_in=", ok), ok
    assert re.search(
        r' GET "/v2/health/live\\n2026-12-06 forged peer=x" 404 [\d.]+ms peer=127', missing
    )


def test_a_json_line_whose_args_do_not_fit_its_message_is_still_one_json_line() -> None:
    # getMessage raised: logging wrote "--- Logging error ---" and a traceback on stderr,
    # lines no log shipper reads as JSON, and the record itself was lost.
    record = logging.LogRecord("trioinfer.x", logging.WARNING, "/a/b.py", 7, "n=%d", ("x",), None)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    fields = json.loads(line)
    assert (fields["level"], fields["message"]) == ("WARNING", "n=%d")
    assert fields["args"] == "('x',)"
    assert fields["format_error"].startswith("/a/b.py:7: TypeError: ")


@pytest.mark.parametrize("kind", ["default", "ISO8601"])
def test_a_text_line_whose_args_do_not_fit_its_message_is_still_one_line(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A plugin's log.info("x %d", "a"): logging wrote "--- Logging error ---" and a
    # traceback on stderr and dropped the record (the json format said it in one line).
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(_formatter(kind))
    record = logging.LogRecord(
        "trioinfer.x", logging.WARNING, "/a/b.py", 7, "n=%d\n", ("x y",), None
    )
    handler.handle(record)
    assert "Logging error" not in capsys.readouterr().err
    [line] = out.getvalue().splitlines()
    said = line.split(" trioinfer.x WARNING ", 1)[1]
    assert said == (
        "message could not be formatted (/a/b.py:7: TypeError: %d format: a real number is "
        'required, not str): message="n=%d\\n" args="(\'x y\',)"'
    ), said
    # The record itself is left as it was, for the other handlers.
    assert (record.msg, record.args) == ("n=%d\n", ("x y",))


def test_a_closed_stdout_does_not_stop_the_server(tmp_path: Path) -> None:
    # `trioinfer serve | head -1`: printing the banner to a pipe nobody reads raised
    # BrokenPipeError, and the server stopped, saying "cannot listen on ...: Broken pipe".
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "serve.log"
    command = [*_command("--no-grpc", "--model", "digits", "--access-log")]
    command[command.index("--port") + 1] = str(port)
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr)
    assert process.stdout is not None
    process.stdout.close()  # the reader leaves before the first line
    try:
        deadline = time.monotonic() + STOP_S
        while True:
            assert process.poll() is None, log_tail(log)
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready")
            except httpx.TransportError:
                assert time.monotonic() < deadline, log_tail(log)
                time.sleep(0.1)
                continue
            if answer.status_code == 200:
                break
        infer = httpx.post(f"http://127.0.0.1:{port}/v2/models/digits/infer", json=_INFER)
        assert infer.status_code == 200
    finally:
        process.terminate()
        code = process.wait(timeout=STOP_S)
    assert code == 0, log_tail(log)
    text = log.read_text()
    assert "could not print the banner on stdout" in text
    assert "Broken pipe" in text
    assert "POST /v2/models/digits/infer 200" in text


def test_a_huge_request_id_or_path_is_cut_short_in_the_request_log(tmp_path: Path) -> None:
    # A 100 kB request id made a 100 kB log line (per request: log volume at the client's
    # choosing), which Docker's log driver (16 KiB) and journald split into pieces that no
    # longer parse as JSON.
    log = tmp_path / "serve.log"
    command = _command("--no-grpc", "--log-format", "json", "--access-log", "--model", "digits")
    with serve_process(command, log=log) as started, httpx.Client(base_url=started.url) as client:
        request = {**_INFER, "id": "i" * 100_000}
        assert client.post("/v2/models/digits/infer", json=request).status_code == 200
        assert client.get("/" + "p" * 20_000).status_code == 404
    lines = [line for line in log.read_text().splitlines() if "trioinfer.access" in line]
    assert all(len(line) < 4096 for line in lines), [len(line) for line in lines]
    ok, missing = (json.loads(line) for line in lines)
    assert ok["request_id"] == "i" * 256 + "..."
    assert missing["path"] == "/" + "p" * 255 + "..."


def test_an_extra_field_cannot_replace_a_json_lines_own_keys() -> None:
    # `log.info(..., extra={"level": 3, "time": "yesterday"})` (a plugin's) replaced the
    # line's level and time: a shipper then filed an INFO line under level 3.
    record = logging.LogRecord("trioinfer.x", logging.INFO, __file__, 1, "m", None, None)
    record.__dict__.update({"level": 3, "time": "yesterday", "pid": 0, "user": "u"})
    fields = json.loads(JsonFormatter().format(record))
    assert (fields["level"], fields["pid"], fields["user"]) == ("INFO", record.process, "u")
    assert _TIME.fullmatch(fields["time"])
