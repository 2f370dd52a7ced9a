"""A dataset origin for the tests: HTTPS on 127.0.0.1 with a CA made for the test, serving files
(held in memory, or generated on the fly so that a 1 GB file costs no memory), counting requests,
and misbehaving on demand: drop the connection half-way once, ignore ranges, serve wrong bytes,
redirect, refuse, hold a response until the test lets it go.

    ca = TestCA(tmp_path)
    with Origin(ca) as origin:
        origin.add("/a.bin", b"...")
        origin.url("/a.bin"), origin.count("/a.bin"), origin.requests
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import random
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from localhttp import LocalHTTPServer

BLOCK = 1024 * 1024


class TestCA:
    """A throwaway CA and a server certificate it signed for 127.0.0.1, 127.0.0.2, localhost
    and ``names``."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(
        self, directory: Path, name: str = "flashnode test CA", names: tuple[str, ...] = ()
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.2")),
                        *(x509.DNSName(n) for n in ("localhost", *names)),
                    ]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        self.ca_file = directory / "ca.pem"
        self.cert_file = directory / "server.pem"
        self.key_file = directory / "server.key"
        self.ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        self.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def server_context(self, seen: list[str | None] | None = None) -> ssl.SSLContext:
        """The server's context; ``seen`` collects the name each client asked for (SNI)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        if seen is not None:
            context.sni_callback = lambda sock, name, ctx: seen.append(name)
        return context


class Content:
    """A file's bytes: ``read(offset, n)`` and ``size``."""

    size: int

    def read(self, offset: int, n: int) -> bytes:
        raise NotImplementedError

    def chunks(self, offset: int = 0, end: int | None = None) -> Iterator[bytes]:
        end = self.size if end is None else end
        while offset < end:
            piece = self.read(offset, min(BLOCK, end - offset))
            yield piece
            offset += len(piece)

    def sha256(self) -> str:
        h = hashlib.sha256()
        for piece in self.chunks():
            h.update(piece)
        return h.hexdigest()


class Blob(Content):
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]


class Generated(Content):
    """``size`` deterministic bytes made on the fly: 1 MiB of seeded noise, each block stamped
    with its index so that no two blocks are alike. Costs 1 MiB of memory whatever the size."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.base = random.Random(seed).randbytes(BLOCK)

    def block(self, index: int) -> bytes:
        return index.to_bytes(8, "big") + self.base[8:]

    def read(self, offset: int, n: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        out = bytearray()
        while n > 0:
            index, within = divmod(offset, BLOCK)
            piece = self.block(index)[within : within + n]
            out += piece
            offset += len(piece)
            n -= len(piece)
        return bytes(out)


@dataclass
class Route:
    """What the origin does for one path."""

    content: Content | None = None
    status: int | None = None  # answer this status instead (refuse), with no body
    refuse_times: int = -1  # answer ``status`` this many times, then serve (-1: always)
    redirect: str | None = None  # answer 302 to this location
    drop_at: int | None = None  # the first full answer is cut after this many bytes
    ignore_range: bool = False  # answer 200 with everything to a Range request
    corrupt: bool = False  # flip one byte in the middle
    etag: str | None = None
    no_length: bool = False  # no Content-Length: the body ends when the connection closes
    extra: bytes = b""  # sent after the content (with no_length: more than the file holds)
    set_cookie: str | None = None
    hold: threading.Event | None = None  # wait for this before sending a body
    dropped: bool = field(default=False, init=False)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]


class Origin:
    """The HTTPS server on ``host``; a context manager. Thread-safe enough for the tests.
    ``server_names``: the name each TLS client asked for (SNI; None: none)."""

    def __init__(self, ca: TestCA, host: str = "127.0.0.1") -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[Request] = []
        self.server_names: list[str | None] = []
        self._lock = threading.Lock()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                origin._serve(self)

        self.server = LocalHTTPServer((host, 0), Handler)
        self.host = host
        self.server.socket = ca.server_context(self.server_names).wrap_socket(
            self.server.socket, server_side=True, do_handshake_on_connect=False
        )
        self.port = self.server.server_address[1]

    def __enter__(self) -> Origin:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for route in self.routes.values():
            if route.hold is not None:
                route.hold.set()
        self.server.close()

    def url(self, path: str, host: str | None = None) -> str:
        return f"https://{host or self.host}:{self.port}{path}"

    def add(self, path: str, content: bytes | Content, **how: Any) -> Route:
        blob = content if isinstance(content, Content) else Blob(content)
        route = Route(content=blob, **how)
        self.routes[path] = route
        return route

    def count(self, path: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if path is None or r.path == path)

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        with self._lock:
            self.requests.append(Request("GET", path, {k.lower(): v for k, v in h.headers.items()}))
        route = self.routes.get(path)
        if route is None:
            return self._empty(h, 404)
        if route.status is not None and route.refuse_times != 0:
            route.refuse_times -= 1
            return self._empty(h, route.status)
        if route.redirect is not None:
            return self._empty(h, 302, {"Location": route.redirect})
        content = route.content
        assert content is not None
        start = 0
        wanted = h.headers.get("Range")
        if wanted and not route.ignore_range:
            first = int(wanted.removeprefix("bytes=").split("-", 1)[0])
            if first >= content.size:
                return self._empty(h, 416, {"Content-Range": f"bytes */{content.size}"})
            start = first
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if route.etag is not None:
            headers["ETag"] = route.etag
        if route.set_cookie is not None:
            headers["Set-Cookie"] = route.set_cookie
        if not route.no_length:
            headers["Content-Length"] = str(content.size - start)
        else:
            h.close_connection = True
            headers["Connection"] = "close"
        if start:
            headers["Content-Range"] = f"bytes {start}-{content.size - 1}/{content.size}"
        h.send_response(206 if start else 200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if route.hold is not None:
            route.hold.wait()
        cut = None
        if route.drop_at is not None and not route.dropped and not start:
            route.dropped = True
            cut = route.drop_at
        middle = content.size // 2
        sent = start
        try:
            for piece in content.chunks(start, content.size if cut is None else cut):
                if route.corrupt and sent <= middle < sent + len(piece):
                    flipped = bytearray(piece)
                    flipped[middle - sent] ^= 0xFF
                    piece = bytes(flipped)
                h.wfile.write(piece)
                sent += len(piece)
            if cut is None and route.extra:
                h.wfile.write(route.extra)
            h.wfile.flush()
        except (ConnectionError, ssl.SSLError, OSError):
            h.close_connection = True
            return None
        if cut is not None:
            # Gone without a word: no close_notify, the rest of the body never comes.
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
        return None

    def _empty(
        self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str] | None = None
    ) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", "0")
        h.end_headers()
