"""Readings → the CPU figures of ExecutionEvidence.

The rule: None means not measured, 0 means measured zero. Host-wide CPU use over a run is the
busy share of the host's CPU time between two readings of the cumulative counters, taken at the
start and the end of the run: exact over the run, with no thread and no first-reading artefact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil

CpuTimes = Callable[[], tuple[float, float]]  # (busy seconds, total seconds), host-wide


def host_cpu_times() -> tuple[float, float]:
    t = psutil.cpu_times()
    total = sum(t)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


@dataclass
class CpuWindow:
    """The host-wide CPU mean between ``start`` and ``stop``, in percent of all cores."""

    read: CpuTimes = host_cpu_times
    _start: tuple[float, float] | None = None
    percent: float | None = None

    def start(self) -> None:
        self._start = self._safe_read()

    def stop(self) -> float | None:
        end = self._safe_read()
        if self._start is None or end is None:
            return None
        busy = end[0] - self._start[0]
        total = end[1] - self._start[1]
        if total <= 0:
            return None  # shorter than one clock tick: not measured
        self.percent = round(min(max(busy / total * 100.0, 0.0), 100.0), 2)
        return self.percent

    def _safe_read(self) -> tuple[float, float] | None:
        try:
            return self.read()
        except Exception:  # an unreadable counter is "not measured", never a crash
            return None
