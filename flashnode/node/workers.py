"""The node's workers: one per slot, each running one attempt on its own thread.

``Workers`` owns which slots are free, the running attempts by slot and their threads, starting
an attempt on a free slot (with the GPUs it asks for taken at once, so that the next claim sees
them held), applying the owner controls' stop and suspension to the running attempts,
cancelling them all, and waiting for them at shutdown. It counts how attempts ended
(``stats``) and keeps the latest ending (``last_ended``), for the status.

An attempt ends on its own thread; the ending is queued and handed to the loop by ``ended()``,
so what follows it (the node's holds, the claim pacing) runs on the loop's thread, never beside
it: this part's state is written under its lock only.

Not to be confused with the trusted runner's ``runners.slots.SlotPool``: the workers decide
*which* slot number an attempt runs in and keep its thread; the runner's pool, given that slot
number by the attempt, owns what lies between two tasks of the same slot on the host (its
user's turnover, the chain started ahead). Workers know nothing of users or sandboxes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashnode.attempt import Attempt, AttemptContext, Outcome
from flashnode.attempt.record import State
from flashnode.clock import Clock
from flashnode.config.settings import Settings
from flashnode.errors import AttemptFailed, AttemptLapsed, Stopped
from flashnode.evidence.gpupool import Device
from flashnode.node.decision import Decision
from flashnode.node.guard import Ending
from flashnode.runners.base import Handle

log = logging.getLogger(__name__)


def effective_slots(settings: Settings, gpus: int) -> int:
    """Attempts run at once: ``slots``, or with ``auto`` one per GPU (1 without GPUs)."""
    if settings.slots == "auto":
        return max(1, gpus)
    return settings.slots


@dataclass
class Stats:
    """Attempts started, and how many ended in each outcome."""

    started: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1


def describe_outcomes(outcomes: dict[str, int]) -> str:
    """``no attempt ended``, ``1 attempt ended: committed``, ``3 attempts ended: 2 committed,
    1 failed`` (the outcomes in their enum's order); tasks let go of for the next start have
    not ended: ``...; 1 task left running for the next start``."""
    left = outcomes.get(Outcome.DETACHED.value, 0)
    ended = {o: n for o, n in outcomes.items() if o != Outcome.DETACHED.value and n}
    total = sum(ended.values())
    order = [o.value for o in Outcome]
    counts = sorted(ended.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)
    if total == 0:
        text = "no attempt ended"
    elif total == 1:
        text = f"1 attempt ended: {counts[0][0]}"
    else:
        text = f"{total} attempts ended: " + ", ".join(f"{n} {o}" for o, n in counts)
    if left:
        text += f"; {left} task{'s' if left > 1 else ''} left running for the next start"
    return text


@dataclass(frozen=True)
class Ended:
    """An attempt that ended: how, after how long, and when (monotonic)."""

    attempt: Attempt
    outcome: Outcome
    seconds: float
    at: float

    @property
    def ending(self) -> Ending:
        """The ending as the node's own holds weigh it."""
        attempt, lease = self.attempt, self.attempt.lease
        return Ending(
            self.outcome,
            attempt.ended[1] if attempt.ended else "",
            lease.job_id if lease else "",
            attempt.node_fault,
            self.seconds,
            job_endpoint=attempt.job_endpoint,
            outgrew_room=attempt.outgrew_room,
            short_of_room=attempt.short_of_room,
        )


class Measured(Protocol):
    def cpu_seconds(self) -> float | None: ...


def task_cpu(attempts: Iterable[tuple[int, Measured]]) -> dict[str, float] | None:
    """Cumulative CPU seconds of each running attempt's task, by its key (for the ``load``
    rule); None when one of them cannot be measured, so that the rule never mistakes this
    node's own tasks for other programs."""
    found: dict[str, float] = {}
    for key, attempt in attempts:
        seconds = attempt.cpu_seconds()
        if seconds is None:
            return None
        found[str(key)] = seconds
    return found


class Workers:
    def __init__(self, ctx: AttemptContext, clock: Clock, wake: Callable[[], None]) -> None:
        """``ctx``: the edges (the GPU pool, the metrics, ``start_thread``) and the settings the
        node starts with: the runner made its slots for them, so no reload adds one.
        ``wake``: called once an attempt has settled (its slot is free) and once it has
        ended, to wake the loop."""
        self._ctx = ctx
        self._clock = clock
        self._wake = wake
        self._made = effective_slots(ctx.settings, len(ctx.gpus.devices))
        self._lock = threading.Lock()
        self._running: dict[int, Attempt] = {}
        self._ended: list[Ended] = []
        self.stats = Stats()
        self.last_ended: dict[str, Any] | None = None  # the latest attempt's end, for status

    # --- what runs ----------------------------------------------------------------------------

    def slots(self, settings: Settings) -> int:
        """Attempts run at once under ``settings``; never more than at the start, for which the
        runner made its slots (GPUs found later add none)."""
        return min(effective_slots(settings, len(self._ctx.gpus.devices)), self._made)

    def attempts(self) -> list[Attempt]:
        with self._lock:
            return list(self._running.values())

    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def leases(self) -> set[str]:
        """The leases running here."""
        return {a.record.lease_id for a in self.attempts()}

    def free_slot(self, settings: Settings) -> int | None:
        """The first slot that runs nothing and can run a task (the runner says). An attempt
        that settled (``Attempt.settled``) holds no slot while it writes its records."""
        used = {a.record.slot for a in self.attempts() if not a.settled}
        usable = self._ctx.runner.slot_usable
        return next((i for i in range(self.slots(settings)) if i not in used and usable(i)), None)

    def could_take(self, settings: Settings) -> bool:
        """A free slot that could serve a task: on a GPU node, with a free GPU."""
        gpus = self._ctx.gpus
        return self.free_slot(settings) is not None and not (gpus.devices and gpus.free == 0)

    def task_cpu(self) -> dict[str, float] | None:
        """Cumulative CPU seconds of every running attempt's task (for the ``load`` rule)."""
        with self._lock:
            attempts = list(self._running.items())
        return task_cpu(attempts)

    # --- starting and ending ------------------------------------------------------------------

    def start(self, lease: dict[str, Any], ctx: AttemptContext) -> None:
        """Run the claimed ``lease`` on a free slot, on a thread of its own, with ``ctx`` (the
        configuration it was claimed under)."""
        slot = self.free_slot(ctx.settings) or 0
        attempt = Attempt(ctx, lease, slot, self._reserve_gpus(lease))
        attempt.on_settled = self._wake  # its slot is free: the loop may claim for it
        with self._lock:
            self.stats.started += 1
            key = self.stats.started
            self._running[key] = attempt
        self._ctx.start_thread(lambda: self._run(key, attempt), f"attempt-{key}")

    def adopt(self, attempt: Attempt, handle: Handle) -> None:
        """Carry on, in its recorded slot, an attempt whose task an earlier run of the agent
        let go of (``handle``: that task, rejoined)."""
        attempt.handle = handle  # its processes are the node's from now (the courtesy asks)
        attempt.on_settled = self._wake
        with self._lock:
            self.stats.started += 1
            key = self.stats.started
            self._running[key] = attempt
        self._ctx.start_thread(lambda: self._run(key, attempt, handle), f"attempt-{key}")

    def _reserve_gpus(self, lease: dict[str, Any]) -> list[Device]:
        """Take the GPUs a lease asks for now, in the loop, so that the next claim already
        sees them held; the attempt checks the request properly (and ends it with a reason)."""
        payload = lease.get("payload")
        want = payload.get("gpus") if isinstance(payload, dict) else None
        if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
            return []
        try:
            return self._ctx.gpus.acquire(want)
        except AttemptFailed:
            return []

    def _run(self, key: int, attempt: Attempt, rejoined: Handle | None = None) -> None:
        outcome = Outcome.FAILED
        started = self._clock.monotonic()
        try:
            outcome = attempt.run() if rejoined is None else attempt.rejoin(rejoined)
        finally:
            now = self._clock.monotonic()
            with self._lock:
                self._running.pop(key, None)
                self._ended.append(Ended(attempt, outcome, now - started, now))
                self.stats.count(outcome)
                self._last(attempt, outcome)
            self._wake()

    def count(self, outcome: Outcome) -> None:
        """Count the ending of an attempt run elsewhere (recovered at the start)."""
        with self._lock:
            self.stats.count(outcome)

    def _last(self, attempt: Attempt, outcome: Outcome) -> None:
        lease = attempt.lease
        self.last_ended = {
            "lease_id": attempt.lease_id,
            "job_id": lease.job_id if lease else "",
            "task_id": lease.task_id if lease else "",
            "outcome": outcome.value,
            "reason": attempt.ended[1] if attempt.ended else "",
            "ended_at": self._clock.wall(),
        }

    def outcomes(self) -> dict[str, int]:
        """How many attempts ended in each outcome so far."""
        with self._lock:
            return dict(self.stats.outcomes)

    def summary(self) -> str:
        """The attempts that ended, in words: ``3 attempts ended: 2 committed, 1 failed``."""
        return describe_outcomes(self.outcomes())

    def ended(self) -> list[Ended]:
        """The attempts that ended since the last call, for the loop to act on."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    # --- stopping -----------------------------------------------------------------------------

    def obey(self, decision: Decision, grace: float) -> None:
        """Apply the owner controls' word to the running attempts: stop them (not the tasks'
        fault: the lease lapses) or suspend their tasks until the rule clears."""
        attempts = self.attempts()
        for attempt in attempts:
            # A finished result (its task ran, its outputs are spooled) is still committed:
            # the pause stops tasks.
            if decision.stop_reason and attempt.record.state is not State.FINISHED:
                attempt.cancel(Stopped(decision.stop_reason), grace)
            attempt.request_suspension(decision.suspend_reason)
        suspended = sum(a.suspended_since is not None for a in attempts)
        # One that settled is only writing its records: the next task may hold its slot.
        self._ctx.metrics.set_running(sum(not a.settled for a in attempts), suspended)

    def cancel_all(self, ending: AttemptLapsed, grace: float) -> None:
        for attempt in self.attempts():
            attempt.cancel(ending, grace)

    def detach_all(self, grace: float) -> None:
        """The agent restarts: running tasks are let go of; other attempts are stopped."""
        for attempt in self.attempts():
            attempt.detach(grace)

    def wait_all(self, deadline: float, wake: threading.Event, tick: Callable[[], None]) -> int:
        """Wait until every attempt has ended or ``deadline`` (monotonic) passes, calling
        ``tick`` about every half second; how many are still running."""
        while self.running() and self._clock.monotonic() < deadline:
            tick()
            self._clock.wait(wake, 0.5)
            wake.clear()
        return self.running()
