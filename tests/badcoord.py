"""A misbehaving coordinator for the tests: it speaks the node protocol, but each answer can be
scripted to be wrong (invalid JSON, huge, dripping, redirecting, failing)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from fakes import lease
from localhttp import LocalHTTPServer

Responder = Callable[[BaseHTTPRequestHandler], None]


def answer(
    status: int, body: bytes | dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> Responder:
    def respond(h: BaseHTTPRequestHandler) -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return respond


def drip(data: bytes, every: float = 1.0) -> Responder:
    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        for i in range(len(data)):
            try:
                h.wfile.write(data[i : i + 1])
                h.wfile.flush()
            except OSError:
                return
            time.sleep(every)

    return respond


def huge(status: int, size: int, chunk: int = 1 << 20) -> Responder:
    """An answer of ``size`` bytes, streamed (never held in memory here)."""

    def respond(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(size))
        h.end_headers()
        block = b"x" * chunk
        left = size
        try:
            while left > 0:
                h.wfile.write(block[: min(chunk, left)])
                left -= chunk
        except OSError:
            return

    return respond


def sequence(*responders: Responder) -> Responder:
    """Each request gets the next responder; the last one repeats."""
    queue = list(responders)
    lock = threading.Lock()

    def respond(h: BaseHTTPRequestHandler) -> None:
        with lock:
            responder = queue.pop(0) if len(queue) > 1 else queue[0]
        responder(h)

    return respond


class BadCoordinator:
    def __init__(self) -> None:
        self.requests: list[tuple[float, str, str, dict[str, str], bytes]] = []
        self.claims: list[Responder] = []
        self.overrides: dict[str, Responder] = {}  # path prefix -> responder, before defaults
        self.fails: list[tuple[str, str]] = []
        self.completes: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with outer._lock:
                    outer.requests.append(
                        (time.monotonic(), self.command, self.path, dict(self.headers), body)
                    )
                outer._dispatch(self, body)

            do_GET = do_POST = do_PUT = _handle

        class Server(LocalHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # the agent hanging up on a hostile answer is the point, not an error

        self.server = Server(("127.0.0.1", 0), Handler).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()

    def count(self, path_part: str) -> int:
        return sum(1 for r in self.requests if path_part in r[2])

    def _dispatch(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        path = h.path
        for prefix, responder in self.overrides.items():
            if path.startswith(prefix):
                return responder(h)
        api = "/v1alpha1"
        if path == f"{api}/nodes/register":
            return answer(200, {"node_id": json.loads(body)["node_id"], "status": "registered"})(h)
        if path.startswith(f"{api}/nodes/"):
            return answer(200, {"status": "ok"})(h)
        if path == f"{api}/leases/claim":
            with self._lock:
                responder = self.claims.pop(0) if self.claims else answer(204)
            return responder(h)
        if path.startswith(f"{api}/attempts/"):
            lease_id, action = path.split("/")[3:5]
            if action == "fail":
                self.fails.append((lease_id, json.loads(body)["reason"]))
                return answer(200, {"status": "requeued-or-exhausted"})(h)
            if action == "complete":
                self.completes.append((lease_id, json.loads(body)))
                return answer(200, {"accepted": True})(h)
            return answer(200, {})(h)
        if path.startswith(f"{api}/artifacts/") and h.command == "PUT":
            return answer(200, {"sha256": hashlib.sha256(body).hexdigest()})(h)
        return answer(404, {"detail": "not here"})(h)


def lease_answer(n: int, lease_seconds: Any = 60.0, **payload: Any) -> Responder:
    """A 200 claim answer for a trusted argv task that writes metrics.json. A string
    ``lease_seconds`` goes into the JSON as it is (NaN, Infinity: what json.dumps refuses)."""
    payload.setdefault("argv", ["sh", "-c", "echo '{\"ok\": 1}' > metrics.json"])
    data = lease(n, **payload)
    data["lease_seconds"] = "@LS@"
    raw = lease_seconds if isinstance(lease_seconds, str) else json.dumps(lease_seconds)
    return answer(200, json.dumps(data).replace('"@LS@"', raw).encode())
