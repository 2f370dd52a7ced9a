"""The first phase: the lease's payload becomes a Task, the runner may refuse it, and the GPUs it
asks for are taken.

Nothing is written to the outbox yet: a restarted agent lets every lease it finds unfinished
lapse, so a record matters only once the task's processes may exist (the execute phase writes
it before anything starts); the workspace of an attempt a crash ended earlier is removed at the
next start, with a ledger line (``Agent.startup``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnode.coordinator.lease import parse_task
from flashnode.errors import AttemptFailed, AttemptLapsed, Stopped

if TYPE_CHECKING:
    from flashnode.attempt.hooks import AttemptView
    from flashnode.coordinator.lease import Lease, Task


def run(a: AttemptView, lease: Lease) -> Task:
    """The lease's task, checked by the runner, its GPUs held (``a.hold_gpus``)."""
    task = parse_task(lease)
    a.ctx.runner.check(task, a.ctx.settings)
    if len(a.devices) != task.gpus:
        a.ctx.gpus.release(a.devices)
        a.hold_gpus([])
        try:
            a.hold_gpus(a.ctx.gpus.acquire(task.gpus))
        except AttemptFailed as exc:
            # The coordinator placed it by the GPUs this node registered; that they are not
            # free now is not the task's fault.
            if task.gpus <= len(a.ctx.gpus.devices):
                blocked = a.ctx.gpus.blocked
                if blocked:  # given back to the owner (or too hot): the owner's courtesy
                    why = "; ".join(dict.fromkeys(blocked.values()))
                    raise Stopped(f"{exc} ({why})") from None
                raise AttemptLapsed(str(exc)) from None
            raise
    return task
