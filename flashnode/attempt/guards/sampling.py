"""The task's use, sampled every ``sample_seconds`` beside it (``evidence.sampler``: its
evidence and the owner's live view): a guard that never acts, so that a running task costs the
agent one loop and no thread of its own."""

from __future__ import annotations

from collections.abc import Callable

from flashnode.attempt.guards.base import Action, Running


class SamplingGuard:
    def __init__(self, sample: Callable[[], None], interval: float, started: float) -> None:
        """``sample``: one reading; the first ``interval`` after ``started`` (monotonic)."""
        self.sample, self.interval = sample, interval
        self.next = started + interval

    def turn(self, now: float, task: Running) -> Action | None:
        if now >= self.next:
            self.sample()
            self.next += self.interval
            if self.next <= now:  # a late turn: no burst to catch up
                self.next = now + self.interval
        return None

    def next_at(self, task: Running) -> float:
        return self.next
