"""What an earlier run of this agent left, dealt with before the first claim.

``recover`` rejoins the tasks an earlier run let go of at a restart (their attempts are handed
back, to go on in their slots), commits the results it finished (the outbox), lets the rest
lapse (their processes reaped first), has the runner reconcile what it left, removes the
workspaces no record names, with a ledger line each, and has the runner prime its first tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flashnode import logcontext
from flashnode.attempt import Attempt, AttemptContext, Outcome
from flashnode.attempt.record import State, workspace_of
from flashnode.coordinator.ids import SAFE_ID
from flashnode.runners.base import Handle
from flashnode.sandbox.removal import remove_stale_workspaces

log = logging.getLogger(__name__)


def recover(ctx: AttemptContext, count: Callable[[Outcome], None]) -> list[tuple[Attempt, Handle]]:
    """Deal with every leftover, each ending ``count``ed; ``ctx`` is what a recovered attempt
    is given. The attempts whose tasks run on, rejoined, are returned to be carried on. One bad
    leftover does not keep the agent from starting."""
    outbox = ctx.outbox
    rejoined: list[tuple[Attempt, Handle]] = []
    leases = outbox.leases()
    # Running tasks first: they wait for this agent for ``reattach_seconds`` only, and their
    # leases for a renewal; finished results wait in the outbox as long as their leases live.
    running = [lease_id for lease_id in leases if _running(ctx, lease_id)]
    for lease_id in running + [lease_id for lease_id in leases if lease_id not in running]:
        try:
            with logcontext.attempt(lease_id):  # its attempt adds its job and task once read
                found = _recover(ctx, lease_id, count)
        except Exception:
            log.exception("recovery failed; dropping its record", extra=logcontext.fields(lease_id))
            outbox.remove(lease_id)
            continue
        if found is not None:
            rejoined.append(found)
    try:
        ctx.runner.reconcile()
        keep = set(outbox.leases())
        stale = remove_stale_workspaces(ctx.settings.state_dir / "attempts", keep=keep)
        for lease_id in stale:  # ended by a crash before its task started: no record
            if _ledger_lapsed(ctx, lease_id, "agent restarted before the task started"):
                count(Outcome.LAPSED)
        ctx.runner.prime()  # after the sweep of attempts/, where it makes directories
    except Exception:
        log.exception("cleaning up after an earlier run failed")
    return rejoined


def _running(ctx: AttemptContext, lease_id: str) -> bool:
    try:
        record = ctx.outbox.read(lease_id)
    except Exception:  # read again, and dealt with, in its turn
        return False
    return record is not None and record.state is State.RUNNING


def _recover(
    ctx: AttemptContext, lease_id: str, count: Callable[[Outcome], None]
) -> tuple[Attempt, Handle] | None:
    record = ctx.outbox.read(lease_id)
    if record is None:
        ctx.outbox.remove(lease_id)
        return None
    attempt = Attempt(ctx, record.lease, record.slot, record=record)
    if record.state is State.RUNNING and record.process and SAFE_ID.match(lease_id):
        workspace = workspace_of(ctx.settings.state_dir, lease_id, record.task_uid)
        try:
            handle = ctx.runner.rejoin(record.process, record.slot, workspace, attempt.wake.set)
        except Exception:  # reaped below, like one that is gone
            log.exception("cannot rejoin its task")
            handle = None
        if handle is not None:
            attempt.devices = ctx.gpus.take(record.gpus)  # its task holds them still
            return attempt, handle
    if record.process:
        ctx.runner.reap(record.process)
    if record.state is State.FINISHED:
        count(attempt.resume())
    else:
        count(attempt.abandon("agent restarted"))
    return None


def _ledger_lapsed(ctx: AttemptContext, lease_id: str, reason: str) -> bool:
    """A ledger line for a lease left to lapse; False for a name that is no lease's."""
    if not SAFE_ID.match(lease_id):
        return False
    named = logcontext.fields(lease_id)
    log.warning("%s; letting its lease lapse", reason, extra=named)
    entry = {"lease_id": lease_id, "outcome": Outcome.LAPSED.value, "reason": reason}
    try:
        ctx.ledger.append({**entry, "ended_at": ctx.clock.wall()})
    except OSError as exc:
        log.error("cannot write the ledger: %s", exc, extra=named)
    return True
