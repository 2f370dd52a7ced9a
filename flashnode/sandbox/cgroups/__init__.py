"""Per-attempt cgroups: limits (memory, CPU, pids), kill-everything-inside, OOM detection, and
the freezer (an owner control suspends a task).

Supports the unified hierarchy (cgroup v2, with the memory, pids and cpu controllers enabled for
the agent's own cgroup, e.g. systemd ``Delegate=yes``) and the v1 hierarchies of hosts that mount
``memory``, ``pids`` and ``cpu`` separately (and ``freezer``, when mounted, for suspension).
Attempt cgroups are created below the agent's own cgroup in each hierarchy, under
``flashnode/<name>``; the owner's CPU cap for all tasks together (``task_cpu_percent``) is the CPU
quota of that ``flashnode`` parent. Where none of this is possible ``detect`` returns None with the
reason, and the agent carries on with process groups and tokens alone.

The package's parts, each importing only those before it: ``files`` (the hierarchy's constants
and how a control file is written, the CPU quota on v1 and v2), ``attempt`` (``AttemptCgroup``:
one attempt's cgroup), ``hierarchy`` (``Hierarchy``: where attempt cgroups are made, the CPU cap
of them all, the sweep of those left), ``detection`` (``detect``: which hierarchy this host has,
probed). This module is the package's interface: the three names every user needs.
"""

from __future__ import annotations

from flashnode.sandbox.cgroups.attempt import AttemptCgroup
from flashnode.sandbox.cgroups.detection import detect
from flashnode.sandbox.cgroups.hierarchy import Hierarchy

__all__ = ["AttemptCgroup", "Hierarchy", "detect"]
