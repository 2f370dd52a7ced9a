"""The supervisors' fork server, real processes: it goes when its agent does while the
supervisors it forked stay with their tasks, a server that went is started again, and a forked
supervisor holds only what is its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from harness import wait_for

from flashnode.sandbox import procs
from flashnode.sandbox.procs import forkserver
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.supervisor import SERVER, sweep_homes
from flashnode.sandbox.procs.task import TaskProcess


def start(tmp_path: Path, name: str, script: str) -> TaskProcess:
    return TaskProcess(
        ["sh", "-c", script],
        {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
        cwd=tmp_path,
        stdout=tmp_path / f"{name}.out",
        stderr=tmp_path / f"{name}.err",
        log_max_bytes=1 << 20,
        on_exit=lambda: None,
        homes=tmp_path / "tasks",
        reattach_seconds=30.0,
    )


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def descriptors(pid: int) -> list[str]:
    """What ``pid`` holds. A descriptor it closed between the listing and the readlink was not
    held: a supervisor closes some of its own after it answered (its chain's fault pipe once
    the pipe's end is read), and a loaded machine may look at it just then."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return held


AGENT = """
import sys
from pathlib import Path
from flashnode.sandbox import procs
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.supervisor import SERVER
from flashnode.sandbox.procs.task import TaskProcess

home = Path(sys.argv[1])
proc = TaskProcess(
    ["sleep", "300"],
    {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
    cwd=home,
    stdout=home / "out",
    stderr=home / "err",
    log_max_bytes=1 << 20,
    on_exit=lambda: None,
    homes=home / "tasks",
    reattach_seconds=300.0,
)
print(SERVER._popen.pid, proc._sup._child.pid, proc.pid, flush=True)
proc.detach()  # the agent goes (a restart): its task runs on
"""


def test_the_fork_server_goes_with_its_agent_and_the_supervisors_it_forked_stay(
    tmp_path: Path,
) -> None:
    agent = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(AGENT), str(tmp_path)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    server, supervisor, task = (int(word) for word in agent.stdout.split())
    try:
        wait_for("the fork server gone", lambda: gone(server), timeout=10)
        assert not gone(supervisor) and not gone(task)
    finally:
        sweep_homes(tmp_path, set())  # what the next agent does with a task nobody rejoins
    wait_for("the task ended", lambda: gone(task), timeout=10)
    assert gone(supervisor)


def test_a_fork_server_that_went_is_started_again(tmp_path: Path) -> None:
    first = start(tmp_path, "first", "exit 0")
    wait_for("the first task's end", first.exited.is_set)
    first.close()
    before = SERVER._popen
    assert before is not None
    before.kill()
    before.wait()
    again = start(tmp_path, "again", "echo again; exit 3")
    wait_for("the next task's end", again.exited.is_set)
    assert again.returncode == 3
    again.close()
    assert (tmp_path / "again.out").read_bytes() == b"again\n"
    assert SERVER._popen is not None and SERVER._popen.pid != before.pid


def test_a_forked_supervisor_holds_only_its_own_descriptors(tmp_path: Path) -> None:
    """Not its neighbours' (the server's pidfds of the supervisors it forked before), nor the
    server's socket: a supervisor is one task's, and outlives the others."""
    first = start(tmp_path, "first", "sleep 300")
    second = start(tmp_path, "second", "sleep 300")
    try:
        for proc in (first, second):
            assert proc._sup._child is not None
            held = descriptors(proc._sup._child.pid)
            assert held.count("anon_inode:[pidfd]") == 1  # its own chain's
            assert sum(d.startswith("socket:") for d in held) == 2  # its agent's, its listener
    finally:
        for proc in (first, second):
            proc.kill()
            wait_for("its end", proc.exited.is_set)
            proc.close()


def test_what_the_agent_holds_of_a_supervisor_goes_to_no_program_it_starts(
    tmp_path: Path,
) -> None:
    """The pidfd of a root supervisor the agent got from its fork server: a program the agent
    starts without closing its descriptors (a library's helper) must not get it."""
    proc = start(tmp_path, "held", "sleep 300")
    try:
        assert proc._sup._child is not None and proc._sup._child.pidfd >= 0
        seen = subprocess.run(
            ["sh", "-c", "ls -l /proc/$$/fd"], close_fds=False, capture_output=True, check=True
        )
        assert b"pidfd" not in seen.stdout, seen.stdout.decode()
    finally:
        proc.kill()
        wait_for("its end", proc.exited.is_set)
        proc.close()


def test_a_fork_server_that_does_not_answer_is_ended_and_the_next_start_gets_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped (SIGSTOP) or stuck would hold every task's start and every slot's
    turnover behind it, for good: past ``ANSWER_S`` the start fails (the attempt lapses, as
    when no supervisor can be forked), the server is killed, and the next start gets a new
    one."""
    first = start(tmp_path, "first", "exit 0")
    wait_for("the first task's end", first.exited.is_set)
    first.close()
    stuck = SERVER._popen
    assert stuck is not None
    os.kill(stuck.pid, signal.SIGSTOP)
    monkeypatch.setattr(forkserver, "ANSWER_S", 0.5)
    with pytest.raises(OSError, match="its fork server did not answer in 0.5 s"):
        start(tmp_path, "held", "exit 0")
    assert stuck.poll() == -signal.SIGKILL  # ended, not left stopped
    again = start(tmp_path, "again", "echo again; exit 3")
    wait_for("the next task's end", again.exited.is_set)
    assert again.returncode == 3
    again.close()
    assert SERVER._popen is not None and SERVER._popen.pid != stuck.pid
