"""TLS for the gRPC and HTTP endpoints: the certificate files, their checks, the handshakes.

The files are read when the server starts (`server_context`), so that a
missing, unreadable or mismatched file stops ``trioinfer serve`` at once with
a message naming it, rather than failing every client's handshake later.
While serving, renewed files are picked up for new connections
(`ReloadingContext`); a renewal that cannot be used keeps the files before it.
Each connection's handshake then runs in that connection's own task, under
the server's ``head_timeout`` (`handshake`): a client that connects and never
finishes it holds nothing but its own socket, and is dropped.

The handshake and the record layer are the standard library's ``ssl``
module: for gRPC through ``anyio.streams.tls.TLSStream`` (on Trio and
asyncio alike, `handshake`); for HTTP an ``ssl.SSLSocket`` in non-blocking
mode (`tls_handshake`), since the HTTP server calls its sockets directly and
waits through ``_io.py`` only when a call would block.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import hashlib
import logging
import os
import re
import socket
import ssl
import threading
import time
from typing import Any, Final, NamedTuple, final

import anyio
import anyio.abc
import attrs
from anyio.streams.tls import TLSStream

from .._exceptions import ConfigError
from ._io import IO

__all__ = [
    "HTTP_TLS_FLAGS",
    "ReloadingContext",
    "TlsFiles",
    "handshake",
    "server_context",
    "tls_handshake",
]

log = logging.getLogger("trioinfer.server")


def _path(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


@attrs.frozen
class TlsFiles:
    """The files a TLS endpoint serves with (Triton's ``--grpc-server-cert`` and the rest).

    Attributes:
        cert: The server's certificate (PEM), optionally followed by its chain.
        key: The certificate's private key (PEM, not encrypted).
        root: Certificates (PEM) that a client's certificate must be signed by;
            needed when *mutual* is true, and only read then.
        mutual: Require each client to present a certificate signed by *root*
            (mutual TLS, Triton's ``--grpc-use-ssl-mutual``); a client without one
            fails the handshake.
    """

    cert: str = attrs.field(converter=_path)
    key: str = attrs.field(converter=_path)
    root: str | None = attrs.field(default=None, converter=_path)
    mutual: bool = False

    def __attrs_post_init__(self) -> None:
        if self.mutual and self.root is None:
            raise ConfigError(
                "mutual TLS needs the root certificate that client certificates must be "
                "signed by (--grpc-root-cert), and none was given"
            )


#: What each file is called in messages: the flags of ``trioinfer serve``.
_FLAGS = {"cert": "--grpc-server-cert", "key": "--grpc-server-key", "root": "--grpc-root-cert"}
#: The same for the HTTP endpoint's files.
HTTP_TLS_FLAGS = {"cert": "--http-ssl-cert", "key": "--http-ssl-key"}


def server_context(
    files: TlsFiles, *, alpn: str = "h2", flags: dict[str, str] | None = None
) -> ssl.SSLContext:
    """The server-side ``SSLContext`` for *files*, offering *alpn*; reads and checks every file.

    *flags* names each file (``cert``, ``key``, ``root``) in messages, by the
    option it came from (by default the ``--grpc-*`` ones).

    Raises:
        ConfigError: A file is missing or unreadable, holds no PEM certificate (or
            key), the key is encrypted or does not match the certificate; the
            message names the file and the option it came from.
    """
    names = {**_FLAGS, **(flags or {})}

    def said(which: str) -> str:
        return f"{names[which]} {getattr(files, which)!r}"

    for which in ("cert", "key", "root"):
        path = getattr(files, which)
        if path is None or (which == "root" and not files.mutual):
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise ConfigError(
                f"{said(which)}: cannot read it ({exc.strerror or exc}); expected a "
                "readable PEM file"
            ) from None
    # Not ssl.create_default_context(), which trusts the system's CAs: under mutual TLS
    # any client certificate from a public CA would pass. Only *root* is trusted here.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.options |= ssl.OP_NO_COMPRESSION
    # HTTP/2 over TLS needs 1.2 or later (RFC 9113, section 9.2); so does every gRPC client.
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols([alpn])
    context.sslsocket_class = _TlsSocket  # for the HTTP server's sockets (gRPC's use no socket)
    # The certificate alone first: load_cert_chain's error would not say which file is bad.
    _load_verify(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), files.cert, said("cert"))
    try:
        context.load_cert_chain(files.cert, files.key, password=_no_password)
    except _EncryptedKey:
        raise ConfigError(
            f"{said('key')} is encrypted (it asks for a password); expected an unencrypted "
            "PEM private key"
        ) from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise ConfigError(
                f"{said('key')} does not match the certificate in {said('cert')}; expected the "
                "private key of that certificate"
            ) from None
        raise ConfigError(
            f"{said('key')} holds no usable private key ({exc.reason or exc}); expected a "
            "PEM private key"
        ) from None
    if files.mutual:
        assert files.root is not None  # TlsFiles checks it
        _load_verify(context, files.root, said("root"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _EncryptedKey(Exception):
    pass


def _no_password() -> bytes:
    # Without a callback, OpenSSL would ask for the password on the terminal.
    raise _EncryptedKey


def _load_verify(context: ssl.SSLContext, path: str, said: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{said} holds no PEM certificate ({exc.reason or exc}); expected one or more "
            "'-----BEGIN CERTIFICATE-----' blocks"
        ) from None


def _warn_of_a_missing_chain(files: TlsFiles, flag: str) -> None:
    """Warn when the certificate file (given as *flag*) surely lacks its leaf's issuer.

    A file with the server's certificate alone, signed by an intermediate CA,
    loads and serves; a client that has only the root then fails every
    handshake ("unable to get local issuer certificate"), while a browser or
    a client that has the intermediate cached works, which hides the cause.
    A leaf signed straight by a private root (an internal CA, trustme, mkcert)
    needs nothing more, and the file alone cannot tell that root from an
    intermediate. What tells them apart:

    - the issuer is in the file after the leaf, or is the leaf (self-signed),
      or is a self-signed certificate of the client CA file (mutual TLS):
      nothing is missing;
    - the leaf names where its issuer's certificate is published (Authority
      Information Access, caIssuers), as a public CA's leaves do, and those
      never come straight off a root (CA/Browser Forum): WARNING, naming it;
    - otherwise (a private CA's leaf, most often off its root): INFO, in case
      the issuer is an intermediate after all.

    A file that cannot be read or parsed here says nothing: `server_context`
    checks it.
    """
    try:
        with open(files.cert, "rb") as f:
            leaf, *chain = map(_read_certificate, _pem_certificates(f.read()))
        roots: list[_Certificate] = []
        if files.mutual and files.root is not None:
            with open(files.root, "rb") as f:
                roots = [c for c in map(_read_certificate, _pem_certificates(f.read())) if c.root]
        if leaf.root or any(c.subject == leaf.issuer for c in (*chain, *roots)):
            return
        said = _name_text(leaf.issuer)
    except (OSError, IndexError, ValueError):
        return
    log.log(
        logging.WARNING if leaf.published_issuer else logging.INFO,
        "%s %r holds the server's certificate without the certificate that signed it (%s): "
        "a client that does not have that one fails the TLS handshake (unable to get local "
        "issuer certificate). Append the intermediate certificate(s) to the file after the "
        "server's, as a CA's full chain has them (certbot's fullchain.pem, cert-manager's "
        "tls.crt)%s",
        flag,
        files.cert,
        said,
        ""
        if leaf.published_issuer
        else f"; if {said} is a root CA that every client trusts, nothing is missing",
    )


_PEM_CERTIFICATE: Final = re.compile(
    rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL
)


def _pem_certificates(pem: bytes) -> list[bytes]:
    # Each certificate of a PEM file, as DER.
    try:
        return [base64.b64decode(body) for body in _PEM_CERTIFICATE.findall(pem)]
    except binascii.Error as exc:
        raise ValueError(str(exc)) from None


def _der(data: bytes, pos: int) -> tuple[int, int, int]:
    # The DER item at *pos*: its tag, where its content starts and where it ends.
    tag, length = data[pos], data[pos + 1]
    pos += 2
    if length & 0x80:
        size = length & 0x7F
        length = int.from_bytes(data[pos : pos + size], "big")
        pos += size
    if pos + length > len(data):
        raise ValueError("a DER item runs past the end of its certificate")
    return tag, pos, pos + length


class _Certificate(NamedTuple):
    issuer: bytes  # its issuer's name, as DER: compared as bytes, as a CA copies its subject
    subject: bytes  # into the issuer of what it signs
    published_issuer: bool  # it says where its issuer's certificate is (AIA caIssuers)

    @property
    def root(self) -> bool:
        """Self-issued: a root CA (or a self-signed server certificate)."""
        return self.issuer == self.subject


#: The OIDs (their DER content) of Authority Information Access and of its caIssuers.
_AIA: Final = bytes.fromhex("2b06010505070101")  # 1.3.6.1.5.5.7.1.1
_CA_ISSUERS: Final = bytes.fromhex("2b06010505073002")  # 1.3.6.1.5.5.7.48.2


def _read_certificate(der: bytes) -> _Certificate:
    # What _warn_of_a_missing_chain needs of a certificate (RFC 5280, 4.1).
    _, pos, _ = _der(der, 0)  # Certificate: into it
    _, pos, tbs_end = _der(der, pos)  # its tbsCertificate: into it
    tag, _, end = _der(der, pos)
    if tag == 0xA0:  # [0] version: then the serial number
        tag, _, end = _der(der, end)
    _, _, end = _der(der, end)  # the signature algorithm
    _, start, issuer_end = _der(der, end)
    issuer = der[start:issuer_end]
    _, _, end = _der(der, issuer_end)  # validity
    _, start, end = _der(der, end)
    subject = der[start:end]
    published = False
    _, _, end = _der(der, end)  # subjectPublicKeyInfo; then [1], [2] unique ids, [3] extensions
    while end < tbs_end:
        tag, start, end = _der(der, end)
        if tag == 0xA3:
            published = _names_ca_issuers(der, start)
    return _Certificate(issuer, subject, published)


def _names_ca_issuers(der: bytes, pos: int) -> bool:
    # Whether the extensions at *pos* (the SEQUENCE in [3]) hold AIA with a caIssuers entry.
    _, pos, end = _der(der, pos)
    while pos < end:
        _, item, pos = _der(der, pos)  # Extension: extnID, critical (optional), extnValue
        _, oid, item = _der(der, item)
        if der[oid:item] != _AIA:
            continue
        tag, value, value_end = _der(der, item)
        if tag == 0x01:  # critical
            tag, value, value_end = _der(der, value_end)
        _, access, access_end = _der(der, value)  # the OCTET STRING holds a SEQUENCE
        while access < access_end:
            _, method, access = _der(der, access)  # AccessDescription: method, location
            _, oid, oid_end = _der(der, method)
            if der[oid:oid_end] == _CA_ISSUERS:
                return True
    return False


#: The attributes of a name that a message shows, by their OID's DER (2.5.4.x).
_SHOWN: Final = {b"\x55\x04\x03": "CN", b"\x55\x04\x0a": "O", b"\x55\x04\x0b": "OU"}


def _name_text(name: bytes) -> str:
    # A name's common name and organisation, for a message: "CN=R3,O=Let's Encrypt".
    parts = []
    pos = 0
    while pos < len(name):
        _, set_start, set_end = _der(name, pos)  # one RelativeDistinguishedName (a SET)
        _, pair, _ = _der(name, set_start)  # its first AttributeTypeAndValue
        _, oid_start, oid_end = _der(name, pair)
        _, value_start, value_end = _der(name, oid_end)
        key = _SHOWN.get(name[oid_start:oid_end])
        if key is not None:
            parts.append(f"{key}={name[value_start:value_end].decode('utf-8', 'replace')}")
        pos = set_end
    return repr(",".join(parts)) if parts else "the issuer"


#: How often, at most, a TLS endpoint looks at its files for a renewal (see `ReloadingContext`).
RELOAD_CHECK_S: Final = 1.0

#: How long, at most, the connection that starts a look at the files waits for it; the
#: look goes on in its thread after that, and the connection gets the context in use.
RELOAD_WAIT_S: Final = 1.0

#: How long a renewal that cannot be used stays so before it is said at ERROR: a tool
#: that replaces the certificate, then the key, leaves them mismatched for a moment,
#: an ordinary step of the renewal (see `ReloadingContext`).
RELOAD_SETTLE_S: Final = 5.0

#: What a file is, for noticing that it changed: a digest of what it holds (through
#: symlinks), or why it could not be read.
_Stamp = str


def _stamp(path: str) -> _Stamp:
    # The content, not the inode, size and mtime: a file rewritten in place with
    # the same size within one tick of the filesystem's clock (a second on some,
    # two on FAT), or copied keeping its timestamps, keeps all three. A
    # certificate, its key and a root are a few kilobytes, read on a thread.
    try:
        with open(path, "rb") as f:  # follows symlinks: a swapped link is its target
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        return f"{type(exc).__name__} {exc.errno}"


@final
@attrs.define(eq=False)
class ReloadingContext:
    """The server-side ``SSLContext`` of one endpoint, rebuilt when its files are renewed.

    cert-manager, certbot and Kubernetes renew a certificate by replacing its
    files every few weeks (a new file renamed over the old, a symlink swapped,
    or rewritten in place). `latest`, awaited as each connection arrives,
    looks at the files (a digest of what each holds) at most once every
    `RELOAD_CHECK_S` seconds, and when one changed builds a new context from
    them (`server_context`'s checks); that connection and the later ones
    handshake with it, while connections already open keep the one they
    handshook with. Why this and not inotify or SIGHUP: reading a few
    kilobytes a second costs nothing, needs no task, no platform API and no
    signal forwarded to ``--workers`` (each process checks by itself), and
    sees every way of renewing, including a symlink swapped above the file;
    the price is that a renewal shows up to a second late, and only once a
    connection arrives (no one needs it sooner). The look runs on a worker
    thread, never on the event loop, and one at a time: a slow or hung
    filesystem (NFS) holds the connection that started it for at most
    `RELOAD_WAIT_S` seconds, and no other; they handshake with the context in
    use until the look ends.

    A renewal that cannot be used (a file half written, missing, not PEM, a
    key that is not the certificate's, as a renewal that has replaced the
    certificate but not yet the key) keeps the context in use. It is tried
    again when a file changes again; a tool's next step (the key) usually
    comes within a second, so it is said (once, as an ERROR naming the file
    and why) only when a look finds the files unchanged `RELOAD_SETTLE_S`
    seconds or more after they were first found so, and until then only at
    DEBUG.

    Attributes:
        files: The files, read again at each renewal.
        alpn: The protocol the contexts offer (``h2``, ``http/1.1``).
        flags: What each file is called in messages (see `server_context`).
    """

    files: TlsFiles
    alpn: str
    flags: dict[str, str] | None
    _context: ssl.SSLContext = attrs.field(alias="context")
    _loaded: tuple[_Stamp, ...] = attrs.field(alias="loaded")
    # The files last found unusable: their stamps, since when, why, and whether it was said.
    _refused: _Refused | None = attrs.field(default=None, alias="refused")
    _checked_at: float = attrs.field(factory=time.monotonic, alias="checked_at")
    # Held by the thread looking at the files: one look at a time, and none started
    # while one hangs (a thread abandoned by its connection still holds it).
    _looking: threading.Lock = attrs.field(factory=threading.Lock, alias="looking")

    @classmethod
    def load(
        cls, files: TlsFiles, *, alpn: str = "h2", flags: dict[str, str] | None = None
    ) -> ReloadingContext:
        """Read and check *files* now, as `server_context` does (same arguments).

        Raises:
            ConfigError: As `server_context`.
        """
        stamps = cls._stamps(files)  # before reading: a change meanwhile is seen next time
        context = server_context(files, alpn=alpn, flags=flags)
        _warn_of_a_missing_chain(files, {**_FLAGS, **(flags or {})}["cert"])
        return cls(files, alpn, flags, context=context, loaded=stamps)

    @staticmethod
    def _stamps(files: TlsFiles) -> tuple[_Stamp, ...]:
        paths = [files.cert, files.key]
        if files.mutual and files.root is not None:
            paths.append(files.root)
        return tuple(_stamp(path) for path in paths)

    def current(self) -> ssl.SSLContext:
        """The context in use: the files' last usable state as last looked at."""
        return self._context

    async def latest(self) -> ssl.SSLContext:
        """The context for a connection arriving now, the files looked at if a second passed.

        The look (`check`) runs on a worker thread, and waits at most
        `RELOAD_WAIT_S`; while one is under way, the context in use is returned
        at once.
        """
        now = time.monotonic()
        if now - self._checked_at >= RELOAD_CHECK_S and not self._looking.locked():
            self._checked_at = now
            with anyio.move_on_after(RELOAD_WAIT_S):
                # Abandoned when the wait ends (or the connection is cancelled): the
                # thread goes on, holding _looking until it ends.
                await anyio.to_thread.run_sync(self._look, abandon_on_cancel=True)
        return self._context

    def _look(self) -> None:
        if not self._looking.acquire(blocking=False):
            return  # another thread is looking (or hangs looking)
        try:
            self.check()
        finally:
            self._looking.release()

    def check(self) -> bool:
        """Look at the files now, reload them if they changed; whether a new context is in use.

        Blocking (it reads the files): the server calls it on a worker thread (`latest`).
        """
        stamps = self._stamps(self.files)
        if stamps == self._loaded:
            self._refused = None  # back as loaded: the same failure again is a new one
            return False
        refused = self._refused
        if refused is not None and stamps == refused.stamps:
            self._say_if_settled(refused)
            return False
        names = {**_FLAGS, **(self.flags or {})}
        try:
            context = server_context(self.files, alpn=self.alpn, flags=self.flags)
        except ConfigError as exc:
            why = str(exc)
        except (OSError, ValueError) as exc:
            # A file that went away between server_context's checks and OpenSSL's read of
            # it: said as any other renewal that cannot be used, never failing a handshake.
            files = ", ".join(f"{names[w]} {getattr(self.files, w)!r}" for w in ("cert", "key"))
            why = f"reading {files}: {exc}"
        else:
            self._context, self._loaded, self._refused = context, stamps, None
            log.info(
                "TLS files reloaded (%s %r): new connections get the renewed certificate",
                names["cert"],
                self.files.cert,
            )
            _warn_of_a_missing_chain(self.files, names["cert"])
            return True
        self._refused = _Refused(stamps, time.monotonic(), why)
        log.debug("TLS files changed but cannot be used (yet): %s", why)
        self._say_if_settled(self._refused)
        return False

    @staticmethod
    def _say_if_settled(refused: _Refused) -> None:
        if refused.said or time.monotonic() - refused.since < RELOAD_SETTLE_S:
            return
        refused.said = True
        log.error(
            "TLS files changed but cannot be used, for %gs now: %s; new connections still "
            "get the certificate loaded before, and the files are tried again when they change",
            RELOAD_SETTLE_S,
            refused.why,
        )


@attrs.define(eq=False)
class _Refused:
    stamps: tuple[_Stamp, ...]
    since: float
    why: str
    said: bool = False


async def _current(context: ssl.SSLContext | ReloadingContext) -> ssl.SSLContext:
    return await context.latest() if isinstance(context, ReloadingContext) else context


async def handshake(
    stream: anyio.abc.ByteStream,
    context: ssl.SSLContext | ReloadingContext,
    limit_s: float,
    what: str,
) -> TLSStream | None:
    """The TLS stream over *stream* once its handshake is done; None if it failed (closed then).

    A client that does not finish the handshake within *limit_s* seconds (the
    server's ``head_timeout``: one that connected and said nothing, or speaks
    plaintext and waits for an answer) is dropped, as is one that fails it (plaintext, no client
    certificate under mutual TLS, an untrusted one); each is said on the log at
    info level, with *what* (``"gRPC"``) and the client's address.
    """
    try:
        with anyio.fail_after(limit_s):
            # Not standard_compatible: closing sends no close_notify and waits for none
            # (a client gone or silent would hold the close), and a client closing
            # without one is an ordinary end (grpc-core's often do).
            return await TLSStream.wrap(
                stream,
                server_side=True,
                ssl_context=await _current(context),
                standard_compatible=False,
            )
    except TimeoutError:
        why = f"no TLS handshake within {limit_s}s (head_timeout)"
    except ssl.SSLError as exc:
        why = _failed(exc)
    except (anyio.BrokenResourceError, anyio.EndOfStream, OSError):
        why = _CLOSED
    except BaseException:
        await anyio.aclose_forcefully(stream)
        raise
    _dropped(what, stream.extra(anyio.abc.SocketAttribute.remote_address, None), why)
    await anyio.aclose_forcefully(stream)
    return None


_CLOSED = "the client closed the connection during the TLS handshake"
#: OpenSSL's reasons for a first record that is not TLS at all.
_NOT_TLS = frozenset({"HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "WRONG_VERSION_NUMBER"})


def _failed(exc: ssl.SSLError) -> str:
    reason = exc.reason or str(exc)
    hint = " (the client speaks plaintext, not TLS)" if reason in _NOT_TLS else ""
    return f"TLS handshake failed: {reason}{hint}"


def _dropped(what: str, address: Any, why: str) -> None:
    if isinstance(address, tuple) and len(address) >= 2:
        host = f"[{address[0]}]" if ":" in str(address[0]) else address[0]
        peer = f"{host}:{address[1]}"
    else:
        peer = "a client"
    log.info("%s connection from %s closed: %s", what, peer, why)


async def tls_handshake(
    sock: socket.socket, context: ssl.SSLContext | ReloadingContext, io: IO, limit_s: float
) -> socket.socket | None:
    """*sock* (just accepted) as a non-blocking TLS socket once its handshake is done.

    For the HTTP server: the socket returned reads and writes as a plain
    non-blocking one does (`BlockingIOError` when a call would block), so the
    connection code is the same for both. None if the handshake failed or did
    not end within *limit_s* seconds (the server's ``head_timeout``); the
    socket is closed then, and the log says why at info level.
    """
    try:
        ssl_context = await _current(context)
    except BaseException:
        sock.close()
        raise
    try:
        address = sock.getpeername()
        sock.setblocking(False)
        tls = ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    except OSError:  # the client is already gone
        sock.close()
        return None
    try:
        with anyio.fail_after(limit_s):
            while True:
                try:
                    tls.do_handshake()
                except ssl.SSLWantReadError:
                    await io.wait_readable(tls)
                except ssl.SSLWantWriteError:
                    await io.wait_writable(tls)
                else:
                    return tls
    except TimeoutError:
        why = f"no TLS handshake within {limit_s}s (head_timeout)"
    except ssl.SSLError as exc:
        why = _failed(exc)
    except OSError:
        why = _CLOSED
    except BaseException:
        io.notify_closing(tls)
        tls.close()
        raise
    _dropped("HTTPS", address, why)
    io.notify_closing(tls)
    tls.close()
    return None


class _TlsSocket(ssl.SSLSocket):
    """A non-blocking TLS socket that reads and writes as the HTTP server expects of a plain one.

    ``SSLWantReadError`` and ``SSLWantWriteError`` become `BlockingIOError`
    (the server waits and tries again), a read also takes what the TLS layer
    already decrypted and holds (the socket would not turn readable for it),
    and ``shutdown`` sends the TLS close (close_notify) before the TCP one.
    """

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        """Read up to *buflen* bytes, and what the TLS layer holds decrypted beyond them."""
        try:
            data = super().recv(buflen, flags)
            while (held := self.pending()) > 0:
                data += super().recv(held, flags)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError(errno.EAGAIN, "TLS: no complete record to read yet") from None
        return data

    def send(self, data: Any, flags: int = 0) -> int:
        """Write *data* whole (a TLS write is not partial), or raise `BlockingIOError`."""
        try:
            return super().send(data, flags)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError(errno.EAGAIN, "TLS: the socket is full") from None

    def shutdown(self, how: int) -> None:
        """Send the TLS close (not waiting for the client's), then shut the socket down."""
        # unwrap() sends close_notify, then would wait for the client's: non-blocking,
        # it raises instead, and what the client still sends is read raw and dropped.
        with contextlib.suppress(OSError, ValueError):
            self.unwrap()
        super().shutdown(how)
