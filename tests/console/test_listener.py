"""The console's listener: the address is bound at start (a taken port is said then), and the
HTTP edge and the app are made at the first connection, once, not before (issue 44: an agent
whose console nobody opens does not hold them)."""

from __future__ import annotations

import logging
import socket
import threading

import httpx
import pytest

from flashnode.console.listener import ConsoleServer
from flashnode.console.server import Request, Response


class Answers:
    """An app that answers every request with its path, and counts how often it was made."""

    def __init__(self) -> None:
        self.made = 0
        self.lock = threading.Lock()

    def __call__(self) -> Answers:
        with self.lock:
            self.made += 1
        return self

    def handle(self, request: Request) -> Response:
        return Response(200, request.path.encode(), "text/plain")


def test_the_app_is_made_at_the_first_connection_and_only_once() -> None:
    server = ConsoleServer("127.0.0.1", 0)
    app = Answers()
    try:
        server.serve(app)
        assert app.made == 0  # listening, nothing made
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass  # a connection that asks nothing: the app is made for it all the same
        for path in ("/one", "/two"):
            answer = httpx.get(f"http://127.0.0.1:{server.port}{path}", timeout=10)
            assert (answer.status_code, answer.text) == (200, path)
        assert app.made == 1
    finally:
        server.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_a_connection_before_serving_waits_and_is_answered() -> None:
    server = ConsoleServer("127.0.0.1", 0)
    app = Answers()
    try:
        got: list[httpx.Response] = []
        asker = threading.Thread(
            target=lambda: got.append(httpx.get(f"http://127.0.0.1:{server.port}/x", timeout=10))
        )
        asker.start()
        asker.join(0.3)
        assert asker.is_alive() and app.made == 0  # queued on the bound socket
        server.serve(app)
        asker.join(10)
        assert got and got[0].text == "/x"
    finally:
        server.close()


def test_a_taken_port_is_refused_at_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            ConsoleServer("127.0.0.1", taken.getsockname()[1])


def test_an_app_that_cannot_be_made_stops_the_console_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Answers:
        raise RuntimeError("no app")

    server = ConsoleServer("127.0.0.1", 0)
    try:
        with caplog.at_level(logging.ERROR, logger="flashnode.console.listener"):
            server.serve(broken)
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{server.port}/", timeout=10)
        assert "the console is off" in caplog.text
    finally:
        server.close()
