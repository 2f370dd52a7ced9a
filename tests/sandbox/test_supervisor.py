"""A trusted task's supervisor, real processes: the task runs on while its agent is away, a
returning agent rejoins it (its exit status and whole output), a task suspended when let go of
runs again once rejoined, no agent back ends it, and it inherits no signal its supervisor
ignores."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from harness import tmpfs_disk, wait_for

from flashnode.sandbox import procs
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.supervisor import Gone, Supervised, new_home, sweep_homes
from flashnode.sandbox.procs.task import TaskProcess


def out(tmp_path: Path) -> bytes:
    """What the task printed so far (its supervisor makes the file once it is told of it)."""
    try:
        return (tmp_path / "stdout.txt").read_bytes()
    except FileNotFoundError:
        return b""


def supervisors(tmp_path: Path) -> list[str]:
    try:
        return os.listdir(tmp_path / "tasks")
    except FileNotFoundError:
        return []


def start(tmp_path: Path, script: str, reattach: float = 30.0) -> TaskProcess:
    return TaskProcess(
        ["sh", "-c", script],
        {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
        cwd=tmp_path,
        stdout=tmp_path / "stdout.txt",
        stderr=tmp_path / "stderr.txt",
        log_max_bytes=1 << 20,
        on_exit=lambda: None,
        homes=tmp_path / "tasks",
        reattach_seconds=reattach,
    )


def let_go(proc: TaskProcess) -> None:
    """``proc.detach()``, as an agent that restarts does."""
    proc.detach()


def test_a_task_let_go_of_runs_on_and_the_next_agent_gets_its_whole_output_and_status(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    first = start(
        tmp_path, f"echo before; while [ ! -e {gate} ]; do sleep 0.05; done; echo after; exit 7"
    )
    identity = first.identity()
    wait_for("its first line", lambda: b"before" in out(tmp_path))
    let_go(first)
    gate.touch()  # it goes on while no agent is there
    wait_for("its last line", lambda: b"after" in out(tmp_path))
    ended = threading.Event()
    again = TaskProcess.rejoin(identity, ended.set)
    assert again is not None
    wait_for("its end", again.exited.is_set)
    assert ended.is_set() and again.returncode == 7 and again.launched
    again.close()
    assert (tmp_path / "stdout.txt").read_text() == "before\nafter\n"
    assert not supervisors(tmp_path)  # its supervisor ended with it


def test_a_task_suspended_when_let_go_of_runs_again_once_rejoined(tmp_path: Path) -> None:
    first = start(tmp_path, "while :; do echo tick; sleep 0.05; done")
    wait_for("a line", lambda: b"tick" in out(tmp_path))
    first.suspend()  # no cgroup here: SIGSTOP
    identity = first.identity()
    let_go(first)
    again = TaskProcess.rejoin(identity, lambda: None)
    assert again is not None
    size = len(out(tmp_path))
    wait_for("it prints again", lambda: len(out(tmp_path)) > size)
    again.terminate(1.0)
    wait_for("its end", again.exited.is_set)
    again.close()


def test_with_no_agent_back_its_supervisor_ends_it_and_goes(tmp_path: Path) -> None:
    proc = start(tmp_path, "sleep 300", reattach=0.5)
    pid = proc.pid
    let_go(proc)
    wait_for("the task gone", lambda: not os.path.exists(f"/proc/{pid}"), timeout=10)
    wait_for("its supervisor gone", lambda: not supervisors(tmp_path), timeout=10)
    assert TaskProcess.rejoin(proc.identity(), lambda: None) is None


def test_a_task_inherits_no_signal_its_supervisor_ignores(tmp_path: Path) -> None:
    proc = start(tmp_path, "grep SigIgn /proc/self/status")
    wait_for("its end", proc.exited.is_set)
    proc.close()
    ignored = int((tmp_path / "stdout.txt").read_text().split()[1], 16)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        assert not ignored & (1 << (sig - 1)), f"the task ignores {sig.name}"


def test_with_no_agent_back_a_task_is_ended_when_its_lease_would_end(tmp_path: Path) -> None:
    """Sooner than ``reattach_seconds`` when the lease ends first: an agent that came back then
    could not renew it, so nothing of the task outlives its lease."""
    proc = start(tmp_path, "sleep 300", reattach=300)
    proc.lease_left(1.0)
    pid = proc.pid
    let_go(proc)
    wait_for("the task gone", lambda: not os.path.exists(f"/proc/{pid}"), timeout=10)


def test_a_supervisor_no_agent_will_rejoin_is_ended_with_its_task_at_once(tmp_path: Path) -> None:
    """At its start an agent ends the supervisors of tasks it did not rejoin (no record names
    them): they do not wait on beside its own tasks for ``reattach_seconds``."""
    proc = start(tmp_path, "sleep 300", reattach=300)
    pid = proc.pid
    let_go(proc)
    sweep_homes(tmp_path, keep=set())
    assert not os.path.exists(f"/proc/{pid}") or procs.process_state(pid) in (None, "Z")
    assert not supervisors(tmp_path)


def test_a_task_that_fills_the_disk_cannot_take_its_exit_status_along(tmp_path: Path) -> None:
    """The supervisor's directory and the task's files share the disk: the task's end reaches
    the agent on the supervisor's socket, whatever room is left."""
    with tmpfs_disk("flashnode-sup-", "size=2m") as disk:
        proc = TaskProcess(
            ["sh", "-c", f"dd if=/dev/zero of={disk}/fill bs=64k 2>/dev/null; exit 3"],
            {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
            cwd=disk,
            stdout=disk / "stdout.txt",
            stderr=disk / "stderr.txt",
            log_max_bytes=1 << 20,
            on_exit=lambda: None,
            homes=disk / "tasks",
            reattach_seconds=30,
        )
        wait_for("its end", proc.exited.is_set)
        assert proc.returncode == 3 and not proc.lost
        proc.close()


def test_letting_go_of_a_running_task_ends_its_watcher_at_once_and_twice_is_harmless(
    tmp_path: Path,
) -> None:
    """The watcher sleeps until its supervisor speaks or the agent lets go (no turn of its own
    while the task sleeps): letting go wakes it, and its wake-up pipe goes with it."""
    proc = start(tmp_path, "sleep 300", reattach=0.5)
    pipe = {fd: f"pipe:[{os.fstat(fd).st_ino}]" for fd in (proc._stop_r, proc._stop_w)}
    assert proc._watcher.is_alive()
    let_go(proc)
    assert not proc._watcher.is_alive()

    def still(fd: int, name: str) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == name
        except FileNotFoundError:
            return False

    assert not [fd for fd, name in pipe.items() if still(fd, name)]
    proc.detach()  # again: nothing left to stop, nothing closed twice
    wait_for("its supervisor gone", lambda: not supervisors(tmp_path), timeout=10)


def test_a_containers_watch_is_answered_for_later_and_one_that_never_answers_is_gone(
    tmp_path: Path,
) -> None:
    """The agent starts the container while its watch loads, and reads the watch's answer
    after: a watch that answers says pid 0, and lives on with no engine to ask yet (it makes
    its client when it first has a container to remove); one that died first is Gone (the
    agent then removes the container and lets the lease lapse)."""
    away = "unix:///nonexistent/docker.sock"
    homes = tmp_path / "tasks"
    homes.mkdir()
    watch = Supervised.watch("flashnode-none", away, new_home(homes), 30.0)
    watch.answer()
    assert watch.pid == 0
    watch.started()
    watch.done()
    assert (watch.home / "supervisor.log").read_bytes() == b""  # it exited with no error
    watch.remove()
    # A watch that dies at its start, before it answers (it cannot make its socket: a
    # directory holds the name).
    home = new_home(homes)
    (home / "sock").mkdir()
    dead = Supervised.watch("flashnode-none", away, home, 30.0)
    assert dead._child is not None and dead._child.wait(10)
    with pytest.raises(Gone):
        dead.answer()
    dead.done()  # what the runner does then
    (home / "sock").rmdir()
    dead.remove()
