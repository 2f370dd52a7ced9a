"""The kernel's TCP socket tables read: real sockets of the test's own, and tables that are not
what the kernel writes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flashnode.coordinator.listener import listener_uids
from flashnode.httpguard import peer_uid
from flashnode.tcptable import LISTEN, TcpSocket, connection_uid, tcp_sockets


def test_a_listening_socket_and_both_ends_of_a_connection_are_found_with_their_owner() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            peer = client.getsockname()[1]
            rows = set(tcp_sockets())
            me = os.geteuid()
            assert TcpSocket(port, 0, LISTEN, me) in rows
            assert any(s.local_port == peer and s.remote_port == port and s.uid == me for s in rows)
            assert listener_uids(port) == {me}
    assert listener_uids(port) == set()


def test_an_unreadable_table_and_rows_that_are_not_sockets_are_passed_over(tmp_path: Path) -> None:
    table = tmp_path / "tcp"
    table.write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000\n"
        "   1: 0100007F:ZZZZ 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000\n"
        "   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  -\n"
        "   3: short row\n"
        "   4: 0100007F:1F92 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  0\n"
    )
    rows = list(tcp_sockets((str(tmp_path / "missing"), str(table))))
    assert rows == [TcpSocket(0x1F90, 0, LISTEN, 1000), TcpSocket(0x1F92, 0x1F90, 1, 0)]


def test_the_owner_of_one_connection_is_asked_of_the_kernel_and_agrees_with_its_tables() -> None:
    """A client socket held by another user (nobody, when this runs as root): the kernel's
    answer for that socket names that user, as the tables do; no such socket: None."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        code = (
            "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1])));"
            " print(s.getsockname()[1], flush=True); sys.stdin.read()"
        )
        command = [*(user if os.geteuid() == 0 else []), sys.executable, "-c", code, str(port)]
        with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
            assert child.stdout is not None and child.stdin is not None
            peer = int(child.stdout.readline())
            conn, address = server.accept()
            with conn:
                expected = 65534 if os.geteuid() == 0 else os.geteuid()
                assert connection_uid(address, ("127.0.0.1", port)) == expected
                assert peer_uid(address, ("127.0.0.1", port)) == expected
                assert address[1] == peer
                tables = {
                    s.uid for s in tcp_sockets() if (s.local_port, s.remote_port) == (peer, port)
                }
                assert tables == {expected}
                assert connection_uid(("127.0.0.1", peer), ("127.0.0.1", port + 1)) is None
                mapped = connection_uid(("::ffff:127.0.0.1", peer), ("::ffff:127.0.0.1", port))
                assert mapped == expected
            child.stdin.close()


def test_a_closed_connection_is_owned_by_none_and_a_link_local_one_is_left_to_the_tables() -> None:
    """A client that closed before it was looked at left a socket owned by no user (the kernel
    would say root): none. A link-local address needs its interface in the question: the
    caller reads the tables instead."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, address = server.accept()
        with conn:
            client.close()
            assert connection_uid(address, ("127.0.0.1", port)) is None
    with pytest.raises(OSError):
        connection_uid(("fe80::1", 40000), ("fe80::2", 7469))
