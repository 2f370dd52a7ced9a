"""Per-attempt cgroups: limits (memory, CPU, pids), kill-everything-inside, and OOM detection.

Supports the unified hierarchy (cgroup v2, with the memory, pids and cpu controllers enabled for
the agent's own cgroup, e.g. systemd ``Delegate=yes``) and the v1 hierarchies of hosts that mount
``memory``, ``pids`` and ``cpu`` separately. Attempt cgroups are created below the agent's own
cgroup in each hierarchy, under ``flashnode/<name>``. Where none of this is possible ``detect``
returns None with the reason, and the agent carries on with process groups and tokens alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from flashnode.clock import Clock, SystemClock

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None


class Hierarchy:
    """Where attempt cgroups are made: one base directory (v2) or one per controller (v1)."""

    def __init__(self, version: int, bases: dict[str, Path], clock: Clock | None = None) -> None:
        self.version = version
        self.bases = bases  # controller (or "unified") -> <agent's cgroup>/flashnode
        self.clock = clock or SystemClock()

    def describe(self) -> str:
        return f"cgroup v{self.version} ({', '.join(str(p) for p in self.bases.values())})"

    def create(self, name: str, limits: Limits) -> AttemptCgroup:
        cg = AttemptCgroup(
            self.version, {c: base / name for c, base in self.bases.items()}, self.clock
        )
        try:
            for path in cg.paths.values():
                path.parent.mkdir(exist_ok=True)
                path.mkdir(exist_ok=True)
            cg.apply(limits)
        except OSError:
            cg.remove()
            raise
        return cg


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
            _write(mem / limit_file, str(limits.memory_bytes))
            with contextlib.suppress(OSError):  # no swap accounting on this host
                if v2:
                    _write(mem / "memory.swap.max", "0")
                else:
                    _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if limits.pids is not None and pids is not None:
            _write(pids / "pids.max", str(limits.pids))
        if limits.cpus is not None and cpu is not None:
            quota = max(int(limits.cpus * CFS_PERIOD_US), 1000)
            if v2:
                _write(cpu / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            else:
                _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(quota))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.paths.values():
            with contextlib.suppress(OSError):
                found.update(int(x) for x in (path / "cgroup.procs").read_text().split())
        return found

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything inside until it is empty. Every pid listed here is the task's."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(self.paths["unified"] / "cgroup.kill", "1")
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
        for path in self.paths.values():
            for name in ("memory.events", "memory.oom_control"):
                try:
                    text = (path / name).read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                        return True
        return False

    def remove(self) -> None:
        self.kill()
        for path in self.paths.values():
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.clock.sleep(0.02)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _own_cgroup() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under key "" for v2."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


def detect(root: Path = ROOT, clock: Clock | None = None) -> tuple[Hierarchy | None, str]:
    """The hierarchy attempt cgroups can be made in, or None and why not."""
    try:
        own = _own_cgroup()
    except OSError as exc:
        return None, f"cannot read /proc/self/cgroup ({exc.strerror})"
    unified = root / "cgroup.controllers"
    if unified.exists():
        base = root / own.get("", "/").lstrip("/") / "flashnode"
        controllers = unified.read_text().split()
        missing = [c for c in V1_CONTROLLERS if c not in controllers]
        if missing:
            return None, f"cgroup v2 lacks the {', '.join(missing)} controller(s)"
        return _probe(Hierarchy(2, {"unified": base}, clock))
    bases = {}
    for controller in V1_CONTROLLERS:
        mount = root / controller
        if not mount.is_dir() or controller not in own:
            return None, f"no cgroup v1 '{controller}' hierarchy is mounted"
        bases[controller] = mount / own[controller].lstrip("/") / "flashnode"
    # CPU accounting, for task-scoped evidence: where "cpu,cpuacct" are mounted together the
    # cpu directory accounts; else the cpuacct hierarchy, when there is one.
    acct = root / "cpuacct"
    if "cpuacct" in own and acct.is_dir() and not (root / "cpu" / "cpuacct.usage").exists():
        bases["cpuacct"] = acct / own["cpuacct"].lstrip("/") / "flashnode"
    return _probe(Hierarchy(1, bases, clock))


def _probe(hierarchy: Hierarchy) -> tuple[Hierarchy | None, str]:
    """Make and remove a cgroup, enabling controllers for children on v2."""
    try:
        if hierarchy.version == 2:
            _enable_v2(hierarchy.bases["unified"])
        cg = hierarchy.create(f"probe-{os.getpid()}", Limits(pids=10))
        cg.remove()
    except OSError as exc:
        return None, f"cannot create cgroups ({exc.strerror or exc})"
    return hierarchy, ""


def _enable_v2(base: Path) -> None:
    """Enable memory, pids and cpu below ``base``. v2 lets a cgroup hand controllers to children
    only while it holds no process itself, so the agent first moves into a leaf of its own."""
    own = base.parent
    wanted = set(V1_CONTROLLERS)
    if not wanted <= set((own / "cgroup.subtree_control").read_text().split()):
        leaf = own / "agent"
        leaf.mkdir(exist_ok=True)
        for pid in (own / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                _write(leaf / "cgroup.procs", pid)
        _write(own / "cgroup.subtree_control", "+memory +pids +cpu")
    base.mkdir(exist_ok=True)
    _write(base / "cgroup.subtree_control", "+memory +pids +cpu")
