"""A full disk is the node's fault, handled everywhere: the attempt ends at once and lapses, its
files are removed, no thread dies, the ledger and status catch up, pause and resume still work,
and the agent claims again when space is back. But a task never fills it itself: its disk cap
is what the disk has free above min_free_bytes when it starts, if that is less than
task_disk_bytes, and a task stopped there has failed."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease
from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    lowest_free,
    run_flashnode,
    tmpfs_disk,
    wait_for,
)

from flashnode import statefile
from flashnode.attempt import Attempt
from flashnode.owner import status
from flashnode.owner.ledger import Ledger
from flashnode.runners.base import Handle
from flashnode.runners.plan import TaskPlan
from flashnode.sandbox.diskuse import Space

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "2"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --- the pieces, with fakes ------------------------------------------------------------------


def test_a_write_that_finds_the_disk_full_lapses_the_attempt_and_fails_nothing(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = FakeRunner()
    runner.start_error = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))  # the outbox record
    attempt = Attempt(context(tmp_path, clock, coord, runner), lease(0))
    assert attempt.run().value == "lapsed"
    assert attempt.ended == ("lapsed", "disk full (Disk quota exceeded)")  # type: ignore[comparison-overlap]
    assert attempt.node_fault
    assert coord.names("fail") == []  # the task's failure budget is untouched
    assert not (tmp_path / "attempts" / "ls-000000000000").exists()


AMPLE = Space(free_bytes=50 << 30, total_bytes=100 << 30, free_inodes=1 << 20, total_inodes=2 << 20)


class Writer(FakeRunner):
    """Writes ``size`` bytes into the task's tmp/ (and its metrics), as a task would."""

    def __init__(self, size: int, code: int = 0) -> None:
        super().__init__(code=code)
        self.size = size

    def start(self, plan: TaskPlan) -> Handle:
        with open(plan.workspace.tmp / "big", "wb") as fh:
            fh.truncate(self.size)
            fh.write(b"x")  # not sparse: the blocks are held
            for _ in range(0, self.size, 1 << 20):
                fh.write(os.urandom(1 << 20))
        return super().start(plan)


def test_a_task_that_fails_while_the_disk_is_full_is_not_blamed(tmp_path: Path) -> None:
    """The disk filled up while the task ran, and the task's own files do not explain it (it
    wrote nothing): what made it fail, most likely, is the node's."""
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = FakeRunner(code=1)
    ctx = context(tmp_path, clock, coord, runner)
    full = dataclasses.replace(AMPLE, free_bytes=4096)  # what something else left
    ctx = dataclasses.replace(ctx, space=lambda: full if runner.started else AMPLE)
    attempt = Attempt(ctx, lease(0))
    assert attempt.run().value == "lapsed"
    assert (
        attempt.ended is not None and attempt.ended[1] == "disk full (4 KiB free in the state dir)"
    )
    assert coord.names("fail") == []


