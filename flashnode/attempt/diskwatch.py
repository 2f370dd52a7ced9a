"""A task's disk: its caps, set when it starts, and how near it is to them between walks.

The caps (``DiskCaps``): a task may hold ``task_disk_bytes`` and ``task_disk_files`` (files and
directories), or what the state dir's disk has free above ``min_free_bytes`` (and the same share
of its inodes) when it starts, less what the tasks running beside it may still write
(``Reserved``), if that is less: tasks never take the owner's disk below the floor the owner
keeps. Everything it wrote counts: out/ and tmp/ as the workspace walk finds
them, plus what its handle measures beyond them (its private temporary directories, files it
removed but keeps open); no single file of it may grow past the byte cap (the runner's
``RLIMIT_FSIZE``). A task past ``task_disk_bytes`` or ``task_disk_files`` has failed: its own
fault, the reason names the cap. A task past a cap that the disk's free space set (less than
those) is stopped all the same, but its lease lapses: the node was short of disk, and a task
within what the node advertises is not at fault (the black-hole guard counts such lapses only
once they span two jobs, as for a job's own endpoints: ``job_endpoint``; and a row of them has
the node's checks run first: ``OutgrewRoom``).

The watch between walks (``DiskWatch``): a walk of a big tree is slow, and a task may write
fast. The disk's free space and inodes are cheap to read, so they are read every ``SPACE_S``,
less often while the task has room for more than a fast writer's burst and its caps are the
owner's, not the disk's room (up to ``QUIET_S``),
and sooner while the disk loses them fast (down to ``SPACE_MIN_S``): whatever the disk lost
since the last walk may have been the task's. Once that is half of what the task may still
write, the task is walked at once, frozen (it cannot write on meanwhile); so is a walk that
would last long enough, at the rate the disk loses space, for the task to write that much.

The watch sees the disk late on a busy machine (its thread waits for a core), and no kernel
limit caps a task's inodes as ``RLIMIT_FSIZE`` caps a file's bytes: a task racing towards a cap
the disk's free inodes set could take the owner's disk past its floor before it is seen. So at
each frozen walk the watch weighs the task's own pace (the files it made since its last walk,
over the time it ran meanwhile) against how late the watch has lately been (``horizon``): a
task left fewer inodes under such a cap than it would make before the watch could look again is
stopped there (``DiskWatch.outrun``), as if past it: the node was short of inodes, its lease
lapses. Only the task's own files set its pace: what others make on the disk is never counted
as the task's (though their load makes the watch later, and so the margin wider). The price: a
task that makes files fast may be stopped up to its pace times the horizon short of its room.
This narrows the race, it does not close it: a task that bursts after a quiet spell, or makes
and removes files so that its count stands still at each walk, on a machine the agent cannot
keep up with, may still go a little past the floor before it is frozen.

A full disk that the task's own files do not explain (a task within its caps cannot have filled
it) is the node's fault: ``full_disk``, a lapse.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

from flashnode.config.settings import Settings
from flashnode.config.sizes import format_size
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    DiskFull,
    NoRoom,
    OutgrewRoom,
    OverBudget,
    ShortOfRoom,
)
from flashnode.sandbox.diskuse import FULL_BELOW_BYTES, Space
from flashnode.sandbox.outputs import Usage

SPACE_S = 0.02  # how often the state dir's free space and inodes are read while a task runs
SPACE_MIN_S = 0.001  # ... at most this often, while they go fast
QUIET_S = 0.5  # ... and at least this often, while the task has room for a fast writer's burst
FAST_BYTES_S = 4 << 30  # a fast writer's pace: bytes a second (into the page cache, on NVMe)
FAST_FILES_S = 250_000  # ... and files and directories made a second
MIN_ROOM_BYTES = 1 << 20  # a task with less room than this on the disk does not start
MIN_ROOM_FILES = 64  # ... nor one with fewer inodes to make its files in
GAP_MAX_S = 0.5  # the longest lateness of the watch a task is stopped for (see horizon)


@dataclass(frozen=True)
class DiskCaps:
    """What one task may hold on the state dir's disk, each with what set it (for reasons)."""

    bytes: int
    files: int
    bytes_by: str = "task_disk_bytes"
    files_by: str = "task_disk_files"


