"""The one loop beside a running task: it asks the task's guards in turn (in their order: the
first to end the task says why) and carries out what they ask, until the task's main process
exits or a guard ends it; between turns it sleeps until the soonest guard wants its next or the
attempt is woken (the task exited, a cancel, a lost lease, a suspension asked or released).

It keeps the task's pauses: when (wall clock), how long, why, each told to ``PauseLog`` as it
ends, and the time paused so far kept in the attempt's record at each resume and when the agent
lets go of a paused task, so that a restart counts it neither as the task's running time nor
against its timeout."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from flashnode.attempt.guards.base import Action, End, Guard, Pause, Resume
from flashnode.errors import Detached, Stopped
from flashnode.runners.base import SuspendFailed

if TYPE_CHECKING:
    import threading

    from flashnode.clock import Clock
    from flashnode.runners.base import Handle

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0  # the longest sleep between turns, whatever the guards say


class PauseLog(Protocol):
    """Where the supervisor tells the attempt of its task's pauses."""

    def paused(self, since: float | None) -> None:
        """The task is paused since ``since`` (monotonic), or runs again (None)."""

    def pause_ended(self, entry: dict[str, Any]) -> None:
        """A pause ended: ``at`` (wall clock), ``seconds``, ``why``."""

    def keep_paused(self, seconds: float, frozen_since: float | None = None) -> None:
        """Keep the time paused so far (earlier runs of the agent included) in the record;
        ``frozen_since``: the agent let go of the task paused (wall clock): it stays frozen
        until the next agent takes it over, and that is not its running time either."""


class Supervisor:
    """Runs the guards of one task; a ``Running`` for them to look at."""

    def __init__(
        self,
        handle: Handle,
        guards: Sequence[Guard],
        clock: Clock,
        wake: threading.Event,
        pauses: PauseLog,
        kill_grace: float,
        before: float = 0.0,
        max_paused: float = math.inf,
        can_pause: bool = True,
    ) -> None:
        """``before``: seconds the task was paused before this run of the agent (rejoined).
        ``max_paused``: the longest pause, whichever guards hold it (each guard may bound its
        own sooner): past it the task is stopped and its lease lapses. ``can_pause``: whether
        its runner can pause a task at all (without, a pause asked for stops it: the owner's
        word wins)."""
        self._handle, self.guards, self.clock, self.wake = handle, list(guards), clock, wake
        self.pauses, self.kill_grace, self.before = pauses, kill_grace, before
        self.max_paused, self.can_pause = max_paused, can_pause
        self._paused_since: float | None = None
        self._paused_before = 0.0
        self._holds: set[int] = set()  # the guards that hold the task paused (their ids)
        self._why: list[str] = []  # why the present pause, each guard's word once
        self.pause_count = 0

    # --- what the guards see --------------------------------------------------------------------

    @property
    def handle(self) -> Handle:
        return self._handle

    @property
    def paused_since(self) -> float | None:
        return self._paused_since

    @property
    def paused_before(self) -> float:
        return self._paused_before

    def paused_total(self, now: float) -> float:
        """Seconds paused in this run of the agent, the present pause included."""
        since = self._paused_since
        return self._paused_before + (now - since if since is not None else 0.0)

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> End | None:
        """Until the task's main process exits (None) or a guard ends it (its ``End``, the task
        stopped already unless the agent let go of it)."""
        handle, clock = self._handle, self.clock
        while not handle.exited():
            for guard in self.guards:
                action = guard.turn(clock.monotonic(), self)
                if action is not None:
                    ended = self._apply(id(guard), action, clock.monotonic())
                    if ended is not None:
                        return ended
            too_long = self._too_long_at()
            if clock.monotonic() >= too_long:
                return self._end(
                    Stopped(
                        f"paused for longer than {self.max_paused:g} s"
                        f" ({'; '.join(self._why)}); the lease lapses"
                    )
                )
            until = min((g.next_at(self) for g in self.guards), default=math.inf)
            until = min(until, too_long)
            clock.wait(self.wake, min(until - clock.monotonic(), MAX_WAIT_S))
            self.wake.clear()
        return None

    def _too_long_at(self) -> float:
        since = self._paused_since
        return math.inf if since is None else since + self.max_paused

    def finish(self, now: float) -> None:
        """The task has ended: its present pause, if any, into its pauses."""
        if self._paused_since is not None:
            self._pause_ended(now)

    def _apply(self, by: int, action: Action, now: float) -> End | None:
        """Carry out ``action`` of the guard ``by``: a pause holds while any guard holds it (a
        guard's resume lets go of its own hold only)."""
        handle = self._handle
        if isinstance(action, End):
            if isinstance(action.why, Detached):
                if self._paused_since is not None:  # not its running time after the rejoin
                    total = self.before + self.paused_total(now)
                    self.pauses.keep_paused(total, frozen_since=self.clock.wall())
            else:
                handle.terminate(action.grace)
            return action
        if isinstance(action, Pause) and by not in self._holds:
            if not self.can_pause:
                return self._end(Stopped(f"its runner cannot pause a task ({action.why})"))
            if not self._holds:
                try:
                    handle.suspend()
                except SuspendFailed as exc:
                    log.error("%s", exc)
                    return self._end(Stopped(f"{exc}, while asked to suspend it ({action.why})"))
                self._paused_since = now
                self.pauses.paused(now)
            self._holds.add(by)
            if action.why not in self._why:
                self._why.append(action.why)
            log.info("task suspended: %s", action.why)
        elif isinstance(action, Resume) and by in self._holds:
            self._holds.discard(by)
            if self._holds or self._paused_since is None:
                return None
            held = now - self._paused_since
            try:
                handle.resume()
            except SuspendFailed as exc:
                log.error("%s", exc)
                return self._end(Stopped(str(exc)))
            self._pause_ended(now)
            self.pauses.keep_paused(self.before + self._paused_before)
            self.pauses.paused(None)
            log.info("task resumed after %.0f s suspended", held)
        return None

    def _end(self, why: Stopped) -> End:
        self._handle.terminate(self.kill_grace)
        return End(why, self.kill_grace)

    def _pause_ended(self, now: float) -> None:
        since = self._paused_since
        assert since is not None
        held = now - since
        self._paused_before += held
        self._paused_since = None
        self.pause_count += 1
        wall = self.clock.wall() - held
        why, self._why = "; ".join(self._why), []
        self.pauses.pause_ended({"at": round(wall, 1), "seconds": round(held, 1), "why": why})
