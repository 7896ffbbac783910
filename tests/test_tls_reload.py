"""Renewed TLS certificates are served to new connections without a restart.

The files are replaced as cert-manager and certbot replace them: a new file renamed over
the old, or a symlink swapped (here the directory the paths go through, as a Kubernetes
secret volume does). Each renewal is a new trustme certificate of the same CA, told apart
from the one before by its serial number.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from cryptography import x509

from _serve import WAIT_S
from trioinfer.server import TlsFiles
from trioinfer.server._tls import RELOAD_CHECK_S, ReloadingContext

trustme = pytest.importorskip("trustme")

pytestmark = pytest.mark.tls


@attrs.frozen
class Issued:
    """One certificate of the test CA, written to files: its PEM chain, key and serial."""

    cert: bytes
    key: bytes
    serial: int


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _issue(ca: trustme.CA) -> Issued:
    issued = ca.issue_cert("127.0.0.1", "localhost")
    chain = b"".join(blob.bytes() for blob in issued.cert_chain_pems)
    serial = x509.load_pem_x509_certificate(issued.cert_chain_pems[0].bytes()).serial_number
    return Issued(chain, issued.private_key_pem.bytes(), serial)


def _replace(path: Path, data: bytes) -> None:
    # As certbot and most tools do: write a new file beside, rename it over the old.
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.replace(new, path)


def _swap(live: Path, target: Path) -> None:
    # A symlink swapped atomically (Kubernetes' ..data, certbot's live/ links).
    new = live.with_name(live.name + ".new")
    new.symlink_to(target.name)
    os.replace(new, live)


def _version(root: Path, name: str, cert: bytes, key: bytes) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "server.pem").write_bytes(cert)
    (directory / "server.key").write_bytes(key)
    return directory


def _serial(der: bytes | None) -> int:
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _memory_handshake(
    server: ssl.SSLContext, client: ssl.SSLContext, *, server_hostname: str = "127.0.0.1"
) -> int:
    """Handshake *client* with *server* in memory; the serial of the certificate served."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ours_out = ssl.MemoryBIO()
    ours = server.wrap_bio(to_server, ours_out, server_side=True)
    theirs_out = ssl.MemoryBIO()
    theirs = client.wrap_bio(to_client, theirs_out, server_hostname=server_hostname)
    done = {"ours": False, "theirs": False}
    for _ in range(20):
        for name, end in (("theirs", theirs), ("ours", ours)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        to_server.write(theirs_out.read())
        to_client.write(ours_out.read())
        if all(done.values()):
            return _serial(theirs.getpeercert(binary_form=True))
    raise AssertionError("the in-memory handshake did not finish")


# -- the context, in this process ----------------------------------------------------------


@pytest.fixture
def live(tmp_path: Path, ca: trustme.CA) -> tuple[Path, Issued]:
    first = _issue(ca)
    (tmp_path / "server.pem").write_bytes(first.cert)
    (tmp_path / "server.key").write_bytes(first.key)
    return tmp_path, first


def _client(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_files_renamed_over_are_loaded(live: tuple[Path, Issued], ca: trustme.CA) -> None:
    root, first = live
    reloading = ReloadingContext.load(TlsFiles(root / "server.pem", root / "server.key"))
    before = reloading.current()
    assert _memory_handshake(before, _client(ca)) == first.serial
    assert not reloading.check()  # nothing changed
    renewed = _issue(ca)
    _replace(root / "server.key", renewed.key)
    _replace(root / "server.pem", renewed.cert)
    assert reloading.check()
    assert _memory_handshake(reloading.current(), _client(ca)) == renewed.serial
    # A connection that handshook before keeps its context: the old one is untouched.
    assert _memory_handshake(before, _client(ca)) == first.serial


def test_a_swapped_symlink_is_loaded(tmp_path: Path, ca: trustme.CA) -> None:
    first, renewed = _issue(ca), _issue(ca)
    _version(tmp_path, "v1", first.cert, first.key)
    _version(tmp_path, "v2", renewed.cert, renewed.key)
    live = tmp_path / "live"
    live.symlink_to("v1")
    reloading = ReloadingContext.load(TlsFiles(live / "server.pem", live / "server.key"))
    _swap(live, tmp_path / "v2")
    assert reloading.check()
    assert _memory_handshake(reloading.current(), _client(ca)) == renewed.serial


@pytest.fixture
def said_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A renewal that cannot be used is said at its first look (no settling time)."""
    from trioinfer.server import _tls

    monkeypatch.setattr(_tls, "RELOAD_SETTLE_S", 0.0)


@pytest.mark.usefixtures("said_at_once")
def test_a_broken_renewal_keeps_the_old_files_and_is_said_once(
    live: tuple[Path, Issued], ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    root, first = live
    cert, key = root / "server.pem", root / "server.key"
    reloading = ReloadingContext.load(TlsFiles(cert, key))
    in_use = reloading.current()
    renewed = _issue(ca)
    # The certificate renewed, its key not yet: they do not match.
    _replace(cert, renewed.cert)
    with caplog.at_level(logging.INFO, logger="trioinfer.server"):
        assert not reloading.check()
        assert not reloading.check()  # looked at again, unchanged: said once
        assert reloading.current() is in_use
        [error] = _errors(caplog)
        assert "--grpc-server-key" in error, error
        assert str(key) in error, error
        assert "does not match" in error, error
        assert _memory_handshake(reloading.current(), _client(ca)) == first.serial
        # Half written: the key file cut short.
        _replace(key, renewed.key[:100])
        assert not reloading.check()
        assert len(_errors(caplog)) == 2, _errors(caplog)
        assert "holds no usable private key" in _errors(caplog)[-1]
        # Missing.
        key.unlink()
        assert not reloading.check()
        assert "cannot read it" in _errors(caplog)[-1]
        assert not reloading.check()
        assert len(_errors(caplog)) == 3, _errors(caplog)
        # Then the right key: picked up.
        key.write_bytes(renewed.key)
        assert reloading.check()
    assert len(_errors(caplog)) == 3, _errors(caplog)
    assert _memory_handshake(reloading.current(), _client(ca)) == renewed.serial
    assert any("TLS files reloaded" in r.getMessage() for r in caplog.records)


def test_a_certificate_renewed_a_moment_before_its_key_is_not_an_error(
    live: tuple[Path, Issued],
    ca: trustme.CA,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tool that replaces the certificate, then the key: a connection between the two
    # sees them mismatched, an ordinary moment of a renewal, not yet worth an ERROR.
    from trioinfer.server import _tls

    clock = [1000.0]
    monkeypatch.setattr(_tls.time, "monotonic", lambda: clock[0])
    root, first = live
    cert, key = root / "server.pem", root / "server.key"
    reloading = ReloadingContext.load(TlsFiles(cert, key))
    renewed = _issue(ca)
    with caplog.at_level(logging.DEBUG, logger="trioinfer.server"):
        _replace(cert, renewed.cert)
        assert not reloading.check()
        clock[0] += _tls.RELOAD_SETTLE_S / 2
        assert not reloading.check()
        assert _errors(caplog) == []
        assert _memory_handshake(reloading.current(), _client(ca)) == first.serial
        _replace(key, renewed.key)
        assert reloading.check()
        assert _errors(caplog) == []
        assert _memory_handshake(reloading.current(), _client(ca)) == renewed.serial
        # Still mismatched once it had time to settle: said then, once, at ERROR.
        _replace(cert, _issue(ca).cert)
        assert not reloading.check()
        clock[0] += _tls.RELOAD_SETTLE_S - 0.1
        assert not reloading.check()
        assert _errors(caplog) == []
        clock[0] += 0.1
        assert not reloading.check()
        [error] = _errors(caplog)
        assert "does not match" in error, error
        assert f"for {_tls.RELOAD_SETTLE_S:g}s" in error, error
        clock[0] += 100
        assert not reloading.check()
        assert len(_errors(caplog)) == 1
    assert _memory_handshake(reloading.current(), _client(ca)) == renewed.serial


@pytest.mark.usefixtures("said_at_once")
def test_a_file_gone_while_it_is_read_is_said_once(
    live: tuple[Path, Issued],
    ca: trustme.CA,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Removed between server_context's checks and OpenSSL's read: OpenSSL's own OSError.
    from trioinfer.server import _tls

    root, first = live
    reloading = ReloadingContext.load(TlsFiles(root / "server.pem", root / "server.key"))
    renewed = _issue(ca)
    _replace(root / "server.pem", renewed.cert)

    def gone(*args: object, **kwargs: object) -> ssl.SSLContext:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(_tls, "server_context", gone)
    with caplog.at_level(logging.INFO, logger="trioinfer.server"):
        assert not reloading.check()
        assert not reloading.check()
    [error] = _errors(caplog)
    assert "--grpc-server-cert" in error, error
    assert "No such file" in error, error
    assert _memory_handshake(reloading.current(), _client(ca)) == first.serial


def test_the_mutual_tls_root_is_reloaded(live: tuple[Path, Issued], ca: trustme.CA) -> None:
    root, first = live
    old_ca, new_ca = trustme.CA(), trustme.CA()
    (root / "ca.pem").write_bytes(old_ca.cert_pem.bytes())
    reloading = ReloadingContext.load(
        TlsFiles(root / "server.pem", root / "server.key", root / "ca.pem", mutual=True)
    )

    def client_of(client_ca: trustme.CA) -> ssl.SSLContext:
        context = _client(ca)
        client_ca.issue_cert("client@example.com").configure_cert(context)
        return context

    assert _memory_handshake(reloading.current(), client_of(old_ca)) == first.serial
    with pytest.raises(ssl.SSLError):
        _memory_handshake(reloading.current(), client_of(new_ca))
    _replace(root / "ca.pem", new_ca.cert_pem.bytes())
    assert reloading.check()
    assert _memory_handshake(reloading.current(), client_of(new_ca)) == first.serial
    with pytest.raises(ssl.SSLError):
        _memory_handshake(reloading.current(), client_of(old_ca))


def test_a_root_ca_rollover_through_a_root_file_of_both_cas(
    live: tuple[Path, Issued], ca: trustme.CA
) -> None:
    # As the docs advise: both CAs in the root file while clients move to the new one.
    root, first = live
    old_ca, new_ca = trustme.CA(), trustme.CA()
    (root / "ca.pem").write_bytes(old_ca.cert_pem.bytes())
    reloading = ReloadingContext.load(
        TlsFiles(root / "server.pem", root / "server.key", root / "ca.pem", mutual=True)
    )

    def client_of(client_ca: trustme.CA) -> ssl.SSLContext:
        context = _client(ca)
        client_ca.issue_cert("client@example.com").configure_cert(context)
        return context

    _replace(root / "ca.pem", old_ca.cert_pem.bytes() + new_ca.cert_pem.bytes())
    assert reloading.check()
    for client_ca in (old_ca, new_ca):
        assert _memory_handshake(reloading.current(), client_of(client_ca)) == first.serial


def _rewrite_in_place(path: Path, data: bytes) -> None:
    # Written into the same inode, and its mtime put back: as a copy that keeps
    # timestamps, or a second write within one tick of a coarse clock (1 s, 2 s on FAT).
    before = path.stat()
    with path.open("r+b") as f:
        f.write(data)
        f.truncate()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


def test_a_file_rewritten_with_the_same_size_and_mtime_is_loaded(
    live: tuple[Path, Issued], ca: trustme.CA
) -> None:
    root, first = live
    reloading = ReloadingContext.load(TlsFiles(root / "server.pem", root / "server.key"))
    # A renewal whose files are exactly as long as the ones they replace.
    for _ in range(200):
        renewed = _issue(ca)
        if (len(renewed.cert), len(renewed.key)) == (len(first.cert), len(first.key)):
            break
    else:
        pytest.skip("no renewal of the same sizes issued")
    _rewrite_in_place(root / "server.key", renewed.key)
    _rewrite_in_place(root / "server.pem", renewed.cert)
    assert reloading.check()
    assert _memory_handshake(reloading.current(), _client(ca)) == renewed.serial


async def test_the_files_are_read_off_the_event_loop_and_a_hung_read_blocks_nothing(
    live: tuple[Path, Issued], ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trioinfer.server import _tls

    root, _ = live
    reloading = ReloadingContext.load(TlsFiles(root / "server.pem", root / "server.key"))
    in_use = reloading.current()
    monkeypatch.setattr(_tls, "RELOAD_CHECK_S", 0.0)  # every connection may look
    monkeypatch.setattr(_tls, "RELOAD_WAIT_S", 0.05)  # not a second for each try here
    loop_thread = threading.current_thread()
    hung, threads = threading.Event(), []
    real = _tls.server_context

    def slow_filesystem(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        threads.append(threading.current_thread())
        hung.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(_tls, "server_context", slow_filesystem)
    renewed = _issue(ca)
    _replace(root / "server.key", renewed.key)
    _replace(root / "server.pem", renewed.cert)
    # The files hang: connections go on with the certificate in use, and only one
    # read is under way however many connections arrive meanwhile.
    for _ in range(5):
        assert await reloading.latest() is in_use
    hung.set()
    for _ in range(int(WAIT_S / 0.01)):
        if (context := await reloading.latest()) is not in_use:
            break
        await trio.sleep(0.01)
    assert _memory_handshake(context, _client(ca)) == renewed.serial
    [thread] = threads
    assert thread is not loop_thread


# -- a real trioinfer serve ----------------------------------------------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trioinfer.testing import models

    root = tmp_path_factory.mktemp("tls-reload") / "repository"
    models.write_add(root / "simple" / "1" / "model.onnx", dtype=np.int32, width=16)
    return root


def _https_serial(url: str, ca: trustme.CA) -> int:
    port = int(url.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw,
        _client(ca).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return _serial(tls.getpeercert(binary_form=True))


def _grpc_serial(address: str, ca: trustme.CA) -> int:
    host, port = address.rsplit(":", 1)
    context = _client(ca)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=WAIT_S) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        return _serial(tls.getpeercert(binary_form=True))


def _get_live(tls: ssl.SSLSocket) -> bytes:
    """GET /v2/health/live on a kept-alive connection; the status line."""
    tls.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = tls.recv(65536)
        assert chunk, answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += tls.recv(65536)
    return head.split(b"\r\n", 1)[0]


def _until(condition: Callable[[], bool], what: str) -> None:
    # Polled with a bound against hangs; nothing asserts how long it took.
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S}s: {what}"
        time.sleep(RELOAD_CHECK_S / 4)


@pytest.fixture
def versions(tmp_path: Path, ca: trustme.CA) -> tuple[Path, Issued]:
    first = _issue(ca)
    _version(tmp_path, "v1", first.cert, first.key)
    live = tmp_path / "live"
    live.symlink_to("v1")
    return live, first


@pytest.mark.grpc
def test_serve_picks_up_a_renewal_and_keeps_open_connections(
    repository: Path, versions: tuple[Path, Issued], ca: trustme.CA, tmp_path: Path
) -> None:
    import tritonclient.grpc as triton

    from test_grpc import run_server, simple_inputs

    live, first = versions
    cert, key = str(live / "server.pem"), str(live / "server.key")
    config = tmp_path / "serve.toml"
    # Long enough that the connection kept open is not closed as idle meanwhile.
    config.write_text(f"[limits]\nhead_timeout = {WAIT_S}\n")
    args = ["--grpc-use-ssl", "--grpc-server-cert", cert, "--grpc-server-key", key]
    args += ["--http-ssl-cert", cert, "--http-ssl-key", key, "--config", str(config)]
    with run_server(repository, *args, log=tmp_path / "server.log") as server:
        port = int(server.url.rsplit(":", 1)[1])
        with (
            socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw,
            _client(ca).wrap_socket(raw, server_hostname="127.0.0.1") as kept,
        ):
            assert _get_live(kept) == b"HTTP/1.1 200 OK"
            assert _serial(kept.getpeercert(binary_form=True)) == first.serial
            assert _grpc_serial(server.grpc, ca) == first.serial

            # A broken renewal: the new certificate with another certificate's key.
            renewed, other = _issue(ca), _issue(ca)
            _version(live.parent, "v2", renewed.cert, other.key)
            _swap(live, live.parent / "v2")

            def refused() -> bool:
                served = {_https_serial(server.url, ca), _grpc_serial(server.grpc, ca)}
                assert served == {first.serial}, "a broken renewal was served"
                log = server.log_text()
                return "--http-ssl-key" in log and "--grpc-server-key" in log

            _until(refused, "the broken renewal said on the log")
            # Connections go on arriving, each endpoint looks again: nothing more is said.
            for _ in range(3):
                time.sleep(RELOAD_CHECK_S * 1.5)
                assert _https_serial(server.url, ca) == first.serial
                assert _grpc_serial(server.grpc, ca) == first.serial
            errors = [line for line in server.log_text().splitlines() if " ERROR " in line]
            assert len(errors) == 2, errors
            assert all("does not match" in line for line in errors), errors

            # The good renewal: picked up by both endpoints.
            _version(live.parent, "v3", renewed.cert, renewed.key)
            _swap(live, live.parent / "v3")
            _until(
                lambda: _https_serial(server.url, ca) == renewed.serial,
                "HTTPS serving the renewed certificate",
            )
            _until(
                lambda: _grpc_serial(server.grpc, ca) == renewed.serial,
                "gRPC serving the renewed certificate",
            )
            pem = live.parent / "ca.pem"
            ca.cert_pem.write_to_path(str(pem))
            client = triton.InferenceServerClient(server.grpc, ssl=True, root_certificates=str(pem))
            with client:
                inputs, a, b = simple_inputs(2)
                result = client.infer("simple", inputs)
                np.testing.assert_array_equal(result.as_numpy("sum"), a + b)

            # The connection opened before the renewals is still served, on its certificate.
            assert _get_live(kept) == b"HTTP/1.1 200 OK"
            assert _serial(kept.getpeercert(binary_form=True)) == first.serial
    log = server.log_text()
    assert "Traceback" not in log, log[-4000:]
    assert "TLS files reloaded" in log, log[-4000:]


@pytest.mark.workers
def test_every_worker_picks_up_a_renewal(
    repository: Path, versions: tuple[Path, Issued], ca: trustme.CA, tmp_path: Path
) -> None:
    from test_grpc import run_server

    live, first = versions
    cert, key = str(live / "server.pem"), str(live / "server.key")
    args = ["--workers", "2", "--http-ssl-cert", cert, "--http-ssl-key", key]
    args += ["--grpc-use-ssl", "--grpc-server-cert", cert, "--grpc-server-key", key]
    log = tmp_path / "server.log"
    with run_server(repository, *args, log=log) as server:
        assert _https_serial(server.url, ca) == first.serial
        assert _grpc_serial(server.grpc, ca) == first.serial
        renewed = _issue(ca)
        _version(live.parent, "v2", renewed.cert, renewed.key)
        _swap(live, live.parent / "v2")
        # The kernel spreads connections over both workers; each reloads by itself, so
        # once several in a row are served the renewed certificate, both have.
        streak = [0]

        def renewed_everywhere() -> bool:
            serials = {_https_serial(server.url, ca), _grpc_serial(server.grpc, ca)}
            streak[0] = streak[0] + 1 if serials == {renewed.serial} else 0
            return streak[0] >= 12

        _until(renewed_everywhere, "every worker serving the renewed certificate")
    text = server.log_text()
    assert "Traceback" not in text, text[-4000:]
    # Each worker's two endpoints, each by itself.
    assert text.count("TLS files reloaded") == 4, text[-4000:]


def _kubernetes_secret(mount: Path, stamp: str, files: dict[str, bytes]) -> None:
    # As the kubelet's atomic writer updates a secret volume: the files in a new
    # timestamped directory, ..data (a symlink to it) swapped by a rename, the old
    # directory removed; each key's path is a symlink through ..data, made once.
    directory = mount / f"..{stamp}"
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    data_link = mount / "..data"
    old = data_link.resolve() if data_link.is_symlink() else None
    tmp = mount / "..data_tmp"
    tmp.symlink_to(directory.name)
    os.replace(tmp, data_link)
    for name in files:
        if not (mount / name).is_symlink():
            (mount / name).symlink_to(f"..data/{name}")
    if old is not None:
        for path in old.iterdir():
            path.unlink()
        old.rmdir()


def test_a_kubernetes_secret_volume_update_is_loaded(tmp_path: Path, ca: trustme.CA) -> None:
    # tls.crt, tls.key and ca.crt of a kubernetes.io/tls secret (cert-manager's), mutual TLS.
    first, renewed = _issue(ca), _issue(ca)
    old_ca, new_ca = trustme.CA(), trustme.CA()
    mount = tmp_path / "tls"
    mount.mkdir()
    _kubernetes_secret(
        mount,
        "2026_01_01_00_00_00.1",
        {"tls.crt": first.cert, "tls.key": first.key, "ca.crt": old_ca.cert_pem.bytes()},
    )
    files = TlsFiles(mount / "tls.crt", mount / "tls.key", mount / "ca.crt", mutual=True)
    reloading = ReloadingContext.load(files)

    def client_of(client_ca: trustme.CA) -> ssl.SSLContext:
        context = _client(ca)
        client_ca.issue_cert("client@example.com").configure_cert(context)
        return context

    assert _memory_handshake(reloading.current(), client_of(old_ca)) == first.serial
    _kubernetes_secret(
        mount,
        "2026_02_01_00_00_00.2",
        {"tls.crt": renewed.cert, "tls.key": renewed.key, "ca.crt": new_ca.cert_pem.bytes()},
    )
    assert reloading.check()
    assert _memory_handshake(reloading.current(), client_of(new_ca)) == renewed.serial
    with pytest.raises(ssl.SSLError):
        _memory_handshake(reloading.current(), client_of(old_ca))
    assert not reloading.check()


@pytest.mark.usefixtures("said_at_once")
def test_the_same_broken_renewal_again_is_said_again(
    live: tuple[Path, Issued], ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    # A key made unreadable (or deleted), then restored, then the same again later: the
    # second time is a new event, said as the first was.
    root, first = live
    key = root / "server.key"
    reloading = ReloadingContext.load(TlsFiles(root / "server.pem", key))
    with caplog.at_level(logging.INFO, logger="trioinfer.server"):
        for _ in range(2):
            key.unlink()
            assert not reloading.check()
            key.write_bytes(first.key)
            assert not reloading.check()  # the files loaded: nothing to do
        assert len(_errors(caplog)) == 2, _errors(caplog)
        assert all("cannot read it" in error for error in _errors(caplog))
    assert _memory_handshake(reloading.current(), _client(ca)) == first.serial


def _chain_warnings(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and "without the certificate that signed it" in r.message
    ]


def _published_leaf(issuer: trustme.CA) -> tuple[bytes, bytes]:
    """A server certificate of *issuer* as a public CA makes one: with AIA caIssuers.

    trustme's leaves carry no Authority Information Access; a public CA's always
    say where their issuer's certificate is (Let's Encrypt's: http://r11.i.lencr.org/).
    """
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import AuthorityInformationAccessOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(issuer.cert_pem.bytes())
    ca_key = serialization.load_pem_private_key(issuer.private_key_pem.bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityInformationAccess(
                [
                    x509.AccessDescription(
                        AuthorityInformationAccessOID.OCSP,
                        x509.UniformResourceIdentifier("http://ocsp.example/"),
                    ),
                    x509.AccessDescription(
                        AuthorityInformationAccessOID.CA_ISSUERS,
                        x509.UniformResourceIdentifier("http://ca.example/issuer.der"),
                    ),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # an EC or RSA key
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_a_leaf_straight_off_a_private_root_is_not_warned_of(
    tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    # An internal CA's leaf, served alone: clients that trust the root are fine, yet a
    # WARNING said the chain was incomplete. Said at INFO now, in case the issuer is
    # an intermediate after all.
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    issued = ca.issue_cert("127.0.0.1")
    cert.write_bytes(issued.cert_chain_pems[0].bytes())
    key.write_bytes(issued.private_key_pem.bytes())
    caplog.set_level(logging.INFO, logger="trioinfer.server")
    reloading = ReloadingContext.load(TlsFiles(cert, key))
    assert _chain_warnings(caplog) == []
    [said] = _chain_warnings(caplog, logging.INFO)
    assert "is a root CA that every client trusts, nothing is missing" in said
    assert _memory_handshake(reloading.current(), _client(ca)) > 0
    # Under mutual TLS with that root as the client CA: the issuer is known, a root.
    caplog.clear()
    root = tmp_path / "ca.pem"
    root.write_bytes(ca.cert_pem.bytes())
    ReloadingContext.load(TlsFiles(cert, key, root, mutual=True))
    assert _chain_warnings(caplog) == _chain_warnings(caplog, logging.INFO) == []


def test_a_published_leaf_without_its_intermediate_is_warned_of_even_with_the_root_at_hand(
    tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    intermediate = ca.create_child_ca()
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    leaf, leaf_key = _published_leaf(intermediate)
    cert.write_bytes(leaf)
    key.write_bytes(leaf_key)
    root = tmp_path / "ca.pem"
    root.write_bytes(ca.cert_pem.bytes())  # the root, not the intermediate that signed
    caplog.set_level(logging.INFO, logger="trioinfer.server")
    ReloadingContext.load(TlsFiles(cert, key, root, mutual=True))
    [said] = _chain_warnings(caplog)
    assert "nothing is missing" not in said


def test_a_certificate_file_without_its_intermediate_is_warned_of_at_load_and_renewal(
    tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    # The leaf alone loaded without a word; a client that has only the root then failed
    # every handshake ("unable to get local issuer certificate").
    intermediate = ca.create_child_ca()
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    leaf, leaf_key = _published_leaf(intermediate)
    chain = intermediate.cert_pem.bytes()
    cert.write_bytes(leaf)
    key.write_bytes(leaf_key)
    caplog.set_level(logging.INFO, logger="trioinfer.server")
    reloading = ReloadingContext.load(
        TlsFiles(cert, key), alpn="http/1.1", flags={"cert": "--http-ssl-cert"}
    )
    [said] = _chain_warnings(caplog)
    name = x509.load_pem_x509_certificate(chain).subject
    shown = ",".join(
        f"{a.rfc4514_attribute_name}={a.value!s}"
        for a in name
        if a.rfc4514_attribute_name in ("CN", "O", "OU")
    )
    assert said.startswith(
        f"--http-ssl-cert {str(cert)!r} holds the server's certificate without the "
        f"certificate that signed it ({shown!r}): a client that does not have that one fails"
    ), said
    assert "Append the intermediate certificate(s) to the file after the server's" in said
    assert "nothing is missing" not in said  # a published leaf never comes off a root
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        _memory_handshake(reloading.current(), _client(ca))
    # Renewed with its chain: served whole, nothing said.
    caplog.clear()
    _replace(cert, leaf + chain)
    assert reloading.check()
    assert _memory_handshake(reloading.current(), _client(ca)) > 0
    assert _chain_warnings(caplog) == []
    # Renewed without it again: said again.
    renewed, renewed_key = _published_leaf(intermediate)
    _replace(key, renewed_key)
    _replace(cert, renewed)
    assert reloading.check()
    assert len(_chain_warnings(caplog)) == 1
    # A self-signed certificate (the CA's own, as a test server's may be) has no issuer
    # to add.
    caplog.clear()
    _replace(key, ca.private_key_pem.bytes())
    _replace(cert, ca.cert_pem.bytes())
    assert reloading.check()
    assert _chain_warnings(caplog) == []
