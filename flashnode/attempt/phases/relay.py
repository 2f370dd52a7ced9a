"""The checkpoint relay (docs/protocol.md §8): while a checkpointing task runs, each new complete
checkpoint in its ``out/ckpt/`` is uploaded, every file registered as a part, then one manifest
committed; once the task has exited, a last sweep ships the newest one it left, also when it
crashed.

A checkpoint is, in flashruntime's layout, a ``step-*`` or ``checkpoint-*`` directory holding a
``manifest.json`` (what ``flashruntime.torch.checkpoint`` and the Hugging Face callback write:
parts first, the manifest last): complete as soon as its manifest is there and its parts match
it, its step the manifest's, shipped as the parts it lists and the manifest itself, committed
with the manifest's ``framework`` and ``world_size``. In the older layouts it is a file
``step-<N>.<ext>``, complete when a newer one exists, when it stayed unchanged over one scan (for
tasks that write in place instead of renaming), or when the task has exited; or a directory
``step-<N>/`` without a manifest, complete when a newer one exists or the task has exited, and
never once the task has shown that it writes manifests (such a directory is then one being
written, or one a crash left half written). The relay ships the newest complete one newer than
the last it shipped (or the one the attempt resumed from: it is never shipped back). Files are
read as outputs are: from directory descriptors, regular files of the task's user only, uploaded
from the descriptor that was checked, as a stream; a part whose bytes do not match its
manifest's sha256 makes its checkpoint one that is not shipped.

Fencing: a 410 (403 in token mode) on any checkpoint write means this attempt is no longer the
task's live one: the relay stops at once and takes the lease as lost, so the task is stopped and
nothing more is uploaded. An attempt's artifact keys are its own
(``<output prefix>ckpt/<lease id>/<step>/…``), so even the bytes a superseded attempt uploaded
before its 410 cannot replace the live attempt's resume point. A transport error costs that
checkpoint only (the next one supersedes it; the last sweep retries); a 409 means that
checkpoint does not exist; the task runs on either way.

Disk: once a checkpoint is committed (or given up), every older one is deleted, so the task's
disk holds the newest shipped checkpoint and what is newer; checkpoints past
``CHECKPOINTS_ON_DISK`` times ``max_checkpoint_bytes`` in all stop the task.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, TypeVar, cast

from flashnode.attempt.phases.transfer import transfer
from flashnode.coordinator import retry
from flashnode.coordinator.ids import ARTIFACT_SCHEME
from flashnode.coordinator.messages import CheckpointPart
from flashnode.errors import (
    AttemptFailed,
    Cancelled,
    CheckpointRefused,
    CoordinatorError,
    CredentialsError,
    LeaseLost,
    OutOfDescriptors,
    PayloadTooLarge,
)
from flashnode.sandbox.checkpoints import Checkpoint, find_checkpoints, remove_checkpoint
from flashnode.sandbox.outputs import OutputFile, open_output
from flashnode.sandbox.workspace import CKPT

if TYPE_CHECKING:
    from flashnode.attempt.hooks import AttemptView
    from flashnode.attempt.record import Staged

log = logging.getLogger(__name__)
T = TypeVar("T")

# The task may hold this many checkpoints' worth of bytes in out/ckpt/ (the newest shipped, the
# one being shipped, the one being written, and slack) before it is stopped.
CHECKPOINTS_ON_DISK = 4


class Shipped(enum.Enum):
    SHIPPED = "shipped"  # committed: the task's new resume point
    FAILED = "failed"  # a transport error: the next one supersedes it
    REFUSED = "refused"  # it cannot be shipped (409, too large, not regular files): never again
    AGAIN = "again"  # it changed while it was read: look again at the next scan
    LOST = "lost"  # the lease is gone: nothing more


class Relay:
    """A watcher of the running task (``Attempt.during_run``). ``start`` runs the relay on its
    own thread, one sweep every ``checkpoint_scan_seconds``; ``finish`` waits for a ship under
    way, then sweeps once more with the task gone. Never raises, never blocks the task.
    ``restored``: the (name, step) of the checkpoint restored into out/ckpt/ for the task, in
    flashruntime's layout: only newer ones are shipped."""

    def __init__(
        self, a: AttemptView, staged: Staged, restored: tuple[str, int] | None = None
    ) -> None:
        self._a = a
        self._lease, self._task, self._ws = staged.lease, staged.task, staged.workspace
        self._lost = a.keeper.lost if a.keeper is not None else threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._exited = False
        self._shipped: tuple[str, int] | None = restored  # (name, step) of the resume point
        self._writes_manifests = restored is not None
        self._refused: set[str] = set()
        self._failed: set[str] = set()
        self._stamps: dict[str, tuple[tuple[str, int, int, int], ...]] = {}
        self._warned: set[str] = set()

    # --- the watcher ------------------------------------------------------------------------

    def start(self, a: AttemptView) -> None:
        a.ctx.start_thread(self._run, f"relay-{self._lease.lease_id}")

    def stop(self) -> None:
        self._exited = True
        self._wake.set()

    def finish(self, a: AttemptView) -> None:
        self._exited = True
        self._wake.set()
        with self._lock:
            try:
                self.sweep(final=True)
            except Exception:  # a bug: the attempt's outcome must not depend on it
                log.exception("checkpoint relay failed")

    def _run(self) -> None:
        clock, every = self._a.ctx.clock, self._a.ctx.settings.checkpoint_scan_seconds
        while not clock.wait(self._wake, every):
            with self._lock:
                if self._exited or self._lost.is_set():
                    return
                try:
                    self.sweep()
                except Exception:
                    log.exception("checkpoint relay failed")

    # --- one sweep --------------------------------------------------------------------------

    def sweep(self, final: bool = False) -> None:
        """One look at out/ckpt/: ship the newest complete checkpoint newer than the last one
        shipped, then delete what is older. ``final``: the task has exited."""
        if self._lost.is_set():
            return
        s = self._a.ctx.settings
        try:
            found, total, unusable = find_checkpoints(self._ws)
        except (AttemptFailed, OutOfDescriptors, OSError) as exc:
            self._warn("ckpt", f"no checkpoint is shipped while out/{CKPT}/ is unusable: {exc}")
            return
        for name, why in unusable.items():
            self._warn(name, f"{CKPT}/{name} is not shipped: {why}")
        self._writes_manifests = (
            self._writes_manifests or bool(unusable) or any(c.manifest is not None for c in found)
        )
        limit = CHECKPOINTS_ON_DISK * s.max_checkpoint_bytes
        if total > limit and not final:
            self._a.cancel(
                AttemptFailed(f"checkpoints in out/{CKPT}/ grew past {limit} bytes"),
                s.kill_grace_seconds,
            )
            return
        ready = self._ready(found, final)
        self._stamps = {c.name: c.stamp for c in found}
        if ready is None or ready.name in self._refused:
            return
        if ready.name in self._failed and not final:
            return
        outcome = self._ship(ready, final)
        if outcome is Shipped.SHIPPED:
            self._shipped = (ready.name, ready.step)
        elif outcome is Shipped.FAILED:
            self._failed.add(ready.name)
        elif outcome is Shipped.REFUSED:
            self._refused.add(ready.name)
        if outcome in (Shipped.SHIPPED, Shipped.FAILED, Shipped.REFUSED):
            self._remove_older(found, ready.step)

    def _ready(self, found: list[Checkpoint], final: bool) -> Checkpoint | None:
        """The newest complete checkpoint newer than the last one shipped."""
        after = self._shipped[1] if self._shipped is not None else -1
        newest = max((c.step for c in found), default=-1)
        ready = None
        for c in found:
            if c.step <= after or not c.files:
                continue
            if c.manifest is not None:
                complete = True
            elif c.directory:
                complete = not self._writes_manifests and (final or c.step < newest)
            else:
                complete = final or c.step < newest or self._stamps.get(c.name) == c.stamp
            if complete:
                ready = c
        return ready

    def _ship(self, c: Checkpoint, final: bool) -> Shipped:
        lease, task, coordinator = self._lease, self._task, self._a.ctx.coordinator
        s = self._a.ctx.settings
        if c.problem:
            self._warn(c.name, f"checkpoint step {c.step} is not shipped: {c.problem}")
            return Shipped.REFUSED
        if c.size > s.max_checkpoint_bytes:
            self._warn(
                c.name,
                f"checkpoint step {c.step} is not shipped: it holds {c.size} bytes, more than"
                f" max_checkpoint_bytes ({s.max_checkpoint_bytes})",
            )
            return Shipped.REFUSED
        base = f"{task.output_prefix}{CKPT}/{lease.lease_id}/{c.step}/"
        ids = (lease.job_id, lease.task_id, lease.lease_id, c.step)
        m = c.manifest
        declared = {f"{CKPT}/{c.name}/{p.name}": p.sha256 for p in m.parts} if m else {}
        try:
            parts = []
            for f in c.files:
                key = base + f.rel[len(CKPT) + 1 :]
                sha = self._call(final, lambda f=f, key=key: self._upload(key, f))  # type: ignore[misc]
                if declared.get(f.rel, sha) != sha:
                    name = f.rel.rsplit("/", 1)[-1]
                    self._warn(
                        c.name,
                        f"checkpoint step {c.step} is not shipped: its part {name!r} does not"
                        " match the sha256 of its manifest",
                    )
                    return Shipped.REFUSED
                parts.append(CheckpointPart(key=key, sha256=sha, size_bytes=f.size))
            for part in parts:
                self._call(final, lambda part=part: coordinator.checkpoint_part(*ids, part))  # type: ignore[misc]
            world_size, framework = (m.world_size, m.framework) if m else (1, "")
            self._call(
                final,
                lambda: coordinator.checkpoint_commit(
                    *ids, parts, ARTIFACT_SCHEME + base, world_size, framework
                ),
            )
        except (LeaseLost, CredentialsError) as exc:
            self._lose(f"checkpoint write refused: {exc}")
            return Shipped.LOST
        except Cancelled:
            return Shipped.LOST
        except (CheckpointRefused, PayloadTooLarge) as exc:
            self._warn(c.name, f"checkpoint step {c.step} was refused: {exc}")
            return Shipped.REFUSED
        except (AttemptFailed, OSError) as exc:  # changed or vanished while it was read
            log.debug("checkpoint step %d: %s", c.step, exc)
            return Shipped.AGAIN
        except (CoordinatorError, retry.GaveUp) as exc:
            log.warning(
                "checkpoint step %d could not be shipped (%s); the next one supersedes it",
                c.step,
                exc,
            )
            return Shipped.FAILED
        self._a.shipped(c.step, (c.name, c.step))
        log.info("checkpoint step %d shipped (%d file(s), %d bytes)", c.step, len(parts), c.size)
        return Shipped.SHIPPED

    def _upload(self, key: str, f: OutputFile) -> str:
        if self._lost.is_set():
            raise Cancelled("the lease is lost")
        with open_output(self._ws, f) as fh:
            sha = self._a.ctx.coordinator.upload(
                key, cast(BinaryIO, _StopsOnLoss(fh, self._lost)), f.size
            )
        self._a.count_uploaded(f.size)
        return sha

    def _call(self, final: bool, call: Callable[[], T]) -> T:
        """While the task runs, one try (the next checkpoint supersedes this one); in the last
        sweep, retried like a download while the lease lives."""
        if self._lost.is_set():
            raise Cancelled("the lease is lost")
        if not final:
            return call()
        return transfer(self._a, "last checkpoint", call, stop=self._lost)

    def _remove_older(self, found: list[Checkpoint], step: int) -> None:
        keep = self._shipped[0] if self._shipped is not None else None
        for c in found:
            if c.step < step and c.name != keep:
                try:
                    remove_checkpoint(self._ws, c.name)
                except (AttemptFailed, OSError) as exc:
                    log.debug("cannot remove %s: %s", c.name, exc)

    def _lose(self, reason: str) -> None:
        log.warning("%s; stopping", reason)
        keeper = self._a.keeper
        if keeper is not None:
            keeper.mark_lost(reason)
        else:
            self._lost.set()

    def _warn(self, name: str, text: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("%s", text)


class _StopsOnLoss:
    """A checked output file whose reads end once the lease is lost, so that an upload under
    way stops within one chunk instead of sending the rest."""

    def __init__(self, fh: BinaryIO, lost: threading.Event) -> None:
        self._fh, self._lost = fh, lost

    def read(self, n: int = -1) -> bytes:
        if self._lost.is_set():
            raise Cancelled("the lease is lost")
        return self._fh.read(n)
