"""The slot pool's contract, with a fake launcher and a fake cgroup hierarchy standing in for the
real chains and cgroups (those are held by tests/sandbox/test_process_ownership.py and
test_attacks_launch.py, as root): the turnover's order, the chain kept ahead given only to a task
that can use it, the wait for the turnover, and what reconcile and close end."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from harness import wait_for

from flashnode.runners.slots import SlotPool
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.launch import Launch
from flashnode.sandbox.procs.mounts import Sandbox

USER = procs.TaskUser("flashnode-task-0", 60000, 60000)
BLANK = Sandbox(1 << 20, work=True)
OTHER = Sandbox(1 << 20, hidden_devices=("/dev/nvidia1",), work=True)


# What happened, in order, across the fakes and the pool's worker thread.
Events = list[str]


class FakeCgroup(cgroups.AttemptCgroup):
    def __init__(self, name: str, events: Events, gone: bool = True) -> None:
        super().__init__(2, {"unified": Path("/nonexistent") / name})
        self.name, self.events, self.gone = name, events, gone
        self.release = threading.Event()
        self.release.set()

    def remove(self) -> bool:
        self.events.append(f"remove {self.name}")
        self.release.wait()
        return self.gone


class FakeHierarchy(cgroups.Hierarchy):
    def __init__(self, events: Events, fail: bool = False) -> None:
        super().__init__(2, {"unified": Path("/nonexistent")})
        self.events, self.fail = events, fail
        self.swept: list[str] = []

    def create(self, name: str, limits: Limits) -> cgroups.AttemptCgroup:
        if self.fail:
            raise PermissionError(13, "Permission denied")
        self.events.append(f"create {name}")
        return FakeCgroup(name, self.events)

    def sweep(self, prefix: str, keep: object = frozenset()) -> int:
        self.swept.append(prefix)
        return 1


class FakeLaunch(Launch):
    """A chain that records what is done to it, and never starts a process."""

    def __init__(
        self,
        cwd: Path,
        cgroup: cgroups.AttemptCgroup | None = None,
        user: procs.TaskUser | None = None,
        sandbox: Sandbox | None = None,
        events: Events | None = None,
    ) -> None:
        self.cwd, self.cgroup, self.user, self.sandbox = cwd, cgroup, user, sandbox
        self.events = events if events is not None else []
        self.waiting = True
        self.discarded = False
        self.events.append(f"launch {cwd.name}")

    def alive(self) -> bool:
        return self.waiting

    def discard(self) -> None:
        self.discarded = True
        self.events.append(f"discard {self.cwd.name}")
        if self.cgroup is not None:
            self.cgroup.remove()


class Pool:
    """A pool over a state dir of its own, and what it did."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        ahead: bool = True,
        hierarchy: bool = True,
        failing_launch: bool = False,
        keyrings: str | None = None,
    ) -> None:
        self.state_dir = tmp_path / "state"
        (self.state_dir / "attempts").mkdir(parents=True, exist_ok=True)
        self.events: Events = []
        self.hierarchy = FakeHierarchy(self.events)
        self.launched: list[FakeLaunch] = []
        self.failing_launch = failing_launch
        self.keyrings = keyrings
        self.pool = SlotPool(
            self.state_dir,
            self.hierarchy if hierarchy else None,
            lambda: BLANK,
            ahead=ahead,
            launcher=self._launch,
            clear_keyrings=self._clear,
        )

    def _launch(
        self,
        cwd: Path,
        cgroup: cgroups.AttemptCgroup | None,
        user: procs.TaskUser | None,
        sandbox: Sandbox | None,
    ) -> Launch:
        if self.failing_launch:
            raise FileNotFoundError(2, "No such file or directory", "unshare")
        launch = FakeLaunch(cwd, cgroup, user, sandbox, self.events)
        self.launched.append(launch)
        return launch

    def _clear(self, user: procs.TaskUser) -> str | None:
        self.events.append(f"clear keyrings of {user.name}")
        return self.keyrings

    def task_ended(self, slot: int = 0, user: procs.TaskUser | None = USER) -> FakeCgroup:
        """A task of ``slot`` has ended: its cgroup, handed to the pool's turnover."""
        cgroup = FakeCgroup(f"lease-{len(self.events)}", self.events)
        self.pool.turn_over(slot, user, cgroup)
        return cgroup

    def ahead_dirs(self) -> list[Path]:
        return sorted((self.state_dir / "attempts").glob(".ahead-*"))


