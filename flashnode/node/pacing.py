"""When the loop talks to the coordinator next: the pace of one node in a fleet.

A pool operator runs many nodes against one coordinator, a single process. What each node does
alone is harmless; what matters is what they do together:

* **No lockstep.** Every wait is drawn from a jitter band, so nodes that started together, or
  that noticed one event together (a burst ended, the coordinator went away), drift apart
  instead of claiming in the same instant forever: idle claims and errors from ``[0.5, 1.0]`` of
  their step, heartbeats from ``[0.9, 1.1]`` of their period.
* **No herd after a coordinator restart.** A restarted coordinator forgets every node; each
  notices at its next heartbeat or claim, and registers again only after a delay drawn from
  ``[0, heartbeat period)``, so that a fleet that noticed together does not re-register (and
  then claim) in the same instant.
* **A slow coordinator is a busy one.** An answer that took ``t`` seconds is followed by a wait
  of at least ``SLOW_FACTOR * t`` (measured from the answer, not from the question): the slower
  the coordinator answers, the less often each node asks, instead of each node asking again
  the moment a slow answer arrives.
* **Idle is cheap, work is found fast.** The end of an attempt claims again at once (the
  loop's part); then, for ``claim_alert_seconds``, the node claims about every second
  (``ALERT_STEP_S``), because after work more work is likely: a job's next round, the rest of a
  burst, a retry. After that an empty claim doubles the wait from ``claim_backoff_min_seconds``
  up to ``claim_backoff_max_seconds``: a node idle for long costs the coordinator a heartbeat
  every 5 s and a claim every 6 s on average. This coordinator says nothing about waiting work
  except in a claim's own answer (docs/protocol.md §10, item 22), so an idle node learns of new
  work only by claiming: the cap is the price of that (the curve of requests against dispatch
  latency: benchmarks/RESULTS.md, "Dispatch and the idle cost").

Pure: it reads no clock and sleeps never; the loop asks it for delays.
"""

from __future__ import annotations

import random

from flashnode.config.settings import Settings
from flashnode.coordinator.retry import Backoff, Policy

IDLE_JITTER = (0.5, 1.0)  # each idle claim's wait, as a share of its step
ERROR_JITTER = (0.5, 1.0)  # each retry's wait after an error, as a share of its step
HEARTBEAT_JITTER = (0.9, 1.1)  # each heartbeat's wait, as a share of heartbeat_seconds
ERROR_FIRST_S = 1.0  # the first wait after an error
SLOW_FACTOR = 2.0  # an answer that took t seconds is followed by a wait of at least 2 t
ALERT_STEP_S = 1.2  # after an attempt: each claim's wait drawn from [0.5, 1.0] of this


class Pacing:
    """The delays of one node's conversations with the coordinator, each with its own backoff:
    a working heartbeat must not hurry a failing claim."""

    def __init__(self, settings: Settings, rng: random.Random) -> None:
        self.rng = rng
        self.heartbeat_seconds = settings.heartbeat_seconds
        self.alert_seconds = settings.claim_alert_seconds
        self.alert_step = max(ALERT_STEP_S, settings.claim_backoff_min_seconds)
        self._alert_until = float("-inf")
        self.idle = Backoff(
            Policy(
                settings.claim_backoff_min_seconds,
                settings.claim_backoff_max_seconds,
                IDLE_JITTER,
            ),
            rng,
        )
        errors = Policy(ERROR_FIRST_S, settings.error_backoff_max_seconds, ERROR_JITTER)
        self.claim_errors = Backoff(errors, rng)
        self.register_errors = Backoff(errors, rng)

    def attempt_ended(self, now: float) -> None:
        """An attempt ended at ``now`` (monotonic): claims stay quick for a while."""
        self._alert_until = now + self.alert_seconds

    def claimed(self, work: bool, took: float, now: float) -> float:
        """A claim was answered at ``now`` (monotonic) after ``took`` seconds: the wait until
        the next claim (0 after work: the next claim follows the attempt's end)."""
        self.claim_errors.reset()
        if work:
            self.idle.reset()
            return 0.0
        if now < self._alert_until:
            return self._not_sooner(self.alert_step * self.rng.uniform(*IDLE_JITTER), took)
        return self._not_sooner(self.idle.next(), took)

    def claim_failed(self, took: float) -> float:
        """A claim failed (transport, 5xx, an answer that makes no sense) after ``took``."""
        return self._not_sooner(self.claim_errors.next(), took)

    def registered(self) -> None:
        self.register_errors.reset()

    def register_failed(self, took: float) -> float:
        return self._not_sooner(self.register_errors.next(), took)

    def rejoin(self) -> float:
        """The coordinator forgot this node (it restarted): the wait before registering again,
        spread over one heartbeat period so that a fleet that noticed together rejoins apart."""
        return self.rng.uniform(0.0, self.heartbeat_seconds)

    def heartbeat(self) -> float:
        """The wait from one node heartbeat to the next (the node stays "online" on the
        coordinator while its last heartbeat is under 15 s old)."""
        return self.heartbeat_seconds * self.rng.uniform(*HEARTBEAT_JITTER)

    @staticmethod
    def _not_sooner(delay: float, took: float) -> float:
        return max(delay, SLOW_FACTOR * took)
