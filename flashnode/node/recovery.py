"""What an earlier run of this agent left, dealt with before the first claim.

``recover`` commits the results an earlier run finished (the outbox), lets the rest lapse (their
processes reaped first), has the runner reconcile what it left, and removes the workspaces no
record names, with a ledger line each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flashnode.attempt import Attempt, AttemptContext, Outcome
from flashnode.attempt.record import State
from flashnode.coordinator.ids import SAFE_ID
from flashnode.sandbox.removal import remove_stale_workspaces

log = logging.getLogger(__name__)


def recover(ctx: AttemptContext, count: Callable[[Outcome], None]) -> None:
    """Deal with every leftover, each ending ``count``ed; ``ctx`` is what a recovered attempt
    is given. One bad leftover does not keep the agent from starting."""
    outbox = ctx.outbox
    for lease_id in outbox.leases():
        try:
            _recover(ctx, lease_id, count)
        except Exception:
            log.exception("lease %s: recovery failed; dropping its record", lease_id)
            outbox.remove(lease_id)
    try:
        ctx.runner.reconcile()
        keep = set(outbox.leases())
        stale = remove_stale_workspaces(ctx.settings.state_dir / "attempts", keep=keep)
        for lease_id in stale:  # ended by a crash before its task started: no record
            if _ledger_lapsed(ctx, lease_id, "agent restarted before the task started"):
                count(Outcome.LAPSED)
    except Exception:
        log.exception("cleaning up after an earlier run failed")


def _recover(ctx: AttemptContext, lease_id: str, count: Callable[[Outcome], None]) -> None:
    record = ctx.outbox.read(lease_id)
    if record is None:
        ctx.outbox.remove(lease_id)
        return
    if record.process:
        ctx.runner.reap(record.process)
    attempt = Attempt(ctx, record.lease, record.slot, record=record)
    if record.state is State.FINISHED:
        count(attempt.resume())
    else:
        count(attempt.abandon("agent restarted"))


def _ledger_lapsed(ctx: AttemptContext, lease_id: str, reason: str) -> bool:
    """A ledger line for a lease left to lapse; False for a name that is no lease's."""
    if not SAFE_ID.match(lease_id):
        return False
    log.warning("lease %s: %s; letting its lease lapse", lease_id, reason)
    entry = {"lease_id": lease_id, "outcome": Outcome.LAPSED.value, "reason": reason}
    try:
        ctx.ledger.append({**entry, "ended_at": ctx.clock.wall()})
    except OSError as exc:
        log.error("lease %s: cannot write the ledger: %s", lease_id, exc)
    return True
