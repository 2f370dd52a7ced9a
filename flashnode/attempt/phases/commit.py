"""Checking outputs, spooling the result, uploading and committing it; and reporting a failure.

``check`` runs once the task ended well: the outputs pass their checks (``metrics.json`` as the
coordinator will judge it: readable JSON, an object for a command task, and what the job's
``validators`` declare, with the coordinator's own reasons; federated averaging's contribution),
then the result is written durably to the outbox (state ``finished``) before anything is
uploaded, so an agent restart resumes the commit instead of losing it. ``commit`` uploads every
file (logs first, ``metrics.json`` last: the commit anchor) from descriptors checked to be the
files the walk saw, and completes with the anchor's sha256 and the evidence; ``accepted: false``
is final.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from flashnode import logcontext
from flashnode.allocator import STREAM_CHUNK
from flashnode.attempt.phases.transfer import transfer
from flashnode.attempt.record import Finished, Outcome
from flashnode.coordinator import retry, validators
from flashnode.coordinator.checks import check_fedavg
from flashnode.coordinator.ids import SAFE_ID
from flashnode.errors import (
    AttemptFailed,
    Cancelled,
    CoordinatorError,
    CredentialsError,
    LeaseLost,
    PayloadTooLarge,
)
from flashnode.sandbox.outputs import OutputFile, list_outputs, open_log, open_output
from flashnode.sandbox.workspace import Workspace
from flashnode.sanitise import sanitise

if TYPE_CHECKING:
    from flashnode.attempt.context import AttemptContext
    from flashnode.attempt.hooks import AttemptView
    from flashnode.attempt.record import Staged
    from flashnode.coordinator.lease import Task
    from flashnode.coordinator.messages import ExecutionEvidence

log = logging.getLogger(__name__)

REASON_MAX = 500
METRICS_MAX_BYTES = 16 * 1024 * 1024
LOGS = ("stdout.txt", "stderr.txt")
T = TypeVar("T")


# --- check ---------------------------------------------------------------------------------


def check(a: AttemptView, staged: Staged, evidence: ExecutionEvidence) -> Finished:
    """The outputs of a run that ended well, checked, then the result spooled durably."""
    finished = _finished(a, staged, evidence)
    a.spool(finished)
    return finished


def recheck(a: AttemptView, staged: Staged) -> Finished:
    """For a result found in the outbox after a restart (``staged`` read back from its record):
    the outputs, checked again, must be the ones spooled."""
    evidence = a.record.evidence
    if evidence is None:  # spooled with the outputs (execute, then check): the record is broken
        raise AttemptFailed("the spooled result has no evidence of its run")
    finished = _finished(a, staged, evidence)
    if not finished.spooled(a.record):
        raise AttemptFailed("outputs changed on disk after the attempt finished")
    return finished


def _finished(a: AttemptView, staged: Staged, evidence: ExecutionEvidence) -> Finished:
    """The outputs walked and checked, and the sha256 of metrics.json (the last of them)."""
    ws = staged.workspace
    files = _checked_outputs(a, staged.task, ws)
    return Finished(evidence, files, _sha256(ws, files[-1]))


def _checked_outputs(a: AttemptView, task: Task, ws: Workspace) -> list[OutputFile]:
    s = a.ctx.settings
    files = list_outputs(ws, s.max_output_file_bytes, s.max_output_total_bytes, s.max_output_files)
    by_name = {f.rel: f for f in files}
    for name in LOGS:
        if f"logs/{name}" in by_name:  # the key of the agent's own capture of the task's output
            raise AttemptFailed(f"out/logs/{name} is reserved for what the task printed")
    metrics_file = files[-1]
    if metrics_file.size > METRICS_MAX_BYTES:
        raise AttemptFailed(f"out/metrics.json is larger than {METRICS_MAX_BYTES} bytes")
    with open_output(ws, metrics_file) as fh:
        data = fh.read()
    try:
        refused = validators.problem(data, task.workload_type, task.validators, a.ctx.schema_check)
    except validators.Unchecked as exc:
        log.warning("the declared json_schema is left to the coordinator: %s", exc)
        refused = None
    if refused is not None:
        raise AttemptFailed(refused)
    metrics = _parse_json(data)

    def opener(name: str) -> AbstractContextManager[BinaryIO] | None:
        f = by_name.get(name)
        return open_output(ws, f) if f is not None else None

    check_fedavg(metrics, opener)
    return files


_NOT_JSON = object()


def _parse_json(data: bytes) -> Any:
    """metrics.json parsed, or a marker when it is not JSON (any bytes do for module kinds)."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _NOT_JSON


