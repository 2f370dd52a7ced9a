"""The contract of a guard: one rule watching a running task, asked in turns by the
``Supervisor`` (``attempt/guards/supervisor.py``), which carries out what it asks.

A guard's ``turn`` answers with nothing (the task runs on), ``Pause``, ``Resume`` or ``End``; its
``next_at`` says when it wants its next turn (monotonic seconds; ``math.inf``: only when the
attempt is woken, as a cancel or a lost lease wake it). An ``End`` carries its reason, whose type
says whose fault it is (``fault``): ``AttemptFailed`` the task's, ``Stopped`` the owner's (or
their service manager's, or the agent's restart), any other ``AttemptLapsed`` the node's. A
guard may use the task's handle itself (the disk guard freezes a task while it measures it)
and must leave it as it found it. Guards import no side-effect module: what they read of the
world comes in through the attempt and its context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from flashnode.errors import AttemptFailed, AttemptLapsed, Detached, Stopped

if TYPE_CHECKING:
    from flashnode.clock import Clock
    from flashnode.config.settings import Settings
    from flashnode.coordinator.lease import Lease
    from flashnode.runners.base import Handle

Fault = Literal["task", "node", "owner"]


@dataclass(frozen=True)
class End:
    """End the task: ``grace`` seconds to stop before it is killed. ``why`` None: its lease is
    lost (nothing to report); ``Detached``: the agent let go of it (it runs on, not stopped)."""

    why: AttemptFailed | AttemptLapsed | Detached | None
    grace: float = 0.0

    @property
    def fault(self) -> Fault | None:
        """Whose fault the ending is; None where nobody's is told (a lost lease, a restart)."""
        if isinstance(self.why, AttemptFailed):
            return "task"
        if isinstance(self.why, Stopped):
            return "owner"
        if isinstance(self.why, AttemptLapsed):
            return "node"
        return None


@dataclass(frozen=True)
class Pause:
    """Freeze the task (it keeps its processes and its lease); ``why`` in the owner's words."""

    why: str


@dataclass(frozen=True)
class Resume:
    """Let a paused task run again."""


Action = End | Pause | Resume


class Running(Protocol):
    """What a guard sees of the running task (the supervisor's view of it)."""

    @property
    def handle(self) -> Handle: ...

    @property
    def paused_since(self) -> float | None:
        """Since when (monotonic) the task is paused; None while it runs."""

    @property
    def paused_before(self) -> float:
        """How long it was paused in this run of the agent, the present pause left out."""


class Asks(Protocol):
    """What the attempt's other threads ask of its running task (the agent's loop, the lease
    keeper, the courtesy): read by the guards on theirs."""

    @property
    def lease_lost(self) -> bool: ...

    @property
    def detaching(self) -> bool: ...

    @property
    def cancelled(self) -> AttemptFailed | AttemptLapsed | None: ...

    @property
    def cancel_grace(self) -> float: ...

    @property
    def suspend_reason(self) -> str | None: ...

    @property
    def suspend_sources(self) -> Mapping[str, float]: ...


class Guard(Protocol):
    """One rule beside a running task."""

    def turn(self, now: float, task: Running) -> Action | None:
        """What the task should do now; None: run on as it is."""

    def next_at(self, task: Running) -> float:
        """When (monotonic) this guard wants its next turn; ``math.inf``: only when woken."""


@dataclass(frozen=True)
class Beside:
    """What a guard beyond the agent's own is built from, once for each task (``GuardMaker``,
    ``AttemptContext.guards``)."""

    settings: Settings  # those the lease was claimed under
    lease: Lease
    asks: Asks
    clock: Clock
    started: float  # when the task started (monotonic; earlier for a rejoined task)


# A guard for one task, or None where the rule has nothing to watch in it.
GuardMaker = Callable[[Beside], Guard | None]
