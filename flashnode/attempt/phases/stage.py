"""Staging: the attempt's workspace and its inputs, downloaded from the coordinator's store
(archives unpacked safely), before anything of the task runs. A stop is honoured between and
during downloads."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from flashnode.attempt.phases.transfer import Ladder, transfer
from flashnode.attempt.record import Staged
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.sandbox import archives

if TYPE_CHECKING:
    from pathlib import Path

    from flashnode.attempt.diskbudget import BudgetedFile
    from flashnode.attempt.hooks import AttemptView
    from flashnode.coordinator.lease import Lease, Task


def make(a: AttemptView, lease: Lease, task: Task) -> Staged:
    """The attempt's workspace, new and empty: the orchestrator holds it before anything is
    downloaded into it, so that it is retired however the attempt ends."""
    a.staging()
    return Staged.make(lease, task, a.ctx.settings.state_dir)


def run(a: AttemptView, staged: Staged) -> None:
    """The task's inputs, downloaded into the workspace (archives unpacked), each byte and inode
    taken from the attempt's disk budget before it is written (``diskbudget.py``)."""
    ws, s = staged.workspace, a.ctx.settings
    budget = s.max_input_bytes
    for inp in staged.task.inputs:
        a.check()
        dest = ws.stage / inp.name if inp.unpack else ws.inputs / inp.dest
        size = _download(a, inp.name, inp.key, dest, budget)
        budget -= size
        if inp.unpack:
            # What it unpacks to is the task's: within the attempt's budget (its own caps, and
            # never below the owner's floor: the agent unpacks as root), each member taken
            # before it is written.
            archives.unpack(
                dest,
                ws.inputs / inp.name,
                inp.name,
                min(budget, s.task_disk_bytes),
                max_entries=s.task_disk_files,
                room=a.budget.room(f"input {inp.name!r}"),
            )
            dest.unlink()
            a.budget.give_back(size, 1)


def fetch(a: AttemptView, key: str, dest: Path, max_bytes: int, what: str, ladder: Ladder) -> int:
    """Download artifact ``key`` into ``dest`` (made here, never through a link), retried with
    the shared backoff while the attempt goes on; counted as staged. Its inode and every chunk
    are taken from the attempt's disk budget before they are written (a chunk that does not fit
    ends the download: ``OverBudget``, ``ShortOfRoom``). How it can end is the ``ladder``'s
    (``transfer.py``)."""
    return fetch_hashed(a, key, dest, max_bytes, what, ladder, hashed=False)[0]


def fetch_hashed(
    a: AttemptView,
    key: str,
    dest: Path,
    max_bytes: int,
    what: str,
    ladder: Ladder,
    *,
    hashed: bool = True,
) -> tuple[int, str]:
    """``fetch``, and the sha256 of the bytes as they were written (hashed on the way: the
    file is never read back); "" when not ``hashed``."""
    budget = a.budget
    budget.take(0, 1, what)
    written = 0  # by the last try: a retry writes the file anew

    def once() -> tuple[int, str]:
        nonlocal written
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        budget.give_back(written, 0)
        written = 0
        digest = hashlib.sha256() if hashed else None
        with budget.open(fd, what) as out:
            try:
                sink = cast(BinaryIO, _Hashing(out, digest)) if digest is not None else out
                size = a.ctx.coordinator.download(key, sink, max_bytes, a.stop)
            finally:
                written = out.written
        a.count_staged(size)
        return size, digest.hexdigest() if digest is not None else ""

    return transfer(a, f"download of {what}", once, ladder=ladder)


class _Hashing:
    """A file written through, each write hashed once it is on its way to the disk."""

    def __init__(self, out: BudgetedFile, digest: Any) -> None:
        self._out, self._digest = out, digest

    def write(self, data: bytes) -> int:
        done = self._out.write(data)  # all of it, or it raises (BudgetedFile)
        self._digest.update(data)
        return done


def _download(a: AttemptView, name: str, key: str, dest: Path, budget: int) -> int:
    ladder = Ladder(
        missing=lambda _: AttemptFailed(f"input {name!r} is missing: no artifact at {key}"),
        gave_up=lambda e: AttemptLapsed(f"input {name!r} could not be fetched: {e.__cause__}"),
        refused=lambda e: AttemptFailed(f"input {name!r} could not be fetched: {e}"),
    )
    return fetch(a, key, dest, budget, f"input {name}", ladder)
