"""The task's lease is lost (the coordinator refused a renewal, or its window passed unrenewed):
the task is stopped at once, after a short grace, and nothing of it is reported (the lease is
someone else's now)."""

from __future__ import annotations

import math

from flashnode.attempt.guards.base import Action, Asks, End, Running

LOST_GRACE_S = 1.0  # at most this long for a task whose lease is lost


class LeaseGuard:
    def __init__(self, asks: Asks, kill_grace: float) -> None:
        self.asks, self.grace = asks, min(kill_grace, LOST_GRACE_S)

    def turn(self, now: float, task: Running) -> Action | None:
        return End(None, self.grace) if self.asks.lease_lost else None

    def next_at(self, task: Running) -> float:
        return math.inf  # the keeper wakes the attempt when it loses the lease