def disk_caps(
    s: Settings, use: Usage, space: Space | None, staged: tuple[int, int] = (0, 0)
) -> DiskCaps:
    """``task_disk_bytes`` and ``task_disk_files``, less what the agent staged for the attempt
    outside the task's files (``staged``: its inputs, bytes and inodes; ``diskbudget.py``), or
    less still: what the workspace holds already (a restored checkpoint) and what the disk has
    free above ``min_free_bytes`` and its share of the inodes. AttemptLapsed when the disk
    leaves the task (next to) no room: the node is short of disk, the task is not at fault."""
    caps = DiskCaps(max(0, s.task_disk_bytes - staged[0]), max(0, s.task_disk_files - staged[1]))
    if space is None:
        return caps
    short = no_room(space, s.min_free_bytes)
    if short:
        raise NoRoom(f"low disk: the state dir has {short}; the task cannot start")
    room = space.free_bytes - s.min_free_bytes
    files = space.free_inodes - space.inode_floor(s.min_free_bytes) if space.total_inodes else None
    if use.disk_bytes + room < caps.bytes:
        by = "what the state dir's disk had free above min_free_bytes when it started"
        caps = dataclasses.replace(caps, bytes=use.disk_bytes + room, bytes_by=by)
    if files is not None and use.disk_files + files < caps.files:
        by = "the inodes the state dir's disk had free above min_free_bytes' share when it started"
        caps = dataclasses.replace(caps, files=use.disk_files + files, files_by=by)
    return caps


