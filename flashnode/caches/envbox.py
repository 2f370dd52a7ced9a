"""A build's bounds: what its steps run in (``BuildBox``: the build user, its sandbox, its cgroup,
its rlimits) and what ends them all; the room it may write (``DiskRoom``) and the watch of its
tree against that room (``BuildWatch``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from flashnode.caches.envtree import tree_bytes
from flashnode.clock import Clock
from flashnode.errors import EnvUnavailable
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.procs.keyrings import clear_user_keyrings
from flashnode.sandbox.procs.mounts import Sandbox

log = logging.getLogger(__name__)

POLL_S = 0.05


def size(n: int) -> str:
    """``1.5 GiB``, ``312.0 KiB``, ``12 B``: for the owner's eyes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


BUDGET_BOUND = "env_cache_bytes"  # a build's room when the budget, not the disk, set it


@dataclass(frozen=True)
class DiskRoom:
    """What a build may write (its directory and uv's cache together): ``bytes``, and which
    bound that is (``env_cache_bytes``, or the free space above ``min_free_bytes``)."""

    bytes: int
    bound: str

    def exceeded(self) -> str:
        return f"the environment grew past {size(self.bytes)} ({self.bound}) while it was built"


WALK_EVERY_S = 1.0  # the disk watch walks the build's tree at least this often


class BuildBox:
    """What one build's steps run in (``UvBuilder._box``); ``close`` ends everything it ran."""

    def __init__(
        self,
        user: procs.TaskUser | None,
        token: str,
        cgroup: cgroups.AttemptCgroup | None,
        sandbox: Sandbox | None,
        rlimits: dict[str, int],
        watch: BuildWatch,
    ) -> None:
        self.user, self.token, self.cgroup, self.sandbox = user, token, cgroup, sandbox
        self.rlimits, self.watch = rlimits, watch

    def close(self) -> None:
        """Kill what the build ran: its cgroup, then every process of its user (or, for an
        agent that is not root, every holder of its token); then empty that user's keyrings
        (they belong to no namespace: the next build would find them). EnvUnavailable when a
        process of the build user is still there: nothing of this build is used then."""
        if self.cgroup is not None and not self.cgroup.remove():
            log.warning("a build's cgroup could not be removed: %s", self.cgroup.paths)
        if self.user is None:
            kill_owned(self.token, os.geteuid())
            return
        left = procs.end_processes_of(self.user)
        if left:
            raise EnvUnavailable(f"{len(left)} process(es) of {self.user.name} outlived the build")
        why = clear_user_keyrings(self.user)
        if why:
            log.error("cannot clear the keyrings of %s: %s", self.user.name, why)


class BuildWatch:
    """A build's use of the disk against its room: its tree walked at least every
    ``WALK_EVERY_S`` (less often when a walk is slow: never more than a twentieth of the time),
    and at once when the file system lost more than the room since the build started."""

    def __init__(self, top: Path, room: DiskRoom, clock: Clock) -> None:
        self.top, self.room, self.clock = top, room, clock
        self._free0 = _free_bytes(top)
        self._next = 0.0
        self._soon = 0.0

    def over(self, now: bool = False) -> bool:
        """Whether the build holds more than its room (walked now when ``now``)."""
        t = self.clock.monotonic()
        free = _free_bytes(self.top)
        lost = self._free0 - free if free is not None and self._free0 is not None else 0
        if not now and t < self._next and (lost <= self.room.bytes or t < self._soon):
            return False
        started = time.monotonic()
        used = tree_bytes(self.top)
        took = time.monotonic() - started
        self._next = t + max(WALK_EVERY_S, 20 * took)
        self._soon = t + max(POLL_S, 4 * took)
        return used is None or used > self.room.bytes


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def kill_owned(token: str, uid: int) -> None:
    """Kill every process of ``uid`` that carries the build's token, until none answers."""
    deadline = time.monotonic() + procs.KILL_ROUNDS_S
    while time.monotonic() < deadline:
        hit = False
        for pid in procs.find_owned(token, uid):
            hit = procs.signal_if_owned(pid, token, None, signal.SIGKILL) or hit
        if not hit:
            return
        time.sleep(0.02)
