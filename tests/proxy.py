"""A TCP proxy for the tests: forwards, stalls (accepts and forwards nothing), or resets every
connection; counts the connections it sees in each mode. It can also lose one answer: the first
request whose bytes hold ``lose_answer_to`` goes through, its answer is kept in ``lost_answer``
and the client's connection is reset instead (the server did the work; the client never hears
it), or, with ``hold_lost``, held open with nothing passed on."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from collections import Counter


class Proxy:
    """TCP to ``target_port`` on 127.0.0.1, or, with ``unix_target``, a unix socket at
    ``unix_listen`` to the one at ``unix_target``."""

    def __init__(self, target_port: int = 0, unix_listen: str = "", unix_target: str = "") -> None:
        self.unix_target = unix_target
        self.target = ("127.0.0.1", target_port)
        self.mode = "forward"
        self.connections: Counter[str] = Counter()
        if unix_listen:
            self._listener = socket.socket(socket.AF_UNIX)
            self._listener.bind(unix_listen)
            self._listener.listen(64)
            self.port = 0
        else:
            self._listener = socket.create_server(("127.0.0.1", 0))
            self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self.lose_answer_to: bytes | None = None
        self.lost = threading.Event()
        self.lost_answer = b""
        self.hold_lost = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        assert mode in ("forward", "stall", "reset")
        self.mode = mode
        if mode != "stall":
            for s in self._held:
                self._reset(s)
            self._held.clear()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            mode = self.mode
            self.connections[mode] += 1
            if mode == "reset":
                self._reset(client)
            elif mode == "stall":
                self._held.append(client)
            else:
                threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            if self.unix_target:
                upstream = socket.socket(socket.AF_UNIX)
                upstream.connect(self.unix_target)
            else:
                upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            self._reset(client)
            return
        upstream.settimeout(None)
        socks = [client, upstream]
        losing = False
        try:
            while not self._stop.is_set():
                if self.mode == "reset":
                    break
                ready, _, _ = select.select(socks, [], [], 0.2)
                if self.mode == "stall":
                    continue  # hold the connection: nothing passes either way
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client and self.lose_answer_to and self.lose_answer_to in data:
                        self.lose_answer_to, losing = None, True
                    elif s is upstream and losing:
                        self.lost_answer += data
                        whole = b"\r\n\r\n" in self.lost_answer and b"}" in self.lost_answer
                        if whole and not self.lost.is_set():
                            self.lost.set()
                            if not self.hold_lost:
                                return  # the client's connection is reset
                        continue
                    (upstream if s is client else client).sendall(data)
        except OSError:
            pass
        finally:
            self._reset(client)
            upstream.close()
