"""TLS against a real ``trioinfer serve``: gRPC (Triton's --grpc-use-ssl flags) and HTTPS.

tritonclient.grpc and tritonclient.http connect with ``ssl=True`` as they would to
Triton (or to a proxy in front of it, for HTTPS); the certificates are trustme's (a
throwaway CA, its server certificate for 127.0.0.1 and a client's).
"""

from __future__ import annotations

import functools
import queue
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from click.testing import CliRunner
from tritonclient.utils import InferenceServerException

from _serve import WAIT_S
from test_grpc import Server, run_server, simple_inputs
from trioinfer.cli import main as cli_main
from trioinfer.testing import models

trustme = pytest.importorskip("trustme")

pytestmark = [pytest.mark.grpc, pytest.mark.tls]

#: A short head_timeout, so that a client stalling in the handshake is dropped soon.
HEAD_TIMEOUT_S = 1.0
SERVE_CONFIG = f"""\
[limits]
head_timeout = {HEAD_TIMEOUT_S}
"""


@attrs.frozen
class Certs:
    """The PEM files of one test CA: the server's, a client's, and an untrusted client's."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    root = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.private_key_pem.write_to_path(str(root / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(root / "server.pem"))
    for blob in server.cert_chain_pems[1:]:
        blob.write_to_path(str(root / "server.pem"), append=True)
    client = ca.issue_cert("client@example.com")
    client.private_key_pem.write_to_path(str(root / "client.key"))
    client.cert_chain_pems[0].write_to_path(str(root / "client.pem"))
    stranger = trustme.CA().issue_cert("stranger@example.com")  # signed by another CA
    stranger.private_key_pem.write_to_path(str(root / "stranger.key"))
    stranger.cert_chain_pems[0].write_to_path(str(root / "stranger.pem"))
    return Certs(
        root / "ca.pem",
        root / "server.pem",
        root / "server.key",
        root / "client.pem",
        root / "client.key",
        root / "stranger.pem",
        root / "stranger.key",
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tls") / "repository"
    models.write_add(root / "simple" / "1" / "model.onnx", dtype=np.int32, width=16)
    return root


def _serve_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "serve.toml"
    path.write_text(SERVE_CONFIG)
    return path


@pytest.fixture(scope="module")
def tls_server(
    repository: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--grpc-use-ssl", "--grpc-server-cert", str(certs.server_cert)]
    args += ["--grpc-server-key", str(certs.server_key)]
    args += ["--http-ssl-cert", str(certs.server_cert), "--http-ssl-key", str(certs.server_key)]
    args += ["--config", str(_serve_config(tmp_path_factory)), "--log-level", "info"]
    with run_server(repository, *args, log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


@pytest.fixture(scope="module")
def mutual_server(
    repository: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # Triton's spelling, a value after '=': the command lines teams bring along work.
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--grpc-use-ssl-mutual=1", f"--grpc-server-cert={certs.server_cert}"]
    args += [f"--grpc-server-key={certs.server_key}", f"--grpc-root-cert={certs.ca}"]
    with run_server(repository, *args, log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def _client(server: Server, certs: Certs, *, cert: bool = False) -> triton.InferenceServerClient:
    options: dict[str, Any] = {"ssl": True, "root_certificates": str(certs.ca)}
    if cert:
        options |= {
            "private_key": str(certs.client_key),
            "certificate_chain": str(certs.client_cert),
        }
    return triton.InferenceServerClient(server.grpc, **options)


def _check_infer(client: triton.InferenceServerClient) -> None:
    inputs, a, b = simple_inputs(2)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
    np.testing.assert_array_equal(result.as_numpy("diff"), a - b)


def test_infer_stream_and_metadata_over_tls(tls_server: Server, certs: Certs) -> None:
    with _client(tls_server, certs) as client:
        assert client.is_server_live()
        assert client.get_server_metadata().name == "trioinfer"
        assert client.get_model_metadata("simple").name == "simple"
        _check_infer(client)
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            inputs, a, b = simple_inputs()
            for i in range(3):
                client.async_stream_infer("simple", inputs, request_id=str(i))
            got = [answers.get(timeout=WAIT_S) for _ in range(3)]
        finally:
            client.stop_stream()
    assert [error for _, error in got] == [None] * 3
    assert sorted(result.get_response().id for result, _ in got) == ["0", "1", "2"]
    for result, _ in got:
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)


def test_tls_offers_h2_by_alpn(tls_server: Server, certs: Certs) -> None:
    # gRPC clients require the server to select h2; a raw TLS client sees it chosen.
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.set_alpn_protocols(["h2"])
    host, port = tls_server.grpc.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=WAIT_S) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        assert tls.selected_alpn_protocol() == "h2"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_a_plaintext_client_fails_and_the_server_goes_on(tls_server: Server, certs: Certs) -> None:
    with (
        triton.InferenceServerClient(tls_server.grpc) as plain,
        pytest.raises(InferenceServerException),
    ):
        plain.is_server_live(client_timeout=10)
    with _client(tls_server, certs) as client:
        _check_infer(client)


def test_a_client_stalling_in_the_handshake_is_dropped(tls_server: Server, certs: Certs) -> None:
    host, port = tls_server.grpc.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as silent:
        # Connected, and never a ClientHello: closed by the server after head_timeout.
        started = time.monotonic()
        assert silent.recv(1024) == b""
        assert time.monotonic() - started < WAIT_S
        # Meanwhile the others were served, and are still.
        with _client(tls_server, certs) as client:
            _check_infer(client)
    log = tls_server.log_text()
    assert "no TLS handshake within" in log, log[-4000:]


def test_mutual_tls_needs_a_client_certificate_signed_by_the_root(
    mutual_server: Server, certs: Certs
) -> None:
    with _client(mutual_server, certs, cert=True) as client:
        _check_infer(client)
        assert client.get_model_metadata("simple").name == "simple"
    with (
        _client(mutual_server, certs) as anonymous,
        pytest.raises(InferenceServerException),
    ):
        anonymous.is_server_live(client_timeout=10)
    stranger = triton.InferenceServerClient(
        mutual_server.grpc,
        ssl=True,
        root_certificates=str(certs.ca),
        private_key=str(certs.stranger_key),
        certificate_chain=str(certs.stranger_cert),
    )
    with stranger, pytest.raises(InferenceServerException):
        stranger.is_server_live(client_timeout=10)
    with _client(mutual_server, certs, cert=True) as client:
        _check_infer(client)  # still served
    log = mutual_server.log_text()
    assert "TLS handshake failed" in log, log[-4000:]


@pytest.mark.workers
def test_every_worker_serves_tls(
    repository: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--workers", "2", "--grpc-use-ssl-mutual", "--grpc-server-cert", str(certs.server_cert)]
    args += ["--grpc-server-key", str(certs.server_key), "--grpc-root-cert", str(certs.ca)]
    args += ["--http-ssl-cert", str(certs.server_cert), "--http-ssl-key", str(certs.server_key)]
    with run_server(repository, *args, log=log) as running:
        assert running.url.startswith("https://")
        # New connections spread over the workers: several clients reach both.
        for _ in range(6):
            with _client(running, certs, cert=True) as client:
                _check_infer(client)
            with _https(certs) as http:
                assert http.get(f"{running.url}/v2/health/ready").status_code == 200
        with _client(running, certs) as anonymous, pytest.raises(InferenceServerException):
            anonymous.is_server_live(client_timeout=10)
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


# -- HTTPS -----------------------------------------------------------------------------------


def _https(certs: Certs) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(certs.ca)), timeout=WAIT_S)


def test_https_serves_the_v2_api(tls_server: Server, certs: Certs) -> None:
    assert tls_server.url.startswith("https://127.0.0.1:")
    _, a, b = simple_inputs(2)
    body = {
        "inputs": [
            {"name": name, "shape": [2, 16], "datatype": "INT32", "data": array.ravel().tolist()}
            for name, array in (("a", a), ("b", b))
        ]
    }
    with _https(certs) as http:
        assert http.get(f"{tls_server.url}/v2/health/ready").status_code == 200
        # Keep-alive: several requests on the one TLS connection.
        for _ in range(3):
            answer = http.post(f"{tls_server.url}/v2/models/simple/infer", json=body)
            assert answer.status_code == 200, answer.text
            outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
            assert outputs["sum"] == (a + b).ravel().tolist()
    # tritonclient.http (geventhttpclient), binary tensors and all.
    client = triton_http.InferenceServerClient(
        tls_server.url.removeprefix("https://"), ssl=True, ssl_options={"ca_certs": str(certs.ca)}
    )
    try:
        http_inputs = []
        for name, array in (("a", a), ("b", b)):
            http_inputs.append(triton_http.InferInput(name, [2, 16], "INT32"))
            http_inputs[-1].set_data_from_numpy(array)
        result = client.infer("simple", http_inputs)
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)
        assert client.get_model_metadata("simple")["name"] == "simple"
    finally:
        client.close()


def test_https_offers_http11_by_alpn(tls_server: Server, certs: Certs) -> None:
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.set_alpn_protocols(["h2", "http/1.1"])
    port = int(tls_server.url.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.selected_alpn_protocol() == "http/1.1"
        tls.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_plain_http_to_https_fails_and_the_server_goes_on(tls_server: Server, certs: Certs) -> None:
    plain = tls_server.url.replace("https://", "http://")
    with httpx.Client(timeout=WAIT_S) as http, pytest.raises(httpx.HTTPError):
        http.get(f"{plain}/v2/health/ready")
    port = int(tls_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as silent:
        assert silent.recv(1024) == b""  # no handshake: dropped after head_timeout
    with _https(certs) as http:
        assert http.get(f"{tls_server.url}/v2/health/ready").status_code == 200
    log = tls_server.log_text()
    assert "HTTPS connection from" in log, log[-4000:]


def test_a_bad_https_key_stops_serve_at_start(repository: Path, certs: Certs) -> None:
    said = _serve_fails(
        repository,
        "--no-grpc",
        "--http-ssl-cert",
        str(certs.server_cert),
        "--http-ssl-key",
        str(certs.client_key),
    )
    assert "--http-ssl-key" in said, said
    assert "does not match" in said, said
    said = _serve_fails(repository, "--no-grpc", "--http-ssl-cert", str(certs.server_cert))
    assert "--http-ssl-key" in said, said


@pytest.mark.parametrize("loop", ["trio", "asyncio"])
def test_large_messages_over_tls_and_a_drain(
    repository: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory, loop: str
) -> None:
    # Many TLS records each way (a full socket on the way out, several records per read on
    # the way in), on either loop; the server then stops with both clients connected.
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--loop", loop, "--grpc-use-ssl", "--grpc-server-cert", str(certs.server_cert)]
    args += ["--grpc-server-key", str(certs.server_key)]
    args += ["--http-ssl-cert", str(certs.server_cert), "--http-ssl-key", str(certs.server_key)]
    rows = 16_384  # 1 MiB per input
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.ones_like(a)
    with run_server(repository, *args, log=log) as running:
        grpc_client = _client(running, certs)
        http_client = triton_http.InferenceServerClient(
            running.url.removeprefix("https://"),
            ssl=True,
            ssl_options={"ca_certs": str(certs.ca)},
            network_timeout=WAIT_S,
        )
        for _ in range(2):
            grpc_inputs = [triton.InferInput(n, [rows, 16], "INT32") for n in ("a", "b")]
            http_inputs = [triton_http.InferInput(n, [rows, 16], "INT32") for n in ("a", "b")]
            for inputs in (grpc_inputs, http_inputs):
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(b)
            result: Any = grpc_client.infer("simple", grpc_inputs)
            np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
            result = http_client.infer("simple", http_inputs)
            np.testing.assert_array_equal(result.as_numpy("diff"), a - b)
    # (run_server required exit status 0 after SIGTERM, with both clients still connected.)
    grpc_client.close()
    http_client.close()
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def test_mutual_tls_trusts_the_root_alone(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not the system's CAs besides: a client certificate from any public CA would pass.
    # OpenSSL's default store read from SSL_CERT_FILE stands for the system's here.
    from trioinfer.server import TlsFiles
    from trioinfer.server._tls import server_context

    system = tmp_path / "system-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(system))
    monkeypatch.setenv("SSL_CERT_FILE", str(system))
    context = server_context(TlsFiles(certs.server_cert, certs.server_key, certs.ca, mutual=True))
    assert context.verify_mode == ssl.CERT_REQUIRED
    trusted = context.get_ca_certs(binary_form=True)
    assert trusted == [ssl.PEM_cert_to_DER_cert(certs.ca.read_text())]
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    plain = server_context(TlsFiles(certs.server_cert, certs.server_key))
    assert plain.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_serve_asgi_over_tls_says_https_in_the_scope(certs: Certs, backend: str) -> None:
    from trioinfer.server import TlsFiles
    from trioinfer.server._http_server import serve_asgi
    from trioinfer.server._tls import server_context

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")  # served without one
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["scheme"].encode()})

    context = server_context(TlsFiles(certs.server_cert, certs.server_key), alpn="http/1.1")

    async def main() -> tuple[str, str]:
        shutdown = anyio.Event()
        async with anyio.create_task_group() as tg:
            urls = await tg.start(
                functools.partial(
                    serve_asgi,
                    app,
                    "127.0.0.1",
                    0,
                    shutdown=shutdown,
                    graceful_timeout=1.0,
                    ssl_context=context,
                )
            )
            verify = ssl.create_default_context(cafile=str(certs.ca))
            async with httpx.AsyncClient(verify=verify, timeout=WAIT_S) as client:
                answer = await client.get(f"{urls[0]}/")
            shutdown.set()
        return urls[0], answer.text

    url, scheme = anyio.run(main, backend=backend)
    assert url.startswith("https://127.0.0.1:")
    assert scheme == "https"


# -- bad settings stop serve at start ------------------------------------------------------


def _serve_fails(repository: Path, *args: str) -> str:
    result = CliRunner().invoke(
        cli_main,
        ["serve", "--port", "0", "--model-repository", str(repository), *args],
    )
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "Traceback" not in result.output
    return result.output


def test_a_missing_certificate_file_stops_serve_at_start(
    repository: Path, certs: Certs, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.pem"
    said = _serve_fails(
        repository,
        "--grpc-use-ssl",
        "--grpc-server-cert",
        str(missing),
        "--grpc-server-key",
        str(certs.server_key),
    )
    assert "--grpc-server-cert" in said, said
    assert str(missing) in said, said
    assert "cannot read" in said, said


def test_a_key_of_another_certificate_stops_serve_at_start(repository: Path, certs: Certs) -> None:
    said = _serve_fails(
        repository,
        "--grpc-use-ssl",
        "--grpc-server-cert",
        str(certs.server_cert),
        "--grpc-server-key",
        str(certs.client_key),
    )
    assert "--grpc-server-key" in said, said
    assert str(certs.client_key) in said, said
    assert "does not match" in said, said


def test_a_file_that_is_not_a_certificate_stops_serve_at_start(
    repository: Path, certs: Certs, tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    said = _serve_fails(
        repository,
        "--grpc-use-ssl",
        "--grpc-server-cert",
        str(junk),
        "--grpc-server-key",
        str(certs.server_key),
    )
    assert "--grpc-server-cert" in said, said
    assert str(junk) in said, said
    said = _serve_fails(
        repository,
        "--grpc-use-ssl-mutual",
        "--grpc-server-cert",
        str(certs.server_cert),
        "--grpc-server-key",
        str(certs.server_key),
        "--grpc-root-cert",
        str(junk),
    )
    assert "--grpc-root-cert" in said, said
    assert str(junk) in said, said


def test_tls_without_its_files_stops_serve_at_start(repository: Path, certs: Certs) -> None:
    said = _serve_fails(repository, "--grpc-use-ssl", "--grpc-server-cert", str(certs.server_cert))
    assert "--grpc-server-key" in said, said
    said = _serve_fails(
        repository,
        "--grpc-use-ssl-mutual",
        "--grpc-server-cert",
        str(certs.server_cert),
        "--grpc-server-key",
        str(certs.server_key),
    )
    assert "--grpc-root-cert" in said, said
    said = _serve_fails(
        repository,
        "--no-grpc",
        "--grpc-use-ssl",
        "--grpc-server-cert",
        str(certs.server_cert),
        "--grpc-server-key",
        str(certs.server_key),
    )
    assert "--no-grpc" in said, said


def test_config_file_keys_name_themselves_and_resolve_beside_it(
    repository: Path, certs: Certs, tmp_path: Path
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        'grpc_use_ssl = true\ngrpc_server_cert = "missing.pem"\n'
        f'grpc_server_key = "{certs.server_key}"\n'
    )
    said = _serve_fails(repository, "--config", str(config))
    assert "grpc_server_cert in" in said, said
    assert str(tmp_path / "missing.pem") in said, said
