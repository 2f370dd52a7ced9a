"""Where attempt cgroups are made (``Hierarchy``): one base directory (v2) or one per controller
(v1); the CPU cap of all attempts together, and the sweep of those an earlier run left.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from flashnode.clock import Clock, SystemClock
from flashnode.sandbox.cgroups.attempt import AttemptCgroup
from flashnode.sandbox.cgroups.files import ROOT, write_cpu
from flashnode.sandbox.limits import Limits


class Hierarchy:
    """Where attempt cgroups are made: one base directory (v2) or one per controller (v1)."""

    def __init__(self, version: int, bases: dict[str, Path], clock: Clock | None = None) -> None:
        self.version = version
        self.bases = bases  # controller (or "unified") -> <agent's cgroup>/flashnode
        self.clock = clock or SystemClock()
        self._real: dict[str, str] | None = None  # each base's real path, once needed

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
                write_cpu(cpu / name, self.version, target)
            except FileNotFoundError:
                continue  # the attempt ended meanwhile
            except OSError:
                late.append((cpu / name, target))  # above the parent's present quota
        write_cpu(cpu, self.version, cpus)
        for path, target in late:
            with contextlib.suppress(OSError):
                write_cpu(path, self.version, target)

    def sweep(self, prefix: str, keep: set[str] | frozenset[str] = frozenset()) -> int:
        """Remove the attempt cgroups whose names start with ``prefix`` (what an earlier run of
        this agent made ahead and never used: see runners/slots.py), but those in ``keep``; how
        many."""
        names: set[str] = set()
        for base in self.bases.values():
            with contextlib.suppress(OSError):
                names.update(p.name for p in base.iterdir() if p.name.startswith(prefix))
        names -= keep
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
        if self._real is None:  # resolved once: the agent's own cgroup does not move
            self._real = {c: os.path.realpath(base) for c, base in self.bases.items()}
        made_in: set[str] = set()
        try:
            for controller, path in cg.paths.items():
                path.parent.mkdir(exist_ok=True)
                real = self._real[controller]
                if real in made_in:
                    continue  # co-mounted controllers (cpu,cpuacct): one directory
                made_in.add(real)
                # Never one that exists: it is another attempt's, or a chain's started ahead (a
                # lease id is the coordinator's to choose).
                path.mkdir()
                made[controller] = path
            cg.apply(limits)
        except OSError:
            AttemptCgroup(self.version, made, self.clock).remove()
            raise
        return cg


def _min_cpus(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
