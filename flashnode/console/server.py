"""The console's HTTP edge: the standard library's HTTP server on the listener's socket and
thread (``listener.py``, which builds this edge at the first connection), a short-lived thread
per request, ``Connection: close`` after every answer, and a bounded read of every request.

No one can hold the owner out: a connection from a refused user (a task's) is closed when it is
accepted, before it takes anything; each user (each address, for a peer of another machine) has
at most ``MAX_PER_CLIENT`` requests under way, all of them together ``MAX_CLIENTS`` (more are
closed unanswered); and a request must arrive whole within ``READ_TIMEOUT_S`` (a client that
sends a byte now and then is cut off at that deadline, not at each read's). What a request means
is the ``App``'s business (``app.py``); this module only moves bytes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from flashnode.httpguard import Connections, client, deadline_reader, peer_uid, refused

log = logging.getLogger(__name__)

MAX_CLIENTS = 16
MAX_PER_CLIENT = 4  # requests under way from one user (or one address, for a remote peer)
MAX_BODY = 16 * 1024
READ_TIMEOUT_S = 10.0


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names; a repeated header is refused before this
    body: bytes
    peer: tuple[str, int]
    uid: int | None = None  # the connecting process's user (loopback TCP), None when unknown

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


class App(Protocol):
    def handle(self, request: Request) -> Response: ...


# Sent with every answer: nothing may frame the page, sniff a type, leak a URL, or load from
# anywhere but the console itself; answers are never cached.
SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
        " connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
)


class Edge(ThreadingHTTPServer):
    """Serving on ``sock``, which the listener bound and listens on (non-blocking): one
    ``handle_request`` each time it is ready."""

    daemon_threads = True

    def __init__(self, sock: socket.socket, app: App, refused_uids: frozenset[int]) -> None:
        self.address_family = sock.family
        self.app = app
        self.refused_uids = refused_uids
        self._slots = Connections(MAX_CLIENTS, MAX_PER_CLIENT)
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # the one socketserver made: the listener's is served instead
        self.socket = sock

    def process_request(self, request: Any, client_address: Any) -> None:
        who = client(request, client_address)
        if refused(who, self.refused_uids) or not self._slots.take(who):
            self.shutdown_request(request)  # refused, or too many at once: closed unanswered
            return
        try:
            threading.Thread(
                target=self._serve_one, args=(request, client_address, who), daemon=True
            ).start()
        except BaseException:
            self._slots.give(who)
            raise

    def _serve_one(self, request: Any, client_address: Any, who: int | str) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.give(who)


class _Handler(BaseHTTPRequestHandler):
    server: Edge
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads
    timeout = READ_TIMEOUT_S
    server_version = "flashnode"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # One deadline for the whole request, not one per read (no thread: each read is given
        # what is left of it).
        self.rfile.close()  # the file setup made: it would hold the socket open after its close
        self.rfile = deadline_reader(self.connection, READ_TIMEOUT_S)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._send(Response(405, b'{"error": "method not allowed"}'))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD

    def _dispatch(self) -> None:
        headers: dict[str, str] = {}
        for name in self.headers:
            key = name.lower()
            if key in headers:  # two Host or Origin headers: which one would a check see?
                self._send(Response(400, b'{"error": "repeated header"}'))
                return
            headers[key] = self.headers[name]
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self._send(Response(413, b'{"error": "request body too large"}'))
            return
        body = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        try:
            query = {k: v[0] for k, v in parse_qs(parts.query, max_num_fields=16).items()}
        except ValueError:
            self._send(Response(400, b'{"error": "too many query fields"}'))
            return
        peer = self.client_address[:2]
        found = peer_uid(peer, self.connection.getsockname()[:2])
        uid = found if isinstance(found, int) else None
        request = Request(self.command, parts.path, query, headers, body, peer, uid)
        try:
            response = self.server.app.handle(request)
        except Exception:
            log.exception("console: %s %s failed", self.command, parts.path)
            response = Response(500, b'{"error": "the console failed; see the agent log"}')
        self._send(response)

    def _send(self, response: Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in (*SECURITY_HEADERS, *response.headers):
            self.send_header(name, value)
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(response.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests are not logged: a login link's token is in one
