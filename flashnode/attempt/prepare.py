"""The first phase: the lease is ours (recorded before anything else), its payload becomes a
Task, the runner may refuse it, and the GPUs it asks for are taken."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnode.attempt.record import State
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.wire import parse_task

if TYPE_CHECKING:
    from flashnode.attempt import Attempt


def run(a: Attempt) -> None:
    assert a.lease is not None
    # First of all: a restarted agent must know this lease was ours.
    a.save(State.CLAIMED)
    a.task = task = parse_task(a.lease)
    a.ctx.runner.check(task)
    if len(a.devices) != task.gpus:
        a.ctx.gpus.release(a.devices)
        a.devices = []
        try:
            a.devices = a.ctx.gpus.acquire(task.gpus)
        except AttemptFailed as exc:
            # The coordinator placed it by the GPUs this node registered; that they are not
            # free now is not the task's fault.
            if task.gpus <= len(a.ctx.gpus.devices):
                raise AttemptLapsed(str(exc)) from None
            raise
