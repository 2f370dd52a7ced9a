"""What every attempt is given: its edges (coordinator, runner, clock, outbox, ledger) behind
small interfaces, so the phases run against fakes in tests."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

from flashnode.attempt.diskwatch import Reserved
from flashnode.attempt.guards.base import GuardMaker
from flashnode.clock import Clock
from flashnode.config.settings import Settings
from flashnode.coordinator.messages import CheckpointManifest, CheckpointPart, ExecutionEvidence
from flashnode.coordinator.validators import SchemaCheck
from flashnode.evidence.gpupool import GpuPool
from flashnode.evidence.sampler import CpuWindow, GpuReader
from flashnode.owner.ledger import Ledger
from flashnode.owner.metrics import MetricsSink, NullMetrics
from flashnode.runners.base import Runner
from flashnode.sandbox.diskuse import Space
from flashnode.sandbox.limits import Limits

if TYPE_CHECKING:
    import threading
    from collections.abc import Sequence
    from pathlib import Path

    from flashnode.attempt.outbox import Outbox
    from flashnode.coordinator.datasets import DatasetEntry


class CoordinatorPort(Protocol):
    """What an attempt needs of the coordinator (flashnode.coordinator.client.Coordinator fits)."""

    def attempt_heartbeat(self, lease_id: str) -> None: ...
    def complete(
        self, lease_id: str, output_sha256: str, evidence: ExecutionEvidence
    ) -> tuple[bool, str]: ...
    def fail(self, lease_id: str, reason: str) -> None: ...
    def upload(self, key: str, fh: BinaryIO, size: int) -> str: ...
    def download(
        self, key: str, out: BinaryIO, max_bytes: int, stop: threading.Event | None = None
    ) -> int: ...
    def checkpoint_part(
        self, job_id: str, task_id: str, lease_id: str, step: int, part: CheckpointPart
    ) -> None: ...
    def checkpoint_commit(
        self,
        job_id: str,
        task_id: str,
        lease_id: str,
        step: int,
        parts: list[CheckpointPart],
        storage_prefix: str,
        world_size: int = 1,
        framework: str = "",
    ) -> None: ...
    def checkpoint_latest(self, job_id: str, task_id: str) -> CheckpointManifest | None: ...


class EnvLease(Protocol):
    """A job environment pinned for one attempt (flashnode.caches.envcache.EnvHandle fits)."""

    key: str
    path: Path  # the venv
    python: Path  # its interpreter
    built: bool  # this acquire built it
    build_seconds: float

    def release(self) -> None: ...


class EnvPort(Protocol):
    """The agent's cache of job environments (flashnode.caches.envcache.EnvCache fits)."""

    def acquire(
        self, python: str, lines: Sequence[str], *, stop: threading.Event, timeout_s: float
    ) -> EnvLease: ...

    def pin(self, key: str) -> EnvLease | None:
        """The environment ``key`` pinned again (a rejoined task's); None when it is gone."""


class ShardLease(Protocol):
    """A dataset shard pinned for one attempt (flashnode.caches.datacache.ShardHandle fits)."""

    size: int
    fetched: bool  # False: a cache hit
    seconds: float

    def release(self) -> None: ...


H = TypeVar("H", bound=ShardLease)


class DataPort(Protocol[H]):
    """The agent's dataset cache (flashnode.caches.datacache.DataCache fits)."""

    budget_bytes: int

    def acquire_all(self, entries: Sequence[DatasetEntry], *, stop: threading.Event) -> list[H]: ...
    def layout(self, handles: Sequence[H], dest: Path, *, task_uid: int) -> None: ...


@dataclass(frozen=True)
class AttemptContext:
    """The agent's edges and configuration. Each Attempt is handed a copy with the ``settings``
    and ``limits`` current when it was claimed, and keeps them across a reload (``lent_now``
    alone reads the running configuration: what the owner stopped lending is never mounted)."""

    coordinator: CoordinatorPort
    runner: Runner
    settings: Settings
    clock: Clock
    ledger: Ledger
    outbox: Outbox
    start_thread: Callable[[Callable[[], None], str], None]
    rng: random.Random = field(default_factory=random.Random)
    cpu_window: Callable[[], CpuWindow] = CpuWindow
    gpu: GpuReader | None = None
    gpus: GpuPool = field(default_factory=GpuPool)
    limits: Limits = field(default_factory=Limits)  # per task (runners.spec.task_limits)
    metrics: MetricsSink = field(default_factory=NullMetrics)
    envs: EnvPort | None = None  # job environments, one cache per agent (trusted runner)
    data: DataPort[Any] | None = None  # dataset shards, one cache per agent
    space: Callable[[], Space | None] = lambda: None  # the state dir's disk now (None: unknown)
    # What the running tasks may still write on it: a task starting gets only the rest.
    reserved: Reserved = field(default_factory=Reserved)
    # A declared JSON Schema checked on the node (procs.helpers.json_schema_problem); None: left to
    # the coordinator.
    schema_check: SchemaCheck | None = None
    # What may run after an attempt's outcome (removing its retired workspace): at once by
    # default; the agent hands it to a thread off the next claim's way (background.py).
    later: Callable[[Callable[[], None]], object] = field(default=lambda job: job())
    # The directories the owner lends now (``local_data`` of the running configuration; None:
    # the claimed settings'): a reload that stops lending one takes it from attempts not yet
    # started too.
    lent_now: Callable[[], Mapping[str, Path]] | None = None
    # Guards beside every running task beyond the agent's own (the execute phase's), asked
    # after them in this order.
    guards: tuple[GuardMaker, ...] = ()
