"""The console's listening socket, bound when the console starts, and the one thread that sleeps
in ``select`` on it until a browser connects (no timer wakes it while nobody looks).

The HTTP edge (``server.py``, on the standard library's HTTP server) and what the requests mean
(``app.py``) are imported and built at the first connection, on this thread, not when the console
starts: an agent whose console nobody opens does not hold them (about 0.5 MB of an idle agent's
memory, issue 44). Once built they stay until the console closes. The address is bound at start
all the same, so a port that is taken is still said at start, and a connection that comes before
the edge is built waits in the listen queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashnode.console.server import App, Edge

log = logging.getLogger(__name__)

BACKLOG = 128  # a burst of connections waits to be refused, not dropped


class ConsoleServer:
    """Listening on ``host:port`` (port 0: any free one) from its construction until ``close``;
    answering from ``serve`` on."""

    def __init__(self, host: str, port: int) -> None:
        """OSError when the address cannot be bound."""
        self._socket = _listen(host, port)
        self.port = int(self._socket.getsockname()[1])
        self._edge: Edge | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None

    def serve(self, app: Callable[[], App], refused_uids: frozenset[int] = frozenset()) -> None:
        """Answer connections: ``app`` makes what answers them, at the first one; connections
        of ``refused_uids`` (the task users) are closed unanswered."""
        self._thread = threading.Thread(
            target=self._serve, args=(app, refused_uids), name="console", daemon=True
        )
        self._thread.start()

    def _serve(self, app: Callable[[], App], refused_uids: frozenset[int]) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._socket, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in sel.select()]  # no timeout: sleeps
                if self._wake_r in ready:
                    return
                if self._edge is None:
                    try:
                        self._edge = _edge(self._socket, app(), refused_uids)
                    except Exception:
                        log.exception("the console is off: it could not answer a request")
                        with contextlib.suppress(OSError):
                            self._socket.close()  # what waits to be answered is refused
                        return
                self._edge.handle_request()

    def close(self, on_closed: Callable[[], None] = lambda: None) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
        if self._edge is not None:
            self._edge.server_close()  # closes the socket
        with contextlib.suppress(OSError):
            self._socket.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        on_closed()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, as the standard library's TCP server binds one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        # A client gone between select and accept must not block the loop in accept.
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _edge(sock: socket.socket, app: App, refused_uids: frozenset[int]) -> Edge:
    # Imported at the first connection, not at start (the module's docstring says why).
    from flashnode.console.server import Edge

    return Edge(sock, app, refused_uids)
