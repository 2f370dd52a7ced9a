"""The task's use, sampled every ``sample_seconds`` beside it (``evidence.sampler``: its
evidence and the owner's live view): a guard that never acts, so that a running task costs the
agent one loop and no thread of its own. While the task is quiet (``quiet``: it holds no GPU and
used next to no CPU since the last reading) the readings come twice as far apart each time, up
to ``QUIET_S``: a task that sleeps costs the agent a reading every few seconds, and the first
reading that finds it busy brings them back to ``sample_seconds``."""

from __future__ import annotations

from collections.abc import Callable

from flashnode.attempt.guards.base import Action, Running

QUIET_S = 8.0


class SamplingGuard:
    def __init__(
        self,
        sample: Callable[[], None],
        interval: float,
        started: float,
        quiet: Callable[[], bool] = lambda: False,
    ) -> None:
        """``sample``: one reading; the first ``interval`` after ``started`` (monotonic);
        ``quiet``: whether the latest reading found the task quiet."""
        self.sample, self.interval, self.quiet = sample, interval, quiet
        self.every = interval
        self.next = started + interval

    def turn(self, now: float, task: Running) -> Action | None:
        if now >= self.next:
            self.sample()
            longest = max(QUIET_S, self.interval)
            self.every = min(self.every * 2, longest) if self.quiet() else self.interval
            self.next += self.every
            if self.next <= now:  # a late turn: no burst to catch up
                self.next = now + self.every
        return None

    def next_at(self, task: Running) -> float:
        return self.next
