"""Suspension (``Attempt.request_suspension``: the owner's controls, the courtesy's owner's use of
a GPU and heat): the task is paused while any source asks and resumed once none does. A pause
longer than ``max_suspend_seconds`` (default: the lease's window) ends the task and gives the
lease back (``Stopped``: not the task's fault), so that no lease sits frozen for hours while
other nodes could run it: each source counted from when it asked, the owner's use of the task's
GPU ``gpu_yield_stop_seconds`` longer (the courtesy stops the task at that; this bounds one that
failed to)."""

from __future__ import annotations

import math

from flashnode.attempt.guards.base import Action, Asks, End, Pause, Resume, Running
from flashnode.errors import Stopped


class SuspensionGuard:
    def __init__(
        self, asks: Asks, max_suspend: float, gpu_yield_stop: float, kill_grace: float
    ) -> None:
        self.asks, self.max_suspend, self.gpu_yield_stop = asks, max_suspend, gpu_yield_stop
        self.grace = kill_grace
        self.since: float | None = None  # since when it holds the task paused (monotonic)

    def turn(self, now: float, task: Running) -> Action | None:
        reason = self.asks.suspend_reason
        if reason is not None and self.since is None:
            self.since = now
            return Pause(reason)
        if reason is None and self.since is not None:
            self.since = None
            return Resume()
        too_long = self._too_long_at()
        if too_long is not None and now >= too_long:
            limit = too_long - (self.since or too_long)
            return End(
                Stopped(
                    f"suspended for longer than {limit:g} s"
                    f" ({reason or 'released just now'}); the lease lapses"
                ),
                self.grace,
            )
        return None

    def next_at(self, task: Running) -> float:
        too_long = self._too_long_at()
        return math.inf if too_long is None else too_long  # a request wakes the attempt

    def _too_long_at(self) -> float | None:
        """When its present pause has lasted too long (monotonic); None while it holds none."""
        began = self.since
        if began is None:
            return None
        sources = self.asks.suspend_sources or {"owner": began}  # released: resumed next turn
        return min(
            max(since, began)
            + self.max_suspend
            + (self.gpu_yield_stop if source == "gpu" else 0.0)
            for source, since in sources.items()
        )