def test_the_turnover_removes_the_tasks_cgroup_clears_the_keyrings_then_starts_the_next_chain(
    tmp_path: Path,
) -> None:
    p = Pool(tmp_path)
    cgroup = p.task_ended()
    chain = p.pool.take(0, BLANK)
    assert chain is not None
    (created,) = (e for e in p.events if e.startswith("create "))
    assert p.events == [
        f"remove {cgroup.name}",
        "clear keyrings of flashnode-task-0",
        created,
        f"launch {chain.work.name}",
    ]
    assert created.startswith(f"create {p.pool.prefix}0-")
    assert chain.launch.user == USER and chain.launch.sandbox == BLANK
    assert chain.work.parent == p.state_dir / "attempts" and chain.work.is_dir()
    assert chain.work.name.startswith(".ahead-0-")


def test_the_next_start_of_a_slot_does_not_wait_for_its_last_tasks_supervisor_to_go(
    tmp_path: Path,
) -> None:
    """Letting go of the task's supervisor (root's: its exit waited for, its directory removed)
    comes after the turnover, on the same thread: the slot's next chain is there first."""
    p = Pool(tmp_path)
    going, gone = threading.Event(), threading.Event()

    def let_go() -> None:
        going.set()
        gone.wait(10)
        p.events.append("supervisor let go of")

    cgroup = FakeCgroup("lease-1", p.events)
    p.pool.turn_over(0, USER, cgroup, let_go)
    chain = p.pool.take(0, BLANK)  # does not wait for let_go
    assert chain is not None and "supervisor let go of" not in p.events
    assert going.wait(10)
    gone.set()
    p.pool.close()  # waits for what was queued, let_go too
    assert p.events[-1] == "supervisor let go of"


def test_a_slot_whose_last_supervisor_is_slow_to_go_holds_up_no_other_slots_next_start(
    tmp_path: Path,
) -> None:
    p = Pool(tmp_path)
    held, gone = threading.Event(), threading.Event()

    def let_go() -> None:  # slot 0's supervisor takes its time to exit
        held.set()
        gone.wait(10)

    p.pool.turn_over(0, USER, FakeCgroup("lease-0", p.events), let_go)
    assert held.wait(10)
    other = procs.TaskUser("flashnode-task-1", USER.uid + 1, USER.gid + 1)
    p.task_ended(slot=1, user=other)
    started = threading.Thread(target=lambda: p.pool.take(1, BLANK), daemon=True)
    started.start()
    started.join(5)  # slot 0's let-go still waits: slot 1's turnover must not be behind it
    try:
        assert not started.is_alive(), "slot 1's next start waited for slot 0's supervisor"
    finally:
        gone.set()
        p.pool.close()


def test_a_slot_whose_last_cgroup_would_not_go_keeps_no_chain_beside_it(tmp_path: Path) -> None:
    """A process that would not die keeps its cgroup, and lives as the slot's user: no chain
    of that user may wait beside it."""
    p = Pool(tmp_path)
    cgroup = FakeCgroup("lease-stuck", p.events, gone=False)
    p.pool.turn_over(0, USER, cgroup)
    assert p.pool.take(0, BLANK) is None
    assert p.events == ["remove lease-stuck", "clear keyrings of flashnode-task-0"]
    assert p.launched == [] and p.ahead_dirs() == []


