"""The metrics' HTTP server, on TCP (``metrics_listen = "HOST:PORT"``) or a unix socket
(``"unix:PATH"``). ``metrics.py`` imports this module only when metrics are on, so that an agent
without them does not load ``http.server`` and ``socketserver``.

Each connection has a thread of its own, at most ``MAX_SCRAPES`` at once and
``MAX_PER_CLIENT`` of them from one client (a user, by the kernel's socket tables or the unix
socket's credentials; else an address); more are closed at once, and so is every connection of
a task user: nobody on the machine (a trusted task shares its network) can have the agent start
thread after thread, nor hold the owner's scrapes out. A request must arrive whole within
``REQUEST_S`` (one deadline for all its reads: a client that drips a byte now and then is cut
off at it)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import socketserver
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashnode.httpguard import Connections, client, deadline_reader, refused

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


log = logging.getLogger(__name__)
REQUEST_S = 2.0
MAX_SCRAPES = 8
MAX_PER_CLIENT = 2


class _Serving(socketserver.ThreadingMixIn):
    daemon_threads = True
    registry: CollectorRegistry
    refused_uids: frozenset[int] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._scrapes = Connections(MAX_SCRAPES, MAX_PER_CLIENT)
        self._clients: dict[int, int | str] = {}  # who each connection under way is
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        who = client(request, client_address)
        if refused(who, self.refused_uids) or not self._scrapes.take(who):
            with contextlib.suppress(OSError):
                request.close()
            return
        self._clients[id(request)] = who
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._clients.pop(id(request), None)
            self._scrapes.give(who)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._scrapes.give(self._clients.pop(id(request)))

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):  # the scraper hung up or stalled: not ours
            log.debug("metrics: a scrape ended early", exc_info=True)
        else:
            log.warning("metrics: a scrape failed", exc_info=True)


class _TCPServer(_Serving, socketserver.TCPServer):
    allow_reuse_address = True
    request_queue_size = 128  # a burst of connections waits to be refused, not dropped


class _UnixServer(_Serving, socketserver.UnixStreamServer):
    request_queue_size = 128
    inode = 0  # of the socket file in the file system, to remove only our own at close


class _Handler(BaseHTTPRequestHandler):
    server: _TCPServer | _UnixServer
    timeout = REQUEST_S

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the file setup made: it would hold the socket open after its close
        self.rfile = deadline_reader(self.connection, REQUEST_S)

    def do_GET(self) -> None:
        from prometheus_client.exposition import choose_encoder

        if self.path.split("?", 1)[0] not in ("/", "/metrics"):
            self.send_error(404)
            return
        encoder, content_type = choose_encoder(",".join(self.headers.get_all("Accept") or []))
        if "\r" in content_type or "\n" in content_type:  # echoed from the request's Accept
            encoder, content_type = choose_encoder("")
        body = encoder(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "unix" if isinstance(self.server, _UnixServer) else super().address_string()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_tcp(
    host: str, port: int, registry: CollectorRegistry, refused_uids: frozenset[int] = frozenset()
) -> _TCPServer:
    """Bind ``host``:``port`` (0: any free port) and serve on a daemon thread."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("_Bound", (_TCPServer,), {"address_family": family})
    server: _TCPServer = server_class((host, port), _Handler)
    server.registry, server.refused_uids = registry, refused_uids
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def close_tcp(server: _TCPServer) -> None:
    server.shutdown()
    server.server_close()


def serve_unix(
    path: Path, registry: CollectorRegistry, refused_uids: frozenset[int] = frozenset()
) -> _UnixServer:
    """Bind ``path`` (mode 0660: the agent's user and group may scrape), replacing only a stale
    socket: a live one or anything that is not a socket is an error, never removed."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} exists and is not a socket; not replacing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1)
            probe.connect(str(path))
        except OSError:
            pass  # stale: nobody listens
        else:
            raise OSError(f"{path} is in use by another process")
        finally:
            probe.close()
    # Bound under a private name, given its mode, then renamed into place: no moment where the
    # socket exists with the process umask's mode.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    server = _UnixServer(str(tmp), _Handler, bind_and_activate=True)
    try:
        os.chmod(tmp, 0o660)
        os.replace(tmp, path)
        server.inode = path.lstat().st_ino
    except BaseException:
        server.server_close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    server.registry, server.refused_uids = registry, refused_uids
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def close_unix(server: _UnixServer, path: Path) -> None:
    server.shutdown()
    server.server_close()
    with contextlib.suppress(OSError):
        if path.lstat().st_ino == server.inode:
            path.unlink()
