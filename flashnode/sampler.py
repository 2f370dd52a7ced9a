"""Readings → the figures of ExecutionEvidence (DESIGN.md §6).

The rule: None means not measured, 0 means measured zero; a figure any of whose readings failed
is None for the whole run.

* Host-wide CPU: the busy share of the host's cumulative CPU counters between the start and the
  end of the run: exact over the run, with no first-reading artefact.
* Task CPU: the task's CPU seconds (its cgroup's accounting, else what sampling its processes
  saw) over the same stretch of its own wall time, in percent of one core: both measured from
  the moment its runner handed it over (the CPU it had used then is subtracted, so that its
  launch, and a short task's whole life inside that launch, never count against no wall time).
  It lies within 0 … 100 times the machine's cores; a run shorter than ``MIN_WALL_S``, or whose
  counter went backwards, is not measured (None), never a huge figure. While the task runs, the
  sampler reads it every ``CPU_EVERY_S`` for the live view.
* GPU, host-wide and task-scoped: sampled every ``interval`` seconds while the task runs, and
  once more at its end so that a run shorter than one interval still has a reading.
  Host-wide is the mean over all of this node's GPUs; task-scoped is the SM utilisation of the
  task's processes on the GPUs it was given, averaged over those GPUs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import psutil

from flashnode.clock import Clock
from flashnode.gpupool import Device

CpuTimes = Callable[[], tuple[float, float]]  # (busy seconds, total seconds), host-wide
MIN_WALL_S = 0.01  # shorter, a task's CPU figure is not measured: one clock tick
CPU_EVERY_S = 5.0  # the live view's task CPU is read at most this often (a container's costs)


def task_cpu_percent(cpu_seconds: float | None, wall_seconds: float, cores: int) -> float | None:
    """The task's CPU seconds over ``wall_seconds`` of its own, in percent of one core, within
    0 … 100 times ``cores``; None when not measured, too short to tell, or inconsistent."""
    if cpu_seconds is None or cpu_seconds < 0 or wall_seconds < MIN_WALL_S:
        return None
    return round(min(cpu_seconds / wall_seconds * 100.0, 100.0 * max(cores, 1)), 2)


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
        return round(min(max(busy / total * 100.0, 0.0), 100.0), 2)

    def _safe_read(self) -> tuple[float, float] | None:
        try:
            return self.read()
        except Exception:  # an unreadable counter is "not measured", never a crash
            return None


class GpuReader(Protocol):
    def utilization(self, device: Device) -> float | None: ...
    def process_utilization(
        self, device: Device, since_us: int
    ) -> list[tuple[int, float, int]] | None: ...


class TaskProbe(Protocol):
    def pids(self) -> set[int]: ...


@dataclass
class _Series:
    values: list[float] = field(default_factory=list)
    failed: bool = False

    def add(self, value: float | None) -> None:
        if value is None:
            self.failed = True
        else:
            self.values.append(value)

    def mean(self) -> float | None:
        if self.failed or not self.values:
            return None
        return round(sum(self.values) / len(self.values), 2)


class Sampler:
    """Samples one running attempt on its own thread until ``finish``."""

    def __init__(
        self,
        clock: Clock,
        interval: float,
        probe: TaskProbe,
        gpu: GpuReader | None = None,
        host_devices: list[Device] | None = None,
        task_devices: list[Device] | None = None,
        cpu: Callable[[], float | None] | None = None,
        cores: int = 1,
    ) -> None:
        """``cpu``: the task's CPU seconds so far (for the live view), read from now on."""
        self._clock, self._interval, self._probe = clock, interval, probe
        self._cpu, self._cores = cpu, cores
        self._gpu = gpu
        self._host = list(host_devices or []) if gpu else []
        self._task = list(task_devices or []) if gpu else []
        self._since = {d.visible: 0 for d in self._task}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seen: set[int] = set()  # every pid the task ever had: samples outlive processes
        # Its processes' CPU so far first (without cgroup accounting, reading its processes is
        # what measures it): the baseline its own CPU is counted from.
        self._remember_pids()
        self._cpu_start: tuple[float, float | None] = (clock.monotonic(), _read(cpu))
        self._cpu_last: tuple[float, float | None] | None = None
        self._readings = 0
        self.host_gpu, self.task_gpu = _Series(), _Series()

    def run(self) -> None:
        self._remember_pids()
        while not self._clock.wait(self._stop, self._interval):
            self.sample()

    @property
    def cpu_start(self) -> tuple[float, float | None]:
        """When the task was handed over (monotonic) and the CPU seconds it had used then."""
        return self._cpu_start

    def live_cpu_percent(self) -> float | None:
        """The task's CPU so far, from its last reading (None before one)."""
        last = self._cpu_last
        if last is None:
            return None
        (t0, cpu0), (t1, cpu1) = self._cpu_start, last
        if cpu1 is None:
            return None
        return task_cpu_percent(cpu1 - (cpu0 or 0.0), t1 - t0, self._cores)

    def finish(self) -> tuple[float | None, float | None]:
        """Stop and return (host GPU mean, task GPU mean). A run that ended before its first
        reading gets one now."""
        self._stop.set()
        with self._lock:
            taken = self._readings
        if not taken:
            self.sample()
        return self.host_gpu.mean(), self.task_gpu.mean()

    def _remember_pids(self) -> None:
        with contextlib.suppress(Exception):  # gone or unreadable: keep what was seen
            self._seen.update(self._probe.pids())

    def sample(self) -> None:
        with self._lock:
            self._readings += 1
            self._remember_pids()
            now = self._clock.monotonic()
            last = self._cpu_last
            if self._cpu is not None and (last is None or now - last[0] >= CPU_EVERY_S):
                self._cpu_last = (now, _read(self._cpu))
            if self._gpu is None:
                return
            if self._host:
                readings = [self._gpu.utilization(d) for d in self._host]
                ok = [r for r in readings if r is not None]
                self.host_gpu.add(sum(ok) / len(ok) if len(ok) == len(readings) else None)
            if self._task:
                total = 0.0
                for d in self._task:
                    samples = self._gpu.process_utilization(d, self._since[d.visible])
                    if samples is None:
                        self.task_gpu.add(None)
                        return
                    per_pid: dict[int, list[float]] = {}
                    for pid, sm, ts in samples:
                        if pid in self._seen:
                            per_pid.setdefault(pid, []).append(sm)
                            self._since[d.visible] = max(self._since[d.visible], ts)
                    total += sum(sum(v) / len(v) for v in per_pid.values())
                self.task_gpu.add(min(total / len(self._task), 100.0))


def _read(cpu: Callable[[], float | None] | None) -> float | None:
    if cpu is None:
        return None
    try:
        return cpu()
    except Exception:  # unreadable: not measured
        return None
