"""What the parts of ``cgroups`` stand on: where the hierarchies are mounted, the controllers an
attempt's cgroup needs, and how a control file is written (the CPU quota, on v1 and v2).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
V1_FREEZER = "freezer"  # optional on v1: without it a task is suspended with SIGSTOP
CFS_PERIOD_US = 100_000
FREEZE_WAIT_S = 2.0  # how long freezing may take (a task in uninterruptible sleep delays it)


def read(path: Path) -> str:
    """A control file's text, with plain system calls: the task's processes are listed several
    times a task (``AttemptCgroup.pids``), where a text file object costs a few more each."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def write_cpu(path: Path, version: int, cpus: float | None) -> None:
    """The CPU quota of one cgroup directory: ``cpus`` CPUs per period, None for no quota."""
    quota = -1 if cpus is None else max(int(cpus * CFS_PERIOD_US), 1000)
    if version == 2:
        write(path / "cpu.max", f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}")
    else:
        write(path / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        write(path / "cpu.cfs_quota_us", str(quota))
