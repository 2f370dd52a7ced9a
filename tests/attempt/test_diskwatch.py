"""The disk watch between walks of a task's files, on readings of the disk and walks at given
times (no task, no clock): a task that would make the rest of the inodes the disk left it before
a watch as late as this one could look again is stopped at its walk, on its own pace only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flashnode.attempt.diskwatch import (
    FAST_BYTES_S,
    FAST_FILES_S,
    QUIET_S,
    SPACE_S,
    DiskCaps,
    DiskWatch,
    Look,
)
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


def watched(caps: DiskCaps, files: int = 0) -> DiskWatch:
    """A watch whose task was walked at 0 s with ``files``, on a disk with 20,000 inodes free."""
    watch = DiskWatch(caps, None)
    watch.walked(Look(space(20_000), 0, files), 0.0, 0.0, None, frozen=False)
    return watch


def late(watch: DiskWatch, free: list[int]) -> None:
    """Readings 20 ms apart, then one 100 ms late (the agent waited for a core)."""
    at = 0.0
    for i, inodes in enumerate(free):
        at += 0.1 if i == len(free) - 1 else 0.02
        watch.sample(at, space(inodes))


def test_a_task_making_files_faster_than_a_late_watch_could_stop_it_is_stopped_at_its_walk(
    tmp_path: Path,
) -> None:
    """5,000 files in 120 ms (about 42,000 a second) with 5,000 left: a watch 100 ms late
    could see it again only after it made them all."""
    watch = watched(ROOM)
    late(watch, [19_000, 15_000])
    ending = watch.outrun(Look(space(15_000), 0, 5_000), 0.12, settings(tmp_path), "; stopped")
    assert isinstance(ending, OutgrewRoom)
    assert "about to grow past that (5000 inodes left; it made 41667 a second" in str(ending)
    assert str(ending).endswith("; stopped")


def test_what_others_make_on_the_disk_never_stops_a_task(tmp_path: Path) -> None:
    """The disk loses 40,000 inodes a second to another slot's task (or the owner's programs);
    this task holds 4,000 of its 10,000 and makes none."""
    watch = watched(ROOM, files=4_000)
    late(watch, [19_000, 15_000])
    assert watch.outrun(Look(space(15_000), 0, 4_000), 0.12, settings(tmp_path), "") is None


def test_a_task_is_blamed_only_past_the_owners_cap_never_before(tmp_path: Path) -> None:
    """The same race under task_disk_files: the disk has room for what the task may make, so
    nothing is at stake but the task's own cap, and a task fails only past it."""
    watch = watched(OWN)
    late(watch, [19_000, 15_000])
    assert watch.outrun(Look(space(15_000), 0, 5_000), 0.12, settings(tmp_path), "") is None


def test_a_task_making_files_slowly_near_the_disks_room_goes_on(tmp_path: Path) -> None:
    watch = watched(ROOM, files=9_970)
    late(watch, [19_999, 19_998])
    assert watch.outrun(Look(space(19_998), 0, 9_972), 0.12, settings(tmp_path), "") is None


def test_one_stall_of_the_watch_does_not_stop_a_task_with_seconds_of_room(tmp_path: Path) -> None:
    """A 2 s stall (swap, a burst of load) counts for at most half a second: a task that made
    about 1,000 files a second through it, with 2,980 left (3 s of them), goes on."""
    watch = watched(ROOM, files=5_000)
    watch.sample(2.0, space(17_980))
    looked = Look(space(17_980), 0, 7_020)
    assert watch.outrun(looked, 2.0, settings(tmp_path), "") is None


def test_a_task_writing_fast_up_to_just_below_the_disks_room_in_bytes_goes_on(
    tmp_path: Path,
) -> None:
    """Bytes have min_free_bytes' breadth and the kernel's cap on each file: a task writing
    2 GB a second into 10 GiB of room, walked with 100 MB of it left, is not stopped."""
    watch = watched(BYTES)
    watch.sample(0.02, space(20_000, 50 * GiB - (40 << 20)))
    watch.sample(0.12, space(20_000, 50 * GiB - (240 << 20)))
    left = Look(space(20_000, 40 * GiB + (100 << 20)), 10 * GiB - (100 << 20), 2)
    assert watch.outrun(left, 0.12, settings(tmp_path), "") is None


def test_a_long_walk_does_not_make_the_disk_look_faster_than_it_is() -> None:
    """A walk of 1 s (the task not frozen, making 1,000 files a second meanwhile), then a
    reading 20 ms after it: the disk lost 20 inodes in those 20 ms, not the walk's 1,000 too.
    At its true pace a walk as long again leaves the task most of its room: not frozen for it."""
    watch = DiskWatch(ROOM, None)
    watch.walked(Look(space(20_000), 0, 0), 0.0, 1.0, space(19_000), frozen=False)
    assert not watch.sample(1.02, space(18_980))
    assert not watch.risky(space(18_980))