def test_take_waits_for_the_slots_turnover(tmp_path: Path) -> None:
    """The next task of a slot starts only once its last task's cgroup is gone and its user's
    keyrings are cleared: ``take`` called during the turnover returns the chain it ends with."""
    p = Pool(tmp_path)
    cgroup = FakeCgroup("lease-slow", p.events)
    cgroup.release.clear()
    p.pool.turn_over(0, USER, cgroup)
    wait_for("the turnover to begin", lambda: "remove lease-slow" in p.events)
    timer = threading.Timer(0.2, cgroup.release.set)
    timer.start()
    try:
        chain = p.pool.take(0, BLANK)
    finally:
        timer.join()
    assert chain is not None and chain.launch is p.launched[0]
    assert p.events[:2] == ["remove lease-slow", "clear keyrings of flashnode-task-0"]


def test_a_primed_slot_clears_its_users_keyrings_then_keeps_a_chain_for_its_first_task(
    tmp_path: Path,
) -> None:
    """An agent's start, for a slot with no task: a turnover without a task's cgroup, so that the
    slot's first task starts in a chain kept ahead as every later one does."""
    p = Pool(tmp_path)
    p.pool.prime(0, USER)
    chain = p.pool.take(0, BLANK)  # waits for the prime, as for a turnover
    assert chain is not None and chain.launch.user == USER
    (created,) = (e for e in p.events if e.startswith("create "))
    assert p.events == ["clear keyrings of flashnode-task-0", created, f"launch {chain.work.name}"]


