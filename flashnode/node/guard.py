"""The node's own holds on claiming, from how its attempts ended: pure logic on a clock.

* **The black-hole guard** (``Quarantine``): a node that cannot run anything (a broken driver or
  interpreter, a full disk, a sandbox that fails) would otherwise take task after task and spend
  every job's budgets. After ``after`` attempts in a row that ended through this node's fault (a
  lapse that was not a drain, stop, pause or owner control), or that failed within
  ``FAST_FAIL_S`` of their claim with the same reason across at least two jobs, the node stops
  claiming and says why. A failure is the task's own ending, in its author's hands (two jobs
  that ``exit 1`` fail fast alike): such a row only makes the node run its checks at once,
  claiming nothing meanwhile, and it is quarantined only if they fail; if they pass, the row
  was the tasks' own and it claims on. A lapse that may as well be the job's as the node's
  (``job_endpoint``: at an endpoint the job itself named, its dataset origin or package index;
  or a task stopped at a disk cap that the disk's free space set) counts only once such lapses
  in the row span two jobs: one job's dead origin is no sign of this node's health, and must
  not bench node after node; a node whose own network is down fails every job alike. A row
  that trips only with the lapses of tasks past the disk's room (``outgrew_room``) has the
  node's checks run first, as for fast failures: once the tasks' files are gone, a healthy disk
  passes them, and jobs that write much must not bench it. Once
  quarantined, it runs its own checks (the preflight ``flashnode work`` runs at start:
  ``health``) at once and every ``check_seconds``;
  once they pass, and no sooner than one interval after it stopped (a fault its checks cannot
  see must not bring it back at full speed), it takes work again. A committed attempt resets
  the count.
* **The backoff after a revoked lease** (``RevokedBackoff``): the coordinator's silence watchdog
  revokes a lease whose task shipped no checkpoint in time (docs/protocol.md §8); claiming straight
  away would most likely get that task back, to be revoked again, each time spending its expiry
  budget. A claim cannot exclude a job (docs/protocol.md §3.4: ``job_id`` only narrows it to one),
  so the node claims nothing for a while (from ``REVOKED_FIRST_S``, doubling with each revocation in
  a row up to ``REVOKED_CAP_S``, reset by a commit), so that another node may take the task.

Both give a ``decision.Hold`` with a reason an owner can read (``flashnode status``, the log, the
metric ``flashnode_claiming_held{rule}``). They are fed from attempt threads, read from the
loop: each keeps its state under a lock.
"""

from __future__ import annotations

import logging
import random
import re
import threading
from dataclasses import dataclass

from flashnode.attempt.record import Outcome
from flashnode.clock import Clock
from flashnode.coordinator.retry import Backoff, Policy
from flashnode.node.decision import Hold

log = logging.getLogger(__name__)

FAST_FAIL_S = 60.0  # a failure this soon after its claim may be the node's, not the task's
REVOKED_FIRST_S = 60.0
REVOKED_CAP_S = 960.0
REVOKED = re.compile(r"revoked: no progress")
_NOISE = re.compile(r"ls-[0-9a-z-]+|[0-9a-f]{8,}|[0-9]+(\.[0-9]+)?")


@dataclass(frozen=True)
class Ending:
    """How one attempt ended, as the guard sees it."""

    outcome: Outcome
    reason: str
    job_id: str
    node_fault: bool = False  # lapsed through this node's fault
    seconds: float | None = None  # claim to end
    job_endpoint: bool = False  # ... at an endpoint the job named (a data origin, an index)
    outgrew_room: bool = False  # ... past the room the disk had for it (job_endpoint too)
    # What the agent was about to write for it did not fit the disk's room (bytes, inodes):
    # not this node's fault, and no sign of its health (node_fault is False).
    short_of_room: tuple[int, int] | None = None


def same_reason(reason: str) -> str:
    """A failure's reason without what differs between attempts (lease ids, numbers, paths'
    hashes), so that one cause reads the same in every job."""
    return _NOISE.sub("#", reason.lower()).strip()


