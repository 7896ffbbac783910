"""Header forwarding (Triton's --http-header-forward-pattern, --grpc-header-forward-pattern).

The serving tests run a real ``trioinfer serve`` on 127.0.0.1 (``--port 0``) with Python
models that answer with the parameters they got, and talk to it with httpx and
tritonclient.grpc.
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from _serve import WAIT_S, serve_process
from test_parameters import infer_body, write_served
from trioinfer import ConfigError
from trioinfer.server import ServerConfig
from trioinfer.server._app import RESERVED_PARAMETERS
from trioinfer.server._forward import forward_regex, forwarded_headers

#: What the servers below forward: every X-Fwd-* header (the pattern in upper case:
#: HTTP reads it case-insensitively), "tenant" (a body parameter's name too) and
#: "priority" (a reserved one, which no header may set).
HTTP_PATTERN = "X-FWD-.*|^tenant$|^priority$"
#: gRPC's, case-sensitive as Triton's (?-i) makes it; metadata keys are lower case.
GRPC_PATTERN = "(?-i)^x-fwd-|^tenant$"


def forwarded(pattern: str, *pairs: tuple[str, str]) -> dict[str, str] | None:
    regex = forward_regex(pattern, option="p")
    assert regex is not None
    return forwarded_headers(regex, pairs, RESERVED_PARAMETERS)


def test_patterns_are_read_as_tritons() -> None:
    # Searched anywhere in the name, case-insensitively; (?-i) first makes it case-sensitive.
    assert forwarded("FWD", ("x-fwd-a", "1"), ("other", "2")) == {"x-fwd-a": "1"}
    assert forwarded("(?-i)FWD", ("x-fwd-a", "1")) is None
    assert forwarded("(?-i)fwd", ("x-fwd-a", "1")) == {"x-fwd-a": "1"}
    assert forwarded("^fwd$", ("x-fwd-a", "1")) is None
    # An empty pattern forwards nothing, as Triton's; none is the default.
    assert forward_regex("", option="p") is None
    assert forward_regex(None, option="p") is None
    assert ServerConfig().http_header_forward_pattern is None


def test_what_is_never_forwarded() -> None:
    # Pseudo-headers, gRPC's own names, binary metadata, and the parameters the server
    # reads itself: none reaches the model, whatever the pattern.
    never = [
        (":path", "/x"),
        ("grpc-timeout", "1S"),
        ("x-data-bin", "AAE="),
        ("priority", "1"),
        ("timeout", "5"),
        ("sequence_id", "7"),
        ("headers", "h"),
        ("binary_data_output", "true"),
        ("triton_enable_empty_final_response", "true"),
    ]
    assert forwarded(".*", *never) is None
    # A header sent twice is forwarded once, its values joined (RFC 9110 5.3).
    assert forwarded(".*", ("a", "1"), ("a", "2")) == {"a": "1, 2"}


@pytest.mark.parametrize("key", ["http_header_forward_pattern", "grpc_header_forward_pattern"])
def test_a_bad_pattern_is_refused_by_the_config(key: str) -> None:
    flag = "--" + key.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"{flag} \({key} in a --config file\) '\(' is not"):
        ServerConfig(**{key: "("})
    with pytest.raises(ConfigError, match="must be a regular expression"):
        ServerConfig(**{key: 5})


@pytest.mark.parametrize(
    ("args", "lines", "said"),
    [
        (
            ("--http-header-forward-pattern", "x-("),
            "",
            "invalid server settings: --http-header-forward-pattern "
            "(http_header_forward_pattern in a --config file) 'x-(' is not a valid regular "
            "expression: missing ), unterminated subpattern at position 2",
        ),
        (
            ("--grpc-header-forward-pattern", "[a-"),
            "",
            "--grpc-header-forward-pattern (grpc_header_forward_pattern in a --config file) "
            "'[a-' is not a valid regular expression",
        ),
        ((), 'grpc_header_forward_pattern = "*"\n', "'*' is not a valid regular expression"),
        ((), "http_header_forward_pattern = 5\n", "http_header_forward_pattern must be a string"),
    ],
)
def test_serve_exits_2_on_a_bad_pattern(
    tmp_path: Path, args: tuple[str, ...], lines: str, said: str
) -> None:
    from test_cli import invoke

    config = tmp_path / "server.toml"
    config.write_text(lines)
    result = invoke("serve", "--config", str(config), *args)
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("args", "lines", "said"),
    [
        (
            ("--no-grpc", "--grpc-header-forward-pattern", "x-"),
            "",
            "invalid server settings: --grpc-header-forward-pattern forwards gRPC metadata, "
            "but --no-grpc serves no gRPC; drop one of the two",
        ),
        (
            (),
            'grpc = false\ngrpc_header_forward_pattern = "x-"\n',
            "invalid server settings: grpc_header_forward_pattern in {config} forwards gRPC "
            "metadata, but grpc = false in {config} serves no gRPC; drop one of the two",
        ),
    ],
)
def test_a_grpc_pattern_without_grpc_is_refused(
    tmp_path: Path, args: tuple[str, ...], lines: str, said: str
) -> None:
    # It was accepted, and forwarded nothing: no gRPC was served to forward it from.
    from test_cli import invoke

    config = tmp_path / "server.toml"
    config.write_text(lines)
    # (A repository that does not exist: had the settings passed, serve would stop there.)
    where = ("--model-repository", str(tmp_path / "none"), "--port", "0")
    result = invoke("serve", "--config", str(config), *where, *args)
    assert result.exit_code == 2, result.output
    assert said.format(config=config) in " ".join(result.output.split())


# -- over a real trioinfer serve -----------------------------------------------------------


def serve_command(root: Path, *args: str) -> list[str]:
    return [
        *(sys.executable, "-m", "trioinfer", "serve", "--model-repository", str(root)),
        *("--host", "127.0.0.1", "--port", "0", *args),
    ]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_served(tmp_path / "models")


def parameters_of(answer: httpx.Response) -> Any:
    assert answer.status_code == 200, answer.text
    (p,) = answer.json()["outputs"][0]["data"]
    return json.loads(p)


#: Headers an HTTP client sends: two forwarded, one sent twice, one named as a body
#: parameter (the header wins), one reserved, one the pattern does not match.
SENT: list[tuple[str, str]] = [
    ("X-Fwd-User", "alice"),
    ("x-fwd-list", "a"),
    ("x-fwd-list", "b"),
    ("Tenant", "from-header"),
    ("priority", "9"),
    ("x-other", "no"),
]
#: What the model gets of them (names in lower case, as HTTP/1.1 reads them here).
GOT = {"x-fwd-user": "alice", "x-fwd-list": "a, b", "tenant": "from-header"}


@pytest.mark.python_model
@pytest.mark.streaming
def test_http_infer_and_generate_forward_matching_headers(root: Path, tmp_path: Path) -> None:
    command = serve_command(root, "--no-grpc", "--http-header-forward-pattern", HTTP_PATTERN)
    with (
        serve_process(command, log=tmp_path / "serve.log") as started,
        httpx.Client(base_url=started.url, timeout=WAIT_S) as client,
    ):
        body = infer_body({"tenant": "from-body", "k": 1})
        for model in ("echo", "triton"):  # a trioinfer Python model and a Triton one
            answer = client.post(f"/v2/models/{model}/infer", json=body, headers=SENT)
            assert parameters_of(answer) == {"k": 1, **GOT}
        # Without the headers, the body's parameters alone, as before.
        answer = client.post("/v2/models/echo/infer", json=body)
        assert parameters_of(answer) == {"k": 1, "tenant": "from-body"}
        answer = client.post("/v2/models/echo/infer", json=infer_body({}), headers=SENT)
        assert parameters_of(answer) == GOT
        answer = client.post(
            "/v2/models/echo/generate", json={"x": 1, "tenant": "from-body"}, headers=SENT
        )
        assert answer.status_code == 200, answer.text
        assert json.loads(answer.json()["p"]) == GOT
        answer = client.post("/v2/models/stream/generate_stream", json={"x": 2}, headers=SENT)
        assert answer.status_code == 200, answer.text
        events = [
            json.loads(json.loads(line.removeprefix("data: "))["p"])
            for line in answer.text.splitlines()
            if line.startswith("data: ")
        ]
        assert events == [GOT, GOT]


@pytest.mark.python_model
def test_headers_are_not_forwarded_by_default(root: Path, tmp_path: Path) -> None:
    with (
        serve_process(serve_command(root, "--no-grpc"), log=tmp_path / "serve.log") as started,
        httpx.Client(base_url=started.url, timeout=WAIT_S) as client,
    ):
        answer = client.post("/v2/models/echo/infer", json=infer_body({"k": 1}), headers=SENT)
        assert parameters_of(answer) == {"k": 1}


@pytest.mark.python_model
def test_a_pattern_from_the_config_file_on_asyncio(root: Path, tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    # (On asyncio: the same HTTP server forwards the same.)
    config.write_text(
        f'http_header_forward_pattern = {json.dumps(HTTP_PATTERN)}\nloop = "asyncio"\n'
    )
    command = serve_command(root, "--no-grpc", "--config", str(config))
    with (
        serve_process(command, log=tmp_path / "serve.log") as started,
        httpx.Client(base_url=started.url, timeout=WAIT_S) as client,
    ):
        answer = client.post("/v2/models/echo/infer", json=infer_body({}), headers=SENT)
        assert parameters_of(answer) == GOT


#: gRPC metadata: keys in lower case; a binary one (never forwarded) among them.
METADATA = {
    "x-fwd-user": "bob",
    "tenant": "from-metadata",
    "x-fwd-data-bin": b"\x00\x01",
    "x-other": "no",
}
GRPC_GOT = {"x-fwd-user": "bob", "tenant": "from-metadata"}


@pytest.mark.python_model
@pytest.mark.grpc
@pytest.mark.streaming
def test_grpc_infer_and_stream_forward_matching_metadata(root: Path, tmp_path: Path) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import re

    command = serve_command(root, "--grpc-port", "0", "--grpc-header-forward-pattern", GRPC_PATTERN)
    with serve_process(command, log=tmp_path / "serve.log") as started:
        found = (re.search(r"gRPC on (\S+)", line) for line in started.lines)
        address = next(match.group(1) for match in found if match)
        x = grpcclient.InferInput("x", [1], "INT32")
        x.set_data_from_numpy(np.array([2], np.int32))
        with grpcclient.InferenceServerClient(address) as client:
            for model in ("echo", "triton"):
                result = client.infer(
                    model, [x], parameters={"tenant": "from-body", "k": 1}, headers=METADATA
                )
                assert json.loads(result.as_numpy("p")[0]) == {"k": 1, **GRPC_GOT}
            result = client.infer("echo", [x], parameters={"k": 1})
            assert json.loads(result.as_numpy("p")[0]) == {"k": 1}
            # ModelStreamInfer: the call's metadata, for each of its requests.
            answers: queue.Queue[Any] = queue.Queue()
            client.start_stream(
                lambda result, error: answers.put(error or result), headers=METADATA
            )
            try:
                client.async_stream_infer("echo", [x], parameters={"k": 2})
                client.async_stream_infer("stream", [x])  # decoupled: two responses
                got = [answers.get(timeout=WAIT_S) for _ in range(3)]
            finally:
                client.stop_stream()
        seen = sorted((json.loads(r.as_numpy("p")[0]) for r in got), key=len)
        assert seen == [GRPC_GOT, GRPC_GOT, {"k": 2, **GRPC_GOT}]


@pytest.mark.python_model
@pytest.mark.workers
def test_every_worker_forwards_headers(root: Path, tmp_path: Path) -> None:
    from test_workers import fresh, two_workers

    with two_workers(
        root, tmp_path / "serve.log", "--no-grpc", "--http-header-forward-pattern", HTTP_PATTERN
    ) as served:
        # Each request on a connection of its own, so that the kernel spreads them over
        # both workers: every one got the pattern from the supervisor.
        for _ in range(8):
            answer = fresh(
                "POST", f"{served.url}/v2/models/echo/infer", json=infer_body({}), headers=SENT
            )
            assert parameters_of(answer) == GOT
        served.process.terminate()
        assert served.process.wait(timeout=WAIT_S) == 0