def test_a_slot_primed_after_close_keeps_no_chain(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    p.pool.close()
    p.pool.prime(0, USER)
    assert p.pool.take(0, BLANK) is None
    assert p.launched == []


def test_a_chain_kept_ahead_goes_to_the_next_task_of_its_slot_only(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    p.task_ended(slot=0)
    p.task_ended(slot=1, user=procs.TaskUser("flashnode-task-1", 60001, 60001))
    assert p.pool.take(2, BLANK) is None
    one = p.pool.take(1, BLANK)
    zero = p.pool.take(0, BLANK)
    assert one is not None and one.launch.user is not None
    assert one.launch.user.name == "flashnode-task-1"
    assert zero is not None and zero.launch.user == USER
    assert p.pool.take(0, BLANK) is None  # taken: it is the task's now
    assert not any(launch.discarded for launch in p.launched)


@pytest.mark.parametrize("why", ["another sandbox", "no sandbox", "ended"])
def test_a_chain_the_task_cannot_use_is_ended_before_it_starts(tmp_path: Path, why: str) -> None:
    """A task with read-only views or hidden GPUs (another sandbox), or one after a reload that
    changed the lent directories, or a chain that exited (its setup failed): the chain is ended
    (its cgroup removed, its /work directory gone) and the task gets one of its own."""
    p = Pool(tmp_path)
    p.task_ended()
    wait_for("a chain kept ahead", lambda: p.launched)
    (chain,) = p.launched
    sandbox: Sandbox | None = {"another sandbox": OTHER, "no sandbox": None}.get(why, BLANK)
    if why == "ended":
        chain.waiting = False
    assert p.pool.take(0, sandbox) is None
    assert chain.discarded
    assert isinstance(chain.cgroup, FakeCgroup)
    assert p.events[-2:] == [f"discard {chain.cwd.name}", f"remove {chain.cgroup.name}"]
    assert p.ahead_dirs() == []
    assert p.pool.take(0, BLANK) is None


def test_a_chain_no_task_took_is_ended_when_the_slot_turns_over_again(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    p.task_ended()
    p.task_ended()
    chain = p.pool.take(0, BLANK)
    first, second = p.launched
    assert first.discarded and not second.discarded
    assert chain is not None and chain.launch is second
    assert p.ahead_dirs() == [chain.work]


@pytest.mark.parametrize("how", ["not kept ahead", "no cgroups", "same user"])
def test_without_chains_ahead_the_turnover_still_cleans_the_slot(tmp_path: Path, how: str) -> None:
    """The same-user mode (no task user), a host without cgroups, or a state dir under a private
    directory: the task's cgroup is still removed (and a task user's keyrings cleared) before the
    slot's next task, which starts its own chain."""
    p = Pool(tmp_path, ahead=how != "not kept ahead", hierarchy=how != "no cgroups")
    cgroup = p.task_ended(user=None if how == "same user" else USER)
    assert p.pool.take(0, BLANK) is None
    cleared = [] if how == "same user" else ["clear keyrings of flashnode-task-0"]
    assert p.events == [f"remove {cgroup.name}", *cleared]
    assert p.launched == [] and p.ahead_dirs() == []


def test_a_chain_that_cannot_start_leaves_neither_its_cgroup_nor_its_directory(
    tmp_path: Path,
) -> None:
    p = Pool(tmp_path, failing_launch=True)
    p.task_ended()
    assert p.pool.take(0, BLANK) is None
    created = [e.removeprefix("create ") for e in p.events if e.startswith("create ")]
    assert len(created) == 1 and p.events[-1] == f"remove {created[0]}"
    assert p.ahead_dirs() == []


def test_a_slot_whose_chain_cgroup_cannot_be_made_starts_its_next_task_the_plain_way(
    tmp_path: Path,
) -> None:
    p = Pool(tmp_path)
    p.hierarchy.fail = True
    p.task_ended()
    assert p.pool.take(0, BLANK) is None
    assert p.launched == [] and p.ahead_dirs() == []


def test_keyrings_that_cannot_be_cleared_are_reported_to_the_owner(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = Pool(tmp_path, keyrings="Permission denied")
    p.task_ended()
    with caplog.at_level(logging.ERROR):
        p.pool.take(0, BLANK)
    assert "cannot reset the keyrings of flashnode-task-0 (Permission denied)" in caplog.text


def test_a_turnover_that_fails_is_logged_and_the_next_task_still_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = Pool(tmp_path)

    def broken(user: procs.TaskUser) -> str | None:
        raise RuntimeError("keyctl exploded")

    p.pool._clear_keyrings = broken
    p.task_ended()
    with caplog.at_level(logging.ERROR):
        assert p.pool.take(0, BLANK) is None
    assert "slot 0: its turnover failed" in caplog.text
    assert p.launched == []


def test_close_waits_for_the_turnovers_and_ends_every_chain_kept(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    slow = FakeCgroup("lease-slow", p.events)
    slow.release.clear()
    p.task_ended(slot=0)
    p.pool.turn_over(1, procs.TaskUser("flashnode-task-1", 60001, 60001), slow)
    wait_for("the second turnover to begin", lambda: "remove lease-slow" in p.events)
    timer = threading.Timer(0.2, slow.release.set)
    timer.start()
    try:
        p.pool.close()
        waited = "clear keyrings of flashnode-task-1" in p.events  # the slow turnover's end
    finally:
        timer.join()
    assert waited
    assert p.launched and all(launch.discarded for launch in p.launched)
    assert p.ahead_dirs() == []
    assert p.pool.take(0, BLANK) is None


def test_a_turnover_after_close_cleans_the_slot_and_starts_no_chain(tmp_path: Path) -> None:
    p = Pool(tmp_path)
    p.pool.close()
    cgroup = p.task_ended()
    assert p.pool.take(0, BLANK) is None
    assert p.events == [f"remove {cgroup.name}", "clear keyrings of flashnode-task-0"]
    assert p.launched == []


def test_reconcile_sweeps_the_cgroups_named_for_this_state_dir_only(tmp_path: Path) -> None:
    """A crash leaves the cgroups of the chains kept ahead: the next start of the agent on the
    same state dir removes them, and never those of another agent (another state dir)."""
    first, again = Pool(tmp_path / "a"), Pool(tmp_path / "a")
    other = Pool(tmp_path / "b")
    for p in (first, again, other):
        p.pool.reconcile()
    assert first.hierarchy.swept == again.hierarchy.swept == [first.pool.prefix]
    assert other.pool.prefix != first.pool.prefix
    assert first.pool.prefix.startswith("ahead-")
    Pool(tmp_path / "c", hierarchy=False).pool.reconcile()  # no cgroups: nothing to sweep
