"""A task's limits (memory, CPUs, pids): what the settings ask of every task, carried out by the
runners (the container's limits, or the task's cgroup: ``cgroups/``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
