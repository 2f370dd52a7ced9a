"""The per-task limits both runners apply: what the owner set, else a share of the machine per
slot, and the machine-wide CPU cap (what a task sees of its workspace, argv and environment is
the plan's: ``runners.plan``)."""

from __future__ import annotations

from flashnode.config.settings import Settings
from flashnode.sandbox.limits import Limits


def task_limits(settings: Settings, slots: int, memory_bytes: int, cores: int) -> Limits:
    """The per-task limits: what the owner set, else a share of the machine per slot (three
    quarters of its memory, its cores, split between the slots), and ``task_pids``. The
    machine-wide CPU cap (``machine_cpus``) is applied by each runner on top of these."""
    slots = max(slots, 1)
    memory = settings.task_memory_bytes or max(memory_bytes * 3 // 4 // slots, 64 * 1024 * 1024)
    cpus = settings.task_cpus or max(cores / slots, 1.0)
    return Limits(memory, cpus, settings.task_pids)


def machine_cpus(settings: Settings, cores: int) -> float | None:
    """``task_cpu_percent`` of the machine, in CPUs: what all tasks together may use (None: no
    cap). The trusted runner sets it as the quota of the tasks' parent cgroup; the container
    runner, which has no common parent, splits it between the slots."""
    percent = settings.task_cpu_percent
    return None if percent is None else max(cores * percent / 100.0, 0.01)


def min_cpus(a: float | None, b: float | None) -> float | None:
    """The tighter of two CPU limits (None: no limit)."""
    return b if a is None else a if b is None else min(a, b)
