"""One agent per state dir: an exclusive advisory lock (``flock``) on ``<state dir>/agent.lock``,
held for the agent's whole life.

A second ``flashnode work`` on the same state dir finds the lock held and stops before it touches
anything (no reaping, no cgroup sweep, no outbox), naming the holder: its pid, and its systemd
unit when it runs as one (from ``/proc/<pid>/cgroup``). The owner's other commands (``status``,
``history``, ``logs``, ``pause``) never take the lock and work beside the running agent.

The lock file is the agent's alone (mode 0600, in a state dir only the agent's user may write):
anyone who could open it could take the lock and keep the agent from starting. It is opened
close-on-exec, so no task, launch chain or build the agent starts inherits it (a process that
kept the descriptor would keep the lock after the agent exits). The kernel drops the lock when
the agent's process ends, however it ends: a stale file never blocks a start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "agent.lock"


@dataclass(frozen=True)
class Holder:
    """The agent that holds a state dir: its pid (None when it cannot be told) and unit."""

    pid: int | None
    unit: str | None = None

    def describe(self) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "a process whose pid is unknown"
        return f"{who} (systemd unit {self.unit})" if self.unit else who


class Held(Exception):
    """The state dir's lock is held by another agent."""

    def __init__(self, holder: Holder) -> None:
        super().__init__(holder.describe())
        self.holder = holder


class StateLock:
    """The held lock; ``release`` (or the process's end) lets it go."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1


def acquire(state_dir: Path) -> StateLock:
    """Take the state dir's lock without waiting. Raises Held when another process holds it,
    OSError when the lock file cannot be opened (the state dir is missing or not ours)."""
    path = state_dir / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask, and whatever an older file had
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Held(_holder(fd)) from None
        # The pid, for the next agent's message. Rewritten in place: a state dir whose disk is
        # full still gets it (the file keeps its block).
        data = f"{os.getpid()}\n".encode().ljust(16)
        with contextlib.suppress(OSError):
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
    except BaseException:
        os.close(fd)
        raise
    return StateLock(fd, path)


def _holder(fd: int) -> Holder:
    pid = _pid_in_file(fd) or _pid_in_proc_locks(fd)
    return Holder(pid, systemd_unit(pid) if pid is not None else None)


def _pid_in_file(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _pid_in_proc_locks(fd: int) -> int | None:
    """The holder as the kernel lists it (a holder that has not written its pid yet):
    ``1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF``."""
    try:
        st = os.fstat(fd)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            return int(fields[4]) if fields[4].isdigit() and int(fields[4]) > 0 else None
    return None


def systemd_unit(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The systemd service ``pid`` runs in, from its cgroup path (``…/flashnode.service/…``);
    None outside a service (a login session, no systemd)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return unit_of(text)


def unit_of(cgroup_file: str) -> str | None:
    """The innermost ``*.service`` in the systemd hierarchy of a ``/proc/<pid>/cgroup`` text:
    the unified hierarchy (``0::/system.slice/flashnode.service``) or v1's ``name=systemd``."""
    found: str | None = None
    for line in cgroup_file.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not ((hierarchy == "0" and controllers == "") or "name=systemd" in controllers):
            continue
        for part in path.split("/"):
            if part.endswith(".service") and part != ".service":
                found = part
    return found