class Quarantine:
    def __init__(self, after: int, check_seconds: float, clock: Clock) -> None:
        """``after``: endings in a row that stop claiming (0: never)."""
        self.after = after
        self.check_seconds = check_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._faults = 0  # node-fault endings in a row, but those at a job's endpoints
        self._endpoint_faults = 0  # those, in the same row
        self._endpoint_jobs: set[str] = set()  # ... and the jobs whose endpoints they were
        self._room_faults = 0  # those of them past the disk's room
        self._fault_reason = ""
        self._fails = 0  # fast failures in a row with one reason
        self._fail_reason = ""
        self._fail_text = ""
        self._fail_jobs: set[str] = set()
        self._suspect = ""  # why, while a row of fast failures has the node's checks run
        self._since: float | None = None  # monotonic, while quarantined
        self._why = ""
        self._next_check = 0.0
        self._problems: list[str] | None = None  # what the last check found (None: not yet)

    # --- fed by attempts ----------------------------------------------------------------------

    def record(self, e: Ending) -> None:
        with self._lock:
            if e.outcome is Outcome.COMMITTED:
                self._fails = 0
                self._fail_jobs.clear()
                self._no_faults()
            elif e.node_fault:
                if e.job_endpoint:
                    self._endpoint_faults += 1
                    self._endpoint_jobs.add(e.job_id)
                    self._room_faults += e.outgrew_room
                else:
                    self._faults += 1
                self._fault_reason = e.reason
                self._fails = 0
                self._fail_jobs.clear()
            elif e.outcome is Outcome.FAILED:
                fast = e.seconds is not None and e.seconds < FAST_FAIL_S
                key = same_reason(e.reason)
                self._no_faults()
                if not fast:
                    self._fails = 0
                    self._fail_jobs.clear()
                elif self._fails and key == self._fail_reason:
                    self._fails += 1
                    self._fail_jobs.add(e.job_id)
                else:
                    self._fails, self._fail_reason, self._fail_jobs = 1, key, {e.job_id}
                self._fail_text = e.reason
            # Other endings (a drain, a stop, a pause, a lost or rejected lease) say nothing
            # about this node's health: the count stays where it is.
            if self._since is None and self.after > 0:
                self._trip()

    def _no_faults(self) -> None:
        self._faults = self._endpoint_faults = self._room_faults = 0
        self._endpoint_jobs.clear()

    def _counted_faults(self, rooms: bool = True) -> int:
        """The node-fault endings in a row that count: those at a job's endpoints only once
        they span two jobs (``rooms``: those past the disk's room among them)."""
        if len(self._endpoint_jobs) < 2:
            return self._faults
        return self._faults + self._endpoint_faults - (0 if rooms else self._room_faults)

    def _trip(self) -> None:
        """Quarantine on a row of node faults; on a row that counts only with the lapses past
        the disk's room, or of fast failures across two jobs, have the node's checks run first
        (``checked`` decides)."""
        faults = self._counted_faults(rooms=False)
        if faults >= self.after:
            why = (
                f"{faults} attempts in a row ended through this node's fault"
                f" (the last: {self._fault_reason})"
            )
        elif self._counted_faults() >= self.after:
            if not self._suspect:
                self._suspect = (
                    f"{self._counted_faults()} attempts in a row ended through this node's"
                    f" fault, {self._room_faults} of {len(self._endpoint_jobs)} jobs past the"
                    f" room its disk had for them (the last: {self._fault_reason})"
                )
                self._next_check = self._clock.monotonic()
                log.warning("%s; checking this node before claiming again", self._suspect)
            return
        elif self._fails >= self.after and len(self._fail_jobs) >= 2:
            if not self._suspect:
                self._suspect = (
                    f"{self._fails} attempts of {len(self._fail_jobs)} jobs in a row failed"
                    f" within {FAST_FAIL_S:g} s with the same reason ({self._fail_text})"
                )
                self._next_check = self._clock.monotonic()
                log.warning("%s; checking this node before claiming again", self._suspect)
            return
        else:
            return
        now = self._clock.monotonic()
        self._since, self._why, self._problems, self._suspect = now, why, None, ""
        self._next_check = now  # check at once: status says what is wrong
        log.error(
            "quarantined: %s; not claiming until this node passes its own checks (every %g s)",
            why,
            self.check_seconds,
        )

    # --- read by the loop ---------------------------------------------------------------------

    @property
    def streak(self) -> int:
        """The longer of the two counts (for the metrics)."""
        with self._lock:
            return max(self._counted_faults(), self._fails)

    def hold(self) -> Hold | None:
        with self._lock:
            if self._since is None:
                if not self._suspect:
                    return None
                return Hold(
                    "quarantine",
                    f"checking this node: {self._suspect}",
                    fix="none needed: it claims again once its checks pass (the failures were"
                    " then the tasks' own); if they fail, it says what they found",
                )
            found = self._problems
            if found is None:
                checks = "checking this node"
            elif found:
                checks = "its checks fail: " + "; ".join(found)
            else:
                checks = "its checks pass; claiming again shortly"
            return Hold(
                "quarantine",
                f"quarantined: {self._why}; {checks}",
                fix="fix what its checks find (`flashnode doctor` runs them too); it claims"
                f" again once they pass, checking every {self.check_seconds:g} s",
            )

    def check_due(self) -> bool:
        """A check should start now (the caller runs it, then calls ``checked``)."""
        with self._lock:
            if self._since is None and not self._suspect:
                return False
            if self._clock.monotonic() < self._next_check:
                return False
            self._next_check = float("inf")  # until ``checked``
            return True

    def checked(self, problems: list[str]) -> None:
        """What the node's checks found: nothing (they pass) ends the quarantine once it has
        lasted one interval; else it goes on, and the next check is one interval away. After a
        row of fast failures (not quarantined yet): failing checks quarantine the node, passing
        ones end the row (the failures were the tasks' own)."""
        with self._lock:
            now = self._clock.monotonic()
            if self._since is None and self._suspect:
                if problems:
                    self._since, self._why, self._problems = now, self._suspect, list(problems)
                    self._next_check = now + self.check_seconds
                    log.error(
                        "quarantined: %s; this node's checks fail: %s",
                        self._suspect,
                        "; ".join(problems),
                    )
                else:
                    log.info(
                        "%s, but this node passes its own checks: the failures are the tasks'"
                        " own; claiming on",
                        self._suspect,
                    )
                    self._fails = 0
                    self._fail_jobs.clear()
                    self._no_faults()
                self._suspect = ""
                return
            if self._since is None:
                return
            changed = problems != self._problems
            self._problems = list(problems)
            served = now - self._since >= self.check_seconds
            if not problems and served:
                log.info("quarantine ends: this node passes its own checks; claiming again")
                self._since, self._problems = None, None
                self._fails = 0
                self._fail_jobs.clear()
                self._no_faults()
                return
            if problems and changed:
                log.error("quarantined: this node's checks fail: %s", "; ".join(problems))
            # Failing: look again in one interval. Passing this soon: once it has lasted one.
            self._next_check = (
                now + self.check_seconds if problems else self._since + self.check_seconds
            )


