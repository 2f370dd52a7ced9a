"""An address the agent listens on (``metrics_listen``, ``ui_listen``): TCP ``HOST:PORT`` or a
unix socket; parsed for the settings, served by the metrics and the console.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL


@dataclass(frozen=True)
class Listen:
    """A parsed ``metrics_listen``: TCP ``host``:``port``, or a unix socket ``path``."""

    host: str = ""
    port: int = 0
    path: Path | None = None

    @property
    def loopback(self) -> bool:
        """A unix socket or a loopback address: reachable from this machine only."""
        if self.path is not None or self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name other than localhost: not known to be local

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(text: str) -> Listen:
    """``127.0.0.1:9464``, ``[::1]:9464``, ``localhost:9464`` or ``unix:/run/x.sock``.

    Raises ValueError naming what is wrong. Whether a non-loopback address is allowed is the
    caller's question (``metrics_allow_remote``).
    """
    if text.startswith("unix:"):
        raw = text[len("unix:") :]
        if not raw.startswith("/") or "\0" in raw:
            raise ValueError(f"{text!r}: a unix socket needs an absolute path (unix:/run/x.sock)")
        if len(os.fsencode(raw)) > UNIX_PATH_MAX:
            raise ValueError(f"{text!r}: the socket path is longer than {UNIX_PATH_MAX} bytes")
        return Listen(path=Path(raw))
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9464) or unix:/path")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [::1]:9464")
    elif not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", host):
        raise ValueError(f"{text!r}: {host!r} is not a host name or address")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: {port!r} is not a port number")
    return Listen(host=host, port=int(port))
