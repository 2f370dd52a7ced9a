"""The node's own holds on claiming, together: the black-hole guard's quarantine and its checks,
the backoff after a revoked lease (both ``guard.py``), and the disk: claim nothing while the
state dir's disk leaves a task no room.

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
from flashnode.node.decision import Hold
from flashnode.node.guard import Ending, Quarantine, RevokedBackoff
from flashnode.sandbox.diskuse import Space

log = logging.getLogger(__name__)

CLEANUP_WAIT_S = 120.0  # the longest the quarantine's check waits for ended attempts' cleanup


class DiskHold:
    def __init__(self, space: Callable[[], Space | None], reserved: Reserved) -> None:
        """``space``: the state dir's disk now (None: unknown, never held). ``reserved``: what
        the running tasks may still write on it."""
        self._space = space
        self._reserved = reserved
        self._low = False

    def hold(self, settings: Settings) -> Hold | None:
        """Below ``min_free_bytes`` free in the state dir (or its share of the inodes), or with
        too little above it for a task to start (``diskwatch.no_room``), claim nothing; say so
        once."""
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
        if space is None or not short:
            return None
        what = "the state dir's disk is full" if space.full() else "low disk"
        return Hold(
            "disk",
            f"{what}: {short}; claims resume above it",
            fix=f"free space on the disk of {settings.state_dir} (`flashnode envs prune`"
            " evicts unused job environments), or lower min_free_bytes",
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
        self.disk = DiskHold(space, reserved)
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