class RevokedBackoff:
    def __init__(self, clock: Clock, rng: random.Random) -> None:
        self._clock = clock
        self._backoff = Backoff(Policy(REVOKED_FIRST_S, REVOKED_CAP_S, jitter=(0.8, 1.0)), rng)
        self._lock = threading.Lock()
        self._until: float | None = None
        self._why = ""

    def record(self, e: Ending, lease_id: str) -> None:
        with self._lock:
            if e.outcome is Outcome.COMMITTED:
                self._backoff.reset()
            elif e.outcome is Outcome.LOST and REVOKED.search(e.reason):
                wait = self._backoff.next()
                self._until = self._clock.monotonic() + wait
                self._why = (
                    f"the coordinator's watchdog revoked lease {lease_id} (job {e.job_id}: no"
                    f" progress); not claiming for {wait:.0f} s, so that another node may take"
                    " its task"
                )
                log.warning("%s", self._why)

    def hold(self) -> Hold | None:
        with self._lock:
            if self._until is None:
                return None
            if self._clock.monotonic() >= self._until:
                self._until = None
                log.info("the backoff after a revoked lease is over; claiming again")
                return None
            return Hold(
                "revoked",
                self._why,
                fix="none needed: it claims again by itself; a job that ships no checkpoint"
                " within its watchdog_seconds is revoked on every node",
            )