class Reserved:
    """What the attempts running now hold and may still write on the state dir's disk: each
    task's caps less what it held at its last walk, and what the agent staged for each attempt
    before its task started (``stage``: inputs, a restored checkpoint), which counts toward that
    attempt's caps. A task that starts gets its caps from the room the others leave (``start``),
    a write staged for an attempt is refused past its caps or past that room (``stage``), and the
    node claims only while that room is enough for a task (the ``disk`` hold): attempts side by
    side never together take the disk below ``min_free_bytes``. One per agent, shared by its
    attempts (``AttemptContext.reserved``), under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[str, tuple[DiskCaps, int, int]] = {}  # caps, bytes and files held
        self._staged: dict[str, tuple[int, int]] = {}  # bytes and inodes staged outside them

    def start(self, key: str, s: Settings, use: Usage, space: Space | None) -> DiskCaps:
        """The caps of the task ``key`` starts with (``disk_caps`` on the room the running
        tasks leave, less what was staged for it), reserved until ``end``."""
        with self._lock:
            caps = disk_caps(s, use, self._left(space), self._staged.get(key, (0, 0)))
            self._tasks[key] = (caps, use.disk_bytes, use.disk_files)
            return caps

    def stage(
        self, key: str, s: Settings, space: Space | None, nbytes: int, inodes: int, what: str
    ) -> None:
        """Count ``nbytes`` and ``inodes`` that the agent is about to write for attempt ``key``
        before its task starts. OverBudget when they take what was staged for it past
        ``task_disk_bytes`` or ``task_disk_files`` (the job's); ShortOfRoom when the disk has
        not that much above ``min_free_bytes`` and its share of the inodes, less what the
        running tasks may still write (the node's, now)."""
        with self._lock:
            held_bytes, held_inodes = self._staged.get(key, (0, 0))
            total_bytes, total_inodes = held_bytes + nbytes, held_inodes + inodes
            if total_bytes > s.task_disk_bytes:
                raise OverBudget(
                    f"{what} would take what the attempt holds on disk to"
                    f" {format_size(total_bytes)}, past task_disk_bytes"
                    f" ({format_size(s.task_disk_bytes)})"
                )
            if total_inodes > s.task_disk_files:
                raise OverBudget(
                    f"{what} would take what the attempt holds on disk to {total_inodes} files"
                    f" and directories, past task_disk_files ({s.task_disk_files})"
                )
            self._room(s, space, nbytes, inodes, what, (total_bytes, total_inodes))
            self._staged[key] = (total_bytes, total_inodes)

    def room(self, s: Settings, space: Space | None, nbytes: int, inodes: int, what: str) -> None:
        """ShortOfRoom when the disk has not ``nbytes`` and ``inodes`` above ``min_free_bytes``
        and its share of the inodes, less what the running tasks may still write: for what
        the agent writes outside any attempt's workspace (a dataset slice into its cache)."""
        with self._lock:
            self._room(s, space, nbytes, inodes, what, (nbytes, inodes))

    def _room(
        self,
        s: Settings,
        space: Space | None,
        nbytes: int,
        inodes: int,
        what: str,
        needed: tuple[int, int],
    ) -> None:
        left = self._left(space)
        if left is None:
            return
        beside = " (what the running tasks may still write set aside)" if self._tasks else ""
        bytes_fit, inodes_fit, room, files = left.fits(s.min_free_bytes, nbytes, inodes)
        if not bytes_fit:
            raise ShortOfRoom(
                f"low disk: {what} does not fit: {format_size(nbytes)} more would take"
                f" the state dir's disk below min_free_bytes"
                f" ({format_size(max(0, room))} above it{beside})",
                needed=needed,
            )
        if not inodes_fit:
            raise ShortOfRoom(
                f"low disk: {what} does not fit: {inodes} more files and directories"
                " would take the state dir's disk below min_free_bytes' share of its"
                f" inodes ({max(0, files)} above it{beside})",
                needed=needed,
            )

    def unstage(self, key: str, nbytes: int, inodes: int) -> None:
        """What was staged for attempt ``key`` and is no longer on disk outside its task's files
        (removed, or moved under out/ where the task's walk counts it)."""
        with self._lock:
            if key in self._staged:
                b, f = self._staged[key]
                self._staged[key] = (max(0, b - nbytes), max(0, f - inodes))

    def staged(self, key: str) -> tuple[int, int]:
        """The bytes and inodes staged for attempt ``key`` and still counted."""
        with self._lock:
            return self._staged.get(key, (0, 0))

    def held(self, key: str, disk_bytes: int, disk_files: int) -> None:
        """What the task ``key`` held at its latest walk."""
        with self._lock:
            if key in self._tasks:
                self._tasks[key] = (self._tasks[key][0], disk_bytes, disk_files)

    def end(self, key: str) -> None:
        with self._lock:
            self._tasks.pop(key, None)
            self._staged.pop(key, None)

    def left(self, space: Space | None) -> Space | None:
        """The disk as a task that starts now has it: what the running tasks may still write
        taken off its free space and inodes."""
        with self._lock:
            return self._left(space)

    def _left(self, space: Space | None) -> Space | None:
        if space is None or not self._tasks:
            return space
        taken = sum(max(0, caps.bytes - b) for caps, b, _ in self._tasks.values())
        files = sum(max(0, caps.files - f) for caps, _, f in self._tasks.values())
        return dataclasses.replace(
            space,
            free_bytes=max(0, space.free_bytes - taken),
            free_inodes=max(0, space.free_inodes - files) if space.total_inodes else 0,
        )


def no_room(space: Space, min_free_bytes: int) -> str | None:
    """What leaves a task too little room to start (less than ``MIN_ROOM_BYTES`` above
    ``min_free_bytes``, or fewer than ``MIN_ROOM_FILES`` inodes above their share), in the
    owner's words; None when a task has room. The node claims nothing meanwhile."""
    short = space.short(min_free_bytes)
    if short:
        return short
    room = space.free_bytes - min_free_bytes
    if room < MIN_ROOM_BYTES:
        return (
            f"{space.free_bytes >> 10} KiB free, less than {MIN_ROOM_BYTES >> 10} KiB above"
            f" min_free_bytes ({min_free_bytes >> 20} MiB): no room for a task"
        )
    if space.total_inodes:
        files = space.free_inodes - space.inode_floor(min_free_bytes)
        if files < MIN_ROOM_FILES:
            return (
                f"{space.free_inodes} inodes free (files and directories), fewer than"
                f" {MIN_ROOM_FILES} above min_free_bytes' share of them: no room for a task"
            )
    return None


def over_caps(
    usage: Usage, held: int, s: Settings, caps: DiskCaps, then: str = ""
) -> AttemptFailed | AttemptLapsed | None:
    """The ending of a task whose files are past a cap (``held``: what its handle measured
    beyond its workspace), in the owner's words (``then`` added: what was done to it); None
    within them all. Past a cap the disk's free space set: a lapse, the node's shortage."""
    if usage.output_bytes > s.max_output_total_bytes:
        return AttemptFailed(f"outputs grew past {s.max_output_total_bytes} bytes{then}")
    if usage.output_files > s.max_output_files:
        return AttemptFailed(
            f"outputs grew past {s.max_output_files} files (max_output_files){then}"
        )
    if usage.disk_bytes + held > caps.bytes:
        if caps.bytes_by != DiskCaps.bytes_by:
            return _short(
                f"{format_size(caps.bytes)} free above min_free_bytes",
                f"task_disk_bytes, {format_size(s.task_disk_bytes)}",
                then,
            )
        return AttemptFailed(
            f"the task's files grew past {format_size(caps.bytes)} ({caps.bytes_by}:"
            f" out/, tmp/ and its private temporary directories){then}"
        )
    if usage.disk_files > caps.files:
        if caps.files_by != DiskCaps.files_by:
            return _short(
                f"{caps.files} inodes free above min_free_bytes' share",
                f"task_disk_files, {s.task_disk_files}",
                then,
            )
        return AttemptFailed(
            f"the task's files and directories grew past {caps.files} ({caps.files_by}:"
            f" out/ and tmp/){then}"
        )
    return None


def _short(had: str, cap: str, then: str, grew: str = "grew past that") -> AttemptLapsed:
    """A task stopped at a cap the disk's free space set: the node's lack of disk. It may as
    well be the job's doing (it writes much): counted like a job's endpoint, across jobs."""
    return OutgrewRoom(
        f"the state dir's disk had only {had} when the task started (less than {cap}), and"
        f" the task's files {grew}{then}"
    )


def full_disk(space: Space | None) -> DiskFull | None:
    """The ending of an attempt whose state dir has (almost) no space or inodes left, else
    None."""
    if space is None or not space.full():
        return None
    if space.free_bytes < FULL_BELOW_BYTES:
        return DiskFull(f"disk full ({space.free_bytes >> 10} KiB free in the state dir)")
    return DiskFull(f"disk full ({space.free_inodes} inodes free in the state dir)")


@dataclass(frozen=True)
class Look:
    """The disk, and the task's use of it, at one walk."""

    space: Space
    bytes: int  # the task's, what its handle holds beyond the workspace included
    files: int


class DiskWatch:
    """The disk between walks of the task's files (see the module docstring). Inactive (no
    sample is suspect, none is asked for sooner than ``SPACE_S``) while the disk is unknown."""

    def __init__(self, caps: DiskCaps, first: Look | None, since: float = 0.0) -> None:
        """``first``: the task's use and the disk when it started, at ``since``."""
        self.caps = caps
        self.last = first  # the last walk
        self._prev: tuple[float, Space] | None = None  # the last reading of the disk
        self._rate = (0.0, 0.0)  # bytes and inodes the disk lost per second, lately
        self._walk_s = 0.0  # how long the last walk took
        self._gap = 0.0  # the longest time between two readings of the disk, lately
        self._ran_from = since  # since when the task has run unwatched: its last count

    def walked(
        self, look: Look, started: float, ended: float, after: Space | None, frozen: bool
    ) -> None:
        """A walk from ``started`` to ``ended``: the task's use and the disk read first
        (``look``), the disk read again at its end (``after``); ``frozen``: the task made
        nothing meanwhile (frozen for the walk, or suspended by the owner's controls)."""
        self.last, self._walk_s = look, ended - started
        self._prev = (ended, after or look.space)
        self._ran_from = ended if frozen else started

    def sample(self, now: float, space: Space | None) -> bool:
        """A reading of the disk; whether the task must be walked at once, frozen: the disk is
        full, or it lost half of what the task may still write since the last walk."""
        prev, last = self._prev, self.last
        if space is None or last is None:
            return False
        self._prev = (now, space)
        if prev is not None and now > prev[0]:
            seconds = now - prev[0]
            self._gap = max(min(seconds, GAP_MAX_S), self._gap / 2)
            lost = _lost(prev[1], space)
            self._rate = (
                max(lost[0] / seconds, self._rate[0] / 2),
                max(lost[1] / seconds, self._rate[1] / 2),
            )
        if space.full():
            return True
        lost, room = _lost(last.space, space), self._room(last, space)
        return any(gone * 2 > whole for gone, whole in zip(lost, room, strict=True))

    def horizon(self) -> float:
        """Seconds the watch may take to see the disk again and freeze the task: twice the
        longest gap between its readings lately (one stall counts for at most ``GAP_MAX_S``,
        and less with every reading after it), at least twice ``SPACE_S``."""
        return 2 * max(SPACE_S, self._gap)

    def outrun(self, look: Look, started: float, s: Settings, then: str) -> AttemptLapsed | None:
        """The ending of a task whose walk (``look``, frozen, from ``started``) left it fewer
        inodes under a cap the disk's free inodes set than it would make, at its own pace since
        its last walk (over at least ``SPACE_S``), before the watch could stop it (``horizon``):
        stopped now, as if past that cap. None otherwise; for the cap the owner set (a task is
        blamed only past it); and for bytes, whose floor (``min_free_bytes``) is wide and which
        the kernel caps file by file (``RLIMIT_FSIZE``): a task that writes fast up to just below
        its room goes on."""
        last, ran = self.last, started - self._ran_from
        if self.caps.files_by == DiskCaps.files_by or last is None or ran <= 0:
            return None
        # Over a few milliseconds a file or two would read as thousands a second.
        pace, soon = (look.files - last.files) / max(ran, SPACE_S), self.horizon()
        left = self.caps.files - look.files
        if left >= pace * soon:
            return None
        return _short(
            f"{self.caps.files} inodes free above min_free_bytes' share",
            f"task_disk_files, {s.task_disk_files}",
            then,
            f"were about to grow past that ({max(0, left)} inodes left; it made {pace:.0f} a"
            f" second, more than that in the {soon * 1000:.0f} ms the watch may take to stop it)",
        )

    def next_in(self, space: Space | None) -> float:
        """Seconds until the next reading: up to ``QUIET_S`` while the task's caps are the
        owner's (not the disk's room above its floor) and what it may still write is more
        than a fast writer (``FAST_BYTES_S``, ``FAST_FILES_S``) makes in four times that (a
        burst right after a reading is seen before it takes half of it), else ``SPACE_S``;
        sooner while the disk loses what the task may still write fast (half of it by then,
        at the present rate). A task that sleeps costs the agent two readings a second, not
        fifty. (A task that reserves blocks without writing them, ``fallocate``, goes faster
        than any writer: the pace bounds how long it may hold the disk past its caps before
        it is stopped, not whether it can.)"""
        last = self.last
        if space is None or last is None:
            return SPACE_S
        left = self._left(last, space)
        soon = SPACE_S
        if self.caps.bytes_by == DiskCaps.bytes_by and self.caps.files_by == DiskCaps.files_by:
            burst = min(left[0] / FAST_BYTES_S, left[1] / FAST_FILES_S) / 4
            soon = min(QUIET_S, max(SPACE_S, burst))
        for room, rate in zip(left, self._rate, strict=True):
            if rate > 0:
                soon = min(soon, max(SPACE_MIN_S, room / rate / 2))
        return soon

    def risky(self, space: Space | None) -> bool:
        """Whether a walk as long as the last one would give the task, at the rate the disk
        loses space, the time to write half of what it may still write: then it is frozen."""
        last = self.last
        if space is None or last is None:
            return False
        left = self._left(last, space)
        return any(
            rate * self._walk_s * 2 > room for rate, room in zip(self._rate, left, strict=True)
        )

    def _room(self, last: Look, space: Space) -> tuple[float, float]:
        """What the task could still write at the ``last`` walk (inodes: unlimited where the
        disk has no fixed number of them)."""
        files = self.caps.files - last.files if space.total_inodes else math.inf
        return self.caps.bytes - last.bytes, files

    def _left(self, last: Look, space: Space) -> tuple[float, float]:
        """What the task may still write now, were everything the disk lost since the ``last``
        walk its own."""
        room, lost = self._room(last, space), _lost(last.space, space)
        return room[0] - lost[0], room[1] - lost[1]


def _lost(before: Space, after: Space) -> tuple[int, int]:
    """The bytes and inodes the disk lost from ``before`` to ``after``."""
    return before.free_bytes - after.free_bytes, before.free_inodes - after.free_inodes
