"""Readings → the figures of ExecutionEvidence (docs/design.md §6).

The rule: None means not measured, 0 means measured zero; a figure any of whose readings failed
is None for the whole run.

* Host-wide CPU: the busy share of the host's cumulative CPU counters between the start and the
  end of the run: exact over the run, with no first-reading artefact.
* Task CPU: the task's CPU seconds (its cgroup's accounting, else what sampling its processes
  saw) over the same stretch of its own wall time, in percent of one core: both measured from
  the moment its runner handed it over (the CPU it had used then is subtracted, so that its
  launch, and a short task's whole life inside that launch, never count against no wall time).
  It lies within 0 … 100 times the machine's cores; a run shorter than ``MIN_WALL_S``, or whose
  counter went backwards, is not measured (None), never a huge figure.
* GPU, host-wide and task-scoped: sampled every ``sample_seconds`` while the task runs (not
  while it is suspended: a pause is not the task's use), and once more at its end so that a run
  shorter than one interval still has a reading.
  Host-wide is the mean over all of this node's GPUs; task-scoped is the SM utilisation of the
  task's processes on the GPUs it was given, averaged over those GPUs.
* The live view (``live``: not evidence): at each sample, the task's resident memory and its
  CPU use since the last sample (within the same bounds), over its processes now, and its latest
  GPU reading.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import psutil

from flashnode.clock import Clock
from flashnode.evidence.gpupool import Device

CpuTimes = Callable[[], tuple[float, float]]  # (busy seconds, total seconds), host-wide
MIN_WALL_S = 0.01  # shorter, a task's CPU figure is not measured: one clock tick
QUIET_PERCENT = 1.0  # below this much of a core, a task is quiet (``Sampler.quiet``)


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
    """Samples one running attempt, a reading each ``sample`` (the attempt's sampling guard
    asks every ``sample_seconds``), until ``finish``."""

    def __init__(
        self,
        clock: Clock,
        probe: TaskProbe,
        gpu: GpuReader | None = None,
        host_devices: list[Device] | None = None,
        task_devices: list[Device] | None = None,
        cpu: Callable[[], float | None] | None = None,
        cores: int = 1,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        """``cpu``: the task's CPU seconds so far, read once now: the baseline of its figure.
        ``paused``: whether the task is suspended now (its GPUs are not sampled meanwhile)."""
        self._clock, self._probe = clock, probe
        self._cores = cores
        self._paused = paused
        self._gpu = gpu
        self._host = list(host_devices or []) if gpu else []
        self._task = list(task_devices or []) if gpu else []
        self._since = {d.visible: 0 for d in self._task}
        self._lock = threading.Lock()
        self._seen: set[int] = set()  # every pid the task ever had: samples outlive processes
        # Its processes' CPU so far first (without cgroup accounting, reading its processes is
        # what measures it): the baseline its own CPU is counted from.
        self._remember_pids()
        self._cpu_start: tuple[float, float | None] = (clock.monotonic(), _read(cpu))
        self._readings = 0
        self.host_gpu, self.task_gpu = _Series(), _Series()
        self._pid_cpu: tuple[float, dict[int, float]] | None = None  # (when, CPU s per pid)
        # The latest figures, for the live view (read on another thread: its keys never change).
        self.live: dict[str, float | None] = dict.fromkeys(
            ("cpu_percent", "memory_bytes", "gpu_percent")
        )

    @property
    def cpu_start(self) -> tuple[float, float | None]:
        """When the task was handed over (monotonic) and the CPU seconds it had used then."""
        return self._cpu_start

    def finish(self) -> tuple[float | None, float | None]:
        """Stop and return (host GPU mean, task GPU mean). A run that ended before its first
        reading gets one now."""
        with self._lock:
            taken = self._readings
        if not taken:
            self.sample(paused_too=True)
        return self.host_gpu.mean(), self.task_gpu.mean()

    def quiet(self) -> bool:
        """Whether the task holds no GPU this samples and its latest reading found it using
        under ``QUIET_PERCENT`` of a core: it may be read less often meanwhile."""
        if self._host or self._task:
            return False
        percent = self.live["cpu_percent"]
        return percent is not None and percent < QUIET_PERCENT

    def _remember_pids(self) -> set[int] | None:
        try:
            now = self._probe.pids()
        except Exception:  # gone or unreadable: keep what was seen
            return None
        self._seen.update(now)
        return now

    def sample(self, paused_too: bool = False) -> None:
        """One reading (the GPUs not while the task is paused, unless ``paused_too``)."""
        with self._lock:
            pids = self._remember_pids()
            self._live(pids)
            if self._paused() and not paused_too:
                return
            self._readings += 1
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
                self.live["gpu_percent"] = round(min(total / len(self._task), 100.0), 1)

    def _live(self, pids: set[int] | None) -> None:
        """The task's memory (resident, all its processes) and CPU use (percent of one core,
        since the last sample, over the processes seen both times) now: the owner's live view,
        not evidence. None: not measured."""
        if pids is None:
            self.live.update(cpu_percent=None, memory_bytes=None)
            return
        memory, cpu = 0, {}
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    memory += proc.memory_info().rss
                    times = proc.cpu_times()
                cpu[pid] = times.user + times.system
            except (psutil.Error, OSError):
                continue
        at = self._clock.monotonic()
        percent = None
        if self._pid_cpu is not None and at > self._pid_cpu[0]:
            since, before = self._pid_cpu
            used = sum(max(t - before[p], 0.0) for p, t in cpu.items() if p in before)
            percent = task_cpu_percent(used, at - since, self._cores)
        self._pid_cpu = (at, cpu)
        self.live.update(cpu_percent=percent, memory_bytes=memory)


def _read(cpu: Callable[[], float | None] | None) -> float | None:
    if cpu is None:
        return None
    try:
        return cpu()
    except Exception:  # unreadable: not measured
        return None
