"""Bulk bytes (issue 44), against fakes: a restored checkpoint's parts are hashed as they stream
to disk and never read back; a retried download hashes only the bytes of the try that
succeeded. (How fast and in how much memory: benchmarks/bulk.py, not a test.)"""

from __future__ import annotations

import builtins
import hashlib
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.attempt import Attempt, LeaseKeeper
from flashnode.attempt.phases import restore, stage
from flashnode.attempt.phases.transfer import Ladder
from flashnode.attempt.record import Staged
from flashnode.coordinator.lease import parse_lease, parse_task
from flashnode.coordinator.messages import CheckpointManifest, CheckpointPart
from flashnode.errors import AttemptFailed, CoordinatorUnavailable
from flashnode.sandbox.workspace import Workspace

PREFIX = "jobs/j1/task-000/ckpt/ls-old/5/"
PARTS = {"step-5/w.bin": b"weights" * 1000, "step-5/opt/m.bin": b"moments" * 1000}


def manifest() -> CheckpointManifest:
    parts = [
        CheckpointPart(
            key=PREFIX + rel, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)
        )
        for rel, data in PARTS.items()
    ]
    return CheckpointManifest(step=5, storage_prefix="artifact://" + PREFIX, parts=parts)


def attempt(tmp_path: Path, coord: FakeCoordinator, clock: FakeClock) -> tuple[Attempt, Staged]:
    ctx = context(tmp_path, clock, coord, FakeRunner())
    data = lease(checkpoint={"watchdog_seconds": 60})
    a = Attempt(ctx, data)
    a.lease = parse_lease(data)
    a.keeper = LeaseKeeper(coord, a.lease, clock, a._lost)
    ws = Workspace.create(tmp_path / "attempts", a.lease.lease_id)
    ws.task_uid = os.geteuid()
    a.staged = Staged(a.lease, parse_task(a.lease), ws)
    return a, a.staged


def test_a_restored_part_is_hashed_as_it_streams_and_never_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, latest=manifest())
    coord.uploads.update({PREFIX + rel: data for rel, data in PARTS.items()})
    a, staged = attempt(tmp_path, coord, clock)
    reads: list[str] = []
    real_open, real_os_open = Path.open, os.open

    def path_open(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and "+" not in mode:
            reads.append(self.name)
        return real_open(self, mode, *args, **kwargs)

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) == 0:
            reads.append(os.path.basename(os.fspath(path)))
        return real_os_open(path, flags, *args, **kwargs)

    def any_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, Path)) and "r" in mode and "+" not in mode:
            reads.append(os.path.basename(os.fspath(file)))
        return real_builtin_open(file, mode, *args, **kwargs)

    real_builtin_open = builtins.open
    monkeypatch.setattr(Path, "open", path_open)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", any_open)
    contributed = restore.run(a, staged)
    monkeypatch.undo()
    assert contributed.env["FLASHML_RESUME"] == "/work/inputs/resume/step-5"
    assert (staged.workspace.inputs / "resume/step-5/opt/m.bin").read_bytes() == PARTS[
        "step-5/opt/m.bin"
    ]
    assert "w.bin" not in reads and "m.bin" not in reads, reads


class Flaky(FakeCoordinator):
    """A download that breaks after half its bytes on its first try."""

    def __init__(self, clock: FakeClock, data: bytes) -> None:
        super().__init__(clock)
        self.data, self.tries = data, 0

    def download(
        self, key: str, out: BinaryIO, max_bytes: int, stop: threading.Event | None = None
    ) -> int:
        self.tries += 1
        if self.tries == 1:
            out.write(self.data[: len(self.data) // 2])
            raise CoordinatorUnavailable("connection dropped")
        out.write(self.data)
        return len(self.data)


def test_a_retried_download_hashes_only_the_bytes_of_the_try_that_succeeded(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    data = b"0123456789" * 5000
    coord = Flaky(clock, data)
    a, staged = attempt(tmp_path, coord, clock)
    dest = staged.workspace.stage / "part.bin"
    ladder = Ladder(gave_up=AttemptFailed, refused=AttemptFailed)
    size, sha = stage.fetch_hashed(a, "k", dest, len(data), "a part", ladder)
    assert coord.tries == 2
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert dest.read_bytes() == data
