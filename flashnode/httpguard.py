"""What keeps the agent's small HTTP servers (the console, the metrics) answering their owner
beside clients that would hold them: who a connection is (``client``: its user, from the
kernel's socket tables or the unix socket's credentials; else its address), at most so many
connections under way per client and in all (``Connections``), and one deadline for a
request's whole read (``Deadline``), so that a client that sends a byte now and then is cut
off at it, not at each read's timeout.
"""

from __future__ import annotations

import io
import socket
import struct
import threading
import time
from typing import Any

from flashnode.tcptable import ESTABLISHED, connection_uid, hex_address, tcp_sockets

AMBIGUOUS = "ambiguous"  # a connection whose user the tables do not tell apart: refused


def peer_uid(peer: tuple[str, int], server: tuple[str, int]) -> int | str | None:
    """The user owning the client end of the TCP connection from ``peer`` to ``server`` (each
    an address and a port) on this machine, by the kernel's tables: the established socket
    whose local end is ``peer`` and whose remote end is ``server``, matched on both addresses
    and ports (a port alone can be made to match another socket). None when none is found;
    ``AMBIGUOUS`` when sockets of several users match. The kernel is asked for that socket
    (``connection_uid``); its tables are read only where it will not answer so."""
    try:
        return connection_uid(peer, server)
    except OSError:
        pass
    local, remote = hex_address(peer[0]), hex_address(server[0])
    uids = {
        s.uid
        for s in tcp_sockets()
        if s.state == ESTABLISHED
        and (s.local_port, s.remote_port) == (peer[1], server[1])
        and (s.local_address, s.remote_address) == (local, remote)
    }
    if len(uids) > 1:
        return AMBIGUOUS
    return uids.pop() if uids else None


def client(request: Any, client_address: Any) -> int | str:
    """Who a new connection is: its user (a unix socket's peer, or a TCP peer on this
    machine), else its address; ``AMBIGUOUS`` (to be refused) when the tables cannot tell."""
    if isinstance(request, socket.socket) and request.family == socket.AF_UNIX:
        try:
            creds = request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        except OSError:
            return "unix"
        return int(struct.unpack("3i", creds)[1])
    if isinstance(client_address, tuple) and len(client_address) >= 2:
        try:
            server = request.getsockname()
        except (AttributeError, OSError):
            return str(client_address[0])
        uid = peer_uid((str(client_address[0]), int(client_address[1])), (server[0], server[1]))
        return uid if uid is not None else str(client_address[0])
    return str(client_address)


def refused(who: int | str, uids: frozenset[int]) -> bool:
    """A connection to close unanswered: one of ``uids`` (the task users), or one whose user
    the tables cannot tell."""
    return who == AMBIGUOUS or (isinstance(who, int) and who in uids)


class Connections:
    """At most ``total`` connections under way, ``per_client`` of them from one client."""

    def __init__(self, total: int, per_client: int) -> None:
        self._total = threading.BoundedSemaphore(total)
        self._per_client = per_client
        self._lock = threading.Lock()
        self._taken: dict[int | str, int] = {}

    def take(self, who: int | str) -> bool:
        """One more for ``who``; False (nothing taken) when it has its share or all are taken."""
        with self._lock:
            taken = self._taken.get(who, 0)
            if taken >= self._per_client or not self._total.acquire(blocking=False):
                return False
            self._taken[who] = taken + 1
            return True

    def give(self, who: int | str) -> None:
        with self._lock:
            left = self._taken.pop(who, 1) - 1
            if left > 0:
                self._taken[who] = left
        self._total.release()


class Deadline(io.RawIOBase):
    """A socket's reads, each given what is left of one deadline for them all."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._until = sock, time.monotonic() + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


def deadline_reader(sock: socket.socket, seconds: float) -> io.BufferedReader:
    """A request's reader with one deadline for the whole of it."""
    return io.BufferedReader(Deadline(sock, seconds))
