"""sd_notify: the datagram protocol on ``$NOTIFY_SOCKET``; a no-op outside systemd. And
whether the machine is shutting down (``machine_stopping``), which makes a stop end the tasks
instead of letting go of them.

The main loop calls ``tick`` on every turn; it sends ``WATCHDOG=1`` at half the watchdog interval
(``$WATCHDOG_USEC``), so a loop that stops turning is restarted by systemd.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from flashnode.sanitise import sanitise


def machine_stopping(booted: Path = Path("/run/systemd/system")) -> bool:
    """Whether the machine is shutting down: systemd's manager says ``stopping`` (a shutdown
    target is queued). False without systemd, or when it cannot be asked."""
    if not booted.is_dir():
        return False
    try:
        done = subprocess.run(
            ["systemctl", "is-system-running"],
            capture_output=True,
            text=True,
            timeout=3,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.stdout.strip() == "stopping"


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]  # the abstract namespace
        self._address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval = (
            int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else 0.0
        )
        self._next_watchdog = 0.0
        self._status = ""

    def send(self, **fields: str | int) -> None:
        """Send ``KEY=value`` lines, e.g. ``send(READY=1, STATUS="idle")``."""
        if self._sock is None:
            return
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        with contextlib.suppress(OSError):  # systemd went away or the socket is full
            self._sock.sendto(message, self._address)

    def status(self, text: str) -> None:
        """STATUS=, sent only when it changes; one line (a newline would start a field)."""
        text = sanitise(text)
        if text != self._status:
            self._status = text
            self.send(STATUS=text)

    def tick(self) -> None:
        """Called by the main loop on every turn: the watchdog ping, at half its interval."""
        if not self.watchdog_interval:
            return
        now = time.monotonic()
        if now >= self._next_watchdog:
            self._next_watchdog = now + self.watchdog_interval
            self.send(WATCHDOG=1)
