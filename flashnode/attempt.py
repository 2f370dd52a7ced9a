"""One lease from claim to commit (DESIGN.md §1): parse → check → stage → run → check outputs →
upload → commit, with a lease keeper renewing the lease throughout.

Outcomes: ``committed`` (accepted), ``rejected`` (``accepted: false``, final), ``failed`` (reported
with ``fail`` and a reason), ``lost`` (the lease died: nothing more is uploaded or reported), and
``dropped`` (a lease so malformed that it cannot even be reported).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from flashnode.checks import check_fedavg
from flashnode.clock import Clock
from flashnode.errors import (
    AttemptFailed,
    CoordinatorError,
    CoordinatorUnavailable,
    LeaseLost,
    PayloadTooLarge,
)
from flashnode.journal import Journal
from flashnode.ledger import Ledger
from flashnode.runners.base import Handle, Runner
from flashnode.sampler import CpuWindow, GpuReader, Sampler
from flashnode.settings import Settings
from flashnode.slots import Device, GpuPool
from flashnode.wire import SAFE_ID, ExecutionEvidence, Lease, Task, parse_lease, parse_task
from flashnode.workspace import OutputFile, Workspace

log = logging.getLogger(__name__)

REASON_MAX = 500
RETRY_LIMIT = 12
RETRY_DELAY_MAX = 30.0
METRICS_MAX_BYTES = 16 * 1024 * 1024
T = TypeVar("T")


class Outcome(str, enum.Enum):
    COMMITTED = "committed"
    REJECTED = "rejected"
    FAILED = "failed"
    LOST = "lost"
    DROPPED = "dropped"


class CoordinatorPort(Protocol):
    """What an attempt needs of the coordinator (flashnode.coordinator.Coordinator fits)."""

    def attempt_heartbeat(self, lease_id: str) -> None: ...
    def complete(
        self, lease_id: str, output_sha256: str, evidence: ExecutionEvidence
    ) -> tuple[bool, str]: ...
    def fail(self, lease_id: str, reason: str) -> None: ...
    def upload(self, key: str, path: Path) -> str: ...
    def download(self, key: str, dest: Path, max_bytes: int) -> int: ...


@dataclass
class AttemptContext:
    coordinator: CoordinatorPort
    runner: Runner
    settings: Settings
    clock: Clock
    ledger: Ledger
    journal: Journal
    start_thread: Callable[[Callable[[], None], str], None]
    rng: random.Random = field(default_factory=random.Random)
    cpu_window: Callable[[], CpuWindow] = CpuWindow
    gpu: GpuReader | None = None
    gpus: GpuPool = field(default_factory=GpuPool)


class LeaseKeeper:
    """Renews a lease every clamp(lease_seconds/3, 2 s, 60 s) on the monotonic clock.

    410 (or 403 in token mode) means lost. Transport errors are retried until the local deadline
    (last renewal + the lease window) would pass; then the lease is taken as lost too.
    """

    def __init__(
        self, coordinator: CoordinatorPort, lease: Lease, clock: Clock, on_lost: Callable[[], None]
    ) -> None:
        self._coordinator, self._lease, self._clock = coordinator, lease, clock
        self._on_lost = on_lost
        self._stop = threading.Event()
        self.lost = threading.Event()
        self.reason = ""

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        interval, window = self._lease.renew_interval, self._lease.window
        now = self._clock.monotonic()
        next_renewal, deadline = now + interval, now + window
        retry = 1.0
        while not self._clock.wait(self._stop, next_renewal - self._clock.monotonic()):
            try:
                self._coordinator.attempt_heartbeat(self._lease.lease_id)
            except LeaseLost as exc:
                self._mark_lost(f"lease lost ({exc.status}: {exc})")
                return
            except CoordinatorError as exc:
                now = self._clock.monotonic()
                if now + retry >= deadline:
                    self._mark_lost(f"lease could not be renewed before its deadline ({exc})")
                    return
                log.warning("lease %s: renewal failed, retrying: %s", self._lease.lease_id, exc)
                next_renewal = now + retry
                retry = min(retry * 2, interval)
                continue
            now = self._clock.monotonic()
            next_renewal, deadline, retry = now + interval, now + window, 1.0

    def _mark_lost(self, reason: str) -> None:
        self.reason = reason
        self.lost.set()
        self._on_lost()


class Attempt:
    """Runs one claimed lease to its outcome. ``run`` never raises."""

    def __init__(
        self, ctx: AttemptContext, lease_data: Any, reserved: list[Device] | None = None
    ) -> None:
        """``reserved``: GPUs the agent already took for this lease when it claimed it."""
        self.ctx = ctx
        self.data = lease_data
        self.lease: Lease | None = None
        self.task: Task | None = None
        self.ws: Workspace | None = None
        self.evidence: ExecutionEvidence | None = None
        self.output_sha256 = ""
        self.keeper: LeaseKeeper | None = None
        self._wake = threading.Event()
        self._cancel_reason: str | None = None
        self._cancel_grace = 0.0
        self.started_at = ctx.clock.wall()
        self.devices: list[Device] = list(reserved or [])
        self.task_usage: dict[str, float | None] = {}
        self._ran = False

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id if self.lease else "?"

    def describe(self) -> str:
        lease = self.lease
        return f"{lease.lease_id} ({lease.job_id}/{lease.task_id})" if lease else "a new lease"

    def snapshot(self) -> dict[str, Any]:
        lease = self.lease
        assert lease is not None
        return {
            "lease_id": lease.lease_id,
            "job_id": lease.job_id,
            "task_id": lease.task_id,
            "attempt_number": lease.attempt_number,
            "started_at": self.started_at,
            "gpus": [d.visible for d in self.devices],
        }

    def cancel(self, reason: str, grace: float) -> None:
        """Stop the task (TERM, ``grace`` seconds, KILL) and fail the attempt with ``reason``."""
        if self._cancel_reason is None:
            self._cancel_grace = grace
            self._cancel_reason = reason
        self._wake.set()

    # --- the pipeline -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Claim to commit, for a freshly claimed lease."""
        started = self.ctx.clock.wall()
        try:
            self.lease = parse_lease(self.data)
        except ValueError as exc:
            return self._drop(str(exc), started)
        lease = self.lease
        log.info(
            "lease %s: claimed %s/%s (attempt %d)",
            lease.lease_id,
            lease.job_id,
            lease.task_id,
            lease.attempt_number,
        )
        return self._guarded(self._pipeline, started)

    def resume(self, record: dict[str, Any]) -> Outcome:
        """Upload and commit an attempt that finished before the agent restarted (the outbox).

        The outputs are checked again; if the lease died meanwhile, the result is recorded as
        lost."""
        started = self.ctx.clock.wall()
        try:
            self.lease = parse_lease(self.data)
            self.evidence = ExecutionEvidence.model_validate(record.get("evidence"))
        except (ValueError, TypeError):
            return self._drop("unreadable outbox record", started)
        log.info("lease %s: resuming the commit of a finished attempt", self.lease.lease_id)
        return self._guarded(self._resumed_pipeline, started)

    def abandon(self, reason: str) -> Outcome:
        """Fail an attempt a previous run of the agent left unfinished; nothing is run."""
        started = self.ctx.clock.wall()
        try:
            self.lease = parse_lease(self.data)
        except ValueError as exc:
            return self._drop(str(exc), started)
        self.ws = Workspace(self.ctx.settings.state_dir / "attempts" / self.lease.lease_id)
        log.warning("lease %s: %s; failing it", self.lease.lease_id, reason)
        outcome = Outcome.FAILED
        for pause in (0.5, 1.0, 0.0):
            try:
                self.ctx.coordinator.fail(self.lease.lease_id, reason)
                break
            except CoordinatorUnavailable:
                self.ctx.clock.wait(self._wake, pause)
            except CoordinatorError:
                outcome = Outcome.LOST
                break
        self.ws.remove()
        self.ctx.journal.remove(self.lease.lease_id)
        self._record(outcome, reason, started)
        return outcome

    def _guarded(self, body: Callable[[], tuple[Outcome, str]], started: float) -> Outcome:
        """Run ``body`` under a lease keeper; every way out ends in one outcome, one ledger
        record, a removed workspace and a removed journal record."""
        assert self.lease is not None
        lease = self.lease
        self.keeper = LeaseKeeper(self.ctx.coordinator, lease, self.ctx.clock, self._wake.set)
        self.ctx.start_thread(self.keeper.run, f"keeper-{lease.lease_id}")
        reason = ""
        try:
            outcome, reason = body()
        except LeaseLost as exc:
            outcome, reason = Outcome.LOST, (self.keeper.reason or str(exc) or "lease lost")
            log.warning("lease %s: lost, nothing more is reported: %s", lease.lease_id, reason)
        except AttemptFailed as exc:
            outcome, reason = self._report_failure(str(exc))
        except Exception as exc:  # a bug: still fail the attempt cleanly and keep the agent up
            log.exception("lease %s: unexpected error", lease.lease_id)
            outcome, reason = self._report_failure(f"agent error ({type(exc).__name__})")
        finally:
            self.keeper.stop()
            self.ctx.gpus.release(self.devices)
            if self.ws is not None:
                self.ws.remove()
            self.ctx.journal.remove(lease.lease_id)
        self._record(outcome, reason, started)
        return outcome

    def _pipeline(self) -> tuple[Outcome, str]:
        assert self.lease is not None
        s = self.ctx.settings
        # First of all: a restarted agent must know this lease was ours.
        self.ctx.journal.write(self.lease.lease_id, {"lease": self.data, "state": "running"})
        self.task = task = parse_task(self.lease)
        self.ctx.runner.check(task)
        if len(self.devices) != task.gpus:
            self.ctx.gpus.release(self.devices)
            self.devices = []
            self.devices = self.ctx.gpus.acquire(task.gpus)
        self.ws = ws = Workspace.create(s.state_dir / "attempts", self.lease.lease_id)
        self._stage(task, ws)
        self._execute(task, ws)
        files = self._checked_outputs(task, ws)
        assert self.evidence is not None
        # The outbox: from here on a restart of the agent resumes the commit instead of
        # losing the result.
        self.ctx.journal.update(
            self.lease.lease_id,
            state="finished",
            evidence=self.evidence.model_dump(),
            outputs={f.rel: f.size for f in files},
            metrics_sha256=_sha256(ws.out / "metrics.json"),
        )
        return self._commit(task, files)

    def _resumed_pipeline(self) -> tuple[Outcome, str]:
        assert self.lease is not None
        self.task = task = parse_task(self.lease)
        self.ws = ws = Workspace(self.ctx.settings.state_dir / "attempts" / self.lease.lease_id)
        self._ran = True
        record = self.ctx.journal.read(self.lease.lease_id) or {}
        files = self._checked_outputs(task, ws)
        if {f.rel: f.size for f in files} != record.get("outputs") or _sha256(
            ws.out / "metrics.json"
        ) != record.get("metrics_sha256"):
            raise AttemptFailed("outputs changed on disk after the attempt finished")
        return self._commit(task, files)

    def _checked_outputs(self, task: Task, ws: Workspace) -> list[OutputFile]:
        s = self.ctx.settings
        files = ws.outputs(s.max_output_file_bytes, s.max_output_total_bytes)
        metrics = _read_metrics(ws.out / "metrics.json")
        if task.workload_type == "command" and not isinstance(metrics, dict):
            raise AttemptFailed("out/metrics.json is not a JSON object")
        check_fedavg(ws.out, metrics)
        logs = [
            OutputFile(f"logs/{p.name}", p, p.stat().st_size)
            for p in (ws.logs / "stdout.txt", ws.logs / "stderr.txt")
            if p.exists() and p.stat().st_size > 0
        ]
        return logs + files  # metrics.json is last: the commit anchor goes up last

    def _commit(self, task: Task, files: list[OutputFile]) -> tuple[Outcome, str]:
        self._lost_check()
        for f in files:
            key = task.output_prefix + f.rel
            try:
                sha = self._retrying(
                    f"upload of {f.rel}", functools.partial(self._upload, key, f.path)
                )
            except PayloadTooLarge as exc:
                raise AttemptFailed(
                    f"the coordinator refused out/{f.rel} as too large ({exc})"
                ) from None
            if f.rel == "metrics.json":
                self.output_sha256 = sha
        assert self.evidence is not None
        evidence = self.evidence
        accepted, detail = self._retrying(
            "complete",
            lambda: self.ctx.coordinator.complete(self.lease_id, self.output_sha256, evidence),
        )
        if accepted:
            log.info("lease %s: committed, accepted", self.lease_id)
            return Outcome.COMMITTED, ""
        log.warning(
            "lease %s: commit not accepted (final): %s", self.lease_id, detail or "no detail"
        )
        return Outcome.REJECTED, detail

    def _upload(self, key: str, path: Path) -> str:
        self._lost_check()
        return self.ctx.coordinator.upload(key, path)

    def _stage(self, task: Task, ws: Workspace) -> None:
        budget = self.ctx.settings.max_input_bytes
        for inp in task.inputs:
            self._lost_check()
            dest = ws.stage / inp.name if inp.unpack else ws.inputs / inp.dest
            try:
                size = self._retrying(
                    f"download of input {inp.name}",
                    functools.partial(self.ctx.coordinator.download, inp.key, dest, budget),
                )
            except LeaseLost:
                raise
            except CoordinatorError as exc:
                if exc.status == 404:
                    raise AttemptFailed(
                        f"input {inp.name!r} is missing: no artifact at {inp.key}"
                    ) from None
                raise AttemptFailed(f"input {inp.name!r} could not be fetched: {exc}") from None
            budget -= size
            if inp.unpack:
                ws.unpack(dest, inp.name, budget)
                dest.unlink()

    def _execute(self, task: Task, ws: Workspace) -> None:
        s, clock = self.ctx.settings, self.ctx.clock
        assert self.keeper is not None
        timeout = min(task.timeout_seconds or s.max_task_seconds, s.max_task_seconds)
        self._lost_check()
        cpu = self.ctx.cpu_window()
        cpu.start()
        lease_id = self.lease_id
        handle: Handle = self.ctx.runner.start(
            task,
            ws,
            self._wake.set,
            lambda ident: self.ctx.journal.update(lease_id, process=ident),
            self.devices,
        )
        self._ran = True
        sampler = Sampler(
            clock, s.sample_seconds, handle, self.ctx.gpu, self.ctx.gpus.devices, self.devices
        )
        self.ctx.start_thread(sampler.run, f"sampler-{lease_id}")
        t0 = clock.monotonic()
        deadline = t0 + timeout
        stopped = ""
        log.info(
            "lease %s: running (%s runner, timeout %g s)",
            self.lease_id,
            self.ctx.runner.name,
            timeout,
        )
        try:
            while handle.returncode is None:
                now = clock.monotonic()
                if self.keeper.lost.is_set():
                    handle.terminate(min(s.kill_grace_seconds, 1.0))
                    break
                if self._cancel_reason is not None:
                    stopped = self._cancel_reason
                    handle.terminate(self._cancel_grace)
                    break
                if now >= deadline:
                    stopped = f"timed out after {timeout:g} s"
                    handle.terminate(s.kill_grace_seconds)
                    break
                clock.wait(self._wake, deadline - now)
                self._wake.clear()
            wall = clock.monotonic() - t0
            host_gpu, task_gpu = sampler.finish()
            task_cpu = handle.cpu_seconds()
        finally:
            sampler.finish()
            handle.finish()
        self.task_usage = {
            "cpu_percent_mean": round(task_cpu / wall * 100, 2) if task_cpu and wall > 0 else None,
            "gpu_util_percent_mean": task_gpu,
        }
        self.evidence = ExecutionEvidence(
            wall_seconds=round(wall, 4),
            cpu_percent_mean=cpu.stop(),
            gpu_util_percent_mean=host_gpu,
            image_digest=handle.image_digest,
            exit_code=handle.returncode,
        )
        self._lost_check()
        if stopped:
            raise AttemptFailed(stopped)
        cause = handle.failure()
        if cause:
            raise AttemptFailed(cause)
        code = handle.returncode
        if code != 0:
            what = (
                f"killed by signal {-code}"
                if code is not None and code < 0
                else f"exit code {code}"
            )
            tail = _last_lines(handle.stderr_tail())
            raise AttemptFailed(f"{what}: {tail}" if tail else what)

    # --- failure paths ------------------------------------------------------------------------

    def _report_failure(self, reason: str) -> tuple[Outcome, str]:
        reason = _bounded(reason)
        if self.keeper is not None and self.keeper.lost.is_set():
            return Outcome.LOST, self.keeper.reason
        log.warning("lease %s: failed: %s", self.lease_id, reason)
        if self._ran and self.task is not None and self.ws is not None:
            self._upload_logs_best_effort(self.task, self.ws)
        try:
            self._retrying("fail", lambda: self.ctx.coordinator.fail(self.lease_id, reason))
        except LeaseLost:
            return Outcome.LOST, reason
        except CoordinatorError as exc:
            log.error("lease %s: could not report the failure: %s", self.lease_id, exc)
        return Outcome.FAILED, reason

    def _upload_logs_best_effort(self, task: Task, ws: Workspace) -> None:
        for name in ("stdout.txt", "stderr.txt"):
            path = ws.logs / name
            try:
                if path.exists() and path.stat().st_size > 0:
                    self.ctx.coordinator.upload(f"{task.output_prefix}logs/{name}", path)
            except (CoordinatorError, OSError):
                return

    def _drop(self, reason: str, started: float) -> Outcome:
        self.ctx.gpus.release(self.devices)
        self.devices = []
        lease_id = self.data.get("lease_id") if isinstance(self.data, dict) else None
        if isinstance(lease_id, str) and SAFE_ID.match(lease_id):
            log.error("lease %s: %s; failing it", lease_id, reason)
            try:
                self.ctx.coordinator.fail(lease_id, _bounded(reason))
            except CoordinatorError as exc:
                log.error("lease %s: could not report the failure: %s", lease_id, exc)
            self._record(Outcome.FAILED, reason, started, lease_id=lease_id)
            return Outcome.FAILED
        log.error("claim answer dropped: %s (it will expire on the coordinator)", reason)
        self._record(Outcome.DROPPED, reason, started)
        return Outcome.DROPPED

    # --- helpers ------------------------------------------------------------------------------

    def _lost_check(self) -> None:
        if self.keeper is not None and self.keeper.lost.is_set():
            raise LeaseLost(self.keeper.reason)

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying transport errors and 5xx with capped exponential backoff and
        jitter while the lease lives."""
        assert self.keeper is not None
        delay = 0.5
        for failures in range(1, RETRY_LIMIT + 1):
            self._lost_check()
            try:
                return call()
            except CoordinatorUnavailable as exc:
                if failures == RETRY_LIMIT:
                    raise AttemptFailed(f"{what} kept failing: {exc}") from None
                if failures == 1:
                    log.warning("lease %s: %s failed, retrying: %s", self.lease_id, what, exc)
                pause = delay * self.ctx.rng.uniform(0.5, 1.0)
                if self.ctx.clock.wait(self.keeper.lost, pause):
                    raise LeaseLost(self.keeper.reason) from None
                delay = min(delay * 2, RETRY_DELAY_MAX)
        raise AssertionError("unreachable")  # pragma: no cover

    def _record(self, outcome: Outcome, reason: str, started: float, lease_id: str = "") -> None:
        lease = self.lease
        payload = self.data.get("payload") if isinstance(self.data, dict) else None
        try:
            digest = hashlib.sha256(
                json.dumps(payload, sort_keys=True, default=str).encode()
            ).hexdigest()
        except (TypeError, ValueError):
            digest = ""
        self.ctx.ledger.append(
            {
                "lease_id": lease.lease_id if lease else lease_id,
                "job_id": lease.job_id if lease else "",
                "task_id": lease.task_id if lease else "",
                "attempt_number": lease.attempt_number if lease else None,
                "payload_sha256": digest,
                "runner": self.ctx.runner.name,
                "evidence": self.evidence.model_dump() if self.evidence else None,
                "task_usage": self.task_usage or None,
                "gpus": [d.visible for d in self.devices],
                "output_sha256": self.output_sha256,
                "outcome": outcome.value,
                "reason": reason,
                "started_at": started,
                "ended_at": self.ctx.clock.wall(),
            }
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


_NOT_JSON = object()


def _read_metrics(path: Path) -> Any:
    """metrics.json parsed, or a marker when it is not JSON (any bytes do for module kinds)."""
    if path.stat().st_size > METRICS_MAX_BYTES:
        raise AttemptFailed(f"out/metrics.json is larger than {METRICS_MAX_BYTES} bytes")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return _NOT_JSON


def _last_lines(text: str, n: int = 5) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])


def _bounded(reason: str) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= REASON_MAX else reason[: REASON_MAX - 3] + "..."
