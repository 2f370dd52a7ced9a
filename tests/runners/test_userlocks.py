"""Task users belong to one agent: a second agent never runs tasks as a user the first holds."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import AgentProcess, CoordinatorServer, argv_job

from flashnode.runners.userlocks import UserLocks, UsersHeld, held_elsewhere

USER = "flashnode-task"  # ./scripts/task-users makes flashnode-task-0 to -15

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="task users are an agent as root's")


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    try:
        pwd.getpwnam(f"{USER}-1")
    except KeyError:
        pytest.skip("the task users are missing (./scripts/task-users)")
    d = tmp_path / "locks"
    d.mkdir(mode=0o700)
    return d


def test_a_second_agent_takes_task_users_the_first_does_not_hold(
    lock_dir: Path, tmp_path: Path
) -> None:
    first, second = UserLocks(USER, lock_dir), UserLocks(USER, lock_dir)
    a = first.take(2, tmp_path / "state-a")
    b = second.take(2, tmp_path / "state-b")
    assert [u.name for u in a] == [f"{USER}-0", f"{USER}-1"]
    assert not {u.uid for u in a} & {u.uid for u in b}
    first.release()
    third = UserLocks(USER, lock_dir)
    assert [u.name for u in third.take(1, tmp_path / "state-c")] == [f"{USER}-0"]


def test_an_agent_whose_task_users_are_all_held_refuses_naming_the_holder_and_a_way_out(
    lock_dir: Path, tmp_path: Path
) -> None:
    # Another process holds all sixteen, as another agent would.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from flashnode.runners.userlocks import"
            " UserLocks; UserLocks(sys.argv[1], Path(sys.argv[2])).take(16, Path('/srv/a'));"
            " print('held', flush=True); sys.stdin.read()",
            USER,
            str(lock_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(UsersHeld) as refused:
            UserLocks(USER, lock_dir).take(1, tmp_path / "state")
        why = str(refused.value)
        assert f"{USER}-0 (the agent of pid {holder.pid}, state dir /srv/a)" in why
        assert f'task_user = "{USER}-x"' in why  # users of its own, never the same ones
        held = held_elsewhere(USER, tmp_path / "state", lock_dir)
        assert len(held) == 16 and held[0].startswith(f"{USER}-0 (the agent of pid")
        assert held_elsewhere(USER, Path("/srv/a"), lock_dir) == []  # its own agent's
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()
    assert [u.name for u in UserLocks(USER, lock_dir).take(1, tmp_path / "s")] == [f"{USER}-0"]


def test_a_lock_dir_others_can_write_to_is_refused(lock_dir: Path, tmp_path: Path) -> None:
    lock_dir.chmod(0o733)
    with pytest.raises(Exception, match="is not root's alone"):
        UserLocks(USER, lock_dir).take(1, tmp_path / "state")


def test_two_agents_with_the_same_task_user_never_run_two_tasks_under_one_uid(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    """Two agents of two state dirs, both with task_user = flashnode-task and one slot: each
    runs one task of a job, both at the same moment (each waits until the other started)."""
    script = (
        f"id -u > {drop_dir}/uid-{{n}}.tmp && mv {drop_dir}/uid-{{n}}.tmp {drop_dir}/uid-{{n}};"
        f" for i in $(seq 300); do [ -e {drop_dir}/uid-0 ] && [ -e {drop_dir}/uid-1 ] && break;"
        " sleep 0.1; done; echo '{{}}' > metrics.json"
    )
    job = coordinator.submit(argv_job(["sh", "-c", script], params=[{"n": 0}, {"n": 1}]))
    env = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_TASK_USER": USER}
    trusted = ("--runner", "trusted", "--pool", "team-a", "--max-tasks", "1")
    one = start_agent(coordinator.url, *trusted, env=env, name="one")
    two = start_agent(coordinator.url, *trusted, env=env, name="two")
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED", (
        one.log + two.log
    )
    uids = {(drop_dir / f"uid-{n}").read_text().strip() for n in (0, 1)}
    assert len(uids) == 2, f"both agents ran their tasks as uid {uids}"


# An agent that takes two users, leaves a stand-in for a task's supervisor holding slot 1's user
# (a child that keeps that lock open), and exits.
FIRST_RUN = """
import os, sys, time
from pathlib import Path
from flashnode.runners.userlocks import UserLocks
locks = UserLocks(sys.argv[1], Path(sys.argv[2]))
zero, one = locks.take(2, Path(sys.argv[3]))
if os.fork() == 0:
    os.close(locks.fd_of(zero))
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 1)  # the test reads the agent's output to its end, not the stand-in's
    os.dup2(quiet, 2)
    while not os.path.exists(sys.argv[4]):
        time.sleep(0.05)
    os._exit(0)
print(zero.name, one.name, flush=True)
"""


def test_a_restarted_agent_gives_each_slot_its_user_again_even_one_a_running_task_holds(
    lock_dir: Path, tmp_path: Path
) -> None:
    """A task of the earlier run runs on as slot 1's user (its supervisor holds the lock): the
    next agent on that state dir gets that user for slot 1 again, and holds it once the task
    ended; no agent of another state dir takes it meanwhile."""
    state, ended = tmp_path / "state", tmp_path / "task-ended"
    state.mkdir()
    run = [sys.executable, "-c", FIRST_RUN, USER, str(lock_dir), str(state), str(ended)]
    names = subprocess.run(run, capture_output=True, text=True, check=True).stdout.split()
    zero, one = (pwd.getpwnam(n) for n in names)
    other = UserLocks(USER, lock_dir)
    assert [u.name for u in other.take(1, tmp_path / "elsewhere")] == [zero.pw_name]
    again = UserLocks(USER, lock_dir)
    users = again.take(2, state)
    assert users[1].uid == one.pw_uid and users[0].uid not in (zero.pw_uid, one.pw_uid)
    assert again.borrowed(users[1]) and again.fd_of(users[1]) is None
    assert not again.relock(users[1], timeout=0.2)  # its task still runs
    ended.touch()  # the task ended: its supervisor exits
    assert again.relock(users[1]) and again.fd_of(users[1]) is not None
    other.release()
    again.release()


def test_a_same_named_state_dir_elsewhere_never_borrows_a_live_agents_user(
    lock_dir: Path, tmp_path: Path
) -> None:
    """Borrowing is for this very directory's earlier run, gone: an agent whose state dir has
    the same name (another working directory, another mount namespace) takes other users."""
    first = UserLocks(USER, lock_dir)
    state = tmp_path / "state"
    state.mkdir()
    held = first.take(1, state)
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "task-users").write_text(f"{held[0].name}\n")
    second = UserLocks(USER, lock_dir)
    taken = second.take(1, tmp_path / "copy")
    assert taken[0].uid != held[0].uid and not second.borrowed(taken[0])
    first.release()
    second.release()
