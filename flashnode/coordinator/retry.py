"""The one retry policy: capped exponential backoff with jitter, and ``retry`` built on it.

Used by the main loop (claims, registration), the lease keeper and the commit path, so that every
wait after an error has the same shape: the first delay, doubling up to a cap, each delay drawn
from a jitter band of its step so that many nodes never retry in lockstep.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from flashnode.clock import Clock
from flashnode.errors import Cancelled, CoordinatorUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Policy:
    """``first`` seconds, doubling to ``cap``; each delay is ``step * uniform(*jitter)``;
    ``attempts`` bounds ``retry`` (None: until stopped)."""

    first: float
    cap: float
    jitter: tuple[float, float] = (0.8, 1.0)
    attempts: int | None = None


# Downloads and failure reports: 12 tries over about three minutes.
TRANSFER = Policy(first=0.5, cap=30.0, jitter=(0.5, 1.0), attempts=12)
# A finished result's uploads and commit: for as long as the lease lives (the keeper ends it).
RESULT = Policy(first=0.5, cap=30.0, jitter=(0.5, 1.0))


class Backoff:
    """The delays of one policy, in order; ``reset`` after a success."""

    def __init__(self, policy: Policy, rng: random.Random) -> None:
        self.policy, self.rng = policy, rng
        self.step = policy.first

    def reset(self) -> None:
        self.step = self.policy.first

    def next(self) -> float:
        low, high = self.policy.jitter
        delay = self.step * self.rng.uniform(low, high)
        self.step = min(self.step * 2, self.policy.cap)
        return delay


class GaveUp(Exception):
    """``retry`` ran out of attempts; the last error is the cause."""


def retry(
    call: Callable[[], T],
    *,
    policy: Policy,
    rng: random.Random,
    clock: Clock,
    stop: threading.Event,
    what: str = "call",
    retry_on: tuple[type[BaseException], ...] = (CoordinatorUnavailable,),
) -> T:
    """Run ``call``; on ``retry_on`` errors wait the policy's next delay and try again.

    Raises Cancelled when ``stop`` is set (before a try, or while waiting), GaveUp once the
    policy's attempts are spent, and any other error of ``call`` at once."""
    backoff = Backoff(policy, rng)
    failures = 0
    while True:
        if stop.is_set():
            raise Cancelled(f"stopped before {what}")
        try:
            return call()
        except retry_on as exc:
            failures += 1
            if policy.attempts is not None and failures >= policy.attempts:
                raise GaveUp(f"{what} kept failing: {exc}") from exc
            if failures == 1:
                log.warning("%s failed, retrying: %s", what, exc)
            if clock.wait(stop, backoff.next()):
                raise Cancelled(f"stopped while waiting to retry {what}") from None
