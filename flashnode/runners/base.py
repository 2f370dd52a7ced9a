"""The runner contract (docs/design.md §3), shared by every runner.

* ``preflight(settings, slots)`` checks what this runner needs on this host; through
  ``flashnode.runners.preflight`` ``flashnode work`` refuses to start on a fatal problem and
  ``flashnode doctor`` prints every finding, so the two can never disagree.
* ``create(settings, env)`` builds a runner; every runner is built the same way.
* ``check(task, settings)`` refuses a task this runner must not run, before anything starts;
  ``settings`` are those its lease was claimed under (what only a later reload refuses lapses).
* ``pools(settings)`` says which configured pools it can run now (a container runner whose
  engine lacks a pool's runtime leaves that pool out): the node advertises only those.
* ``facts(workspace, slot)`` states how the runner shows a task its workspace (``/work`` or its
  host path, its module interpreter, ``HOME``, its GPUs' numbering, its base ``PATH``), from which
  the agent resolves the task's ``TaskPlan`` (``runners.plan.resolve``) before calling ``start``.
* ``start(plan)`` carries the plan out: returns a Handle or raises after undoing everything it
  began.
* A Handle's ``terminate(grace)`` is idempotent and escalates (polite signal, grace, kill);
  ``result()`` (once the main process exited) removes whatever the task left behind and returns
  the RunResult: data, not an exception. ``suspend()``/``resume()`` freeze and thaw the whole
  task for the owner's controls (the cgroup freezer or SIGSTOP; a container's pause); a
  suspended task is resumed before it is terminated.
* A Handle's ``detach()`` lets go of a running task when the agent restarts; the next agent's
  ``rejoin`` takes it over from its recorded identity (a runner that cannot returns False and
  None: the task is ended and its lease lapses).
* ``reconcile`` runs at agent start (after every ``rejoin``) and removes what an earlier run of
  this agent left behind; ``reap`` does it for one recorded task; ``prime`` then makes ready
  what the first tasks need.

Runners are chosen by name from ``flashnode.runners.registry``, which says what each can do
(``Capabilities``), and imported only when chosen (the Docker SDK costs an agent that never uses
it memory).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from flashnode.clock import Clock, SystemClock
from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.evidence.gpupool import GpuPool
from flashnode.runners.findings import Finding
from flashnode.runners.plan import RunnerFacts, TaskPlan, map_work
from flashnode.sandbox.workspace import Workspace


@dataclass(frozen=True)
class RunResult:
    """How a task ended. ``exit_code`` None with ``signal`` set: killed by that signal."""

    exit_code: int | None
    signal: int | None = None
    oom: bool = False
    cause: str | None = None  # a cause the exit status does not tell ("engine unavailable")
    node_fault: bool = False  # the cause is this node's (its engine, its sandbox), not the task's
    stderr_tail: str = ""
    image_digest: str = ""

    @property
    def status(self) -> int | None:
        """The exit status as ``ExecutionEvidence.exit_code`` reports it (negative: signal)."""
        return -self.signal if self.signal is not None else self.exit_code


class Handle(Protocol):
    def exited(self) -> bool:
        """Whether the main process has exited."""

    def terminate(self, grace: float) -> None:
        """TERM (or the runtime's stop), up to ``grace`` seconds, then KILL. Idempotent."""

    def result(self) -> RunResult:
        """Once exited: remove what the task left behind, close its logs, say how it ended."""

    def pids(self) -> set[int]:
        """The task's live processes now (host pids), for the sampler."""

    def cpu_seconds(self) -> float | None:
        """CPU time the task used so far, None where it cannot be measured."""

    def disk_bytes(self) -> int:
        """What the task holds on disk now beyond what a walk of its workspace finds: its
        private temporary directories (a tmpfs each), and files it removed but keeps open
        (``flashnode.sandbox.diskuse``); 0 where nothing can be measured."""

    def suspend(self) -> None:
        """Stop every process of the task from running, keeping them (an owner control).
        Raises SuspendFailed when it cannot."""

    def resume(self) -> None:
        """Let a suspended task run again; nothing for one that is not suspended. Raises
        SuspendFailed when it cannot."""

    def last_output(self) -> str:
        """The last line the task printed (stdout or stderr, whichever was latest), escaped for
        a terminal; "" before any."""

    def lease_left(self, seconds: float) -> None:
        """The task's lease lives ``seconds`` from now: if the agent is gone then, whatever
        holds the task ends it at the latest at that moment (nothing outlives its lease)."""

    def detach(self) -> bool:
        """Let go of the running task without ending it (the agent restarts): True when it runs
        on, for the next agent to ``rejoin`` by its recorded identity until
        ``reattach_seconds`` pass; False when it cannot (the caller ends it)."""


class SuspendFailed(Exception):
    """A task could not be suspended or resumed (its freezer, signals or engine refused)."""


@dataclass
class RunnerEnv:
    """What the agent gives every runner at construction."""

    node_id: str
    gpus: GpuPool
    clock: Clock = field(default_factory=SystemClock)
    slots: int = 1


class Runner(ABC):
    name: ClassVar[str]
    # Has what allowlisted `python -m` module tasks need (an interpreter, an image) now.
    module_capable: bool = False

    @classmethod
    @abstractmethod
    def preflight(cls, settings: Settings, slots: int = 1) -> list[Finding]:
        """What this runner needs, checked on this host for ``settings`` and ``slots``: an Ok
        for each thing found, a Problem for each missing (``preflight.check`` adds these to the
        state dir's and the credentials' checks, for ``work`` and ``doctor`` alike)."""

    @classmethod
    @abstractmethod
    def create(cls, settings: Settings, env: RunnerEnv) -> Runner:
        """Build the runner; raises PrerequisiteError/ConfigError when it cannot run here."""

    @abstractmethod
    def check(self, task: Task, settings: Settings) -> None:
        """Raise AttemptFailed (the task's fault) or AttemptLapsed (this node's) when this
        runner must not run ``task``. ``settings``: those its lease was claimed under. What they
        allowed and the runner's settings now refuse (a reload since the claim) lapses: the
        owner's latest word wins, and the task is not at fault."""

    def facts(self, workspace: Workspace, slot: int) -> RunnerFacts:
        """How this runner shows a task in ``slot`` its ``workspace`` (the plan is resolved from
        it): by default at ``/work``, with no module interpreter of its own."""
        return RunnerFacts()

    @abstractmethod
    def start(self, plan: TaskPlan) -> Handle:
        """Carry ``plan`` out; on failure raise after undoing everything begun."""

    def runtime(self, pool: str | None) -> str | None:
        """The engine runtime a task of ``pool`` (None: work from no pool) runs under, as the
        settings name it; None where none is named (the engine's default) or there is no
        engine."""
        return None

    def pools(self, settings: Settings) -> tuple[str, ...]:
        """The pools of ``settings`` whose tasks this runner can run now: what the node
        advertises (a pool left out is never placed here). All of them by default."""
        return tuple(settings.pools)

    def passes_gpus(self, settings: Settings) -> bool:
        """Whether a task of any pool ``pools`` advertises (or of no pool) can be given this
        machine's GPUs: where none can, the node registers none, and no GPU lease comes here
        only to lapse. Yes by default."""
        return True

    def ready(self) -> bool:
        """Whether the runner can take a task now (e.g. its container engine answers)."""
        return True

    def slot_usable(self, slot: int) -> bool:
        """Whether ``slot`` can run a task (a trusted slot whose user another agent took
        cannot): a slot that cannot is never offered a claim."""
        return True

    def task_path(self, workspace: Workspace, path: str) -> str:
        """Where a task of this runner finds ``path`` (a ``/work/...`` path) of ``workspace``:
        the path itself where the runner shows the workspace at ``/work`` (a container), else
        the host path it maps to. For what the agent writes into files the task reads (a
        restored checkpoint's manifest)."""
        return map_work(path, self.facts(workspace, 0).root)

    def reconfigure(self, settings: Settings) -> None:  # noqa: B027 - optional hook
        """Take a reloaded configuration (pools, limits). Runs off the main loop's thread."""

    def rejoin(
        self,
        identity: Mapping[str, Any],
        slot: int,
        workspace: Workspace,
        on_exit: Callable[[], None],
    ) -> Handle | None:
        """The task an earlier run of this agent started and let go of (``Handle.detach``),
        from its recorded identity, taken over as if this run had started it; None when it is
        gone (then ``reap`` it). ``on_exit``: called once its main process has exited."""
        return None

    def reap(self, identity: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Remove what an earlier run of this agent left of one task, from its recorded
        identity (what ``start`` passed to ``record``)."""

    def reconcile(self) -> None:  # noqa: B027 - optional hook
        """Remove leftovers of an earlier run of this agent that no record names."""

    def prime(self) -> None:  # noqa: B027 - optional hook
        """At agent start, once every leftover of an earlier run is dealt with (``reconcile``,
        then the stale workspaces removed): make ready what the first tasks will need."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The agent stops (every attempt has ended): release what the runner keeps between
        tasks."""
