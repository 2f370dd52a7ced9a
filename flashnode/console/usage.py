"""The node's CPU, memory and GPU use over the last hour, day and week, for the console's charts,
kept in the state dir so that an agent restart keeps it (``usage.bin``, about 22 kB, 0640 and
group ``flashnode`` like ``status.json``).

It samples from the agent's main loop (it is one of the loop's status sinks: ``tick`` is called
every turn and costs a clock read until the next sample is due), so no thread of its own runs,
browser open or not. A sample is taken every ``STEP`` seconds: CPU is the host's busy share since
the last sample (from its cumulative counters: exact, no first-reading artefact); memory and GPU
are read at the sample. Each figure is a whole percent, or None when it could not be read.

Three rings, each a fixed run of slots in one file: the samples of the last hour, the per-minute
means of the last day, the per-10-minute means of the last week (a mean over the samples that
were measured; None when none was). A sample is one 8-byte record written in place at its slot
(``os.pwrite``, no fsync: a crash loses at most what the page cache held); a minute's or ten
minutes' mean is written once that span has ended, from the samples of the hour ring (so an
agent stopped mid-minute writes that minute's mean after its restart). Each record carries its
time and a check byte: a torn or stale record is simply not shown. A file that is not this one
(another header or size, not a regular file, a symlink, a hard link, another owner) is replaced
by a fresh one, never written through; where none can be made the history is kept in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flashnode import statefile
from flashnode.evidence.sampler import host_cpu_times

log = logging.getLogger(__name__)

T = TypeVar("T")
FILE = "usage.bin"
STEP = 10  # seconds between samples
# (seconds a record covers, records): an hour of samples, a day of minutes, a week of 10 minutes
RINGS = ((STEP, 360), (60, 1440), (600, 1008))
MAGIC = b"FNUSAGE\x01"
HEADER = struct.Struct("<8s7I")  # magic, record size, then (seconds, records) per ring
HEADER_SIZE = 64
RECORD = struct.Struct("<I3BB")  # time // seconds, cpu, memory, gpu, check
NONE = 255  # a figure not measured
MODE = 0o640

CpuCounters = Callable[[], tuple[float, float]]
Reading = Callable[[], float | None]
Point = tuple[int, int | None, int | None, int | None]


def memory_percent() -> float | None:
    import psutil

    try:
        return float(psutil.virtual_memory().percent)
    except (OSError, RuntimeError):
        return None


def file_size() -> int:
    return HEADER_SIZE + RECORD.size * sum(n for _, n in RINGS)


def _header() -> bytes:
    fields = [x for ring in RINGS for x in ring]
    return HEADER.pack(MAGIC, RECORD.size, *fields).ljust(HEADER_SIZE, b"\0")


def _check(index: int, values: bytes) -> int:
    return zlib.crc32(struct.pack("<I", index) + values) & 0xFF


class _Ring:
    """One resolution: ``size`` slots of ``seconds`` each, the slot of time t at
    ``(t // seconds) % size``; in memory as in the file (from ``offset`` on)."""

    def __init__(self, seconds: int, size: int, offset: int) -> None:
        self.seconds, self.size, self.offset = seconds, size, offset
        self.index = array("q", [-1] * size)  # which span each slot holds (time // seconds)
        self.values = bytearray([NONE] * (3 * size))  # cpu, memory, gpu per slot

    def put(self, index: int, values: bytes) -> bytes:
        """Keep ``values`` for span ``index``; the record to write at ``where(index)``."""
        place = index % self.size
        self.index[place] = index
        self.values[3 * place : 3 * place + 3] = values
        return RECORD.pack(index, *values, _check(index, values))

    def where(self, index: int) -> int:
        return self.offset + (index % self.size) * RECORD.size

    def get(self, index: int) -> bytes | None:
        place = index % self.size
        if self.index[place] != index:
            return None
        return bytes(self.values[3 * place : 3 * place + 3])

    def load(self, data: bytes) -> None:
        for place in range(self.size):
            start = self.offset + place * RECORD.size
            index, cpu, memory, gpu, check = RECORD.unpack_from(data, start)
            values = bytes((cpu, memory, gpu))
            if (
                index > 0
                and index % self.size == place
                and check == _check(index, values)
                and all(v <= 100 or v == NONE for v in values)
            ):
                self.index[place] = index
                self.values[3 * place : 3 * place + 3] = values

    def newest(self) -> int:
        return max(self.index)

    def points(self, first: int, last: int) -> list[Point]:
        out = []
        for place in range(self.size):
            index = self.index[place]
            if first <= index <= last:
                figures = _figures(self.values[3 * place : 3 * place + 3])
                out.append((index * self.seconds, *figures))
        out.sort()
        return out


class UsageRing:
    def __init__(
        self,
        cpu: CpuCounters = host_cpu_times,
        memory: Reading = memory_percent,
        gpu: Reading = lambda: None,
        clock: Callable[[], float] = time.time,
        state_dir: Path | None = None,
    ) -> None:
        """``state_dir``: where the history is kept across restarts (None: in memory only)."""
        self._read_cpu, self._read_memory, self._read_gpu = cpu, memory, gpu
        self._clock = clock
        self._lock = threading.Lock()
        offset, self._rings = HEADER_SIZE, []
        for seconds, size in RINGS:
            self._rings.append(_Ring(seconds, size, offset))
            offset += size * RECORD.size
        self._fd = None if state_dir is None else self._open(state_dir / FILE)
        self._write_failed = False
        # Per coarser ring, the span whose mean is still to be written (once it has ended).
        newest = self._rings[0].newest()
        self._pending: list[int | None] = []
        for ring in self._rings[1:]:
            span = newest * STEP // ring.seconds
            self._pending.append(span if newest > 0 and ring.get(span) is None else None)
        self._counters = _safe(self._read_cpu)  # the first sample's CPU is over its interval
        self._due = (self._clock() // STEP + 1) * STEP

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
        index = int(now // STEP)
        self._due = (index + 1) * float(STEP)
        values = bytes(NONE if v is None else max(0, min(100, round(v))) for v in self.now())
        with self._lock:
            fine = self._rings[0]
            self._write(fine.where(index), fine.put(index, values))
            for n, ring in enumerate(self._rings[1:]):
                span = int(now // ring.seconds)
                pending = self._pending[n]
                if pending is not None and pending != span:
                    mean = self._mean(ring.seconds, pending)
                    if mean is not None:
                        self._write(ring.where(pending), ring.put(pending, mean))
                self._pending[n] = span

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

    def series(self, since: float, step: int = STEP) -> list[Point]:
        """Points from ``since`` to now, oldest first, ``step`` seconds apart (one of the
        rings': ``STEP``, 60 or 600): (start, cpu, memory, gpu). A span still under way is
        its samples' mean so far."""
        n = next((n for n, r in enumerate(self._rings) if r.seconds == step), 0)
        ring = self._rings[n]
        now = self._clock()
        first, last = -(-int(since) // ring.seconds), int(now // ring.seconds)
        with self._lock:
            points = ring.points(first, last)
            pending = self._pending[n - 1] if n else None
            if pending is not None and first <= pending <= last and ring.get(pending) is None:
                mean = self._mean(ring.seconds, pending)
                if mean is not None:
                    points.append((pending * ring.seconds, *_figures(mean)))
                    points.sort()
        return points

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---------------------------------------------------------------------------------------------

    def _mean(self, seconds: int, span: int) -> bytes | None:
        """The mean of the samples in span ``span`` of ``seconds`` (None: no sample)."""
        fine = self._rings[0]
        found = [
            v
            for index in range(span * seconds // STEP, (span + 1) * seconds // STEP)
            if (v := fine.get(index)) is not None
        ]
        if not found:
            return None
        out = []
        for i in range(3):
            measured = [v[i] for v in found if v[i] != NONE]
            out.append(round(sum(measured) / len(measured)) if measured else NONE)
        return bytes(out)

    def _write(self, offset: int, record: bytes) -> None:
        if self._fd is None:
            return
        try:
            os.pwrite(self._fd, record, offset)
        except OSError as exc:
            if not self._write_failed:
                log.warning("cannot keep the usage history: %s", exc.strerror or exc)
            self._write_failed = True

    def _open(self, path: Path) -> int | None:
        """The history file, its records loaded; a fresh one in place of anything else there."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = None  # none yet, a symlink (ELOOP), something that cannot be opened
        if fd is not None:
            if self._load(fd):
                return fd
            os.close(fd)
        try:
            statefile.write(path, _header().ljust(file_size(), b"\0"), MODE, statefile.STATUS_GROUP)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            log.warning(
                "the usage history is kept in memory only: cannot write %s (%s)",
                path,
                exc.strerror or exc,
            )
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def _load(self, fd: int) -> bool:
        """Load the records of ``fd`` when it is this agent's history file."""
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_nlink != 1
                or st.st_uid != os.geteuid()
                or st.st_size != file_size()
            ):
                return False
            data = os.pread(fd, file_size(), 0)
            if len(data) != file_size() or data[:HEADER_SIZE] != _header():
                return False
            if stat.S_IMODE(st.st_mode) != MODE:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, MODE)
        except OSError:
            return False
        for ring in self._rings:
            ring.load(data)
        return True


def _figures(values: bytes | bytearray) -> tuple[int | None, int | None, int | None]:
    cpu, memory, gpu = (None if x == NONE else int(x) for x in values)
    return cpu, memory, gpu


def _safe(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except Exception:  # a reading that failed is "not measured", never a broken loop
        return None
