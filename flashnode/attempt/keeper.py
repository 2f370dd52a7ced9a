"""Lease renewal, and the lost-lease latch every phase checks."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from flashnode.attempt.context import CoordinatorPort
from flashnode.clock import Clock
from flashnode.coordinator.lease import Lease
from flashnode.coordinator.retry import Backoff, Policy
from flashnode.errors import CoordinatorError, CredentialsError, LeaseLost

log = logging.getLogger(__name__)


LAST_TRY_S = 1.0  # the last renewal is tried this long before the lease's deadline


class LeaseKeeper:
    """Renews a lease every clamp(lease_seconds/3, 2 s, 60 s) on the monotonic clock.

    410 (or 403 in token mode) means lost, as does a refused credential. Transport errors are
    retried with the shared backoff (from 1 s, capped at the renewal interval), the last try
    ``LAST_TRY_S`` before the local deadline (last renewal + the lease window); once that fails
    the lease is taken as lost too.
    ``stop`` ends renewals without a verdict: a lease left to lapse.
    """

    def __init__(
        self,
        coordinator: CoordinatorPort,
        lease: Lease,
        clock: Clock,
        on_lost: Callable[[], None],
        rng: random.Random | None = None,
        renew_now: bool = False,
        on_renewed: Callable[[float], None] = lambda window: None,
    ) -> None:
        """``renew_now``: the first renewal at once (a lease rejoined after a restart, last
        renewed who knows when), not one interval after the claim. ``on_renewed``: told the
        lease's window after each renewal (it lives that long from now)."""
        self._coordinator, self._lease, self._clock = coordinator, lease, clock
        self._renew_now = renew_now
        self._on_renewed = on_renewed
        self._on_lost = on_lost
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self.lost = threading.Event()
        self.reason = ""
        # Monotonic: the last renewal (at first, the claim) + the lease window; the live view.
        self.deadline = clock.monotonic() + lease.window

    def stop(self) -> None:
        self._stop.set()

    def mark_lost(self, reason: str) -> None:
        """Take the lease as lost because another fenced write was refused (a checkpoint's
        410): renewals end and the attempt stops as if a renewal had been refused."""
        self._stop.set()
        self._mark_lost(reason)

    def run(self) -> None:
        interval, window = self._lease.renew_interval, self._lease.window
        backoff = Backoff(Policy(first=1.0, cap=interval, jitter=(0.9, 1.0)), self._rng)
        now = self._clock.monotonic()
        next_renewal, deadline = now + (0.0 if self._renew_now else interval), now + window
        self.deadline = deadline
        while not self._clock.wait(self._stop, next_renewal - self._clock.monotonic()):
            try:
                self._coordinator.attempt_heartbeat(self._lease.lease_id)
            except LeaseLost as exc:
                self._mark_lost(f"lease lost ({exc.status}: {exc})")
                return
            except CredentialsError as exc:
                self._mark_lost(f"credentials refused: {exc}")
                return
            except CoordinatorError as exc:
                now = self._clock.monotonic()
                last_try = deadline - LAST_TRY_S
                if now >= last_try:
                    self._mark_lost(f"lease could not be renewed before its deadline ({exc})")
                    return
                log.warning("renewal failed, retrying: %s", exc)
                # A backoff step that would pass the deadline is cut short: the coordinator may
                # be back by then, and one more try costs nothing.
                next_renewal = now + min(backoff.next(), last_try - now)
                continue
            backoff.reset()
            now = self._clock.monotonic()
            next_renewal, deadline = now + interval, now + window
            self.deadline = deadline
            self._on_renewed(window)

    def _mark_lost(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        self._on_lost()
