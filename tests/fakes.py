"""Fakes for the loop in the middle: a clock that jumps, a scripted coordinator, a runner that
writes outputs without starting a process."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from flashnode import statefile
from flashnode.attempt import AttemptContext
from flashnode.attempt.outbox import Outbox
from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.coordinator.messages import (
    CheckpointManifest,
    CheckpointPart,
    ExecutionEvidence,
    NodeHeartbeat,
    NodeRegistration,
)
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.node.decision import Decision
from flashnode.node.publisher import NodeView
from flashnode.owner.ledger import Ledger
from flashnode.runners.base import Handle, Runner, RunnerEnv, RunResult
from flashnode.runners.findings import Finding
from flashnode.runners.plan import TaskPlan


class FakeClock:
    """Time moves only when someone waits for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1.7e9 + self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        self.now += max(timeout, 0.0)
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


@dataclass
class FakeCoordinator:
    clock: FakeClock
    claims: list[Any] = field(default_factory=list)  # answers in order: dict, None or an exception
    heartbeat_errors: list[Exception] = field(default_factory=list)
    calls: list[tuple[float, str, Any]] = field(default_factory=list)
    uploads: dict[str, bytes] = field(default_factory=dict)
    accept: bool = True
    latest: CheckpointManifest | None = None  # what checkpoint_latest answers
    checkpoint_errors: list[Exception | None] = field(default_factory=list)  # per write, in order

    def _log(self, name: str, arg: Any = None) -> None:
        self.calls.append((self.clock.now, name, arg))

    def names(self, name: str) -> list[float]:
        return [t for t, n, _ in self.calls if n == name]

    def register(self, registration: NodeRegistration) -> str:
        self._log("register", registration)
        return registration.node_id

    def node_heartbeat(self, heartbeat: NodeHeartbeat) -> None:
        self._log("node_heartbeat", heartbeat.status)
        if self.heartbeat_errors:
            raise self.heartbeat_errors.pop(0)

    def claim(self, node_id: str) -> dict[str, Any] | None:
        self._log("claim")
        answer = self.claims.pop(0) if self.claims else None
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    def attempt_heartbeat(self, lease_id: str) -> None:
        self._log("attempt_heartbeat", lease_id)

    def complete(
        self, lease_id: str, output_sha256: str, evidence: ExecutionEvidence
    ) -> tuple[bool, str]:
        self._log("complete", (lease_id, output_sha256, evidence))
        return self.accept, ""

    def fail(self, lease_id: str, reason: str) -> None:
        self._log("fail", (lease_id, reason))

    def upload(self, key: str, fh: BinaryIO, size: int) -> str:
        data = fh.read(size)
        self.uploads[key] = data
        self._log("upload", key)
        return hashlib.sha256(data).hexdigest()

    def download(
        self, key: str, out: BinaryIO, max_bytes: int, stop: threading.Event | None = None
    ) -> int:
        self._log("download", key)
        data = self.uploads.get(key, b"input")
        out.write(data)
        return len(data)

    def _checkpoint_write(self, name: str, arg: Any) -> None:
        self._log(name, arg)
        error = self.checkpoint_errors.pop(0) if self.checkpoint_errors else None
        if error is not None:
            raise error

    def checkpoint_part(
        self, job_id: str, task_id: str, lease_id: str, step: int, part: CheckpointPart
    ) -> None:
        self._checkpoint_write("checkpoint_part", (lease_id, step, part))

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
    ) -> None:
        self._checkpoint_write(
            "checkpoint_commit", (lease_id, step, parts, storage_prefix, world_size, framework)
        )

    def checkpoint_latest(self, job_id: str, task_id: str) -> CheckpointManifest | None:
        self._log("checkpoint_latest", (job_id, task_id))
        return self.latest


class FakeHandle:
    def __init__(self, code: int) -> None:
        self._code = code

    def exited(self) -> bool:
        return True

    def terminate(self, grace: float) -> None:
        pass

    def result(self) -> RunResult:
        return RunResult(exit_code=self._code, stderr_tail="some error\nlast line")

    def pids(self) -> set[int]:
        return set()

    def cpu_seconds(self) -> float | None:
        return None

    def disk_bytes(self) -> int:
        return 0

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def lease_left(self, seconds: float) -> None:
        pass

    def last_output(self) -> str:
        return ""

    def detach(self) -> bool:
        return False


