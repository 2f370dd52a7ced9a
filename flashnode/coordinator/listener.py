"""Who listens on a loopback port: credentials sent in clear text to a loopback coordinator go
only to a port held by root or the agent's own user, never to a local squatter.
"""

from __future__ import annotations

import os

from flashnode.errors import CoordinatorUnavailable
from flashnode.tcptable import LISTEN, tcp_sockets


def check_listener(host: str | None, port: int) -> None:
    """Refuse (as a transport error: retried) when the loopback port is held by a user other
    than root or this agent's: credentials never go to a local squatter."""
    owners = listener_uids(port)
    strangers = owners - {0, os.geteuid()}
    if strangers:
        raise CoordinatorUnavailable(
            f"{host}:{port} is held by uid {min(strangers)}, not by root or this agent's user:"
            " no credentials are sent there"
        )


def listener_uids(port: int) -> set[int]:
    """The uids owning TCP sockets that listen on ``port`` (loopback or any address)."""
    return {s.uid for s in tcp_sockets() if s.state == LISTEN and s.local_port == port}
