"""Which cgroup hierarchy this host offers the agent (``detect``): v2 or v1 found from the agent's
own cgroup, probed by making and removing one, or None and why not.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from flashnode.clock import Clock
from flashnode.sandbox.cgroups.files import ROOT, V1_CONTROLLERS, V1_FREEZER, write
from flashnode.sandbox.cgroups.hierarchy import Hierarchy
from flashnode.sandbox.limits import Limits


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
                write(leaf / "cgroup.procs", pid)
        write(own / "cgroup.subtree_control", "+memory +pids +cpu")
    base.mkdir(exist_ok=True)
    write(base / "cgroup.subtree_control", "+memory +pids +cpu")