class FakeRunner(Runner):
    """Runs nothing: writes ``metrics`` to out/ and reports ``code``."""

    name = "fake"

    def __init__(
        self, code: int = 0, metrics: dict[str, Any] | None = None, refuse: str = ""
    ) -> None:
        self.code, self.metrics, self.refuse = (
            code,
            metrics if metrics is not None else {"ok": 1},
            refuse,
        )
        self.lapse = ""  # a reason the node cannot run tasks now (AttemptLapsed in check)
        self.start_error: Exception | None = None  # what start raises instead of starting
        self.started: list[TaskPlan] = []

    @classmethod
    def preflight(cls, settings: Settings, slots: int = 1) -> list[Finding]:
        return []

    @classmethod
    def create(cls, settings: Settings, env: RunnerEnv) -> FakeRunner:
        return cls()

    def check(self, task: Task, settings: Settings) -> None:
        if self.refuse:
            raise AttemptFailed(self.refuse)
        if self.lapse:
            raise AttemptLapsed(self.lapse)

    def start(self, plan: TaskPlan) -> Handle:
        if self.start_error is not None:
            raise self.start_error
        self.started.append(plan)
        plan.record({"fake": True})
        plan.workspace.task_uid = os.geteuid()
        (plan.workspace.out / "metrics.json").write_text(json.dumps(self.metrics))
        plan.on_exit()
        return FakeHandle(self.code)


def lease(n: int = 0, job: str = "j1", **payload: Any) -> dict[str, Any]:
    body = {
        "argv": ["true"],
        "env": {},
        "inputs": {},
        "output_prefix": f"jobs/{job}/task-{n:03d}/",
        "task_id": f"task-{n:03d}",
        "isolation": {"tier": "sandboxed", "allowFallback": True},
        "pool": "team-a",
        "workload_type": "command",
    }
    body.update(payload)
    return {
        "lease_id": f"ls-{n:012d}",
        "task_id": f"task-{n:03d}",
        "job_id": job,
        "attempt_number": 1,
        "lease_seconds": 60.0,
        "payload": body,
    }


def inline_threads(fn: Callable[[], None], name: str) -> None:
    """Run attempts inline; lease keepers are not run (nothing renews in these tests)."""
    if name.startswith("attempt-"):
        fn()


def context(
    tmp_path: Path,
    clock: FakeClock,
    coordinator: FakeCoordinator,
    runner: Runner,
    runner_name: str = "trusted",  # the configured runner, whose capabilities the attempt asks
    **settings: Any,
) -> AttemptContext:
    s = Settings(
        coordinator="http://127.0.0.1:1",
        runner=runner_name,
        pools=("team-a",),
        state_dir=tmp_path,
        **settings,
    )
    return AttemptContext(
        coordinator=coordinator,
        runner=runner,
        settings=s,
        clock=clock,
        ledger=Ledger(tmp_path / "ledger.jsonl"),
        outbox=Outbox(tmp_path / "outbox"),
        start_thread=inline_threads,
        rng=random.Random(7),
    )


def trusted_runner(pools: tuple[str, ...] = ("team-a",)) -> Any:
    """A TrustedRunner for its checks only (no users, cgroups or sandbox: it starts nothing)."""
    from flashnode.evidence.gpupool import GpuPool
    from flashnode.runners.trusted import TrustedRunner

    s = Settings(coordinator="http://127.0.0.1:1", runner="trusted", pools=pools)
    return TrustedRunner(s, RunnerEnv("node-1", GpuPool()), None, None, sandbox=False)


def node_view(tmp_path: Path, **changes: Any) -> NodeView:
    """A registered idle node as the loop hands it to the publisher (state dir ``tmp_path``),
    with ``changes``."""
    settings = Settings(
        coordinator="http://127.0.0.1:1", runner="trusted", pools=("team-a",), state_dir=tmp_path
    )
    base = NodeView(
        settings=settings,
        node_id="node-1",
        registered=True,
        draining=False,
        drain_deadline=None,
        started_at=1_000.0,
        beats=3,
        last_heartbeat_at=1_000.0,
        problems=(),
        counters={"committed": 2},
        running=(),
        decision=Decision(),
        last_ended=None,
        reload_refused=None,
    )
    return replace(base, **changes)


class QuietSink:
    """A publisher's status sink that keeps nothing (systemd's and the terminal's stand-in)."""

    def status(self, text: str) -> None:
        pass

    def send(self, **fields: object) -> None:
        pass

    def tick(self) -> None:
        pass


def view_only_reads(path: Path) -> str | None:
    """What a member of group ``flashnode`` (the console's view-only level, who may run
    ``flashnode status`` and ``flashnode history``) can read of ``path``; None: nothing."""
    try:
        gid = grp.getgrnam(statefile.STATUS_GROUP).gr_gid
    except KeyError:
        pytest.skip("no group flashnode on this machine")
    st = os.stat(path)
    mode = st.st_mode & 0o777
    if mode & 0o004 or (st.st_gid == gid and mode & 0o040):
        return path.read_text()
    return None
