"""The node's stops. A stop (SIGTERM: a restart, an upgrade, a shutdown) leaves at once: the
loop ends and the agent's shutdown lets go of running tasks, or stops them when the machine shuts
down. A drain (``flashnode drain``, a package's removal): no new claims, running attempts given
``drain_seconds``, then the attempts left stopped; a second drain request stops them at once.

``Drain`` owns the requests (set from a signal handler: flags only) and the drain's clock: when
it started, when it stops what is left, and telling systemd the stop takes longer.
"""

from __future__ import annotations

import logging

from flashnode.config.settings import Settings
from flashnode.errors import AttemptLapsed, Stopped
from flashnode.owner.status import StatusSink

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN_S = 30.0  # for the last reports of stopped attempts


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.leaving = False  # a stop: the loop ends now
        self.stop_now = False
        self._started = False
        self._deadline = 0.0
        self._extend_at = 0.0

    def request_stop(self) -> None:
        """Leave now (the agent's shutdown says what becomes of running attempts)."""
        self.leaving = True

    def request_drain(self) -> None:
        """First call: drain. Second call: stop the running attempts now, still cleaning up."""
        if self.draining:
            self.stop_now = True
        self.draining = True

    @property
    def deadline(self) -> float | None:
        """When (monotonic) the drain stops the attempts left; None before it started."""
        return self._deadline if self._started else None

    def tick(self, now: float, settings: Settings, sink: StatusSink, running: int) -> bool:
        """From the loop, each turn; True on the turn the drain starts."""
        if not self.draining:
            return False
        started = not self._started
        if started:
            self._started = True
            self._deadline = now + settings.drain_seconds
            log.info("draining: no new claims; %d attempt(s) running", running)
            sink.send(STOPPING=1)
        if now >= self._extend_at:
            # Tell systemd the stop takes longer: what is left of the drain, the kill grace,
            # and a margin for the last commits.
            left = max(self._deadline - now, 0.0) + settings.kill_grace_seconds + SHUTDOWN_MARGIN_S
            sink.send(EXTEND_TIMEOUT_USEC=int(left * 1e6))
            self._extend_at = now + 5
        return started

    def stopping(self, now: float, settings: Settings) -> tuple[AttemptLapsed, float] | None:
        """What the running attempts must be stopped with now, and the grace their tasks get;
        None while they may run on."""
        if self.stop_now:
            return Stopped("agent stopping"), 0.0
        # Only once ``tick`` started the drain: a stop requested later in the same turn has
        # no deadline yet, and must not stop the attempts at once.
        if self._started and now >= self._deadline:
            return Stopped("node draining"), settings.kill_grace_seconds
        return None
