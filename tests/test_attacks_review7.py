"""Review of the chain's first process forked by the supervisor itself (``enter.start``, commit
6b5db67), against ``subprocess.Popen``, which it replaces.

No way for a task to gain or keep a privilege, keep a descriptor of its supervisor's or another
task's, leave the sandbox or reach another slot was found: the task execs with descriptors 0, 1,
2 and its stderr's pipe only (the listener, the agent's socket, the reading ends, the task user's
lock and the fault channel all closed), in a session of its own, umask 077, no signal ignored,
caught or blocked, as before; a failed step, a failed ``chdir`` and a failed exec all end the
process with ``SETUP_FAILED`` before any code of the task.

What changed, and is tested here, is when the supervisor answers. Popen returned once the chain
had exec'd, so that the supervisor's ``pid`` line meant "set up, waiting for its script"; a setup
that hung (a lent directory on a stuck mount, a cgroup that cannot be joined) left the
supervisor silent, and the agent failed the start within ``ANSWER_S`` as the node's lapse
(dbe73d9's "a setup that does not finish before the supervisor's answer deadline a failed
start"; its test was replaced in 6b5db67 by one that fakes a silent supervisor). In 6b5db67 the
answer came at once, with the setup still running, while everything the agent does with the
chain assumes it is done (fixed: ``start`` returns once the setup is done or failed):

* a setup that hangs is never a failed start any more: the agent sends the script and watches a
  "running" task until the task's own timeout ends it, ``AttemptFailed("timed out ...")``, the
  task's failure, charged to its failure budget (``execute._watch`` raises the guard's reason
  before ``TrustedHandle`` can say the task never launched);
* meanwhile the disk guard's walk (0.5 s after the start) reads the task's private directories
  through ``/proc/<pid>/root`` while the chain has not mounted them yet: the host's ``/tmp``,
  ``/var/tmp``, ``/run/lock`` (here the root file system, tens of GB) are counted as the task's
  and fail it past its disk cap, again the task's fault.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import processes_in, shared_dir, slot_user, wait_for

from flashnode.sandbox import procs
from flashnode.sandbox.procs import supervisor
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.mounts import PRIVATE_DIRS, Sandbox
from flashnode.sandbox.procs.task import TaskProcess

ANSWER_S = supervisor.ANSWER_S  # the supervisor's answer deadline (10 s), before any patch


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory outside the private ones (a task gets its own /tmp)."""
    root = shared_dir("flashnode-review7-")
    root.chmod(0o755)
    try:
        yield root
    finally:
        for pid in processes_in(root):  # a chain let go of in its setup (a failed start's)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def _hanging_start(base: Path) -> TaskProcess:
    """A sandboxed task, as the slot's user, whose chain's setup hangs: its table of private
    mounts is a FIFO nobody opens (the stand-in for a step that blocks: a lent directory on a
    stuck NFS mount, as the test this change removed had it). OSError: the start failed."""
    work = base / "work"
    work.mkdir()
    work.chmod(0o777)
    fifo = base / "private.fstab"
    os.mkfifo(fifo)
    return TaskProcess(
        ["sh", "-c", "echo task code ran"],
        {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
        cwd=work,
        stdout=base / "out",
        stderr=base / "err",
        log_max_bytes=4096,
        on_exit=lambda: None,
        user=slot_user(),
        sandbox=Sandbox(1 << 20, fstab=str(fifo), work=True),
        homes=base / "homes",
    )


def _end(proc: TaskProcess) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # root's, still in its setup
    proc.exited.wait(10)
    proc.close()


def _blocked_in_setup(pid: int) -> bool:
    """Root's still (its setup not done), and asleep in the kernel (the FIFO's open)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    return uids[0] == "0" and wchan not in ("0", "")


@pytest.mark.usefixtures("as_root")
def test_a_setup_that_hangs_fails_the_start_as_the_nodes_fault_not_the_tasks_timeout(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before 6b5db67 the agent's start failed with an OSError (the runner's AttemptLapsed: the
    node's lapse) when the supervisor had not answered within ``ANSWER_S``, because it answered
    only after the setup. Now it answers at once; the agent sends the script and nothing ever
    ends the hung chain but the task's own timeout (``AttemptFailed``: the task's fault, after
    up to ``max_task_seconds``). Either way of failing it as the node's passes: the start
    failing, or the chain ended (not launched) within twice the answer deadline."""
    monkeypatch.setattr(supervisor, "ANSWER_S", 1.0)  # the agent's wait (the removed test's)
    started = time.monotonic()
    try:
        proc = _hanging_start(base)
    except OSError as exc:
        assert "cannot start a task's supervisor" in str(exc), exc
        return
    try:
        wait_for("the chain to block in its setup", lambda: _blocked_in_setup(proc.pid))
        ended = proc.exited.wait(max(2 * ANSWER_S - (time.monotonic() - started), 0.1))
        assert ended, (
            f"{time.monotonic() - started:.0f} s after its start the chain still hangs in its"
            " setup, as root, with the task's script in its pipe, and the agent watches it as a"
            " running task: only the task's timeout will end it, as the task's failure"
        )
        assert not proc.launched
    finally:
        _end(proc)


@pytest.mark.usefixtures("as_root")
def test_a_task_whose_chain_is_still_setting_up_is_not_charged_the_hosts_tmp(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TrustedHandle.disk_bytes`` (the disk guard's walk, 0.5 s after the start) counts the
    task's private directories as the chain sees them (``/proc/<pid>/root``). A chain whose
    setup has not mounted them yet sees the host's: its /tmp, /var/tmp and /run/lock on the
    root file system, all of its used space charged to a task none of whose code ran, which
    fails it past its disk cap (``over_caps``: the task's fault). With Popen there was no pid
    before the exec."""
    from flashnode.runners.trustedhandle import TrustedHandle

    monkeypatch.setattr(supervisor, "ANSWER_S", 1.0)
    try:
        proc = _hanging_start(base)
    except OSError:
        return  # the start failed (the node's): no handle, nothing measured
    try:
        wait_for("the chain to block in its setup", lambda: _blocked_in_setup(proc.pid))
        handle = TrustedHandle(proc, private=PRIVATE_DIRS, workspace=base / "work")
        host = os.statvfs("/tmp")
        host_used = (host.f_blocks - host.f_bfree) * host.f_frsize
        held = handle.disk_bytes()
        assert held < 1 << 20, (
            f"a task that has not started holds {held / 2**30:.1f} GiB of private files:"
            f" the host's /tmp ({host_used / 2**30:.1f} GiB used) counted as its own"
        )
    finally:
        _end(proc)
