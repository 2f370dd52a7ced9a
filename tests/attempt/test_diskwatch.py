"""The disk watch between walks of a task's files, on readings of the disk at given times (no
task, no clock): a late watch freezes a fast task sooner, and a task that would outrun the room
the disk set before the watch could stop it is stopped at its walk."""

from __future__ import annotations

from pathlib import Path

from flashnode.attempt.diskwatch import DiskCaps, DiskWatch, Look
from flashnode.config.settings import Settings
from flashnode.errors import OutgrewRoom
from flashnode.sandbox.diskuse import Space

GiB = 1 << 30
BY_DISK = "the inodes the state dir's disk had free above min_free_bytes' share when it started"
ROOM = DiskCaps(bytes=10 * GiB, files=10_000, files_by=BY_DISK)  # the disk set the files' cap
OWN = DiskCaps(bytes=10 * GiB, files=10_000)  # ... the owner's task_disk_files did
BYTES = DiskCaps(bytes=10 * GiB, files=10_000, bytes_by="what the disk had free")


def space(free_inodes: int, free_bytes: int = 50 * GiB) -> Space:
    return Space(
        free_bytes=free_bytes, total_bytes=100 * GiB, free_inodes=free_inodes, total_inodes=40_000
    )


def settings(tmp_path: Path) -> Settings:
    return Settings(coordinator="http://127.0.0.1:1", state_dir=tmp_path)


def watched(caps: DiskCaps) -> DiskWatch:
    """A watch whose task was walked at 0 s with no files, on a disk with 20,000 inodes free."""
    watch = DiskWatch(caps, None)
    watch.walked(Look(space(20_000), 0, 0), now=0.0, seconds=0.0)
    return watch


def test_a_watch_on_time_leaves_a_task_with_room_running() -> None:
    watch = watched(ROOM)
    assert not watch.sample(0.02, space(19_000))  # 50,000 inodes a second, 9,000 left
    assert not watch.sample(0.04, space(18_000))


def test_a_watch_that_saw_the_disk_late_freezes_a_fast_task_while_it_has_room_left() -> None:
    """A reading 100 ms after the last (the agent waited for a core): the task made 4,000 files
    meanwhile and has 5,000 left, half of its room. At 40,000 a second it would make them
    before a watch as late as that looked again: it is walked now, frozen."""
    watch = watched(ROOM)
    assert not watch.sample(0.02, space(19_000))
    assert watch.sample(0.12, space(15_000))


def test_a_task_that_would_outrun_the_disks_room_before_the_watch_sees_it_is_stopped(
    tmp_path: Path,
) -> None:
    watch = watched(ROOM)
    watch.sample(0.02, space(19_000))
    watch.sample(0.12, space(15_000))  # 40,000 inodes a second; the watch 100 ms late
    ending = watch.outrun(Look(space(15_000), 0, 5_000), settings(tmp_path), "; stopped")
    assert isinstance(ending, OutgrewRoom)
    assert "about to grow past that (5000 inodes left" in str(ending), ending
    assert str(ending).endswith("; stopped")


def test_a_task_is_blamed_only_past_the_owners_cap_never_before(tmp_path: Path) -> None:
    """The same race under task_disk_files: the disk has room for what the task may make, so
    nothing is at stake but the task's own cap, and a task fails only past it."""
    watch = watched(OWN)
    watch.sample(0.02, space(19_000))
    watch.sample(0.12, space(15_000))
    assert watch.outrun(Look(space(15_000), 0, 5_000), settings(tmp_path), "") is None


def test_a_task_writing_slowly_near_the_disks_room_goes_on(tmp_path: Path) -> None:
    watch = watched(ROOM)
    watch.sample(1.0, space(19_990))
    watch.sample(2.0, space(19_980))  # 10 inodes a second, 20 left of its room
    watch.walked(Look(space(19_980), 0, 9_980), now=2.0, seconds=0.0)
    assert not watch.sample(2.02, space(19_980))
    assert watch.outrun(Look(space(19_980), 0, 9_980), settings(tmp_path), "") is None


def test_a_task_writing_fast_up_to_just_below_the_disks_room_in_bytes_goes_on(
    tmp_path: Path,
) -> None:
    """Bytes are held by the kernel per file and by min_free_bytes' breadth: a task writing
    2 GB a second into 10 GiB of room, walked with 100 MB of it left, is not stopped."""
    watch = watched(BYTES)
    watch.sample(0.02, space(20_000, 50 * GiB - (40 << 20)))
    watch.sample(0.12, space(20_000, 50 * GiB - (240 << 20)))
    left = Look(space(20_000, 40 * GiB + (100 << 20)), 10 * GiB - (100 << 20), 2)
    assert watch.outrun(left, settings(tmp_path), "") is None
