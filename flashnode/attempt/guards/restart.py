"""The agent restarts (``flashnode`` stopped for an upgrade, a reload of the unit): the running
task is let go of, not stopped, for the next agent to rejoin (``Handle.detach``); a task whose
runner cannot re-attach one (its ``Capabilities.reattach``), or cannot let go of this one, is
ended by the cancel that comes with the restart."""

from __future__ import annotations

import logging
import math

from flashnode.attempt.guards.base import Action, Asks, End, Running
from flashnode.errors import Detached

log = logging.getLogger(__name__)


class RestartGuard:
    def __init__(self, asks: Asks, reattach: bool = True) -> None:
        self.asks, self.reattach = asks, reattach

    def turn(self, now: float, task: Running) -> Action | None:
        if self.asks.detaching and self.reattach and task.handle.detach():
            log.info("its task runs on for the next agent")
            return End(Detached())
        return None

    def next_at(self, task: Running) -> float:
        return math.inf  # a restart wakes the attempt
