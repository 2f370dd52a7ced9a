"""The task's timeout (its own ``timeout_seconds``, at most ``max_task_seconds``): counted over
the time it could run, so a pause moves it on by the time paused; never while it is paused."""

from __future__ import annotations

import math

from flashnode.attempt.guards.base import Action, End, Running
from flashnode.errors import AttemptFailed


class TimeoutGuard:
    def __init__(self, started: float, timeout: float, kill_grace: float) -> None:
        """``started``: when the task started (monotonic; earlier than now for a rejoined task,
        by the time it ran before)."""
        self.started, self.timeout, self.grace = started, timeout, kill_grace

    def deadline(self, task: Running) -> float:
        return self.started + self.timeout + task.paused_before

    def turn(self, now: float, task: Running) -> Action | None:
        if task.paused_since is None and now >= self.deadline(task):
            return End(AttemptFailed(f"timed out after {self.timeout:g} s"), self.grace)
        return None

    def next_at(self, task: Running) -> float:
        if task.paused_since is not None:
            return math.inf  # it waits while paused (the pause's own bound is the suspension's)
        return self.deadline(task)
