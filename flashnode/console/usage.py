"""The node's CPU, memory and GPU use over the last day, for the console's charts: one sample a
minute, in a ring of a day (about 16 kB).

It samples from the agent's main loop (it is one of the loop's status sinks: ``tick`` is called
every turn and costs a clock read until the next minute is due), so no thread of its own runs,
browser open or not. CPU is the host's busy share over the minute (from its cumulative counters:
exact, no first-reading artefact); memory and GPU are read at the sample. Each figure is a whole
percent, or None when it could not be read.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import TypeVar

from flashnode.evidence.sampler import host_cpu_times

T = TypeVar("T")
MINUTES = 24 * 60
NONE = 255  # a figure not measured

CpuCounters = Callable[[], tuple[float, float]]
Reading = Callable[[], float | None]


def memory_percent() -> float | None:
    import psutil

    try:
        return float(psutil.virtual_memory().percent)
    except (OSError, RuntimeError):
        return None


class UsageRing:
    def __init__(
        self,
        cpu: CpuCounters = host_cpu_times,
        memory: Reading = memory_percent,
        gpu: Reading = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._read_cpu, self._read_memory, self._read_gpu = cpu, memory, gpu
        self._clock = clock
        self._minute = array("q", [-1] * MINUTES)  # which minute each place holds
        self._values = bytearray([NONE] * (3 * MINUTES))  # cpu, memory, gpu per place
        self._counters: tuple[float, float] | None = None
        self._due = 0.0

    # --- a status sink: the loop calls tick every turn ------------------------------------------

    def tick(self) -> None:
        now = self._clock()
        if now >= self._due:
            self.sample(now)

    def status(self, text: str) -> None:
        pass

    def send(self, **fields: str | int) -> None:
        pass

    # ---------------------------------------------------------------------------------------------

    def sample(self, now: float) -> None:
        minute = int(now // 60)
        self._due = (minute + 1) * 60.0
        cpu, memory, gpu = self.now()
        place = minute % MINUTES
        self._minute[place] = minute
        for i, value in enumerate((cpu, memory, gpu)):
            self._values[3 * place + i] = NONE if value is None else max(0, min(100, round(value)))

    def now(self) -> tuple[float | None, float | None, float | None]:
        """CPU (since the last reading), memory and GPU use now, in percent; moves the CPU
        window on."""
        counters = _safe(self._read_cpu)
        cpu = None
        if counters is not None and self._counters is not None:
            busy = counters[0] - self._counters[0]
            total = counters[1] - self._counters[1]
            if total > 0:
                cpu = round(min(max(busy / total * 100.0, 0.0), 100.0), 1)
        if counters is not None:
            self._counters = counters
        return cpu, _safe(self._read_memory), _safe(self._read_gpu)

    def series(self, since: float) -> list[tuple[int, int | None, int | None, int | None]]:
        """Samples from ``since`` on, oldest first: (minute start, cpu, memory, gpu)."""
        first = int(since // 60)
        out = []
        for place in range(MINUTES):
            minute = self._minute[place]
            if minute >= first:
                cpu, memory, gpu = (
                    None if x == NONE else int(x) for x in self._values[3 * place : 3 * place + 3]
                )
                out.append((minute * 60, cpu, memory, gpu))
        out.sort()
        return out


def _safe(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except Exception:  # a reading that failed is "not measured", never a broken loop
        return None
