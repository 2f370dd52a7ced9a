"""The runner contract.

* ``check`` refuses a task this runner must not run (raises AttemptFailed) before anything starts.
* ``start`` returns a Handle or raises after undoing everything it began.
* A Handle's ``terminate`` is idempotent and escalates (polite signal, grace, kill); ``finish``
  removes whatever the task left behind once its main process has exited, and closes its logs.
* ``reconcile`` runs at agent start and removes what an earlier run of this agent left behind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from flashnode.settings import Settings
from flashnode.slots import Device
from flashnode.wire import Task
from flashnode.workspace import Workspace


class Handle(Protocol):
    @property
    def returncode(self) -> int | None:
        """The main process's exit status (negative: killed by that signal), None while it runs."""

    @property
    def image_digest(self) -> str:
        """Digest of the image that ran; "" when no container ran."""

    def terminate(self, grace: float) -> None: ...

    def finish(self) -> None: ...

    def stderr_tail(self) -> str:
        """The last lines the task wrote to stderr, for a failure reason."""

    def pids(self) -> set[int]:
        """The task's live processes now (host pids), for the sampler."""

    def cpu_seconds(self) -> float | None:
        """CPU time the task used so far, None where it cannot be measured."""

    def failure(self) -> str | None:
        """A cause of failure the exit status does not tell (e.g. "out of memory"), once
        finished."""


class Runner(ABC):
    name: str
    module_capable: bool = False  # runs allowlisted `python -m` module tasks

    @abstractmethod
    def check(self, task: Task) -> None:
        """Raise AttemptFailed if this runner must not run ``task``."""

    @abstractmethod
    def start(
        self,
        task: Task,
        workspace: Workspace,
        on_exit: Callable[[], None],
        record: Callable[[dict[str, Any]], None],
        gpus: list[Device],
    ) -> Handle:
        """Start the task on ``gpus`` (and no other GPU). ``on_exit`` is called (from any
        thread) when its main process exits; ``record`` is given what a restarted agent needs
        to find the task again, before and after anything is started."""

    def ready(self) -> bool:
        """Whether the runner can take a task now (e.g. its container engine answers)."""
        return True

    def reconfigure(self, settings: Settings) -> None:  # noqa: B027 - optional hook
        """Take a reloaded configuration (pools, limits)."""

    def reap(self, identity: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Remove what an earlier run of this agent left of one task, from its recorded
        identity (what ``start`` passed to ``record``)."""

    def reconcile(self) -> None:  # noqa: B027 - optional hook
        """Remove leftovers of an earlier run of this agent that no record names."""
