"""The typed record of one attempt: what the outbox stores and every phase reads; and the typed
values the phases hand each other.

An attempt moves through ``State`` while it lives (each change written to the outbox), and ends in
exactly one ``Outcome`` (one ledger line). After an agent restart, the state says what to do:
``finished`` results are committed (their outputs were checked and spooled); anything earlier is
reaped and left to lapse, since that ending is not the task's fault.

Between phases (``attempt/orchestrator.py``), what one phase made is the next one's argument:
the stage phase makes a ``Staged`` (the lease, its task, the workspace), the check phase a
``Finished`` (the run's evidence and its checked outputs) that the commit uploads. A result
resumed from the outbox reads both back from its record (``Staged.read_back``,
``Finished.spooled``), through what the first path wrote, never rebuilt by hand.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flashnode.coordinator.lease import Lease, Task, parse_task
from flashnode.coordinator.messages import ExecutionEvidence
from flashnode.sandbox.outputs import OutputFile
from flashnode.sandbox.workspace import Workspace

ATTEMPTS = "attempts"  # the state dir's folder of workspaces, one per lease


class State(str, enum.Enum):
    CLAIMED = "claimed"  # the lease is ours; nothing started
    STAGING = "staging"  # inputs, environment, data being prepared
    RUNNING = "running"  # the task's processes may exist (``process`` says how to find them)
    FINISHED = "finished"  # the run ended and its outputs passed their checks: the outbox


class Outcome(str, enum.Enum):
    COMMITTED = "committed"  # accepted by the coordinator
    REJECTED = "rejected"  # ``accepted: false``: final, discarded
    FAILED = "failed"  # the task's fault, reported with ``fail`` and a reason
    LAPSED = "lapsed"  # not the task's fault: the lease was left to lapse, reason in the ledger
    LOST = "lost"  # the lease died: nothing more was uploaded or reported
    DROPPED = "dropped"  # a claim answer too malformed to report at all
    DETACHED = "detached"  # let go of at a restart, its task running on: the next agent's


class AttemptRecord(BaseModel):
    """One attempt, as stored durably in the outbox."""

    model_config = ConfigDict(extra="ignore", defer_build=True)  # built at the first task

    lease: dict[str, Any]  # the claim answer as received (its envelope was checked)
    state: State = State.CLAIMED
    slot: int = 0
    claimed_at: float = 0.0  # wall clock
    process: dict[str, Any] | None = None  # how a restarted agent finds the task's processes
    task_uid: int | None = None  # who wrote out/: the output walk refuses anyone else's files
    evidence: ExecutionEvidence | None = None
    task_usage: dict[str, float | None] = Field(default_factory=dict)
    outputs: dict[str, int] | None = None  # rel path -> size, as checked
    metrics_sha256: str = ""
    timings: dict[str, float] = Field(default_factory=dict)  # phase -> seconds
    resumed_from_step: int | None = None  # the checkpoint this attempt started from
    checkpoints_shipped: int = 0  # committed by the relay while the task ran (progress)
    checkpoint_step: int | None = None  # the step of the newest one shipped
    relayed: tuple[str, int] | None = None  # the relay's newest (name, step): shipped or resumed
    task_started_at: float | None = None  # wall clock: when the task was handed its script
    gpus: list[str] = Field(default_factory=list)  # the GPUs its task holds (visible names)
    environment: str | None = None  # the key of the job environment its task runs in

    @property
    def lease_id(self) -> str:
        value = self.lease.get("lease_id")
        return value if isinstance(value, str) else ""


def workspace_of(state_dir: Path, lease_id: str, task_uid: int | None = None) -> Workspace:
    """The workspace the stage phase made for ``lease_id`` (``Staged.make``): to read a result
    back from, or to remove what an earlier run of the agent left."""
    return Workspace(state_dir / ATTEMPTS / lease_id, task_uid)


@dataclass(frozen=True)
class Staged:
    """What every phase after staging works on: the lease, its task, and its workspace."""

    lease: Lease
    task: Task
    workspace: Workspace

    @classmethod
    def make(cls, lease: Lease, task: Task, state_dir: Path) -> Staged:
        """A fresh, empty workspace for a claimed lease (the stage phase)."""
        return cls(lease, task, Workspace.create(state_dir / ATTEMPTS, lease.lease_id))

    @classmethod
    def read_back(cls, lease: Lease, record: AttemptRecord, state_dir: Path) -> Staged:
        """What the first path staged, from a record read back from the outbox: the task the
        prepare phase parsed (``parse_task``, the same function), the workspace the stage phase
        made, and who the execute phase recorded as the writer of its ``out/``."""
        return cls(
            lease, parse_task(lease), workspace_of(state_dir, lease.lease_id, record.task_uid)
        )


@dataclass(frozen=True)
class Finished:
    """The run's result, checked (the check phase): its evidence and its outputs, what the
    commit uploads (``metrics.json``, the commit anchor, last) and completes with."""

    evidence: ExecutionEvidence
    files: list[OutputFile]
    metrics_sha256: str

    @property
    def outputs(self) -> dict[str, int]:
        """Each output's path under ``out/`` and size, as spooled in the record."""
        return {f.rel: f.size for f in self.files}

    def spool(self, record: AttemptRecord) -> None:
        """Write into ``record`` what a restarted agent checks the outputs against again."""
        record.outputs, record.metrics_sha256 = self.outputs, self.metrics_sha256

    def spooled(self, record: AttemptRecord) -> bool:
        """Whether these are the outputs ``spool`` wrote into ``record``."""
        return record.outputs == self.outputs and record.metrics_sha256 == self.metrics_sha256