def test_a_disk_out_of_inodes_is_as_full_as_one_out_of_bytes(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = FakeRunner(code=1)
    ctx = context(tmp_path, clock, coord, runner)
    full = dataclasses.replace(AMPLE, free_inodes=10)
    ctx = dataclasses.replace(ctx, space=lambda: full if runner.started else AMPLE)
    attempt = Attempt(ctx, lease(0))
    assert attempt.run().value == "lapsed"
    assert (
        attempt.ended is not None
        and attempt.ended[1] == "disk full (10 inodes free in the state dir)"
    )


def test_a_task_past_the_free_space_above_min_free_bytes_is_stopped_and_its_lease_lapses(
    tmp_path: Path,
) -> None:
    """With 10 MiB free above min_free_bytes, a task that writes 12 MiB is past its cap, the
    free space, whatever task_disk_bytes allows; and no file of the task may grow much past the
    cap (the runner's RLIMIT_FSIZE). The task stayed within what the node advertises: the node
    was short of disk, so the lease lapses and the job's failure budget is not spent (this
    used to fail the task)."""
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = Writer(12 << 20)
    ctx = context(tmp_path, clock, coord, runner, min_free_bytes=16 << 20)
    ctx = dataclasses.replace(ctx, space=lambda: dataclasses.replace(AMPLE, free_bytes=26 << 20))
    attempt = Attempt(ctx, lease(0))
    assert attempt.run().value == "lapsed"
    assert attempt.ended is not None and coord.names("fail") == []
    reason = attempt.ended[1]
    assert "the state dir's disk had only 10.0 MiB free above min_free_bytes when" in reason, reason
    assert attempt.node_fault and attempt.job_endpoint  # the guard counts it across jobs only
    [plan] = runner.started
    assert plan.max_file_bytes is not None and 10 << 20 < plan.max_file_bytes < 11 << 20


def test_a_task_past_task_disk_bytes_itself_fails(tmp_path: Path) -> None:
    """The disk has room; the task writes past the cap the owner set: its own fault."""
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = Writer(12 << 20)
    ctx = context(tmp_path, clock, coord, runner, task_disk_bytes=8 << 20)
    ctx = dataclasses.replace(ctx, space=lambda: AMPLE)
    attempt = Attempt(ctx, lease(0))
    assert attempt.run().value == "failed"
    assert attempt.ended is not None and "(task_disk_bytes:" in attempt.ended[1], attempt.ended


def test_a_task_with_no_room_above_min_free_bytes_does_not_start(tmp_path: Path) -> None:
    """Less free than min_free_bytes by the time the task would start (staging took it): the
    node is short of disk, the task is not at fault."""
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = FakeRunner()
    ctx = context(tmp_path, clock, coord, runner, min_free_bytes=1 << 30)
    ctx = dataclasses.replace(ctx, space=lambda: dataclasses.replace(AMPLE, free_bytes=512 << 20))
    attempt = Attempt(ctx, lease(0))
    assert attempt.run().value == "lapsed"
    assert attempt.ended is not None and attempt.ended[1].startswith("low disk:"), attempt.ended
    assert runner.started == [] and coord.names("fail") == []
    assert not attempt.node_fault  # the disk hold's business: the guard does not count it


def test_a_broken_archive_on_a_full_disk_is_the_disks_fault(tmp_path: Path) -> None:
    import io
    import tarfile

    from flashnode.errors import DiskFull
    from flashnode.sandbox import archives

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        member = tarfile.TarInfo("a.bin")
        member.size = 4
        tar.addfile(member, io.BytesIO(b"abcd"))
    archive = tmp_path / "in.tar"
    archive.write_bytes(data.getvalue())
    real_write = archives._write_member

    def full(*args: object) -> None:
        raise FULL

    archives._write_member = full  # type: ignore[assignment]
    try:
        with pytest.raises(DiskFull):
            archives.unpack(archive, tmp_path / "out", "in", 1 << 20)
    finally:
        archives._write_member = real_write
    assert not (tmp_path / "out").exists()


def test_ledger_lines_a_full_disk_keeps_back_are_written_in_order_once_space_is_back(
    tmp_path: Path,
) -> None:
    ledger = Ledger(Path("/dev/full"))  # every write: ENOSPC
    ledger.append({"n": 1})
    ledger.append({"n": 2})
    ledger.flush()
    assert ledger.pending == 2
    ledger.path = tmp_path / "ledger.jsonl"  # space is back
    ledger.flush()
    ledger.append({"n": 3})
    assert ledger.pending == 0 and [r["n"] for r in ledger.records()] == [1, 2, 3]


def test_status_is_written_in_place_when_the_disk_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status.write(tmp_path, {"pid": os.getpid(), "state": "idle", "running": []})
    size = (tmp_path / status.STATUS_FILE).stat().st_size
    assert size % status.BLOCK_BYTES == 0

    def full(*args: object, **kwargs: object) -> None:
        raise FULL

    monkeypatch.setattr(statefile, "write", full)  # no new file can be made
    snapshot = {"pid": os.getpid(), "state": "not claiming: the state dir's disk is full"}
    status.write(tmp_path, {**snapshot, "running": [{"lease_id": "ls-1"}] * 20})
    read = json.loads((tmp_path / status.STATUS_FILE).read_text())  # padded: still JSON
    assert read is not None and read["state"] == snapshot["state"] and len(read["running"]) == 20
    assert (tmp_path / status.STATUS_FILE).stat().st_size == size  # no new block
    with pytest.raises(OSError):  # more than the file holds: an error, not half a snapshot
        status.write(tmp_path, {**snapshot, "running": [{"lease_id": "ls-1"}] * 2000})


# --- end to end: the state dir on a 64 MiB tmpfs -------------------------------------------


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 64 MiB tmpfs, unmounted and removed at the end whatever happened."""
    with tmpfs_disk("flashnode-small-disk-", "size=64m") as mount:
        yield mount


def status_of(state_dir: Path) -> dict[str, object] | None:
    done = run_flashnode("status", "--json", "--state-dir", str(state_dir))
    return json.loads(done.stdout) if done.returncode == 0 else None


def disk_hold(state_dir: Path) -> str | None:
    snap = status_of(state_dir)
    controls = snap.get("controls") if snap else None
    held = controls.get("held_by") if isinstance(controls, dict) else None
    return next((h["reason"] for h in held or [] if h["rule"] == "disk"), None)


def test_a_task_that_fills_the_disk_itself_is_stopped_at_the_free_space_and_lapses(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """``task_disk_bytes`` (16 GiB by default) is more than the disk has: with about 47 MiB free
    above ``min_free_bytes`` a task writes 100 MB into its tmp/ at full speed. Its cap is the
    free space above the floor: it is stopped there, and the owner's disk keeps what the floor
    keeps, however fast it wrote. It stayed within task_disk_bytes: the node was short of disk,
    so the lease lapses (it used to fail), and the reason says how much the disk had."""
    state_dir = small_disk / "state"
    filler = "head -c 100000000 /dev/zero > /work/tmp/big; sleep 300"
    job = coordinator.submit(argv_job(["sh", "-c", filler], lease_seconds=60, max_attempts=3))
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=state_dir)
    try:
        with lowest_free(small_disk, agent.done) as lowest:
            [line] = agent.wait_ledger(1, timeout=90)
    finally:
        coordinator.cancel(job)
    assert line["outcome"] == "lapsed", line
    assert "the state dir's disk had only" in line["reason"], line["reason"]
    assert [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"] == []
    assert lowest.bytes >= 8 << 20, f"the owner's disk went down to {lowest.bytes >> 10} KiB free"
    assert "Traceback" not in agent.log


def test_a_local_user_cannot_make_the_node_fail_the_pools_tasks_by_leaving_it_little_disk(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """A local unprivileged user leaves the disk 3 MiB above ``min_free_bytes``: each task's cap
    is that free space, and tasks that write 6 MB are stopped there. That is the node's lack of
    disk, not the job's doing: their leases lapse, no task fails, no job's budget is spent."""
    scratch = small_disk / "scratch"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    st = os.statvfs(small_disk)
    fill = st.f_bavail * st.f_frsize - (16 << 20) - (3 << 20) - (1 << 20)  # state dir's own files
    subprocess.run(
        [
            *("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"),
            *("fallocate", "-l", str(fill), str(scratch / "mine")),
        ],
        check=True,
    )
    script = "head -c 6000000 /dev/zero > ../tmp/scratch"  # no braces: params format it
    job = coordinator.submit(
        argv_job(["sh", "-c", script], params=[{"n": i} for i in range(3)], max_attempts=2)
    )
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "3", env=env, state_dir=small_disk / "state"
    )
    try:
        lines = agent.wait_ledger(3, timeout=120)
    finally:
        coordinator.cancel(job)
    failed = [line["reason"] for line in lines if line["outcome"] == "failed"]
    assert failed == [], f"the node's lack of disk was charged to the job: {failed}"
    assert all("the state dir's disk had only" in line["reason"] for line in lines), lines
    assert [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"] == []


def test_a_disk_filled_by_something_else_ends_the_task_at_once_and_the_node_carries_on(
    flashnode: Callable[..., Any],
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
) -> None:
    state_dir = small_disk / "state"
    started = drop_dir / "started"
    sleeper = f"touch {started}; echo '{{}}' > metrics.json; sleep 300"
    victim = coordinator.submit(argv_job(["sh", "-c", sleeper], lease_seconds=60))
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=state_dir)

    # The owner's own program fills the disk while the task runs: the attempt ends within
    # seconds, lapsed as the node's fault; the task, which wrote next to nothing, is not blamed.
    wait_for("the task to start", started.exists, timeout=60)
    with (small_disk / "filler").open("wb") as fh, pytest.raises(OSError):
        while True:
            fh.write(b"\0" * (1 << 20))
            fh.flush()
    t0 = time.monotonic()
    [line] = agent.wait_ledger(1, timeout=30)
    assert time.monotonic() - t0 < 15, agent.log
    assert line["outcome"] == "lapsed" and line["reason"].startswith("disk full"), line
    last = (status_of(state_dir) or {}).get("last_ended")
    assert isinstance(last, dict) and last["reason"] == line["reason"], last
    assert [e for e in coordinator.events(victim) if e["type"] == "TASK_ATTEMPT_FAILED"] == []
    assert "Traceback" not in agent.log and "OSError" not in agent.log
    coordinator.cancel(victim)  # else it comes back once its lease lapses
    wait_for(
        "the workspace to be removed",  # a chain started ahead keeps its empty /work in attempts/
        lambda: all(p.name.startswith(".ahead-") for p in (state_dir / "attempts").iterdir()),
    )

    # The disk full with nothing running: status says so (written in place), and the owner's
    # pause and resume still reach the agent (by signal: the pause file cannot be written).
    with (small_disk / "filler").open("ab") as fh, contextlib.suppress(OSError):
        while True:  # what the removed workspace gave back
            fh.write(b"\0" * (1 << 16))
            fh.flush()
    assert "disk is full" in wait_for(
        "status to say the disk is full", lambda: disk_hold(state_dir)
    )
    paused = flashnode("pause", "--now", "--state-dir", str(state_dir))
    assert paused.returncode == 0 and "by a signal" in paused.stdout, paused.stdout + paused.stderr
    wait_for(
        "the pause to show",
        lambda: (s := status_of(state_dir)) and s["controls"]["paused"],  # type: ignore[index]
    )
    resumed = flashnode("resume", "--state-dir", str(state_dir))
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stdout
    wait_for(
        "the pause to end",
        lambda: (s := status_of(state_dir)) and not s["controls"]["paused"],  # type: ignore[index]
    )

    # Space is back: the hold clears, the next job commits, the ledger is whole.
    (small_disk / "filler").unlink()
    wait_for("the hold to clear", lambda: disk_hold(state_dir) is None)
    job = coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert [r["outcome"] for r in agent.wait_ledger(2)] == ["lapsed", "committed"]
    assert agent.proc.poll() is None

    t0 = time.monotonic()
    agent.signal(15)
    assert agent.wait(30) == 0
    assert time.monotonic() - t0 < 10  # a stop waits for no attempt that already ended


def _inode_bomb(members: int, depth: int) -> bytes:
    """A gzipped tar of ``members`` one-byte files, each at the end of its own chain of
    ``depth`` directories (which the unpacker makes as the files' parents): a few KiB that
    unpack to members * (depth + 1) inodes and a few hundred bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for m in range(members):
            info = tarfile.TarInfo(f"m{m}/" + "/".join(["a"] * depth) + "/f")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


@pytest.fixture
def few_inodes() -> Iterator[Path]:
    """A tmpfs of 64 MiB and 20,000 inodes standing in for the owner's disk."""
    with tmpfs_disk("flashnode-few-inodes-", "size=64m,nr_inodes=20000") as mount:
        yield mount


def test_an_input_archive_cannot_take_the_owners_disk_below_its_floor_of_inodes(
    few_inodes: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """A job ships a 5 KiB archive of 300 one-byte files, each 100 directories deep: 30,000
    inodes, on a disk of 20,000. The agent (root) counts every directory it makes and stops
    before the disk's free inodes go below min_free_bytes' share of them: the owner's disk keeps
    its floor; within the task's own caps (task_disk_files) this node's room is what falls
    short, so the lease lapses with a reason that says why (not the node's full disk), and one
    job's lapses of this kind do not count toward quarantine."""
    coordinator.put_artifact("review2/inodes.tar.gz", _inode_bomb(300, 100))
    job = coordinator.submit(
        argv_job(
            ["true"],
            max_attempts=1,
            inputs={"bomb": "artifact://review2/inodes.tar.gz"},
            unpack_inputs=["bomb"],
        )
    )
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}  # its share: 5,000 of the 20,000 inodes
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "1", env=env, state_dir=few_inodes / "state"
    )
    try:
        with lowest_free(few_inodes, agent.done) as lowest:
            [line] = agent.wait_ledger(1, timeout=120)
    finally:
        coordinator.cancel(job)
    assert lowest.inodes >= 5000, (
        f"unpacking the job's input left the owner's disk {lowest.inodes} free inodes"
        f" ({line['outcome']}: {line['reason']})"
    )
    assert line["outcome"] == "lapsed", line["reason"]
    assert "low disk: input 'bomb' does not fit" in line["reason"]


def test_one_job_cannot_bench_a_node_with_input_archives_that_use_up_its_inodes(
    few_inodes: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """The same archive as the input of two tasks of one job, on a node that would quarantine
    itself at the first ending its guard counts: each lapses for want of room (never as the
    node's full disk), the node holds its claims for a while after the first, and one job's
    lapses never quarantine the node."""
    coordinator.put_artifact("review2/inodes.tar.gz", _inode_bomb(300, 100))
    job = coordinator.submit(
        argv_job(
            ["true"],
            params=[{"n": i} for i in range(2)],
            max_attempts=1,
            inputs={"bomb": "artifact://review2/inodes.tar.gz"},
            unpack_inputs=["bomb"],
        )
    )
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M", "FLASHNODE_QUARANTINE_AFTER": "1"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=few_inodes / "state")
    try:
        lines = agent.wait_ledger(2, timeout=120)
    finally:
        coordinator.cancel(job)
    held = [line for line in agent.log.splitlines() if "quarantined" in line]
    outcomes = [(line["outcome"], line["reason"]) for line in lines]
    assert held == [], f"one job's inputs benched the node: {held}; its attempts: {outcomes}"
    assert all(o == "lapsed" and "does not fit" in r for o, r in outcomes), outcomes
    assert "not claiming for up to" in agent.log


def test_a_task_holding_the_disk_just_above_the_floor_cannot_bench_a_healthy_node(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """One task, within its own cap, writes until the disk is half a MiB above
    ``min_free_bytes`` and sleeps: too little room for another task to start. The node claims
    nothing more while that lasts (the disk hold), and a task that finds no room when it would
    start lapses without counting toward the quarantine: the node whose checks pass is never
    quarantined, and the other job's tasks run once the holder is gone."""
    floor = 16 << 20
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    hold = (
        "avail=$(df -B1 --output=avail /work | tail -n 1);"
        f" head -c $((avail - {floor} - 524288)) /dev/zero > ../tmp/fill; sleep 60"
    )
    holder = coordinator.submit(argv_job(["sh", "-c", hold], max_attempts=1))
    agent = start_agent(
        coordinator.url, *TRUSTED, "--slots", "2", env=env, state_dir=small_disk / "state"
    )

    def near_floor() -> bool:
        st = os.statvfs(small_disk)
        return st.f_bavail * st.f_frsize < floor + (1 << 20)

    try:
        wait_for("the holder's writing", near_floor, 60)
        victims = coordinator.submit(argv_job(["true"], params=[{"n": i} for i in range(5)]))
        # Before the holder's first walk its whole cap is set aside (the hold then says the
        # disk is below the floor, counting what it may still write); once walked, no room.
        wait_for("the disk hold: no room for a task", lambda: no_room_held(small_disk), 30)
        lines = agent.wait_ledger(5, timeout=120)
        coordinator.cancel(victims)
    finally:
        coordinator.cancel(holder)
    held = [line for line in agent.log.splitlines() if "quarantined" in line]
    outcomes = [(line["outcome"], line["reason"][:120]) for line in lines]
    assert held == [], f"one task's disk use benched a healthy node: {held}; {outcomes}"


def no_room_held(small_disk: Path) -> bool:
    return "no room for a task" in (disk_hold(small_disk / "state") or "")


def test_two_jobs_that_outgrow_the_disks_room_cannot_bench_a_healthy_node(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """Two jobs whose tasks write a little more than the room above ``min_free_bytes`` (31 MiB
    here: they write 40) are stopped there and lapse (the node was short of disk); five such
    lapses across two jobs have the node run its checks once their files are removed, and the
    disk, fine again, passes them: the node is never quarantined."""
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "32M"}
    script = (
        "head -c 20971520 /dev/zero > ../tmp/a; head -c 20971520 /dev/zero > ../tmp/b; sleep 10"
    )
    first = coordinator.submit(
        argv_job(["sh", "-c", script], params=[{"n": i} for i in range(3)], max_attempts=1)
    )
    second = coordinator.submit(
        argv_job(["sh", "-c", script], params=[{"n": i} for i in range(2)], max_attempts=1)
    )
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=small_disk / "state")
    try:
        lines = agent.wait_ledger(5, timeout=180)
        wait_for("the node's checks", lambda: "passes its own checks" in agent.log, 60)
    finally:
        coordinator.cancel(first)
        coordinator.cancel(second)
    held = [line for line in agent.log.splitlines() if "quarantined" in line]
    outcomes = [(line["outcome"], line["reason"][:120]) for line in lines]
    assert all("the state dir's disk had only" in r for _, r in outcomes), outcomes
    assert held == [], f"two jobs' own writing benched a healthy node: {held}; {outcomes}"


def test_tasks_in_two_slots_cannot_together_take_the_disk_below_min_free_bytes(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """Two tasks of one job, claimed together in two slots, each write 25 MiB: each alone
    within the room above the 16 MiB floor (about 47 MiB), together past it. A task's room is
    what the running tasks leave (their caps less what they hold): the second waits, or finds
    no room and lapses, and the owner's disk never goes below its floor; no task fails."""
    floor = 16 << 20
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    script = (  # no braces: params format it
        "sleep 3; head -c 26214400 /dev/zero > ../tmp/fill; sleep 3;"
        " printf '\\173\\175' > metrics.json"
    )
    job = coordinator.submit(
        argv_job(["sh", "-c", script], params=[{"n": i} for i in range(2)], max_attempts=1)
    )
    agent = start_agent(
        coordinator.url,
        *TRUSTED,
        "--slots",
        "2",
        "--max-tasks",
        "2",
        env=env,
        state_dir=small_disk / "state",
    )
    with lowest_free(small_disk, lambda: agent.proc.poll() is not None) as lowest:
        try:
            lines = agent.wait_ledger(2, timeout=120)
        finally:
            coordinator.cancel(job)
            agent.stop()
    outcomes = [(line["outcome"], line["reason"]) for line in lines]
    assert lowest.bytes >= floor, (
        f"two tasks within their caps left the owner's disk {lowest.bytes >> 20} MiB free, below"
        f" min_free_bytes (16 MiB); their outcomes: {outcomes}"
    )
    assert all(o in ("committed", "lapsed") for o, _ in outcomes), outcomes


def test_status_says_what_ended_the_last_attempt_and_what_holds_claiming() -> None:
    text = status.render(
        {
            "node_id": "n",
            "state": "idle | not claiming: the state dir's disk is full",
            "controls": {
                "held_by": [{"rule": "disk", "reason": "the state dir's disk is full: 0 MiB free"}]
            },
            "last_ended": {
                "lease_id": "ls-1",
                "job_id": "j",
                "task_id": "t",
                "outcome": "lapsed",
                "reason": "disk full (No space left on device)\x1b[2J",
            },
            "running": [],
        }
    )
    assert "  disk: the state dir's disk is full: 0 MiB free" in text
    assert "last ended  ls-1 (j/t) lapsed: disk full (No space left on device)\\x1b[2J" in text
