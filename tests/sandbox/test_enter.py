"""The launch chain's steps as system calls (``procs.enter``): what a task starts with, both ways
in (a task's launch, forked by its supervisor; the agent's helpers, run as a program), and a
setup that cannot be taken whole runs nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ended_in_sandbox, shared_dir, slot_user, wait_for

from flashnode.sandbox import procs
from flashnode.sandbox.procs import enter
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.helpers import popen_as
from flashnode.sandbox.procs.mounts import Sandbox


def _status(text: str) -> dict[str, list[str]]:
    return {k: v.split() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _assert_nothing_to_regain(status: dict[str, list[str]], user: procs.TaskUser) -> None:
    assert status["Uid"] == [str(user.uid)] * 4 and status["Gid"] == [str(user.gid)] * 4
    assert status["Groups"] == [] and status["NoNewPrivs"] == ["1"]
    assert status["SigIgn"] == ["0000000000000000"]  # the interpreter's ignored ones are not
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb", "CapBnd"):  # the tests run as root
        assert status[caps] == ["0000000000000000"], (caps, status[caps])


@pytest.fixture
def work() -> Iterator[Path]:
    """A task's working directory outside the private directories (a task gets its own /tmp)."""
    root = shared_dir("flashnode-enter-")
    root.chmod(0o777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.usefixtures("as_root")
def test_a_launched_task_has_no_group_capability_or_way_back_to_root(
    tmp_path: Path, work: Path
) -> None:
    user = slot_user()
    argv = ["sh", "-c", "cat /proc/self/status"]
    proc = ended_in_sandbox(argv, Sandbox(1 << 20, work=True), work, tmp_path, user)
    assert proc.launched, proc.setup_failure()
    _assert_nothing_to_regain(_status((tmp_path / "out").read_text()), user)


@pytest.mark.usefixtures("as_root")
def test_a_helper_run_as_a_program_has_no_group_capability_or_way_back_to_root(
    tmp_path: Path, work: Path
) -> None:
    user = slot_user()
    proc = popen_as(
        ["cat", "/proc/self/status"],
        {"PATH": SYSTEM_PATH},
        user,
        Sandbox(1 << 20, keep_agent=True),
        rlimits={"core": 0, "fsize": 1 << 20},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    status = _status(out.decode())
    _assert_nothing_to_regain(status, user)
    proc = popen_as(
        ["sh", "-c", "ulimit -c; ulimit -H -f"],
        {"PATH": SYSTEM_PATH},
        user,
        rlimits={"core": 0, "fsize": 1 << 20},
        stdout=subprocess.PIPE,
        cwd=tmp_path,
    )
    out, _ = proc.communicate(timeout=60)
    assert out.split() == [b"0", str((1 << 20) // 512).encode()]  # the shell's 512-byte blocks
    # Past the limit, the write ends it (SIGXFSZ), as any program is ended there.
    grow = ["sh", "-c", "exec head -c 2000000 /dev/zero > grown"]
    proc = popen_as(grow, {"PATH": SYSTEM_PATH}, user, rlimits={"fsize": 1 << 20}, cwd=work)
    assert proc.wait(60) == -signal.SIGXFSZ


@pytest.mark.usefixtures("as_root")
def test_a_helper_whose_view_cannot_be_bound_says_why_and_runs_nothing(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    (tmp_path / "view").mkdir()
    sandbox = Sandbox(1 << 20, read_only_binds=((str(tmp_path / "vanished"), "view"),))
    proc = popen_as(
        ["touch", str(ran)],
        {"PATH": SYSTEM_PATH},
        None,
        sandbox,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == enter.SETUP_FAILED and not ran.exists()
    assert err == b"flashnode: cannot mount /work/view read-only: No such file or directory\n"


def test_a_plan_that_breaks_the_setup_ends_it_without_running_anything(tmp_path: Path) -> None:
    """Any error of the setup's own (here a plan without its steps) ends the chain as a failed
    step does: nothing after it runs, and the chain says why."""
    ran = tmp_path / "ran"
    cmd = [sys.executable, "-I", "-S", enter.__file__, json.dumps({}), "/bin/touch", str(ran)]
    done = subprocess.run(cmd, capture_output=True, timeout=60)
    assert done.returncode == enter.SETUP_FAILED and not ran.exists()
    assert done.stderr.startswith(b"flashnode: cannot set up the task: KeyError("), done.stderr


@pytest.mark.parametrize("option", ["exec", "suid", "dev", "rw,bind", "X-mount.mode=0777"])
def test_a_mount_table_with_an_option_it_does_not_know_mounts_nothing(
    tmp_path: Path, option: str
) -> None:
    """Options it would not take as ``mount`` does (``exec``, ``suid``) fail closed: a table
    is read whole before its line is mounted."""
    table = tmp_path / "t.fstab"
    table.write_text(f"flashnode-x {tmp_path / 'target'} tmpfs nosuid,nodev,{option} 0 0\n")
    with pytest.raises(enter.SetupFailed, match="unknown option"):
        enter.mount_table(str(table))


def test_a_mount_tables_paths_are_read_as_fstab_escapes_them() -> None:
    assert enter._unescape("/tmp/job\\040env\\134x") == "/tmp/job env\\x"


class _Joined:
    """A stand-in cgroup whose processes file is ``path`` (a FIFO: joining it blocks)."""

    def __init__(self, path: Path) -> None:
        self.procs_files = [str(path)]


def test_a_setup_that_hangs_is_ended_by_sigterm_as_the_programs_were(tmp_path: Path) -> None:
    """The chain's first process is a fork of a supervisor, which catches SIGTERM to outlive its
    agent's stop: the setup itself does not, or a stop sent while it hangs would be lost."""
    fifo = tmp_path / "procs"
    os.mkfifo(fifo)
    code = (
        "import signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"  # as the supervisor does
        "from flashnode.sandbox.procs import enter\n"
        "print('setting up', flush=True)\n"
        "enter.child({'cgroup': [sys.argv[1]], 'sandbox': False, 'rlimits': {}, 'user': None})\n"
    )
    with subprocess.Popen([sys.executable, "-c", code, str(fifo)], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"setting up\n"
        wait_for("the setup to block joining", lambda: _blocked_in_open(proc.pid))
        proc.terminate()
        try:
            ended = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            ended = proc.wait()
        assert ended == -signal.SIGTERM


def _blocked_in_open(pid: int) -> bool:
    return Path(f"/proc/{pid}/wchan").read_text() not in ("0", "")


def test_a_supervisor_that_does_not_answer_fails_the_start_as_the_nodes_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No answer from a launch's supervisor (stuck, or gone) fails the start with an OSError,
    which the runner makes the node's lapse, never an agent error charged to the task; the
    supervisor is ended."""
    from flashnode.sandbox.procs import forkserver
    from flashnode.sandbox.procs.launch import Launch
    from flashnode.sandbox.procs.supervisor import Gone, Supervised

    def silent(self: Supervised) -> None:
        raise Gone("no answer")

    ended: list[int] = []
    kill = forkserver.Child.kill
    monkeypatch.setattr(Supervised, "answer", silent)
    monkeypatch.setattr(forkserver.Child, "kill", lambda c: ended.append(c.pid) or kill(c))
    with pytest.raises(OSError, match="cannot start a task's supervisor: no answer"):
        Launch(tmp_path, homes=tmp_path / "homes")
    assert len(ended) == 1


def test_a_launchs_group_is_its_own_as_soon_as_its_pid_is_known(tmp_path: Path) -> None:
    """What ends a chain signals its group by the chain's pid (``discard``, the task's end): from
    the moment the launch returns, that group exists and is the chain's, never a signal sent to
    no group while the chain's first process has not made its session yet."""
    from flashnode.sandbox.procs.launch import Launch

    for _ in range(20):
        launch = Launch(tmp_path, homes=tmp_path / "homes")
        try:
            assert os.getsid(launch.pid) == launch.pid and os.getpgid(launch.pid) == launch.pid
        finally:
            launch.discard()