def test_a_task_frozen_through_its_walk_made_its_files_in_the_time_after_it(
    tmp_path: Path,
) -> None:
    """Frozen for a 1 s walk, then 20 files in the 20 ms after it: 1,000 a second, not 20 (it
    made nothing while frozen); with 30 left it would make them before the watch looked again."""
    watch = DiskWatch(ROOM, None)
    watch.walked(Look(space(20_000), 0, 9_950), 0.0, 1.0, space(20_000), frozen=True)
    ending = watch.outrun(Look(space(19_980), 0, 9_970), 1.02, settings(tmp_path), "")
    assert isinstance(ending, OutgrewRoom), ending


def test_a_watch_on_time_again_after_a_stall_is_given_no_more_margin(tmp_path: Path) -> None:
    """A stall, then ten readings on time: a task making 1,000 files a second with 100 left
    (0.1 s of them) goes on, as it would had the watch never stalled."""
    watch = watched(ROOM, files=9_200)
    at = 0.5
    watch.sample(at, space(19_500))
    for _ in range(10):
        at += 0.02
        watch.sample(at, space(19_500 - 20 * _))
    assert watch.horizon() < 0.05
    assert watch.outrun(Look(space(19_300), 0, 9_900), at, settings(tmp_path), "") is None


def test_a_file_or_two_made_in_a_millisecond_is_no_race(tmp_path: Path) -> None:
    """Walked again 1.2 ms after a frozen walk (another slot's files set the watch off), the task
    having made 3 files: over so short a time that is no pace to stop it for, however late the
    watch has lately been."""
    watch = DiskWatch(ROOM, None)
    watch.walked(Look(space(20_000), 0, 9_500), 0.0, 0.0, None, frozen=False)
    watch.sample(0.5, space(19_000))  # the watch half a second late
    watch.walked(Look(space(19_000), 0, 9_500), 0.5, 0.5, space(19_000), frozen=True)
    ending = watch.outrun(Look(space(18_000), 0, 9_503), 0.5012, settings(tmp_path), "")
    assert ending is None, ending


def test_a_task_with_room_for_a_fast_writers_burst_has_the_disk_read_twice_a_second() -> None:
    """A sleeping task with 16 GiB and a million files of room under the owner's caps: two
    readings a second. With less room, readings come often enough that a burst at a fast
    writer's pace takes at most a quarter of what is left before the next one; down to every
    20 ms. Under caps the disk's room set (the floor is at stake), every 20 ms always."""
    disk = Space(free_bytes=100 * GiB, total_bytes=200 * GiB, free_inodes=10**7, total_inodes=10**8)
    for room, files, every in (
        (16 * GiB, 1_000_000, QUIET_S),
        (2 * GiB, 1_000_000, 0.125),
        (16 * GiB, 100_000, 0.1),
        (GiB // 8, 1_000_000, SPACE_S),
    ):
        watch = DiskWatch(DiskCaps(bytes=room, files=files), None)
        watch.walked(Look(disk, 0, 0), 0.0, 0.0, None, frozen=False)
        soon = watch.next_in(disk)
        assert soon == pytest.approx(every)
        assert FAST_BYTES_S * soon <= max(room / 4, FAST_BYTES_S * SPACE_S)
        assert FAST_FILES_S * soon <= max(files / 4, FAST_FILES_S * SPACE_S)
    for tight in (BYTES, ROOM):
        watch = DiskWatch(dataclasses.replace(tight, bytes=16 * GiB, files=1_000_000), None)
        watch.walked(Look(disk, 0, 0), 0.0, 0.0, None, frozen=False)
        assert watch.next_in(disk) == SPACE_S


def test_a_disk_losing_room_fast_is_read_sooner_than_the_quiet_pace() -> None:
    """The quiet pace never holds back a watch that sees the disk go: 64 GiB of room, 48 GiB
    of it lost in a second; the next reading comes when half of the rest could be gone."""
    watch = DiskWatch(DiskCaps(bytes=64 * GiB, files=1_000_000), None)
    before = Space(free_bytes=90 * GiB, total_bytes=100 * GiB, free_inodes=10**7, total_inodes=10**8)
    watch.walked(Look(before, 0, 0), 0.0, 0.0, None, frozen=False)
    assert watch.next_in(before) == QUIET_S
    after = Space(free_bytes=42 * GiB, total_bytes=100 * GiB, free_inodes=10**7, total_inodes=10**8)
    watch.sample(1.0, after)  # 48 GiB in a second: half of the 16 GiB left goes in 1/6 s
    assert watch.next_in(after) == pytest.approx(1 / 6)
