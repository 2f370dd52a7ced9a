"""The kernel's TCP socket tables (``/proc/net/tcp`` and ``/proc/net/tcp6``): which user owns a
socket on this machine. The loopback coordinator's guard asks who listens on a port
(``coordinator/listener.py``), the console who holds the other end of a connection
(``console/server.py``): that one socket is asked of the kernel by its addresses and ports
(``connection_uid``, netlink's ``sock_diag``: a lookup, where reading the tables walks every
socket the machine has, some 10 ms of CPU for 750 of them), the tables read only where the
kernel will not answer so.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import os
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


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: any socket with these ends
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
_REQUEST = struct.Struct("=BBBBI")  # struct inet_diag_req_v2, up to its socket id
_UID_AT = _HEADER.size + 4 + 48 + 12  # inet_diag_msg: family..retrans, id, expires..wqueue


def connection_uid(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The user owning the established TCP socket on this machine whose own end is ``local``
    and whose other end is ``remote`` (each an address and a port), asked of the kernel for
    that one socket; None when it has none (or none established: one closed since has no
    owner). OSError when the kernel does not answer such questions here (no ``sock_diag``, or
    one that has not found a connection this process made itself; a link-local address,
    whose interface the question would need): the caller reads the tables instead."""
    # A dual-stack listener sees an IPv4 client as ::ffff:a.b.c.d: its socket is an IPv4 one.
    local, remote = (_unmapped(local[0]), local[1]), (_unmapped(remote[0]), remote[1])
    if _link_local(local[0]) or _link_local(remote[0]):
        raise OSError(errno.EADDRNOTAVAIL, "a link-local address: the tables are read instead")
    if not _sock_diag_answers():
        raise OSError(errno.ENOPROTOOPT, "sock_diag does not answer here")
    return _ask(local, remote)


@functools.cache
def _sock_diag_answers() -> bool:
    """Whether the kernel finds a connection this process makes to itself (once): a kernel
    without its socket diagnostics (no ``tcp_diag``) answers every question "none"."""
    try:
        with (
            socket.create_server(("127.0.0.1", 0)) as server,
            socket.create_connection(server.getsockname()[:2], timeout=5) as client,
        ):
            return _ask(client.getsockname()[:2], server.getsockname()[:2]) == os.geteuid()
    except OSError:
        return False


def _ask(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    v6 = ":" in local[0] or ":" in remote[0]
    family = socket.AF_INET6 if v6 else socket.AF_INET
    try:
        src, dst = (socket.inet_pton(family, a[0]).ljust(16, b"\0") for a in (local, remote))
    except (OSError, ValueError):
        return None
    sockid = (
        struct.pack("!HH", local[1], remote[1])
        + src
        + dst
        + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE)
    )
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << ESTABLISHED) + sockid
    message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(message + body, (0, 0))
        answer = nl.recv(8192)
    if len(answer) < _HEADER.size:
        raise OSError(errno.EPROTO, "a short answer from sock_diag")
    kind = _HEADER.unpack_from(answer)[1]
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, _HEADER.size)[0]
        if code == errno.ENOENT:
            return None  # no such socket here
        raise OSError(code, f"sock_diag refused the question ({errno.errorcode.get(code, code)})")
    if kind != SOCK_DIAG_BY_FAMILY or len(answer) < _UID_AT + 4:
        raise OSError(errno.EPROTO, f"an answer of type {kind} from sock_diag")
    if answer[_HEADER.size + 1] != ESTABLISHED:  # idiag_state: a closed one is owned by none
        return None
    uid: int = struct.unpack_from("=I", answer, _UID_AT)[0]
    return uid


def _unmapped(ip: str) -> str:
    head, _, v4 = ip.rpartition(":")
    return v4 if head.lower() == ":ffff" and "." in v4 else ip


def _link_local(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_link_local
    except ValueError:
        return False
