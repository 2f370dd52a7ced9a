"""The HTTP servers tests run on loopback (package indexes, dataset origins, hostile
coordinators, the owner's private services)."""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any


class LocalHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` whose closing never waits on a handler.

    The standard one joins every handler thread when closed, daemon or not: one handler waiting
    on a client that stays connected (a build stopped mid-download, a keep-alive pool) would
    hold the test's teardown, and the whole run, forever. Here handler threads are left to die
    with the process, and a client that stalls is dropped after ``stall_s``."""

    daemon_threads = True
    block_on_close = False
    stall_s = 60.0

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        sock.settimeout(self.stall_s)
        return sock, address

    def start(self) -> LocalHTTPServer:
        """Serve on a daemon thread; returns the server."""
        threading.Thread(target=self.serve_forever, name="test-http", daemon=True).start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"
