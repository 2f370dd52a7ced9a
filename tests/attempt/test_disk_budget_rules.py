"""The attempt's disk budget on given disks (no task, no real disk): who pays for what does not
fit is decided before the write; a checkpoint is weighed whole, capped in parts and depth; and
the node holds its claims for a while after a task that did not fit, on the fake clock."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
from fakes import FakeClock

from flashnode.attempt.diskbudget import Budget
from flashnode.attempt.diskwatch import Reserved
from flashnode.attempt.phases.restore import Unusable, _inodes, _layout
from flashnode.attempt.record import Outcome
from flashnode.config.settings import Settings
from flashnode.coordinator.messages import CheckpointManifest, CheckpointPart
from flashnode.errors import OverBudget, ShortOfRoom
from flashnode.node.guard import Ending
from flashnode.node.holds import SHORT_CAP_S, SHORT_FIRST_S, DiskHold
from flashnode.sandbox.diskuse import Space
from flashnode.sandbox.outputs import Usage

MiB = 1 << 20
PREFIX = "jobs/j/task-000/"


def settings(tmp_path: Path, **extra: object) -> Settings:
    return Settings(
        coordinator="http://127.0.0.1:1",
        state_dir=tmp_path,
        min_free_bytes=100 * MiB,
        task_disk_bytes=1024 * MiB,
        task_disk_files=5000,
        **extra,  # type: ignore[arg-type]
    )


def disk(free_mib: int, free_inodes: int = 30_000) -> Space:
    """A 400 MiB disk of 40,000 inodes (its floor: 100 MiB and 10,000 inodes)."""
    return Space(free_mib * MiB, 400 * MiB, free_inodes, 40_000)


def budget(tmp_path: Path, space: Space, reserved: Reserved | None = None) -> Budget:
    return Budget(reserved or Reserved(), "ls-1", settings(tmp_path), lambda: space)


def test_a_write_past_the_jobs_own_caps_is_the_jobs_and_names_the_size_and_the_cap(
    tmp_path: Path,
) -> None:
    b = budget(tmp_path, disk(4000))  # room enough: only the caps can refuse
    b.take(1000 * MiB, 1, "input a")
    with pytest.raises(OverBudget, match=r"input b would take .* to 1\.0 GiB, past task_disk"):
        b.take(25 * MiB, 1, "input b")
    with pytest.raises(OverBudget, match="past task_disk_files \\(5000\\)"):
        b.take(0, 5000, "input c")


def test_a_write_past_the_room_above_the_floor_is_the_nodes_and_takes_nothing(
    tmp_path: Path,
) -> None:
    b = budget(tmp_path, disk(300))
    with pytest.raises(ShortOfRoom, match="does not fit: 201 MiB more") as short:
        b.take(201 * MiB, 1, "input b")
    assert short.value.needed == (201 * MiB, 1)
    assert b.mark() == (0, 0)  # nothing counted for a write refused
    few = budget(tmp_path, disk(300, free_inodes=14_000))  # 4,000 above the inode floor
    with pytest.raises(ShortOfRoom, match="below min_free_bytes' share of its inodes"):
        few.take(0, 4001, "the checkpoint")
    b.take(200 * MiB, 1, "input a")


def test_the_room_leaves_out_what_the_running_tasks_may_still_write(tmp_path: Path) -> None:
    reserved = Reserved()
    s = settings(tmp_path)
    reserved.start("ls-running", s, Usage(0, 0, 0, 0), disk(300))  # its caps: all the room
    with pytest.raises(ShortOfRoom, match="what the running tasks may still write set aside"):
        budget(tmp_path, disk(300), reserved).take(MiB, 1, "input a")


def test_what_was_staged_outside_the_tasks_files_is_taken_from_its_caps(tmp_path: Path) -> None:
    reserved = Reserved()
    s = settings(tmp_path)
    b = Budget(reserved, "ls-1", s, lambda: disk(3000))
    b.take(600 * MiB, 2, "input a")
    caps = reserved.start("ls-1", s, Usage(0, 0, 0, 0), disk(3000))
    assert (caps.bytes, caps.files) == (424 * MiB, 4998)
    reserved.end("ls-1")
    assert reserved.staged("ls-1") == (0, 0)


def manifest(parts: list[tuple[str, int]]) -> CheckpointManifest:
    prefix = PREFIX + "ckpt/ls-0/5/"
    sha = hashlib.sha256(b"").hexdigest()
    return CheckpointManifest(
        step=5,
        storage_prefix="artifact://" + prefix,
        parts=[CheckpointPart(key=prefix + rel, sha256=sha, size_bytes=n) for rel, n in parts],
    )


def test_a_checkpoint_of_more_parts_than_the_relay_ships_is_not_used() -> None:
    many = manifest([(f"step-5/p{i}", 0) for i in range(1001)])
    with pytest.raises(Unusable, match="1001 parts, more than 1000"):
        _layout(many, PREFIX, 1 << 40)


def test_a_checkpoint_deeper_than_the_relay_ships_is_not_used() -> None:
    deep = manifest([("step-5/" + "d/" * 17 + "f", 0)])
    with pytest.raises(Unusable, match="deeper than 16 directories"):
        _layout(deep, PREFIX, 1 << 40)
    _layout(manifest([("step-5/" + "d/" * 15 + "f", 0)]), PREFIX, 1 << 40)


def test_a_checkpoints_inodes_count_every_directory_it_needs() -> None:
    files = _layout(manifest([("step-5/a/b/f", 0), ("step-5/a/g", 0)]), PREFIX, 1 << 40)
    # two files; step-5, step-5/a, step-5/a/b; and the directory they are fetched into
    assert _inodes(files) == 6


def test_after_a_task_that_did_not_fit_the_node_holds_its_claims_for_a_while(
    tmp_path: Path,
) -> None:
    clock, s = FakeClock(), settings(tmp_path)
    free = [disk(300)]
    hold = DiskHold(lambda: free[0], Reserved(), clock, random.Random(1))
    assert hold.hold(s) is None
    short = Ending(Outcome.LAPSED, "low disk: input b …", "job-1", short_of_room=(340 * MiB, 2))
    hold.record(short)
    held = hold.hold(s)
    assert held is not None and held.rule == "disk" and "job-1" in held.reason
    clock.now += SHORT_FIRST_S * 0.8 - 1
    assert hold.hold(s) is not None  # not before its backoff ...
    clock.now += SHORT_FIRST_S * 0.2 + 2
    assert hold.hold(s) is None  # ... nor after it
    hold.record(short)
    clock.now += SHORT_FIRST_S
    assert hold.hold(s) is not None  # doubled in a row
    free[0] = disk(450)  # that much room now: claims resume at once
    assert hold.hold(s) is None
    hold.record(Ending(Outcome.FAILED, "exit 1", "job-2"))  # any other ending ends the row
    free[0] = disk(300)
    hold.record(short)
    clock.now += SHORT_FIRST_S
    assert hold.hold(s) is None and SHORT_CAP_S > SHORT_FIRST_S
