"""The attempt was cancelled (a drain past its time, a stop, the owner's reload that no longer
allows the task, a lease the coordinator revoked): the task is stopped with the cancel's grace
and ends with the cancel's reason."""

from __future__ import annotations

import math

from flashnode.attempt.guards.base import Action, Asks, End, Running


class CancelGuard:
    def __init__(self, asks: Asks) -> None:
        self.asks = asks

    def turn(self, now: float, task: Running) -> Action | None:
        cancelled = self.asks.cancelled
        return End(cancelled, self.asks.cancel_grace) if cancelled is not None else None

    def next_at(self, task: Running) -> float:
        return math.inf  # a cancel wakes the attempt
