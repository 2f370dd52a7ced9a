"""One attempt's cgroup (``AttemptCgroup``): its limits, the freezer, its processes killed, its
CPU time and OOM kills read, and its directories removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from flashnode.clock import Clock, SystemClock
from flashnode.sandbox.cgroups.files import (
    FREEZE_WAIT_S,
    V1_CONTROLLERS,
    V1_FREEZER,
    read,
    write,
    write_cpu,
)
from flashnode.sandbox.limits import Limits


class AttemptCgroup:
    """One attempt's cgroup: a directory per hierarchy, keyed by controller ("unified" on v2)."""

    def __init__(self, version: int, paths: dict[str, Path], clock: Clock | None = None) -> None:
        self.version = version
        self.paths = paths
        self.clock = clock or SystemClock()

    @property
    def procs_files(self) -> list[str]:
        """Files a process writes its pid to, to join this cgroup in every hierarchy."""
        return [str(p / "cgroup.procs") for p in self.paths.values()]

    def apply(self, limits: Limits) -> None:
        mem, pids, cpu = (self.paths.get(c, self.paths.get("unified")) for c in V1_CONTROLLERS)
        v2 = self.version == 2
        if limits.memory_bytes is not None and mem is not None:
            limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
            write(mem / limit_file, str(limits.memory_bytes))
            with contextlib.suppress(OSError):  # no swap accounting on this host
                if v2:
                    write(mem / "memory.swap.max", "0")
                else:
                    write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if limits.pids is not None and pids is not None:
            write(pids / "pids.max", str(limits.pids))
        if limits.cpus is not None and cpu is not None:
            write_cpu(cpu, self.version, limits.cpus)

    # --- the freezer ---------------------------------------------------------------------------

    @property
    def can_freeze(self) -> bool:
        """Whether this cgroup has a freezer (v2: always, kernel 5.2+; v1: the freezer mount)."""
        if self.version == 2:
            return (self.paths["unified"] / "cgroup.freeze").exists()
        return V1_FREEZER in self.paths

    def freeze(self) -> None:
        """Stop every process inside from running (they stay, with their memory) until
        ``thaw``. Raises OSError when the freezer cannot be written."""
        if self.version == 2:
            write(self.paths["unified"] / "cgroup.freeze", "1")
        else:
            write(self.paths[V1_FREEZER] / "freezer.state", "FROZEN")
        deadline = self.clock.monotonic() + FREEZE_WAIT_S
        while not self.frozen() and self.clock.monotonic() < deadline:
            self.clock.sleep(0.01)

    def thaw(self) -> None:
        """Let the processes run again; nothing happens where nothing was frozen."""
        with contextlib.suppress(OSError):
            if self.version == 2:
                write(self.paths["unified"] / "cgroup.freeze", "0")
            elif V1_FREEZER in self.paths:
                write(self.paths[V1_FREEZER] / "freezer.state", "THAWED")

    def frozen(self) -> bool:
        try:
            if self.version == 2:
                events = (self.paths["unified"] / "cgroup.events").read_text().split()
                return "frozen" in events and events[events.index("frozen") + 1] == "1"
            if V1_FREEZER not in self.paths:
                return False
            return (self.paths[V1_FREEZER] / "freezer.state").read_text().strip() == "FROZEN"
        except (OSError, IndexError):
            return False

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.paths.values():
            with contextlib.suppress(OSError):
                found.update(int(x) for x in read(path / "cgroup.procs").split())
        return found

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything inside until it is empty. Every pid listed here is the task's.
        A frozen cgroup is killed before it is thawed (on v1 a frozen process dies only once
        thawed): what it holds pending then runs no more of its own code."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                write(self.paths["unified"] / "cgroup.kill", "1")
        for pid in self.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.thaw()
        deadline = self.clock.monotonic() + timeout
        while (pids := self.pids()) and self.clock.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.clock.sleep(0.01)

    def cpu_seconds(self) -> float | None:
        """CPU time used by everything that ran in this cgroup, if the host accounts it."""
        if self.version == 2:
            try:
                for line in (self.paths["unified"] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
            except OSError:
                return None
            return None
        acct = self.paths.get("cpuacct") or self.paths.get("cpu")
        if acct is None:
            return None
        try:
            return int((acct / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        memory = self.paths.get("memory", self.paths.get("unified"))
        if memory is None:
            return False
        for name in ("memory.events", "memory.oom_control"):
            try:
                text = (memory / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                    return True
        return False

    def remove(self) -> bool:
        """Kill everything inside and remove the directories; whether they are all gone (a
        process that would not die keeps its directory)."""
        self.kill()
        gone = True
        for path in self.paths.values():
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.clock.sleep(0.02)
            else:
                gone = False
        return gone