def _sha256(ws: Workspace, f: OutputFile) -> str:
    digest = hashlib.sha256()
    with open_output(ws, f) as fh:
        while chunk := fh.read(STREAM_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- commit --------------------------------------------------------------------------------


def commit(a: AttemptView, staged: Staged, finished: Finished) -> tuple[Outcome, str]:
    """Upload the logs and every output (metrics.json last), then complete: the attempt's
    outcome and its reason."""
    ws, prefix = staged.workspace, staged.task.output_prefix
    with a.timed("commit.upload", phase=False):
        for name in LOGS:
            _upload(a, f"{prefix}logs/{name}", lambda n=name: _log_file(ws, n))  # type: ignore[misc]
        for f in finished.files:
            sha = _upload(a, prefix + f.rel, lambda f=f: _output(ws, f))  # type: ignore[misc]
            if f.rel == "metrics.json" and sha is not None:
                a.metrics_uploaded(sha)
    evidence, sha = finished.evidence, a.output_sha256
    with a.timed("commit.complete", phase=False):
        accepted, detail = _retrying(
            a, "complete", lambda: a.ctx.coordinator.complete(a.lease_id, sha, evidence)
        )
    if accepted:
        log.info("committed, accepted")
        return Outcome.COMMITTED, ""
    log.warning("commit not accepted (final): %s", detail or "-")
    return Outcome.REJECTED, detail


Opened = AbstractContextManager["tuple[BinaryIO, int] | None"]


@contextlib.contextmanager
def _output(ws: Workspace, f: OutputFile) -> Iterator[tuple[BinaryIO, int] | None]:
    with open_output(ws, f) as fh:
        yield fh, f.size


def _log_file(ws: Workspace, name: str) -> Opened:
    return open_log(ws, name)


def _upload(a: AttemptView, key: str, open_file: Callable[[], Opened]) -> str | None:
    """Upload one file (opened anew, and checked, on every try); None when there is nothing."""

    def once() -> str | None:
        a.check()
        with open_file() as opened:
            if opened is None:
                return None
            fh, size = opened
            sha = a.ctx.coordinator.upload(key, fh, size)
            a.count_uploaded(size)
            return sha

    try:
        return _retrying(a, f"upload of {key.rsplit('/', 1)[-1]}", once)
    except PayloadTooLarge as exc:
        raise AttemptFailed(f"the coordinator refused {key} as too large ({exc})") from None


def _retrying(a: AttemptView, what: str, call: Callable[[], T]) -> T:
    """Retry transport errors and 5xx with the shared backoff for as long as the lease lives
    (the keeper says when it is lost) and the attempt is not stopped."""
    return transfer(a, what, call, policy=retry.RESULT)


# --- failure ---------------------------------------------------------------------------------


def report_failure(a: AttemptView, reason: str) -> tuple[Outcome, str]:
    """Report the task's failure with ``fail`` (and its logs, when it ran), unless the lease is
    already lost."""
    reason = bounded(reason)
    if a.keeper is not None and a.keeper.lost.is_set():
        return Outcome.LOST, a.keeper.reason
    log.warning("failed: %s", reason)
    staged = a.staged
    if a.handle is not None and staged is not None:
        _upload_logs_best_effort(a, staged.task.output_prefix, staged.workspace)
    stop = a.keeper.lost if a.keeper is not None else threading.Event()
    try:
        transfer(a, "fail", lambda: a.ctx.coordinator.fail(a.lease_id, reason), stop=stop)
    except (LeaseLost, CredentialsError, Cancelled):
        return Outcome.LOST, reason
    except (CoordinatorError, retry.GaveUp) as exc:
        log.error("could not report the failure: %s", exc)
    return Outcome.FAILED, reason


def _upload_logs_best_effort(a: AttemptView, prefix: str, ws: Workspace) -> None:
    for name in LOGS:
        try:
            with open_log(ws, name) as opened:
                if opened is not None:
                    a.ctx.coordinator.upload(f"{prefix}logs/{name}", *opened)
                    a.count_uploaded(opened[1])
        except (CoordinatorError, CredentialsError, AttemptFailed, OSError):
            return


def reportable(lease_id: str) -> bool:
    return bool(SAFE_ID.match(lease_id))


def fail_quietly(ctx: AttemptContext, lease_id: str, reason: str) -> None:
    """One ``fail`` for a lease too malformed to run; its outcome changes nothing here."""
    try:
        ctx.coordinator.fail(lease_id, bounded(reason))
    except (CoordinatorError, CredentialsError) as exc:
        log.error("could not report the failure: %s", exc, extra=logcontext.fields(lease_id))


def bounded(reason: str) -> str:
    """A reason fit for the coordinator, the ledger, the log and the owner's terminal: one
    line, no control characters (a task's stderr could carry terminal escapes), bounded."""
    return sanitise(" ".join(reason.split()), limit=REASON_MAX)
