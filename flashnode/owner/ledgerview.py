"""What the node gave, from the ledger: totals (today and all time), tasks per hour, and the
latest attempts, read incrementally. One implementation for ``flashnode status`` (the agent
publishes the totals in ``status.json``), the console, and ``flashnode status`` of an agent that
is gone.

Nothing is read until someone asks; then only what was appended since the last look (the file's
offset is kept; a torn last line waits for its end). All time totals are sums kept as the lines go
by, and memory stays bounded: the latest ``RECENT`` attempts, what the last day's gave (summed
per minute, so a day of a thousand short tasks a minute costs what a day of a few does), and the
tasks committed per hour over the last week. The agent keeps those sums in a checkpoint
(``<state dir>/ledger-totals.json``: the offset they cover and the ledger's inode), so a start
reads only what was appended since, and the latest attempts from the ledger's end. A ledger
rotated (``ledger.rotated``) is read on into the rotated file's rest, the sums kept; one replaced
by another file is read from its start, the sums from nothing. A start with no checkpoint that
covers the ledger (none, or one it cannot read: a member of the group) sums the rotated one too.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from flashnode import statefile
from flashnode.owner.ledger import parse, rotated, tail, tail_lines
from flashnode.owner.status import describe_facts

CHECKPOINT_FILE = "ledger-totals.json"
SAVE_EVERY_S = 30.0
RECENT = 500
MINUTE = 60
DAY = 86400.0
WEEK = 7 * DAY
HOUR = 3600
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

    @classmethod
    def of(cls, data: Any) -> Totals:
        """From a checkpoint; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("not totals")
        outcomes = data.get("outcomes")
        if not isinstance(outcomes, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in outcomes.items()
        ):
            raise ValueError("not totals")
        tasks, cpu, gpu = (
            data.get("tasks"),
            number(data.get("cpu_hours")),
            number(data.get("gpu_hours")),
        )
        if not isinstance(tasks, int) or cpu is None or gpu is None:
            raise ValueError("not totals")
        return cls(tasks, dict(outcomes), cpu, gpu)

    def add(self, given: Given) -> None:
        self.outcomes[given.outcome] = self.outcomes.get(given.outcome, 0) + 1
        if given.outcome == "committed":
            self.tasks += 1
        self.cpu_hours += given.cpu_hours
        self.gpu_hours += given.gpu_hours

    def merge(self, other: Totals) -> None:
        for outcome, n in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n
        self.tasks += other.tasks
        self.cpu_hours += other.cpu_hours
        self.gpu_hours += other.gpu_hours

    def view(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "outcomes": dict(self.outcomes),
            "cpu_hours": round(self.cpu_hours, 6),  # 3.6 ms: short work reads as seconds
            "gpu_hours": round(self.gpu_hours, 6),
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
    def __init__(
        self,
        path: Path,
        clock: Any = time.time,
        checkpoint: Path | None = None,
        persist: bool = True,
    ) -> None:
        """``checkpoint``: where the sums are kept between starts (None: in memory only);
        ``persist`` False: only read from it (a command beside the agent)."""
        self.path = path
        self._clock = clock
        self._checkpoint = checkpoint
        self._persist = persist
        self._lock = threading.Lock()
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        self._loaded = False
        self._saved_offset = -1
        self._saved_at = 0.0
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)  # brief, newest last
        self.all_time = Totals()
        self._day: dict[int, Totals] = {}  # what the last day's attempts gave, per minute
        self._hours: dict[int, int] = {}  # tasks committed per hour (its start), the last week's

    def refresh(self) -> None:
        """Read what was appended since the last call (into a rotated ledger's rest first)."""
        with self._lock:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                st = os.fstat(fd)
                if not self._loaded:
                    self._loaded = True
                    if not self._resume(fd, st):
                        self._from_rotated(st)
                if st.st_ino != self._inode:
                    if not self._rotated(st.st_ino):
                        self._reset(st.st_ino)
                elif st.st_size < self._offset:
                    self._reset(st.st_ino)
                for chunk in _appended(fd, self._offset, st.st_size):
                    self._offset += len(chunk)
                    self._lines(chunk)
            finally:
                os.close(fd)
            cutoff = self._clock() - DAY
            for minute in [m for m in self._day if m + MINUTE <= cutoff]:
                del self._day[minute]
            for hour in [h for h in self._hours if h < cutoff - WEEK]:
                del self._hours[hour]
            if (
                self._offset != self._saved_offset
                and self._clock() - self._saved_at >= SAVE_EVERY_S
            ):
                self._save()

    def save(self) -> None:
        """Keep the sums now (the agent, as it stops)."""
        self.refresh()
        with self._lock:
            if self._offset != self._saved_offset:
                self._save()

    def _save(self) -> None:
        """The checkpoint: the sums as of the last whole line read (a torn line's start is not
        covered: it is read again)."""
        if self._checkpoint is None or self._inode is None or not self._persist:
            return
        data = {
            "version": 2,
            "inode": self._inode,
            "offset": self._offset - len(self._partial),
            "all_time": asdict(self.all_time),
            "minutes": [[m, asdict(t)] for m, t in sorted(self._day.items())],
            "hours": sorted(self._hours.items()),
        }
        try:
            statefile.write(self._checkpoint, json.dumps(data).encode())
        except OSError:
            return  # kept in memory; the next start reads the ledger again
        self._saved_offset, self._saved_at = self._offset, self._clock()

    def _resume(self, fd: int, st: os.stat_result) -> bool:
        """Start from the checkpoint when it covers this very ledger (or the one rotated before
        it); the latest attempts from the ledger's end (and the rotated one's). Whether it
        did."""
        if self._checkpoint is None:
            return False
        try:
            data = json.loads(self._checkpoint.read_bytes())
            inode, offset = data["inode"], data["offset"]
            version = data.get("version")
            if version not in (1, 2) or offset < 0 or not _covers(self.path, st, inode, offset):
                return False
            totals = Totals.of(data["all_time"])
            day: dict[int, Totals] = {}
            if version == 1:  # one entry per attempt (an older agent's): summed per minute
                for e, o, c, g in data["day"]:
                    _add_minute(day, Given(number(e), str(o), float(c), float(g)))
            else:
                day = {int(m): Totals.of(t) for m, t in data["minutes"]}
            hours = {int(h): int(n) for h, n in data.get("hours", [])}
        except (OSError, ValueError, KeyError, TypeError):
            return False
        self._inode, self._offset, self.all_time = inode, offset, totals
        self._day.update(day)
        if "hours" not in data:  # a checkpoint from before the week was kept: the last day's
            for minute, given in day.items():
                hour = minute // HOUR * HOUR
                self._hours[hour] = self._hours.get(hour, 0) + given.tasks
        self._hours.update(hours)
        self._saved_offset = offset
        if inode == st.st_ino:
            lines = tail_lines(fd, offset, RECENT)
            if len(lines) < RECENT:
                lines = tail(rotated(self.path), RECENT - len(lines)) + lines
        else:  # the rotated ledger's: its rest is read next, and what follows
            lines = tail(rotated(self.path), RECENT, offset)
        for record in parse(lines):
            self.recent.append(brief(record))
        return True

    def _from_rotated(self, st: os.stat_result) -> None:
        """With no checkpoint to start from: the sums of the rotated ledger too (read first),
        not only of the one that follows it."""
        try:
            before = os.stat(rotated(self.path), follow_symlinks=False)
        except OSError:
            return
        if stat.S_ISREG(before.st_mode) and before.st_ino != st.st_ino:
            self._inode, self._offset = before.st_ino, 0

    def _rotated(self, inode: int) -> bool:
        """Whether the ledger read so far is the rotated one: then its rest is read, and the
        new one (``inode``) is read on from its start, the sums kept."""
        try:
            fd = os.open(rotated(self.path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if st.st_ino != self._inode or st.st_size < self._offset:
                return False
            for chunk in _appended(fd, self._offset, st.st_size):
                self._lines(chunk)
        finally:
            os.close(fd)
        self._inode, self._offset, self._partial = inode, 0, b""  # its lines are whole
        return True

    def _reset(self, inode: int) -> None:
        self._inode, self._offset, self._partial = inode, 0, b""
        self.recent.clear()
        self._day.clear()
        self._hours.clear()
        self.all_time = Totals()

    def _lines(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        cutoff = self._clock() - DAY
        for record in parse(lines):
            given = Given.of(record)
            self.all_time.add(given)
            self.recent.append(brief(record))
            if given.ended is not None and given.ended >= cutoff:
                _add_minute(self._day, given)
            if given.ended is not None and given.ended >= cutoff + DAY - WEEK:
                self._count_hour(given)

    def _count_hour(self, given: Given) -> None:
        if given.outcome == "committed" and given.ended is not None:
            hour = int(given.ended // HOUR) * HOUR
            self._hours[hour] = self._hours.get(hour, 0) + 1

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
            for minute, given in self._day.items():
                if minute >= midnight.timestamp():  # midnight starts a minute
                    today.merge(given)
            return {"all_time": self.all_time.view(), "today": today.view()}

    def per_bin(self, since: float, bin_seconds: int) -> list[tuple[int, int]]:
        """Committed tasks per ``bin_seconds`` from ``since`` on: (bin start, count), every bin
        listed (zeros included). Bins of whole hours reach back a week; shorter ones a day (each
        attempt counted in the bin of the minute it ended in)."""
        self.refresh()
        start = int(since // bin_seconds) * bin_seconds
        end = self._clock()
        counts = {b: 0 for b in range(start, int(end) + 1, bin_seconds)}
        with self._lock:
            if bin_seconds % HOUR == 0:
                for hour, n in self._hours.items():
                    b = hour // bin_seconds * bin_seconds
                    if b in counts:
                        counts[b] += n
                return sorted(counts.items())
            for minute, given in self._day.items():
                b = minute // bin_seconds * bin_seconds
                if minute >= start and b in counts:
                    counts[b] += given.tasks
        return sorted(counts.items())

    def latest(self, outcome: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The latest attempts (``brief``), newest first, optionally of one outcome."""
        self.refresh()
        with self._lock:
            found = [r for r in reversed(self.recent) if outcome in (None, r.get("outcome"))]
        return found[:limit]


def _appended(fd: int, offset: int, size: int) -> Iterator[bytes]:
    """The bytes of ``fd`` from ``offset`` to ``size`` (its size when it was looked at: what is
    appended later is read by the next refresh), in pieces of at most ``CHUNK``, each read asking
    for no more than is there. A read of ``CHUNK`` where a few lines were appended, polled every
    few seconds by the status and the console, made glibc hand out and take back a 1 MiB block
    each time, and the heap it came from kept growing in steps of about 1 MB (issue 44)."""
    os.lseek(fd, offset, os.SEEK_SET)
    while offset < size:
        chunk = os.read(fd, min(CHUNK, size - offset))
        if not chunk:
            return  # shorter than it was: a ledger replaced meanwhile is seen by its inode
        offset += len(chunk)
        yield chunk


def _covers(path: Path, st: os.stat_result, inode: object, offset: int) -> bool:
    """Whether a checkpoint of (``inode``, ``offset``) is of this ledger (``st``) or of the one
    rotated before it (its rest is read first)."""
    if inode == st.st_ino:
        return offset <= st.st_size
    try:
        before = os.stat(rotated(path), follow_symlinks=False)
    except OSError:
        return False
    return inode == before.st_ino and offset <= before.st_size


def _add_minute(day: dict[int, Totals], given: Given) -> None:
    """Count ``given`` in the sums of the minute it ended in."""
    minute = int((given.ended or 0.0) // MINUTE) * MINUTE
    found = day.get(minute)
    if found is None:
        found = day[minute] = Totals()
    found.add(given)


BRIEF_TEXT = 2000


def brief(record: dict[str, Any]) -> dict[str, Any]:
    """What the history shows of a ledger line (the rest stays in the ledger)."""
    cpu, gpu, wall = usage(record)
    reason = record.get("reason")
    return {
        "lease_id": record.get("lease_id"),
        "job_id": record.get("job_id"),
        "task_id": record.get("task_id"),
        "pool": record.get("pool"),
        "outcome": record.get("outcome"),
        "reason": reason[:BRIEF_TEXT] if isinstance(reason, str) else None,
        "ended_at": number(record.get("ended_at")),
        "wall_seconds": wall,
        "cpu_percent": cpu,
        "gpu_percent": gpu,
        "checkpoints": number(record.get("checkpoints_shipped")),
        "checkpoint_step": number(record.get("checkpoint_step")),
        "metrics_step": number(record.get("metrics_step")),
        "facts": describe_facts(record)[:BRIEF_TEXT],
    }
