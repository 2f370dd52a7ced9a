"""A full disk is the node's fault, handled everywhere: the attempt ends at once and lapses, its
files are removed, no thread dies, the ledger and status catch up, pause and resume still work,
and the agent claims again when space is back."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease
from harness import AgentProcess, CoordinatorServer, argv_job, shared_dir, wait_for

from flashnode import statefile, status
from flashnode.attempt import Attempt
from flashnode.ledger import Ledger

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


def test_a_task_that_fails_while_the_disk_is_full_is_not_blamed(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, FakeRunner(code=1))
    ctx.free_bytes = lambda: 4096  # what a task that filled the disk leaves
    attempt = Attempt(ctx, lease(0))
    assert attempt.run().value == "lapsed"
    assert (
        attempt.ended is not None and attempt.ended[1] == "disk full (4 KiB free in the state dir)"
    )
    assert coord.names("fail") == []


def test_a_broken_archive_on_a_full_disk_is_the_disks_fault(tmp_path: Path) -> None:
    import io
    import tarfile

    from flashnode import archives
    from flashnode.errors import DiskFull

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
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = shared_dir("flashnode-small-disk-")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        mount.rmdir()


def flashnode(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashnode", *args], capture_output=True, text=True, timeout=60
    )


def status_of(state_dir: Path) -> dict[str, object] | None:
    done = flashnode("status", "--json", "--state-dir", str(state_dir))
    return json.loads(done.stdout) if done.returncode == 0 else None


def disk_hold(state_dir: Path) -> str | None:
    snap = status_of(state_dir)
    controls = snap.get("controls") if snap else None
    held = controls.get("held_by") if isinstance(controls, dict) else None
    return next((h["reason"] for h in held or [] if h["rule"] == "disk"), None)


def test_a_task_that_fills_the_disk_ends_at_once_and_the_node_carries_on(
    small_disk: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
) -> None:
    state_dir = small_disk / "state"
    started = drop_dir / "started"
    filler = f"touch {started}; head -c 100000000 /dev/zero > big; echo wrote; sleep 300"
    greedy = coordinator.submit(argv_job(["sh", "-c", filler], lease_seconds=60))
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "16M"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=state_dir)

    # The attempt ends within seconds of the disk filling, lapsed as the node's fault.
    wait_for("the task to start", started.exists, timeout=60)
    t0 = time.monotonic()
    [line] = agent.wait_ledger(1, timeout=30)
    assert time.monotonic() - t0 < 15, agent.log
    assert line["outcome"] == "lapsed" and line["reason"].startswith("disk full"), line
    last = (status_of(state_dir) or {}).get("last_ended")
    assert isinstance(last, dict) and last["reason"] == line["reason"], last
    assert [e for e in coordinator.events(greedy) if e["type"] == "TASK_ATTEMPT_FAILED"] == []
    assert "Traceback" not in agent.log and "OSError" not in agent.log
    coordinator.cancel(greedy)  # else it comes back once its lease lapses
    wait_for(
        "the space to be given back",  # a chain started ahead keeps its empty /work in attempts/
        lambda: not [p for p in (state_dir / "attempts").iterdir() if not p.name.startswith(".ahead-")],
    )

    # The disk full with nothing running: status says so (written in place), and the owner's
    # pause and resume still reach the agent (by signal: the pause file cannot be written).
    with (small_disk / "filler").open("wb") as fh, pytest.raises(OSError):
        while True:
            fh.write(b"\0" * (1 << 20))
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
