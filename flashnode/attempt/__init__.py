"""One lease from claim to commit (docs/design.md §1), as a list of phases over one AttemptRecord.

The orchestrator only sequences phases and turns how they end into one outcome:

    prepare → stage → restore → environment → data → execute → check → commit

Each phase is a function in its own module, of the running ``Attempt`` (its hooks) and of what
the phases before it made, which it is handed as arguments (``record.Staged``, the run's evidence,
``record.Finished``); what it makes, it returns. A new capability arrives as a new phase, not as a
branch in an old one. Between phases, and inside every wait, the attempt checks whether it must
stop (a lost lease, a cancel): cancellation is a state every phase sees.

How an attempt ends (docs/design.md §5, whose fault):

* ``AttemptFailed`` — the task's own fault: reported with ``fail``;
* ``AttemptLapsed`` — not the task's fault (drain, stop, restart, what the node lacks): the lease
  is left to lapse and the reason goes to the ledger;
* ``LeaseLost`` — the lease died: nothing more is uploaded or reported.

Whatever raises, every attempt ends in exactly one ledger line, its GPUs released, its workspace
and outbox record removed; unless a finished result waits in the outbox for the next start:
then its workspace is sealed (the agent's alone) until that start commits it.

Why one module of this size: the Attempt's shared state and hooks, which every phase reads, live
beside the orchestrator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

from flashnode.attempt import commit, data, environment, execute, prepare, restore, stage
from flashnode.attempt.context import AttemptContext, CoordinatorPort
from flashnode.attempt.keeper import LeaseKeeper
from flashnode.attempt.record import AttemptRecord, Outcome, Staged, State, workspace_of
from flashnode.coordinator.wire import ExecutionEvidence, Lease, parse_lease
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    Cancelled,
    CredentialsError,
    LeaseLost,
    NoRoom,
    OutgrewRoom,
    Stopped,
    disk_full,
    disk_full_error,
)
from flashnode.evidence.gpupool import Device
from flashnode.runners.base import Handle, RunResult
from flashnode.runners.plan import Contribution
from flashnode.sandbox import logcap
from flashnode.sandbox.removal import remove_tree

__all__ = ["PHASES", "Attempt", "AttemptContext", "CoordinatorPort", "LeaseKeeper", "Outcome"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class Watcher(Protocol):
    """Something that runs beside the task (e.g. the checkpoint relay): ``start`` once the task
    started, ``finish`` once its main process exited (a last sweep; it must not raise)."""

    def start(self, a: Attempt) -> None: ...
    def finish(self, a: Attempt) -> None: ...


# The phases of a claimed lease, in order (``Attempt._phases``), by the names the live view
# and the ledger's timings give them; a result resumed from the outbox goes through the last two.
PHASES = ("prepare", "stage", "restore", "environment", "data", "execute", "check", "commit")


class Attempt:
    """Runs one claimed lease to its outcome. ``run``, ``resume`` and ``abandon`` never raise."""

    def __init__(
        self,
        ctx: AttemptContext,
        lease_data: Any,
        slot: int = 0,
        reserved: list[Device] | None = None,
        record: AttemptRecord | None = None,
    ) -> None:
        """``reserved``: GPUs the agent already took for this lease when it claimed it.

        The attempt keeps the context it was claimed under: a copy, so that a reload, which
        swaps the agent's settings and per-task limits for the next claim, never changes them
        halfway through this attempt (caps, timeouts and grace periods stay what they were)."""
        self.ctx = dataclasses.replace(ctx)
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
        self.node_fault = False  # it lapsed through the node's fault (the black-hole guard)
        self.job_endpoint = False  # ... at an endpoint the job named (AttemptLapsed)
        self.outgrew_room = False  # ... past the room the disk had for it (OutgrewRoom)
        self.ended: tuple[Outcome, str] | None = None  # its outcome and reason, once recorded
        self.phase = "claimed"
        self._drop_reason = "malformed lease"
        # Owner controls (the loop asks, the execute phase acts) and the live view.
        self.suspend_reason: str | None = None  # why the task should be suspended now
        self.suspended_since: float | None = None  # monotonic, while the task is suspended
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
        snap = {
            "lease_id": lease.lease_id,
            "job_id": lease.job_id,
            "task_id": lease.task_id,
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

    def request_suspension(self, reason: str | None) -> None:
        """Ask that the task be suspended (``reason``) or run again (None). The execute phase
        acts on it; a task that is not running yet starts suspended, one that is suspended
        longer than ``max_suspend_seconds`` gives its lease back."""
        change = (reason is None) != (self.suspend_reason is None)
        self.suspend_reason = reason
        if change:
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
        if self._ending is None:
            self.cancel_grace = grace
            self._ending = ending
        self.stop.set()
        self.wake.set()

    # --- what phases use ----------------------------------------------------------------------

    def check(self) -> None:
        """Raise if the attempt must stop: its lease is lost, or it was cancelled."""
        if self.keeper is not None and self.keeper.lost.is_set():
            raise LeaseLost(self.keeper.reason)
        if self._ending is not None:
            raise self._ending

    @property
    def cancelled(self) -> AttemptFailed | AttemptLapsed | None:
        return self._ending

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

    # --- entry points -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Claim to commit, for a freshly claimed lease."""
        lease = self._parse()
        if lease is None:
            return self._drop()
        log.info(
            "lease %s: claimed %s/%s (attempt %d)",
            lease.lease_id,
            lease.job_id,
            lease.task_id,
            lease.attempt_number,
        )
        return self._guarded(lease, self._phases)

    def resume(self) -> Outcome:
        """Upload and commit an attempt that finished before the agent restarted (the outbox).
        The outputs are checked again; if the lease died meanwhile, the result is lost."""
        lease = self._parse()
        if lease is None:
            return self._drop()
        log.info("lease %s: resuming the commit of a finished attempt", self.lease_id)
        return self._guarded(lease, self._resumed)

    def abandon(self, reason: str) -> Outcome:
        """End an attempt a previous run of the agent left unfinished (its processes were
        reaped): not the task's fault, so its lease is left to lapse; nothing is run."""
        lease = self._parse()
        if lease is None:
            return self._drop()
        log.warning("lease %s: %s; letting its lease lapse", lease.lease_id, reason)
        workspace_of(self.ctx.settings.state_dir, lease.lease_id).remove()
        self.ctx.outbox.remove(lease.lease_id)
        self._record(Outcome.LAPSED, reason)
        return Outcome.LAPSED

    # --- the phases ---------------------------------------------------------------------------

    def _phases(self, lease: Lease) -> tuple[Outcome, str]:
        """Claim to commit: each phase is handed what the phases before it made."""
        task = self._phase("prepare", prepare.run, self, lease)
        with self._in("stage"):
            self.staged = staged = stage.make(self, lease, task)
            stage.run(self, staged)
        got = self._contributions
        got.append(self._phase("restore", restore.run, self, staged))
        got.append(self._phase("environment", environment.run, self, task))
        got.append(self._phase("data", data.run, self, staged))
        evidence = self._phase("execute", execute.run, self, staged, tuple(got))
        finished = self._phase("check", commit.check, self, staged, evidence)
        return self._phase("commit", commit.commit, self, staged, finished)

    def _resumed(self, lease: Lease) -> tuple[Outcome, str]:
        """A finished result from the outbox: what the first path staged and spooled is read
        back from its record, checked again, and committed."""
        with self._in("check"):
            self.staged = staged = Staged.read_back(lease, self.record, self.ctx.settings.state_dir)
            finished = commit.recheck(self, staged)
        return self._phase("commit", commit.commit, self, staged, finished)

    def _phase(self, name: str, phase: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        with self._in(name):
            return phase(*args, **kwargs)

    @contextlib.contextmanager
    def _in(self, name: str) -> Iterator[None]:
        """One phase: entered only while the attempt goes on, and timed."""
        self.check()
        with self.timed(name):
            yield

    # --- the guard ----------------------------------------------------------------------------

    def _parse(self) -> Lease | None:
        try:
            self.lease = parse_lease(self.data)
        except ValueError as exc:
            self._drop_reason = str(exc)
        return self.lease

    def _guarded(self, lease: Lease, phases: Callable[[Lease], tuple[Outcome, str]]) -> Outcome:
        self.keeper = keeper = LeaseKeeper(
            self.ctx.coordinator, lease, self.ctx.clock, self._lost, self.ctx.rng
        )
        self.ctx.start_thread(keeper.run, f"keeper-{lease.lease_id}")
        outcome, reason = Outcome.FAILED, ""
        try:
            outcome, reason = phases(lease)
        except (LeaseLost, CredentialsError) as exc:
            outcome, reason = self._lost_reason(exc)
        except Cancelled:
            outcome, reason = self._interrupted()
        except AttemptLapsed as exc:
            outcome, reason = self._lapse(exc)
        except AttemptFailed as exc:
            outcome, reason = self._failed(exc)
        except Exception as exc:
            full = disk_full(exc)  # a write of the agent's, wherever it was: the node's fault
            if full is not None:
                outcome, reason = self._lapse(disk_full_error(full))
            else:  # a bug: still end the attempt cleanly and keep the agent up
                log.exception("lease %s: unexpected error", lease.lease_id)
                outcome, reason = commit.report_failure(self, f"agent error ({type(exc).__name__})")
        finally:
            ended = time.monotonic()
            keeper.stop()
            execute.release(self)
            self._release_contributions()
        keep = outcome is Outcome.LAPSED and self.record.state is State.FINISHED
        if keep:
            log.warning("lease %s: its finished result stays in the outbox", lease.lease_id)
            try:
                if self.staged is not None:
                    self.staged.workspace.seal()
            except OSError as exc:  # the result stays: it is checked again when committed
                log.error("lease %s: cannot seal its workspace: %s", lease.lease_id, exc)
        else:
            try:
                if self.staged is not None:
                    retired = self.staged.workspace.retire()
                    if retired is not None:
                        self._keep_logs(retired / "logs")
                        self.ctx.later(lambda: remove_tree(retired))
                self.ctx.outbox.remove(lease.lease_id)
            except Exception:  # a cleanup that fails must not cost the ledger line
                log.exception("lease %s: cleanup failed", lease.lease_id)
        # After the phases: stopping the keeper, the task's leftovers, workspace and record.
        self.record.timings["end"] = round(time.monotonic() - ended, 4)
        self._record(outcome, reason)
        return outcome

    def _release_contributions(self) -> None:
        """Give back what the phases hold for the task (a pinned job environment, pinned
        dataset slices), the last contributed first, each once."""
        got, self._contributions = self._contributions, []
        for part in reversed(got):
            if part.release is None:
                continue
            try:
                part.release()
            except Exception:  # one failed release must not skip the others
                log.exception("lease %s: a release failed", self.lease_id)

    def _keep_logs(self, logs: Path) -> None:
        """What the task printed stays readable after its end (``flashnode logs LEASE``, the
        console's history): the latest ``keep_logs`` attempts' output."""
        count, state_dir = self.ctx.settings.keep_logs, self.ctx.settings.state_dir
        if count > 0 and self.handle is not None:  # a task ran: there is output to keep
            logcap.keep(logs, state_dir, self.lease_id)
            self.ctx.later(lambda: logcap.rotate(state_dir, count))

    def _lost(self) -> None:
        self.stop.set()
        self.wake.set()

    def _lost_reason(self, exc: Exception) -> tuple[Outcome, str]:
        reason = (self.keeper.reason if self.keeper else "") or str(exc) or "lease lost"
        log.warning("lease %s: lost, nothing more is reported: %s", self.lease_id, reason)
        return Outcome.LOST, reason

    def _interrupted(self) -> tuple[Outcome, str]:
        """A wait was cut short: by a lost lease or by a cancel."""
        try:
            self.check()
        except (LeaseLost, CredentialsError) as exc:
            return self._lost_reason(exc)
        except AttemptLapsed as exc:
            return self._lapse(exc)
        except AttemptFailed as exc:
            return self._failed(exc)
        return self._lapse(Stopped("interrupted"))

    def _failed(self, exc: AttemptFailed) -> tuple[Outcome, str]:
        """The task's fault, unless a full disk is what made it fail."""
        full = disk_full(exc)
        if full is not None:
            return self._lapse(disk_full_error(full))
        return commit.report_failure(self, str(exc))

    def _lapse(self, ending: AttemptLapsed) -> tuple[Outcome, str]:
        """Not the task's fault: the lease is left to lapse. ``node_fault`` says whether the
        node is to blame (not an owner's or a service manager's stop)."""
        # A task the disk had no room for: the disk hold's business, not the guard's.
        self.node_fault = not isinstance(ending, (Stopped, NoRoom))
        self.job_endpoint = ending.job_endpoint
        self.outgrew_room = isinstance(ending, OutgrewRoom)
        log.warning("lease %s: %s; letting the lease lapse", self.lease_id, ending)
        return Outcome.LAPSED, str(ending)

    def _drop(self) -> Outcome:
        """A claim answer whose envelope is unusable: fail it if it names a lease, else drop."""
        self.ctx.gpus.release(self.devices)
        reason = self._drop_reason
        lease_id = self.data.get("lease_id") if isinstance(self.data, dict) else None
        if isinstance(lease_id, str) and commit.reportable(lease_id):
            log.error("lease %s: %s; failing it", lease_id, reason)
            commit.fail_quietly(self.ctx, lease_id, reason)
            self._record(Outcome.FAILED, reason, lease_id=lease_id)
            return Outcome.FAILED
        log.error("claim answer dropped: %s (it will expire on the coordinator)", reason)
        self._record(Outcome.DROPPED, reason)
        return Outcome.DROPPED

    def _record(self, outcome: Outcome, reason: str, lease_id: str = "") -> None:
        """The attempt's one ledger line; a ledger that cannot be written is logged, never
        raised."""
        lease = self.lease
        payload = self.data.get("payload") if isinstance(self.data, dict) else None
        try:
            digest = hashlib.sha256(
                json.dumps(payload, sort_keys=True, default=str).encode()
            ).hexdigest()
        except (TypeError, ValueError, RecursionError):
            digest = ""
        self.ended = (outcome, reason)
        evidence: ExecutionEvidence | None = self.record.evidence
        ended_at = self.ctx.clock.wall()
        entry = {
            "lease_id": lease.lease_id if lease else lease_id,
            "job_id": lease.job_id if lease else "",
            "task_id": lease.task_id if lease else "",
            "attempt_number": lease.attempt_number if lease else None,
            "payload_sha256": digest,
            "runner": self.ctx.runner.name,
            "evidence": evidence.model_dump() if evidence else None,
            "task_usage": self.record.task_usage or None,
            "gpus": [d.visible for d in self.devices],
            "slot": self.record.slot,
            "output_sha256": self.output_sha256,
            "resumed_from_step": self.record.resumed_from_step,
            "checkpoints_shipped": self.record.checkpoints_shipped,
            "checkpoint_step": self.record.checkpoint_step,
            "outcome": outcome.value,
            "reason": reason,
            "timings": dict(self.record.timings),
            "started_at": self.record.claimed_at,
            "ended_at": ended_at,
        }
        for key, value in self.facts.items():
            entry.setdefault(key, value)
        try:
            self.ctx.ledger.append(entry)
        except Exception as exc:
            log.error("lease %s: cannot write the ledger: %s", entry["lease_id"], exc)
        usage, started, ended = self.record.task_usage, self.record.claimed_at, ended_at
        self.ctx.metrics.attempt_finished(
            outcome.value,
            ended - started if started else None,
            usage.get("cpu_percent_mean"),
            usage.get("gpu_util_percent_mean"),
        )
