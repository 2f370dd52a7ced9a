"""The ledger as the console shows it: totals (today and all time), tasks per hour, and the
latest attempts, read incrementally.

Nothing is read until a browser asks; then only what was appended since the last look (the
file's offset is kept; a torn last line waits for its end). All time totals are sums kept as the
lines go by, so a long ledger costs its reading once, and memory stays bounded: the latest
``RECENT`` attempts and the finish times of the last day.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from flashnode.status import describe_facts

RECENT = 500
DAY = 86400.0
CHUNK = 1 << 20


def number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return float(value)
    return None


@dataclass(frozen=True)
class Given:
    """What one attempt gave, in the few numbers the totals need (a day of them is kept)."""

    ended: float | None
    outcome: str
    cpu_hours: float  # core-hours of the task's own CPU use
    gpu_hours: float  # GPU-hours of the task's own GPU use

    @classmethod
    def of(cls, record: dict[str, Any]) -> Given:
        cpu, gpu, wall = usage(record)
        gpus = record.get("gpus")
        count = len(gpus) if isinstance(gpus, list) and gpus else 1
        return cls(
            number(record.get("ended_at")),
            str(record.get("outcome") or "-"),
            cpu / 100.0 * wall / 3600.0 if cpu is not None and wall is not None else 0.0,
            gpu / 100.0 * wall / 3600.0 * count if gpu is not None and wall is not None else 0.0,
        )


@dataclass
class Totals:
    tasks: int = 0  # committed
    outcomes: dict[str, int] = field(default_factory=dict)
    cpu_hours: float = 0.0
    gpu_hours: float = 0.0

    def add(self, given: Given) -> None:
        self.outcomes[given.outcome] = self.outcomes.get(given.outcome, 0) + 1
        if given.outcome == "committed":
            self.tasks += 1
        self.cpu_hours += given.cpu_hours
        self.gpu_hours += given.gpu_hours

    def view(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "outcomes": dict(self.outcomes),
            "cpu_hours": round(self.cpu_hours, 3),
            "gpu_hours": round(self.gpu_hours, 3),
        }


def usage(record: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """(the task's CPU % of one core, its GPU %, the run's wall seconds) of a ledger line."""
    task = record.get("task_usage")
    evidence = record.get("evidence")
    task = task if isinstance(task, dict) else {}
    evidence = evidence if isinstance(evidence, dict) else {}
    return (
        number(task.get("cpu_percent_mean")),
        number(task.get("gpu_util_percent_mean")),
        number(evidence.get("wall_seconds")),
    )


class LedgerView:
    def __init__(self, path: Path, clock: Any = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)  # brief, newest last
        self.all_time = Totals()
        self._day: deque[Given] = deque()  # what the last day's attempts gave

    def refresh(self) -> None:
        """Read what was appended since the last call (from the start after a rotation)."""
        with self._lock:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                st = os.fstat(fd)
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._reset(st.st_ino)
                os.lseek(fd, self._offset, os.SEEK_SET)
                while chunk := os.read(fd, CHUNK):
                    self._offset += len(chunk)
                    self._lines(chunk)
            finally:
                os.close(fd)
            cutoff = self._clock() - DAY
            while self._day and (self._day[0].ended or 0.0) < cutoff:
                self._day.popleft()

    def _reset(self, inode: int) -> None:
        self._inode, self._offset, self._partial = inode, 0, b""
        self.recent.clear()
        self._day.clear()
        self.all_time = Totals()

    def _lines(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        cutoff = self._clock() - DAY
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            given = Given.of(record)
            self.all_time.add(given)
            self.recent.append(brief(record))
            if given.ended is not None and given.ended >= cutoff:
                self._day.append(given)

    # --- views ----------------------------------------------------------------------------------

    def totals(self) -> dict[str, Any]:
        """All time and today (local midnight on), as the owner counts: tasks committed, every
        outcome, CPU-hours and GPU-hours given."""
        self.refresh()
        midnight = datetime.fromtimestamp(self._clock()).replace(
            hour=0, minute=0, second=0, microsecond=0
        )
        today = Totals()
        with self._lock:
            for given in self._day:
                if (given.ended or 0.0) >= midnight.timestamp():
                    today.add(given)
            return {"all_time": self.all_time.view(), "today": today.view()}

    def per_bin(self, since: float, bin_seconds: int) -> list[tuple[int, int]]:
        """Committed tasks per ``bin_seconds`` from ``since`` on: (bin start, count), every bin
        listed (zeros included)."""
        self.refresh()
        start = int(since // bin_seconds) * bin_seconds
        end = self._clock()
        counts = {b: 0 for b in range(start, int(end) + 1, bin_seconds)}
        with self._lock:
            for given in self._day:
                ended = given.ended or 0.0
                if ended >= start and given.outcome == "committed":
                    b = int(ended // bin_seconds) * bin_seconds
                    if b in counts:
                        counts[b] += 1
        return sorted(counts.items())

    def latest(self, outcome: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The latest attempts (``brief``), newest first, optionally of one outcome."""
        self.refresh()
        with self._lock:
            found = [r for r in reversed(self.recent) if outcome in (None, r.get("outcome"))]
        return found[:limit]


BRIEF_TEXT = 2000


def brief(record: dict[str, Any]) -> dict[str, Any]:
    """What the history shows of a ledger line (the rest stays in the ledger)."""
    cpu, gpu, wall = usage(record)
    reason = record.get("reason")
    return {
        "lease_id": record.get("lease_id"),
        "job_id": record.get("job_id"),
        "task_id": record.get("task_id"),
        "outcome": record.get("outcome"),
        "reason": reason[:BRIEF_TEXT] if isinstance(reason, str) else None,
        "ended_at": number(record.get("ended_at")),
        "wall_seconds": wall,
        "cpu_percent": cpu,
        "gpu_percent": gpu,
        "checkpoints": number(record.get("checkpoints_shipped")),
        "facts": describe_facts(record)[:BRIEF_TEXT],
    }
