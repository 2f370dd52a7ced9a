"""The kernel's TCP socket tables (``/proc/net/tcp`` and ``/proc/net/tcp6``): which user owns a
socket on this machine. The loopback coordinator's guard asks who listens on a port
(``coordinator/listener.py``), the console who holds the other end of a connection
(``console/server.py``).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
ESTABLISHED = 0x01  # the kernel's TCP_ESTABLISHED state
LISTEN = 0x0A  # the kernel's TCP_LISTEN state


@dataclass(frozen=True)
class TcpSocket:
    """One row of a table: the local and remote ports, the TCP state and the owner's uid; the
    local and remote addresses as the table writes them (``hex_address``)."""

    local_port: int
    remote_port: int
    state: int
    uid: int
    local_address: str = field(default="", compare=False)
    remote_address: str = field(default="", compare=False)


def hex_address(ip: str) -> str:
    """An address as the tables write it: each 32-bit word of it in this machine's byte order,
    in upper-case hex ("" when ``ip`` is none)."""
    try:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
    except (OSError, ValueError):
        return ""
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words)


def tcp_sockets(tables: tuple[str, ...] = TABLES) -> Iterator[TcpSocket]:
    """Every TCP socket (IPv4, then IPv6) the tables list; a table that cannot be read and a row
    that is not one are passed over."""
    for table in tables:
        try:
            with open(table) as fh:
                next(fh, None)  # the header
                for line in fh:
                    found = _row(line)
                    if found is not None:
                        yield found
        except OSError:
            continue


def _row(line: str) -> TcpSocket | None:
    """``sl local_address rem_address st tx:rx tr:when retrnsmt uid ...``, addresses written
    ``ADDR:PORT`` in hex."""
    fields = line.split()
    if len(fields) <= 7:
        return None
    try:
        return TcpSocket(
            local_port=int(fields[1].rpartition(":")[2], 16),
            remote_port=int(fields[2].rpartition(":")[2], 16),
            state=int(fields[3], 16),
            uid=int(fields[7]),
            local_address=fields[1].rpartition(":")[0].upper(),
            remote_address=fields[2].rpartition(":")[0].upper(),
        )
    except ValueError:
        return None
