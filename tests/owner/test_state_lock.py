"""One agent per state dir: the second `flashnode work` stops at once, naming the first, and
touches nothing of it; the lock never reaches a task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import AgentProcess, CoordinatorServer, argv_job, wait_for

from flashnode.errors import ExitCode
from flashnode.owner import statelock

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")


def test_second_agent_on_a_state_dir_exits_at_once_naming_the_first_which_commits_its_task(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
) -> None:
    fds, go = drop_dir / "fds", drop_dir / "go"
    script = (
        f"ls -l /proc/$$/fd > {fds}.tmp && mv {fds}.tmp {fds};"
        f" while [ ! -e {go} ]; do sleep 0.1; done;"
        ' echo \'{"ok": 1}\' > "$1"'
    )
    job = coordinator.submit(argv_job(["sh", "-c", script, "sh", "/work/out/metrics.json"]))
    first = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for("the first agent's task to run", fds.exists, timeout=60)

    started = time.monotonic()
    second = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=first.state_dir)
    code = second.wait(30)
    took = time.monotonic() - started
    assert code == ExitCode.LOCKED, second.log
    assert took < 15, took  # before the checks, the runner and the coordinator
    assert f"pid {first.proc.pid}" in second.log
    assert second.log.count("\n") == 1, second.log  # one line
    # It touched nothing: the running agent's status, task and record are as they were.
    status = _status(first.state_dir)
    assert status["pid"] == first.proc.pid
    assert [a["job_id"] for a in status["running"]] == [job]
    assert "registered" not in second.log and "reap" not in second.log

    go.touch()
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    ledger = first.wait_ledger(1)
    assert [r["outcome"] for r in ledger] == ["committed"]
    assert statelock.LOCK_FILE not in fds.read_text()  # no task holds the lock
    assert first.proc.poll() is None


def _status(state_dir: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "flashnode", "status", "--json", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout))


def test_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    held = statelock.acquire(tmp_path)
    try:
        with pytest.raises(statelock.Held) as caught:
            statelock.acquire(tmp_path)
        assert caught.value.holder.pid == os.getpid()
        assert (tmp_path / statelock.LOCK_FILE).stat().st_mode & 0o777 == 0o600
    finally:
        held.release()
    statelock.acquire(tmp_path).release()  # released: free again


def test_lock_holder_without_a_pid_in_the_file_is_found_in_the_kernels_list(
    tmp_path: Path,
) -> None:
    held = statelock.acquire(tmp_path)
    try:
        (tmp_path / statelock.LOCK_FILE).write_text("")  # as before the holder writes its pid
        with pytest.raises(statelock.Held) as caught:
            statelock.acquire(tmp_path)
        assert caught.value.holder.pid == os.getpid()
    finally:
        held.release()


def test_lock_held_by_a_process_that_exited_is_free(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from flashnode.owner import statelock;"
        " statelock.acquire(Path(sys.argv[1])); print('held', flush=True)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=30)
    statelock.acquire(tmp_path).release()  # the kernel dropped it with the process


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("0::/system.slice/flashnode.service\n", "flashnode.service"),
        ("0::/system.slice/flashnode.service/agent\n", "flashnode.service"),
        ("0::/user.slice/user-0.slice/session-3.scope\n", None),
        (
            "12:pids:/system.slice/x.service\n1:name=systemd:/system.slice/flashnode.service\n",
            "flashnode.service",
        ),
        ("0::/\n", None),
        ("", None),
    ],
)
def test_systemd_unit_is_read_from_the_cgroup_path(text: str, unit: str | None) -> None:
    assert statelock.unit_of(text) == unit


def test_lock_file_is_never_opened_through_a_link(tmp_path: Path) -> None:
    blocked = tmp_path / "state"
    blocked.mkdir()
    (blocked / statelock.LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        statelock.acquire(blocked)  # never through a link
    assert not (tmp_path / "elsewhere").exists()
