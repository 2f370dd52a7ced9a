"""The typed record of one attempt: what the outbox stores and every phase reads.

An attempt moves through ``State`` while it lives (each change written to the outbox), and ends in
exactly one ``Outcome`` (one ledger line). After an agent restart, the state says what to do:
``finished`` results are committed (their outputs were checked and spooled); anything earlier is
reaped and left to lapse, since that ending is not the task's fault.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flashnode.coordinator.wire import ExecutionEvidence


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


class AttemptRecord(BaseModel):
    """One attempt, as stored durably in the outbox."""

    model_config = ConfigDict(extra="ignore")

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

    @property
    def lease_id(self) -> str:
        value = self.lease.get("lease_id")
        return value if isinstance(value, str) else ""
