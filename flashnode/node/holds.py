"""The node's own holds on claiming, together: the black-hole guard's quarantine and its checks,
the backoff after a revoked lease (both ``guard.py``), and the disk: claim nothing while the
state dir's disk leaves a task no room, nor, for a while, less room than the last task that did
not fit needed.

The loop asks ``holds`` every turn and tells ``ended`` how each attempt ended; the quarantine's
checks (the preflight: seconds) run on a thread of their own, after what the ended attempts
left to be removed.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from flashnode.attempt.diskwatch import Reserved, no_room
from flashnode.clock import Clock
from flashnode.config.settings import Settings
from flashnode.coordinator.retry import Backoff, Policy
from flashnode.node.decision import Hold
from flashnode.node.guard import Ending, Quarantine, RevokedBackoff
from flashnode.sandbox.diskuse import Space

log = logging.getLogger(__name__)

CLEANUP_WAIT_S = 120.0  # the longest the quarantine's check waits for ended attempts' cleanup
SHORT_FIRST_S = 30.0  # no claim for this long after a task that did not fit the disk's room
SHORT_CAP_S = 960.0  # ... doubling with each in a row up to this


class DiskHold:
    def __init__(
        self,
        space: Callable[[], Space | None],
        reserved: Reserved,
        clock: Clock,
        rng: random.Random,
    ) -> None:
        """``space``: the state dir's disk now (None: unknown, never held). ``reserved``: what
        the running tasks may still write on it."""
        self._space = space
        self._reserved = reserved
        self._clock = clock
        self._low = False
        self._lock = threading.Lock()
        self._backoff = Backoff(Policy(SHORT_FIRST_S, SHORT_CAP_S, jitter=(0.8, 1.0)), rng)
        self._short: tuple[float, tuple[int, int], str] | None = None  # until, needed, why

    def record(self, ending: Ending) -> None:
        """How an attempt ended: one whose inputs or checkpoint did not fit the disk's room has
        the node claim nothing until that much is free above the floor or, at the latest, for a
        backoff (``SHORT_FIRST_S``, doubling with each such ending in a row up to
        ``SHORT_CAP_S``; any other ending resets it): a claim cannot exclude a job (docs/protocol.md
        §3.4), and claiming at once would most likely get that task back."""
        with self._lock:
            if ending.short_of_room is None:
                self._backoff.reset()  # any other ending breaks the row
            else:
                wait = self._backoff.next()
                why = (
                    f"a task of job {ending.job_id} needed more of the disk than it has above"
                    f" min_free_bytes ({ending.reason})"
                )
                self._short = (self._clock.monotonic() + wait, ending.short_of_room, why)
                log.warning("%s; not claiming for up to %.0f s, or until it has room", why, wait)

    def hold(self, settings: Settings) -> Hold | None:
        """Below ``min_free_bytes`` free in the state dir (or its share of the inodes), or with
        too little above it for a task to start (``diskwatch.no_room``), or, for a while, too
        little for the task that last did not fit (``record``), claim nothing; say so once."""
        space = self._space()
        floor = settings.min_free_bytes
        short = no_room(space, floor) if space is not None else None
        left = self._reserved.left(space)
        if space is not None and left is not None and not short:
            taken = no_room(left, floor)
            if taken:
                short = f"{taken} (what the running tasks may still write set aside)"
        if short and not self._low:
            log.warning("not claiming: the state dir has %s", short)
        elif self._low and not short:
            log.info("free space is back above the floor; claiming again")
        self._low = bool(short)
        if space is not None and left is not None and not short:
            return self._too_short(settings, left)
        if space is None or not short:
            return None
        what = "the state dir's disk is full" if space.full() else "low disk"
        return Hold(
            "disk",
            f"{what}: {short}; claims resume above it",
            fix=f"free space on the disk of {settings.state_dir} (`flashnode envs prune`"
            " evicts unused job environments), or lower min_free_bytes",
        )

    def _too_short(self, settings: Settings, left: Space) -> Hold | None:
        with self._lock:
            if self._short is None:
                return None
            until, (nbytes, inodes), why = self._short
            bytes_fit, inodes_fit, _, _ = left.fits(settings.min_free_bytes, nbytes, inodes)
            now = self._clock.monotonic()
            if (bytes_fit and inodes_fit) or now >= until:
                self._short = None
                log.info("claiming again after a task that did not fit the disk")
                return None
            return Hold(
                "disk",
                f"{why}; claims resume in {until - now:.0f} s, or once it has that room",
                fix=f"free space on the disk of {settings.state_dir} (`flashnode envs prune`"
                " evicts unused job environments), or lower min_free_bytes; such a job's"
                " tasks run on nodes with more room",
            )


class NodeHolds:
    def __init__(
        self,
        settings: Settings,
        clock: Clock,
        rng: random.Random,
        space: Callable[[], Space | None],
        reserved: Reserved,
        health: Callable[[Settings], list[str]] | None,
        start_thread: Callable[[Callable[[], None], str], None],
        later: Callable[[Callable[[], None]], object],
        wake: Callable[[], None],
    ) -> None:
        """``health``: this node's own checks for the given settings, one line per problem
        (None: always healthy). ``later``: what runs after ended attempts (it returns an
        Event set once what was queued before is done). ``wake``: the loop, once a check
        ended."""
        self.quarantine = Quarantine(
            settings.quarantine_after, settings.quarantine_check_seconds, clock
        )
        self.revoked = RevokedBackoff(clock, rng)
        self.disk = DiskHold(space, reserved, clock, rng)
        self._health = health
        self._start_thread = start_thread
        self._later = later
        self._wake = wake

    def reconfigure(self, settings: Settings) -> None:
        self.quarantine.after = settings.quarantine_after
        self.quarantine.check_seconds = settings.quarantine_check_seconds

    def holds(self, settings: Settings) -> tuple[Hold | None, ...]:
        """Each hold now (None: it does not hold); starts the quarantine's check when due."""
        if self.quarantine.check_due():
            self._check(settings)
        return self.disk.hold(settings), self.quarantine.hold(), self.revoked.hold()

    def ended(self, ending: Ending, lease_id: str) -> None:
        """How an attempt ended (on the loop's thread, once it has ended)."""
        self.quarantine.record(ending)
        self.revoked.record(ending, lease_id)
        self.disk.record(ending)

    def _check(self, settings: Settings) -> None:
        health = self._health

        def check() -> None:
            # What the ended attempts left to be done after them (their retired workspaces
            # removed) first: the checks must see the disk as the node has it, not the task.
            removed = self._later(lambda: None)
            if isinstance(removed, threading.Event):
                removed.wait(CLEANUP_WAIT_S)
            try:
                problems = health(settings) if health is not None else []
            except Exception as exc:  # a check that cannot run is a failing one
                log.exception("the quarantine's check failed to run")
                problems = [f"the checks could not run ({type(exc).__name__})"]
            self.quarantine.checked(problems)
            self._wake()

        self._start_thread(check, "quarantine-check")
