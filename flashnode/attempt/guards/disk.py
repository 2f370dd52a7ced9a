"""The task's disk while it runs (``attempt/diskwatch.py`` says how near it is to its caps): its
files walked every ``WATCH_S``, less often when a walk is slow (a tree of many files), so that
walking never takes more than ``1/WATCH_COST`` of the agent's time, and less often while they
stay as they were (up to ``QUIET_WALK_S``: a task that sleeps); between walks the disk's
free space and inodes, and a walk at once, the task frozen meanwhile, when the disk lost half
of what the task may still write. A task past a cap is killed at once (writing on would take
more); a full disk the task's own files do not explain is the node's fault (``DiskFull``: the
lease lapses) and the task is stopped as soon as it is seen."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from flashnode.attempt.diskwatch import DiskWatch, Look, full_disk, over_caps
from flashnode.attempt.guards.base import Action, End, Running
from flashnode.attempt.guards.lease import LOST_GRACE_S
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.runners.base import SuspendFailed

if TYPE_CHECKING:
    from flashnode.clock import Clock
    from flashnode.config.settings import Settings
    from flashnode.sandbox.diskuse import Space
    from flashnode.sandbox.outputs import Usage

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the task's files are walked
WATCH_COST = 20  # ... or at most 1/WATCH_COST of the time: the next watch waits that many walks
QUIET_WALK_S = 8.0  # ... or, while its files stay as they were, twice as long each time up to this


class DiskGuard:
    def __init__(
        self,
        watch: DiskWatch,
        settings: Settings,
        clock: Clock,
        space: Callable[[], Space | None],
        usage: Callable[[], Usage],
        held: Callable[[int, int], None],
        started: float,
        can_freeze: bool = True,
    ) -> None:
        """``space``: the state dir's disk now; ``usage``: a walk of the task's files; ``held``:
        told what the task holds (bytes, files) after each walk (the other tasks' room);
        ``started``: when the task started (monotonic); ``can_freeze``: its runner can pause it
        (else a walk runs with the task running)."""
        self.watch, self.s, self.clock = watch, settings, clock
        self.can_freeze = can_freeze
        self.space, self.usage, self.held = space, usage, held
        self.next_walk = started + WATCH_S
        self.next_space = started
        self.walk_every = WATCH_S
        self._held: tuple[int, int] | None = None  # what the task held at its last walk

    def turn(self, now: float, task: Running) -> Action | None:
        if now >= self.next_space:
            space = self.space()
            if self.watch.sample(now, space):
                looked = self._look(task, frozen=True)
                if looked is not None:
                    return looked
                space = self.watch.last.space if self.watch.last else space
            self.next_space = self.clock.monotonic() + self.watch.next_in(space)
        if now >= self.next_walk:
            return self._look(task, frozen=self.watch.risky(self.space()))
        return None

    def next_at(self, task: Running) -> float:
        return min(self.next_walk, self.next_space) if self.watch.last else self.next_walk

    def _look(self, task: Running, frozen: bool) -> End | None:
        """Walk the task's files (frozen meanwhile, where it can be and is not paused already)
        and read the disk; the ending when a cap is passed (the task is killed: it must not
        write on) or the disk is full and the task's files do not explain it."""
        handle, s = task.handle, self.s
        froze = False
        if frozen and self.can_freeze and task.paused_since is None:
            try:
                handle.suspend()
                froze = True
            except SuspendFailed as exc:  # walked all the same, only not frozen
                log.warning("%s, to measure its files", exc)
        started = self.clock.monotonic()
        try:
            space = self.space()  # first: what the task writes during the walk counts twice
            usage, held = self.usage(), handle.disk_bytes()
        except (AttemptFailed, AttemptLapsed) as exc:
            return End(exc)
        over = over_caps(usage, held, s, self.watch.caps, "; the task was stopped")
        if over is not None:
            return End(over)
        look = Look(space, usage.disk_bytes + held, usage.disk_files) if space else None
        if frozen:
            full = full_disk(space)  # within its caps, the task cannot have filled it
            if full is not None:
                return End(full, min(s.kill_grace_seconds, LOST_GRACE_S))
        if froze and look is not None:
            outrun = self.watch.outrun(look, started, s, "; the task was stopped")
            if outrun is not None:
                return End(outrun)
        after = self.space() if look is not None else None
        if froze:
            try:
                handle.resume()
            except SuspendFailed as exc:
                return End(AttemptLapsed(f"{exc}, after its files were measured"))
        now = self.clock.monotonic()
        if look is not None:
            still = froze or task.paused_since is not None  # it made nothing meanwhile
            self.watch.walked(look, started, now, after, still)
        holds = (usage.disk_bytes + held, usage.disk_files)
        self.held(*holds)
        # A task whose files stay as they were is walked less and less often: the disk's
        # readings still set off a walk at once should it write much (``DiskWatch.sample``).
        quiet = look is not None and holds == self._held
        self.walk_every = min(self.walk_every * 2, QUIET_WALK_S) if quiet else WATCH_S
        self._held = holds
        self.next_walk = now + max(self.walk_every, (now - started) * WATCH_COST)
        return None
