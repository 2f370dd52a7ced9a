"""What the agent is doing, for its owner: systemd's STATUS, the terminal line, status.json.

The loop hands ``Publisher.publish`` a ``NodeView``: a frozen copy of what it knows this turn.
The publisher reads nothing else of the loop, so what it writes is one consistent moment, and
the status text and snapshot are built (and tested) apart from the loop that changes them.

status.json is written when what it says changes (news waits until ``NEWS_GAP_S`` after the
write before it, and the loop wakes for it then: tasks that take milliseconds would otherwise
rewrite it twice each, with CPU taken from them), and at least once every heartbeat period
(``heartbeat_seconds``) even when nothing did, with its time (``updated_at``) and the period it
promises (``fresh_for_s``): a snapshot much older than its promise is stale (the loop stopped
writing), and ``flashnode status`` and the console say so (``status.staleness``). Whatever runs
(elapsed, the task's output, the lease left) is thus never older than one period.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashnode.clock import Clock, stamp
from flashnode.config.settings import Settings
from flashnode.node.decision import Decision
from flashnode.node.session import Problem
from flashnode.owner import status
from flashnode.owner.status import StatusSink

log = logging.getLogger(__name__)

NEWS_GAP_S = 0.1  # the least time between two writes of status.json for news (not the final one)


@dataclass(frozen=True)
class NodeView:
    """The node as the loop sees it at one moment. ``running``: each running attempt's status
    snapshot; ``drain_deadline``: when a drain started, the moment (monotonic) it stops the
    attempts left; ``beats``: node heartbeats answered so far."""

    settings: Settings
    node_id: str
    registered: bool
    draining: bool
    drain_deadline: float | None
    started_at: float
    beats: int
    last_heartbeat_at: float | None
    problems: tuple[Problem, ...]
    counters: Mapping[str, int]
    running: tuple[dict[str, Any], ...]
    decision: Decision
    last_ended: Mapping[str, Any] | None
    reload_refused: Mapping[str, Any] | None
    rejoined: int = 0  # tasks an earlier run let go of, re-attached at this run's start
    registered_at: float | None = None  # the latest registration the coordinator accepted (wall)


class _Quiet:
    """No systemd, no terminal: status goes nowhere."""

    def status(self, text: str) -> None:
        pass

    def send(self, **fields: str | int) -> None:
        pass

    def tick(self) -> None:
        pass


class Publisher:
    def __init__(
        self,
        clock: Clock,
        sink: StatusSink | None = None,
        extra: dict[str, Any] | None = None,
        totals: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``sink``: systemd and the terminal line (None: nowhere). ``extra``: more for
        status.json (what owners' commands may use to reach the agent). ``totals``: what this
        node gave, today and all time (from the ledger: it survives restarts)."""
        self.clock = clock
        self.sink: StatusSink = sink or _Quiet()
        self._extra = dict(extra or {})
        self._totals = totals
        self._pid = os.getpid()
        self._published: tuple[str, int, object] | None = None
        self._written_at: float | None = None  # when status.json was last written (monotonic)
        self._news_due: float | None = None  # when news held back by the gap is to be written
        self._failing = False

    def publish(self, view: NodeView, final: bool = False) -> None:
        """Say what the node does: the status text at every call; status.json when it
        changed (the text, a heartbeat, a refused reload) and ``NEWS_GAP_S`` passed since it
        was last written (else at the first call after that), when one heartbeat period passed
        since it was last written, or at the ``final`` call."""
        self.sink.status("stopped" if final else self.text(view, timed=True))
        # The file holds no ages (its readers work them out from its times): a task's seconds
        # going by rewrite it no more often than the heartbeat period.
        text = "stopped" if final else self.text(view, timed=False)
        key = (text, view.beats, view.reload_refused)
        now = self.clock.monotonic()
        period = view.settings.heartbeat_seconds
        last = self._written_at
        if not final and last is not None and now < last + period:
            gap_ends = last + NEWS_GAP_S
            if key == self._published or now < gap_ends:
                self._news_due = None if key == self._published else gap_ends
                return
        self._published = key
        self._written_at, self._news_due = now, None
        snapshot = {
            "pid": None if final else self._pid,
            "node_id": view.node_id,
            "coordinator": view.settings.coordinator,
            "runner": view.settings.runner,
            "pools": list(view.settings.pools),
            "state": text,
            "draining": view.draining,
            "registered": view.registered,
            "started_at": view.started_at,
            "last_heartbeat_at": view.last_heartbeat_at,
            "coordinator_problems": self.coordinator_problems(view),
            "counters": dict(view.counters),
            "totals": self._read_totals(),
            "running": list(view.running),
            "controls": view.decision.snapshot(),
            "last_ended": None if view.last_ended is None else dict(view.last_ended),
            "reload_refused": None if view.reload_refused is None else dict(view.reload_refused),
            "rejoined": view.rejoined,
            "registered_at": view.registered_at,
            "updated_at": self.clock.wall(),
            "fresh_for_s": period,
            **self._extra,
        }
        try:
            status.write(view.settings.state_dir, snapshot)
        except OSError as exc:
            if not self._failing:
                log.error("cannot write status.json (%s): `flashnode status` lags", exc.strerror)
            self._failing = True
            return
        if self._failing:
            self._failing = False
            log.info("status.json is written again")

    def news_due(self) -> float | None:
        """When news held back by ``NEWS_GAP_S`` is to be written (monotonic): the loop wakes
        for it then. None when none waits."""
        return self._news_due

    def text(self, view: NodeView, timed: bool) -> str:
        """The one line: draining, the coordinator unreachable, or the running attempts and
        what holds claiming; ``timed``: with each attempt's ages (elapsed, lease left)."""
        running = view.running
        if view.draining:
            text = f"draining: {len(running)} attempt(s) running"
            if running and view.drain_deadline is not None:
                by = self._wall_of(view.drain_deadline)
                text += f", stopped by {stamp(by)} at the latest (drain_seconds)"
            return text
        if view.problems:
            since = min(p.since for p in view.problems)
            what = ", ".join(sorted(p.conversation for p in view.problems))
            return f"coordinator unreachable since {stamp(self._wall_of(since))} ({what})"
        held = view.decision.hold_reason
        wall = self.clock.wall() if timed else None
        text = "; ".join(status.attempt_line(a, wall) for a in running) or "idle"
        if running:
            text = "running " + text
        return f"{text} | not claiming: {held}" if held else text

    def coordinator_problems(self, view: NodeView) -> list[dict[str, Any]]:
        """Each failing conversation with the coordinator: since when, its latest error."""
        offset = self.clock.wall() - self.clock.monotonic()
        return [
            {
                "conversation": p.conversation,
                "since": p.since + offset,
                "error": p.error,
                "fix": "check that the coordinator runs and that this machine reaches"
                f" {view.settings.coordinator} (`flashnode doctor` checks it); the agent keeps"
                " trying",
            }
            for p in sorted(view.problems, key=lambda p: p.conversation)
        ]

    def _wall_of(self, monotonic: float) -> float:
        """A moment on the monotonic clock, on the wall clock."""
        return self.clock.wall() - (self.clock.monotonic() - monotonic)

    def _read_totals(self) -> dict[str, Any] | None:
        if self._totals is None:
            return None
        try:
            return self._totals()
        except Exception:  # the totals are for the owner's eyes: never the loop's end
            log.exception("cannot read the totals from the ledger")
            return None
