"""The running attempt: what it holds while its phases run, and the hooks they share.

``AttemptHooks`` is the state every phase reads and the agent's loop looks at (its lease, its
workspace once staged, its GPUs, the task's handle and use, its facts), with the hooks on it: a
phase checks whether it must stop (``check``; every wait ends on ``stop``), times itself
(``timed``), counts the bytes it moved, and tells what it made through a hook (``report``,
``started``, ``evidence``, ``shipped``...): only these write the attempt's record and its live
view, never a phase itself. A phase is handed the attempt as an ``AttemptView``: its state to
read, its hooks to call, nothing to assign (mypy holds it; tests/test_architecture.py holds that
no phase writes inside its record). The loop reads ``snapshot``, asks for a suspension and
cancels. The orchestrator
(``attempt/orchestrator.py``) is the ``Attempt`` built on it; the phases
(``attempt/phases/``) are handed this and see nothing of the orchestrator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

from flashnode.attempt.context import AttemptContext
from flashnode.attempt.diskbudget import Budget
from flashnode.attempt.guards.base import Asks
from flashnode.attempt.guards.supervisor import PauseLog
from flashnode.attempt.keeper import LeaseKeeper
from flashnode.attempt.record import AttemptRecord, Finished, Outcome, Staged, State
from flashnode.coordinator.lease import Lease
from flashnode.coordinator.messages import ExecutionEvidence
from flashnode.errors import AttemptFailed, AttemptLapsed, LeaseLost, Stopped, disk_full
from flashnode.evidence.gpupool import Device
from flashnode.runners.base import Handle, RunResult
from flashnode.runners.plan import Contribution

log = logging.getLogger(__name__)

PAUSES_KEPT = 20  # the pauses an attempt's record lists (all are counted)

# Who suspends a task: the owner's controls (the loop), the owner's use of its GPU, heat.
SuspendSource = Literal["owner", "gpu", "heat"]


class Watcher(Protocol):
    """Something that runs beside the task (e.g. the checkpoint relay): ``start`` once the task
    started, ``finish`` once its main process exited (a last sweep; it must not raise)."""

    def start(self, a: AttemptView) -> None: ...
    def finish(self, a: AttemptView) -> None: ...
    def stop(self) -> None:
        """The agent let go of the task (``Detached``): stop watching, nothing more."""


class AttemptView(Asks, PauseLog, Protocol):
    """The attempt as its phases, its watchers and its guards see it: its state to read and its
    hooks to call, nothing to assign (``AttemptHooks`` is it; mypy holds a phase to this)."""

    @property
    def ctx(self) -> AttemptContext: ...
    @property
    def record(self) -> AttemptRecord: ...
    @property
    def keeper(self) -> LeaseKeeper | None: ...
    @property
    def lease_id(self) -> str: ...
    @property
    def staged(self) -> Staged | None: ...
    @property
    def devices(self) -> list[Device]: ...
    @property
    def handle(self) -> Handle | None: ...
    @property
    def result(self) -> RunResult | None: ...
    @property
    def during_run(self) -> list[Watcher]: ...
    @property
    def suspended_since(self) -> float | None: ...
    @property
    def output_sha256(self) -> str: ...
    @property
    def stop(self) -> threading.Event: ...
    @property
    def wake(self) -> threading.Event: ...
    @property
    def budget(self) -> Budget: ...

    def check(self) -> None: ...
    def timed(self, name: str, phase: bool = True) -> contextlib.AbstractContextManager[None]: ...
    def count_staged(self, nbytes: int) -> None: ...
    def count_uploaded(self, nbytes: int) -> None: ...
    def cancel(self, ending: AttemptFailed | AttemptLapsed, grace: float) -> None: ...
    def lease_renewed(self, seconds: float) -> None: ...
    def staging(self) -> None: ...
    def hold_gpus(self, devices: list[Device]) -> None: ...
    def report(self, name: str, facts: Any) -> None: ...
    def environment_pinned(self, key: str) -> None: ...
    def restored(self, step: int, relayed: tuple[str, int] | None) -> None: ...
    def beside(self, watcher: Watcher) -> None: ...
    def started(self, identity: dict[str, Any], task_uid: int | None) -> None: ...
    def running(self, handle: Handle, usage: dict[str, float | None] | None) -> None: ...
    def ran(self, result: RunResult | None) -> None: ...
    def evidence(
        self,
        evidence: ExecutionEvidence,
        task_usage: dict[str, Any],
        paused_seconds: float,
        pause_count: int,
    ) -> None: ...
    def shipped(self, step: int, relayed: tuple[str, int]) -> None: ...
    def metrics_uploaded(self, sha256: str) -> None: ...
    def spool(self, finished: Finished) -> None: ...


class AttemptHooks:
    """One attempt's state and the hooks its phases and the agent's loop use; the ``Attempt``
    (``attempt/orchestrator.py``) runs it."""

    def __init__(
        self,
        ctx: AttemptContext,
        lease_data: Any,
        slot: int = 0,
        reserved: list[Device] | None = None,
        record: AttemptRecord | None = None,
    ) -> None:
        """``reserved``: GPUs the agent already took for this lease when it claimed it.

        The attempt keeps the context it was claimed under (``Reloader.snapshot``): it is
        frozen, and so are the settings and per-task limits in it, so a reload, which swaps
        them for the next claim, never changes them halfway through this attempt (caps,
        timeouts and grace periods stay what they were)."""
        self.ctx = ctx
        self.data = lease_data
        self.record = record or AttemptRecord(
            lease=lease_data if isinstance(lease_data, dict) else {},
            slot=slot,
            claimed_at=ctx.clock.wall(),
        )
        # None until the claim answer's envelope is read (and where it cannot be: ``_drop``).
        self.lease: Lease | None = None
        # The workspace once staged (or read back): the attempt's end seals or retires it.
        self.staged: Staged | None = None
        self.keeper: LeaseKeeper | None = None  # renews the lease while the phases run
        self.devices: list[Device] = list(reserved or [])
        self.handle: Handle | None = None  # the task, once started
        self.usage: dict[str, float | None] | None = None  # the task's use now, while it runs
        self.result: RunResult | None = None  # how the task ended, once it has
        self.output_sha256 = ""  # metrics.json's, as the coordinator acknowledged it
        self.during_run: list[Watcher] = []  # started with the task, finished after it exits
        # What the phases before the run contributed to its start: released once it has ended.
        self._contributions: list[Contribution] = []
        # What phases report about themselves (env built or reused, bytes fetched, labels lent):
        # in the attempt's status while it runs, and in its ledger line.
        self.facts: dict[str, Any] = {}
        self.wake = threading.Event()  # the execute phase's wait: exit, cancel or loss
        self.stop = threading.Event()  # every wait of every phase ends when this is set
        self._ending: AttemptFailed | AttemptLapsed | None = None
        self.cancel_grace = 0.0
        self.detaching = False  # the agent restarts: a running task is let go of, not ended
        self.node_fault = False  # it lapsed through the node's fault (the black-hole guard)
        self.job_endpoint = False  # ... at an endpoint the job named (AttemptLapsed)
        self.outgrew_room = False  # ... past the room the disk had for it (OutgrewRoom)
        self.short_of_room: tuple[int, int] | None = None  # bytes, inodes (ShortOfRoom)
        self.ended: tuple[Outcome, str] | None = None  # its outcome and reason, once recorded
        # Committed: what is left (its workspace, logs, outbox record, ledger line) needs no
        # slot, so the slot may take the next task meanwhile. Other endings are not settled
        # early: the node's holds learn of them (a quarantine) before the next claim.
        self.settled = False
        self.on_settled: Callable[[], None] = lambda: None
        self.phase = "claimed"
        self._drop_reason = "malformed lease"
        # Owner controls and the courtesy (they ask, the execute phase acts) and the live view.
        # who asks (SuspendSource) -> (why, since when: monotonic)
        self._suspensions: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()  # suspensions and the ending, asked from two threads
        self.suspended_since: float | None = None  # monotonic, while the task is suspended
        self.pauses: list[dict[str, Any]] = []  # the task's pauses that ended: at, seconds, why
        self.bytes_staged = 0
        self.bytes_uploaded = 0

    # --- what the agent sees ------------------------------------------------------------------

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id if self.lease else "?"

    def describe(self) -> str:
        lease = self.lease
        return f"{lease.lease_id} ({lease.job_id}/{lease.task_id})" if lease else "a new lease"

    def snapshot(self) -> dict[str, Any]:
        """For status.json (``flashnode status``): times are wall clock, so that a reader can
        say how long ago or how long from now. Empty for an attempt whose lease is not read."""
        lease = self.lease
        if lease is None:
            return {}
        clock = self.ctx.clock
        now, wall = clock.monotonic(), clock.wall()
        keeper, since = self.keeper, self.suspended_since
        snap: dict[str, Any] = {
            "lease_id": lease.lease_id,
            "job_id": lease.job_id,
            "task_id": lease.task_id,
            "pool": self.staged.task.pool if self.staged else None,
            "attempt_number": lease.attempt_number,
            "started_at": self.record.claimed_at,
            "phase": self.phase,
            "slot": self.record.slot,
            "gpus": [d.visible for d in self.devices],
            "checkpoints": self.record.checkpoints_shipped,
            "checkpoint_step": self.record.checkpoint_step,
            "resumed_from_step": self.record.resumed_from_step,
            "lease_expires_at": wall + keeper.deadline - now if keeper else None,
            "suspended_since": wall - (now - since) if since is not None else None,
            "suspend_reason": self.suspend_reason if since is not None else None,
            "bytes_staged": self.bytes_staged,
            "bytes_uploaded": self.bytes_uploaded,
            "last_output": self.last_output(),
            "usage": dict(self.usage) if self.usage is not None else None,
        }
        pauses = list(self.pauses)  # those that ended; the present one is suspended_since
        if pauses:
            snap["pauses"] = {
                "count": len(pauses),
                "seconds": round(sum(p["seconds"] for p in pauses), 1),
                "list": pauses[-1:],
            }
        for key, value in list(self.facts.items()):  # phases add to it on their thread
            snap.setdefault(key, value)
        return snap

    def last_output(self) -> str:
        handle = self.handle
        if handle is None:
            return ""
        try:
            return handle.last_output()
        except Exception:  # the live view must never break the loop
            return ""

    def cpu_seconds(self) -> float | None:
        """The task's CPU seconds so far (0 before it started), None where not measurable."""
        handle = self.handle
        if handle is None:
            return 0.0
        try:
            return handle.cpu_seconds()
        except Exception:
            return None

    @property
    def suspend_reason(self) -> str | None:
        """Why the task should be suspended now (every source's word), None: it runs."""
        return "; ".join(why for why, _ in self._suspensions.values()) or None

    @property
    def suspend_sources(self) -> dict[str, float]:
        """Each source that asks for a suspension now, with since when (monotonic)."""
        return {source: since for source, (_, since) in self._suspensions.items()}

    def request_suspension(self, reason: str | None, source: SuspendSource = "owner") -> None:
        """``source`` asks that the task be suspended (``reason``) or no longer (None); it runs
        once no source asks. The execute phase acts on it; a task that is not running yet
        starts suspended; one that a source has held suspended longer than
        ``max_suspend_seconds`` gives its lease back (the owner's use of its GPU: longer than
        ``gpu_yield_stop_seconds`` and that again, should the courtesy not stop it first)."""
        with self._lock:
            before = bool(self._suspensions)
            now = dict(self._suspensions)
            if reason is None:
                now.pop(source, None)
            else:
                since = now[source][1] if source in now else self.ctx.clock.monotonic()
                now[source] = (reason, since)
            self._suspensions = now
        if before != bool(now):
            self.wake.set()

    def count_staged(self, nbytes: int) -> None:
        """Bytes brought in for the task (inputs, data): the live view and the metrics."""
        self.bytes_staged += nbytes
        self.ctx.metrics.downloaded(nbytes)

    def count_uploaded(self, nbytes: int) -> None:
        """Bytes uploaded for the attempt (outputs, logs, checkpoints)."""
        self.bytes_uploaded += nbytes
        self.ctx.metrics.uploaded(nbytes)

    def cancel(self, ending: AttemptFailed | AttemptLapsed, grace: float) -> None:
        """Stop the attempt wherever it is (the task: TERM, ``grace`` seconds, KILL) and end it
        with ``ending``: AttemptLapsed when it is not the task's fault."""
        with self._lock:
            if self._ending is None:
                self.cancel_grace = grace
                self._ending = ending
        self.stop.set()
        self.wake.set()

    def lease_renewed(self, seconds: float) -> None:
        """The lease lives ``seconds`` from now (a renewal, or the task's start): its task's
        supervisor ends the task then at the latest if the agent is gone by then."""
        handle = self.handle
        if handle is None:
            return
        # A supervisor gone is for the task's wait to see, not the keeper.
        with contextlib.suppress(Exception):
            handle.lease_left(seconds)

    def detach(self, grace: float) -> None:
        """The agent restarts: a running task is let go of (``Handle.detach``) for the next
        agent to rejoin; an attempt anywhere else is cancelled as ``Stopped`` with ``grace``."""
        self.detaching = True
        self.cancel(Stopped("agent stopping"), grace)

    # --- what phases make: only these write the attempt's record and its live view ----------

    def staging(self) -> None:
        """The workspace is being made (in memory: no process exists yet)."""
        self.record.state = State.STAGING

    def hold_gpus(self, devices: list[Device]) -> None:
        """The GPUs the attempt holds from now (released at its end)."""
        self.devices = devices

    def report(self, name: str, facts: Any) -> None:
        """What a phase tells of itself (the job environment, the data it fetched, the labels
        lent): in the attempt's status while it runs, and in its ledger line."""
        self.facts[name] = facts

    def environment_pinned(self, key: str) -> None:
        """The job environment the task runs in: pinned again by an agent that rejoins it."""
        self.record.environment = key

    def restored(self, step: int, relayed: tuple[str, int] | None) -> None:
        """The task resumes from checkpoint ``step`` (the relay's start: ``relayed``)."""
        self.record.resumed_from_step = step
        self.record.relayed = relayed

    def beside(self, watcher: Watcher) -> None:
        """``watcher`` runs beside the task: started with it, finished after it exits."""
        self.during_run.append(watcher)

    def started(self, identity: dict[str, Any], task_uid: int | None) -> None:
        """The task's processes may exist from now: its identity (what a restarted agent
        rejoins it by) kept in the outbox before anything starts."""
        self.record.process, self.record.task_uid = identity, task_uid
        self.record.task_started_at = self.ctx.clock.wall()
        self.record.gpus = [d.visible for d in self.devices]
        self.save(State.RUNNING)

    def running(self, handle: Handle, usage: dict[str, float | None] | None) -> None:
        """The task runs: its handle, and its use now as the sampler keeps it (live view)."""
        self.handle, self.usage = handle, usage

    def ran(self, result: RunResult | None) -> None:
        """The task has ended (``result``), or its end is not for this agent to read (None: it
        runs on for the next one); its live use is gone."""
        self.result, self.usage, self.suspended_since = result, None, None

    def paused(self, since: float | None) -> None:
        """The task is paused since ``since`` (monotonic), or runs again (None)."""
        self.suspended_since = since

    def pause_ended(self, entry: dict[str, Any]) -> None:
        """A pause ended: ``at`` (wall clock), ``seconds``, ``why``; the latest kept."""
        self.pauses.append(entry)
        del self.pauses[:-PAUSES_KEPT]

    def keep_paused(self, seconds: float, frozen_since: float | None = None) -> None:
        """Its time paused so far (earlier runs of the agent included), in its record: a
        restart counts it neither as its running time nor against its timeout; nor the time it
        stays frozen after the agent let go of it paused (``frozen_since``, wall clock) until
        the next agent takes it over (``execute.rejoin``)."""
        timings = self.record.timings
        timings["suspended"] = round(seconds, 4)
        if frozen_since is None:
            timings.pop("frozen_at", None)
        else:
            timings["frozen_at"] = round(frozen_since, 3)
        try:
            self.save(State.RUNNING)
        except OSError as exc:  # a full disk: only a restart's count would be off
            log.warning("cannot keep its time suspended: %s", exc)

    def evidence(
        self,
        evidence: ExecutionEvidence,
        task_usage: dict[str, Any],
        paused_seconds: float,
        pause_count: int,
    ) -> None:
        """What the run's end says of it: its evidence, its own use, its pauses."""
        record = self.record
        record.evidence, record.task_usage = evidence, task_usage
        if paused_seconds > 0:
            record.timings["suspended"] = round(paused_seconds, 4)
        if self.pauses:
            self.facts["pauses"] = {
                "count": pause_count,
                "seconds": round(paused_seconds, 1),
                "list": self.pauses[-PAUSES_KEPT:],
            }

    def shipped(self, step: int, relayed: tuple[str, int]) -> None:
        """Checkpoint ``step`` is the coordinator's: what an agent that rejoins the task relays
        from, kept in the outbox (a full disk costs only a restart's relay a step)."""
        record = self.record
        record.checkpoints_shipped += 1
        record.checkpoint_step = step
        record.relayed = relayed
        try:
            self.ctx.outbox.write(record)
        except OSError as exc:
            log.warning("cannot keep the shipped step: %s", exc)

    def metrics_uploaded(self, sha256: str) -> None:
        """metrics.json's digest, as the coordinator acknowledged its upload."""
        self.output_sha256 = sha256

    def spool(self, finished: Finished) -> None:
        """The checked result into the record, kept durably; on a full disk it is committed
        all the same, with no durable record (the one on disk says running)."""
        finished.spool(self.record)
        try:
            self.save(State.FINISHED, durable=True)
        except OSError as exc:
            if disk_full(exc) is None:
                raise
            # A computed result is not given up for a full disk: committing it reads, never
            # writes. Not spooled, it is not kept for a next start either.
            self.record.state = State.RUNNING
            log.warning(
                "the result cannot be spooled (disk full);"
                " committing it now without a durable record"
            )

    # --- what phases use ----------------------------------------------------------------------

    @property
    def budget(self) -> Budget:
        """The attempt's disk budget for what the agent writes for it before its task starts
        (``diskbudget.py``); the execute phase's ``release`` ends it with the task's."""
        ctx = self.ctx
        return Budget(ctx.reserved, self.lease_id, ctx.settings, ctx.space)

    def check(self) -> None:
        """Raise if the attempt must stop: its lease is lost, or it was cancelled."""
        if self.keeper is not None and self.keeper.lost.is_set():
            raise LeaseLost(self.keeper.reason)
        if self._ending is not None:
            raise self._ending

    @property
    def cancelled(self) -> AttemptFailed | AttemptLapsed | None:
        return self._ending

    @property
    def lease_lost(self) -> bool:
        return self.keeper is not None and self.keeper.lost.is_set()

    def save(self, state: State, durable: bool = False) -> None:
        """Move the record to ``state`` and write it to the outbox (what a phase changed in
        ``record`` with it)."""
        self.record.state = state
        self.ctx.outbox.write(self.record, durable=durable)

    @contextlib.contextmanager
    def timed(self, name: str, phase: bool = True) -> Iterator[None]:
        """Add the time spent inside to ``timings[name]`` (the ledger's per-phase timers);
        ``phase``: it is a phase, shown in the live view (else a step inside one)."""
        start = time.monotonic()
        if phase:
            self.phase = name
        try:
            yield
        finally:
            self.record.timings[name] = round(
                self.record.timings.get(name, 0.0) + time.monotonic() - start, 4
            )
