"""Per-attempt cgroups: limits (memory, CPU, pids), kill-everything-inside, OOM detection, and
the freezer (an owner control suspends a task).

Supports the unified hierarchy (cgroup v2, with the memory, pids and cpu controllers enabled for
the agent's own cgroup, e.g. systemd ``Delegate=yes``) and the v1 hierarchies of hosts that mount
``memory``, ``pids`` and ``cpu`` separately (and ``freezer``, when mounted, for suspension).
Attempt cgroups are created below the agent's own cgroup in each hierarchy, under
``flashnode/<name>``; the owner's CPU cap for all tasks together (``task_cpu_percent``) is the CPU
quota of that ``flashnode`` parent. Where none of this is possible ``detect`` returns None with the
reason, and the agent carries on with process groups and tokens alone.

Why one module of this size: both hierarchies (v1 and v2) side by side: every operation differs
between them in a few lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from flashnode.clock import Clock, SystemClock
from flashnode.sandbox.limits import Limits

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
V1_FREEZER = "freezer"  # optional on v1: without it a task is suspended with SIGSTOP
CFS_PERIOD_US = 100_000
FREEZE_WAIT_S = 2.0  # how long freezing may take (a task in uninterruptible sleep delays it)


class Hierarchy:
    """Where attempt cgroups are made: one base directory (v2) or one per controller (v1)."""

    def __init__(self, version: int, bases: dict[str, Path], clock: Clock | None = None) -> None:
        self.version = version
        self.bases = bases  # controller (or "unified") -> <agent's cgroup>/flashnode
        self.clock = clock or SystemClock()

    def describe(self) -> str:
        """``cgroup v2 at /system.slice/flashnode.service/flashnode``; v1's controllers grouped
        by where they are (a long part of a path shortened): one line of readable length."""
        where: dict[str, list[str]] = {}
        for controller, base in self.bases.items():
            mount = ROOT if self.version == 2 else ROOT / controller
            try:
                shown = "/" + str(base.relative_to(mount))
            except ValueError:
                shown = str(base)
            shown = "/".join(p if len(p) <= 24 else p[:12] + "…" for p in shown.split("/"))
            where.setdefault(shown, []).append(controller)
        if self.version == 2:
            return f"cgroup v2 at {', '.join(where)}"
        return "cgroup v1: " + "; ".join(f"{', '.join(c)} at {p}" for p, c in where.items())

    def set_cpu_cap(self, cpus: float | None, tasks: Mapping[str, float | None]) -> None:
        """Cap all attempts together at ``cpus`` CPUs (None: no cap), live.

        ``tasks``: the running attempts' cgroup names and their own CPU limits; each gets
        min(own limit, cap), because cgroup v1 refuses a child quota above its parent's. Children
        that go down are written before the parent, children that go up after it.
        """
        cpu = self.bases.get("cpu", self.bases.get("unified"))
        if cpu is None:
            return
        late: list[tuple[Path, float | None]] = []
        for name, own in tasks.items():
            target = _min_cpus(own, cpus)
            try:
                _write_cpu(cpu / name, self.version, target)
            except FileNotFoundError:
                continue  # the attempt ended meanwhile
            except OSError:
                late.append((cpu / name, target))  # above the parent's present quota
        _write_cpu(cpu, self.version, cpus)
        for path, target in late:
            with contextlib.suppress(OSError):
                _write_cpu(path, self.version, target)

    def sweep(self, prefix: str) -> int:
        """Remove the attempt cgroups whose names start with ``prefix`` (what an earlier run of
        this agent made ahead and never used: see runners/slots.py); how many."""
        names: set[str] = set()
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                names.update(p.name for p in base.iterdir() if p.name.startswith(prefix))
        for name in names:
            AttemptCgroup(
                self.version, {c: base / name for c, base in self.bases.items()}, self.clock
            ).remove()
        return len(names)

    def create(self, name: str, limits: Limits) -> AttemptCgroup:
        cg = AttemptCgroup(
            self.version, {c: base / name for c, base in self.bases.items()}, self.clock
        )
        made: dict[str, Path] = {}
        try:
            for controller, path in cg.paths.items():
                path.parent.mkdir(exist_ok=True)
                if os.path.realpath(path) in {os.path.realpath(p) for p in made.values()}:
                    continue  # co-mounted controllers (cpu,cpuacct): one directory
                # Never one that exists: it is another attempt's, or a chain's started ahead (a
                # lease id is the coordinator's to choose).
                path.mkdir()
                made[controller] = path
            cg.apply(limits)
        except OSError:
            AttemptCgroup(self.version, made, self.clock).remove()
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
            _write_cpu(cpu, self.version, limits.cpus)

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
            _write(self.paths["unified"] / "cgroup.freeze", "1")
        else:
            _write(self.paths[V1_FREEZER] / "freezer.state", "FROZEN")
        deadline = self.clock.monotonic() + FREEZE_WAIT_S
        while not self.frozen() and self.clock.monotonic() < deadline:
            self.clock.sleep(0.01)

    def thaw(self) -> None:
        """Let the processes run again; nothing happens where nothing was frozen."""
        with contextlib.suppress(OSError):
            if self.version == 2:
                _write(self.paths["unified"] / "cgroup.freeze", "0")
            elif V1_FREEZER in self.paths:
                _write(self.paths[V1_FREEZER] / "freezer.state", "THAWED")

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
                found.update(int(x) for x in (path / "cgroup.procs").read_text().split())
        return found

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything inside until it is empty. Every pid listed here is the task's.
        A frozen cgroup is killed before it is thawed (on v1 a frozen process dies only once
        thawed): what it holds pending then runs no more of its own code."""
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(self.paths["unified"] / "cgroup.kill", "1")
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


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _min_cpus(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _write_cpu(path: Path, version: int, cpus: float | None) -> None:
    """The CPU quota of one cgroup directory: ``cpus`` CPUs per period, None for no quota."""
    quota = -1 if cpus is None else max(int(cpus * CFS_PERIOD_US), 1000)
    if version == 2:
        _write(path / "cpu.max", f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}")
    else:
        _write(path / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(path / "cpu.cfs_quota_us", str(quota))


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
    freezer = root / V1_FREEZER
    if V1_FREEZER in own and freezer.is_dir():
        bases[V1_FREEZER] = freezer / own[V1_FREEZER].lstrip("/") / "flashnode"
        found, why = _probe(Hierarchy(1, bases, clock))
        if found is not None:
            return found, why
        del bases[V1_FREEZER]  # the freezer is optional: suspension falls back to SIGSTOP
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
