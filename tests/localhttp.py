"""The HTTP servers tests run on loopback (package indexes, dataset origins, hostile
coordinators, the owner's private services)."""

from __future__ import annotations

import socket
import sys
import threading
from http.server import ThreadingHTTPServer
from typing import Any


class LocalHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` that never waits for ever: a client that stalls is dropped
    after ``stall_s``; accepting waits a second at most, so that ``shutdown`` is seen even should
    a connection that made the socket readable be gone before it was taken; closing a server that
    never served does not wait for it. Handler threads are daemons (never joined)."""

    daemon_threads = True
    stall_s = 60.0
    serving = False

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.settimeout(1.0)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        sock.settimeout(self.stall_s)
        return sock, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up, stalled or refused the certificate is what many tests do on
        # purpose; anything else is the test server's own bug, printed.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def start(self) -> LocalHTTPServer:
        """Serve on a daemon thread; returns the server."""
        threading.Thread(target=self.serve_forever, name="test-http", daemon=True).start()
        self.serving = True
        return self

    def close(self) -> None:
        if self.serving:  # shutdown() waits for a serve_forever that never started, for ever
            self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"
