"""One lease from claim to commit (docs/design.md §1), as a list of phases over one AttemptRecord.

The orchestrator only sequences phases and turns how they end into one outcome:

    prepare → stage → restore → environment → data → execute → check → commit

Each phase is a function in its own module (``attempt/phases/``), of the running attempt's hooks
(``AttemptHooks``, ``attempt/hooks.py``, which ``Attempt`` is built on) and of what the phases
before it made, which it is handed as arguments (``record.Staged``, the run's evidence,
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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ParamSpec, TypeVar

from flashnode import logcontext
from flashnode.attempt.hooks import AttemptHooks
from flashnode.attempt.keeper import LeaseKeeper
from flashnode.attempt.phases import commit, data, environment, execute, prepare, restore, stage
from flashnode.attempt.record import Outcome, Staged, State, workspace_of
from flashnode.coordinator.lease import Lease, parse_lease
from flashnode.coordinator.messages import ExecutionEvidence
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    Cancelled,
    CredentialsError,
    Detached,
    LeaseLost,
    NoRoom,
    OutgrewRoom,
    ShortOfRoom,
    Stopped,
    disk_full,
    disk_full_error,
)
from flashnode.owner.status import without_output
from flashnode.runners.base import Handle
from flashnode.sandbox import logcap
from flashnode.sandbox.removal import remove_tree

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


# The phases of a claimed lease, in order (``Attempt._phases``), by the names the live view
# and the ledger's timings give them; a result resumed from the outbox goes through the last two.
PHASES = ("prepare", "stage", "restore", "environment", "data", "execute", "check", "commit")


class Attempt(AttemptHooks):
    """Runs one claimed lease to its outcome. ``run``, ``resume`` and ``abandon`` never raise."""

    # --- entry points -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Claim to commit, for a freshly claimed lease."""
        lease = self._parse()
        if lease is None:
            return self._drop()
        with _logged(lease):
            log.info("claimed (attempt %d)", lease.attempt_number)
            return self._guarded(lease, self._phases)

    def resume(self) -> Outcome:
        """Upload and commit an attempt that finished before the agent restarted (the outbox).
        The outputs are checked again; if the lease died meanwhile, the result is lost."""
        lease = self._parse()
        if lease is None:
            return self._drop()
        with _logged(lease):
            log.info("resuming the commit of a finished attempt")
            return self._guarded(lease, self._resumed)

    def rejoin(self, handle: Handle) -> Outcome:
        """Carry on an attempt whose task an earlier run of the agent let go of at a restart
        (``handle``: that task, rejoined): its lease renewed at once, the task watched to its
        end, then checked and committed as if nothing happened."""
        lease = self._parse()
        if lease is None:
            handle.terminate(0.0)
            handle.result()
            return self._drop()
        with _logged(lease):
            log.info("rejoined its running task after a restart")
            self.handle = handle  # the attempt's from here: however it ends, its task with it
            return self._guarded(lease, lambda lease: self._rejoined(lease, handle), renew_now=True)

    def abandon(self, reason: str) -> Outcome:
        """End an attempt a previous run of the agent left unfinished (its processes were
        reaped): not the task's fault, so its lease is left to lapse; nothing is run."""
        lease = self._parse()
        if lease is None:
            return self._drop()
        with _logged(lease):
            log.warning("%s; letting its lease lapse", reason)
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

    def _rejoined(self, lease: Lease, handle: Handle) -> tuple[Outcome, str]:
        """A task rejoined: what the first path staged read back from its record, the task
        watched to its end (``execute.rejoin``), then checked and committed."""
        self.staged = staged = Staged.read_back(lease, self.record, self.ctx.settings.state_dir)
        self._contributions.append(environment.rejoin(self))
        evidence = self._phase("execute", execute.rejoin, self, staged, handle)
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

    def _guarded(
        self,
        lease: Lease,
        phases: Callable[[Lease], tuple[Outcome, str]],
        renew_now: bool = False,
    ) -> Outcome:
        self.keeper = keeper = LeaseKeeper(
            self.ctx.coordinator,
            lease,
            self.ctx.clock,
            self._lost,
            self.ctx.rng,
            renew_now,
            self.lease_renewed,
        )
        self.ctx.start_thread(keeper.run, f"keeper-{lease.lease_id}")
        outcome, reason = Outcome.FAILED, ""
        try:
            outcome, reason = phases(lease)
        except Detached:
            outcome = Outcome.DETACHED
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
                log.exception("unexpected error")
                outcome, reason = commit.report_failure(self, f"agent error ({type(exc).__name__})")
        finally:
            ended = time.monotonic()
            keeper.stop()
            if outcome is Outcome.DETACHED:  # its task runs on: only what this agent holds goes
                self.handle = None
            try:
                execute.release(self)
            except Exception:  # the task's end unread: what the phases hold is released still
                log.exception("ending the task failed")
            self._release_contributions()
        if outcome is Outcome.DETACHED:  # the next agent's: nothing removed or recorded
            self.ended = (outcome, "agent stopping")
            return outcome
        if outcome is Outcome.COMMITTED:  # (any other ending is the node's holds' to learn first)
            self.settled = True
            self.on_settled()
        keep = outcome is Outcome.LAPSED and self.record.state is State.FINISHED
        if keep:
            log.warning("its finished result stays in the outbox")
            try:
                if self.staged is not None:
                    self.staged.workspace.seal()
            except OSError as exc:  # the result stays: it is checked again when committed
                log.error("cannot seal its workspace: %s", exc)
        else:
            try:
                if self.staged is not None:
                    retired = self.staged.workspace.retire()
                    if retired is not None:
                        self._keep_logs(retired / "logs")
                        self.ctx.later(lambda: remove_tree(retired))
                self.ctx.outbox.remove(lease.lease_id)
            except Exception:  # a cleanup that fails must not cost the ledger line
                log.exception("cleanup failed")
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
                log.exception("a release failed")

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
        log.warning("lost, nothing more is reported: %s", reason)
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
        if isinstance(ending, ShortOfRoom):
            self.short_of_room = ending.needed
        log.warning("%s; letting the lease lapse", ending)
        return Outcome.LAPSED, str(ending)

    def _drop(self) -> Outcome:
        """A claim answer whose envelope is unusable: fail it if it names a lease, else drop."""
        self.ctx.gpus.release(self.devices)
        reason = self._drop_reason
        lease_id = self.data.get("lease_id") if isinstance(self.data, dict) else None
        if isinstance(lease_id, str) and commit.reportable(lease_id):
            with logcontext.attempt(lease_id):  # all that is known of it
                log.error("%s; failing it", reason)
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
            "pool": self.staged.task.pool if self.staged else None,
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
            # The ledger keeps it without the stderr lines it quotes (``Ledger.append``), which
            # are in the kept logs, unless none are kept.
            "reason": (
                reason
                if self.ctx.settings.keep_logs
                else without_output(reason, "not kept, keep_logs = 0")
            ),
            "timings": dict(self.record.timings),
            "started_at": self.record.claimed_at,
            "ended_at": ended_at,
        }
        for key, value in self.facts.items():
            entry.setdefault(key, value)
        try:
            self.ctx.ledger.append(entry)
        except Exception as exc:
            log.error("cannot write the ledger: %s", exc)
        usage, started, ended = self.record.task_usage, self.record.claimed_at, ended_at
        self.ctx.metrics.attempt_finished(
            outcome.value,
            ended - started if started else None,
            usage.get("cpu_percent_mean"),
            usage.get("gpu_util_percent_mean"),
        )


def _logged(lease: Lease) -> contextlib.AbstractContextManager[None]:
    """What is logged inside, on the attempt's thread and on those it starts, carries the
    lease's ids as fields (``flashnode.logcontext``)."""
    return logcontext.attempt(lease.lease_id, lease.job_id, lease.task_id)
