"""What runs beside a task: each guard alone under a fake clock, the supervisor that carries
out what they ask, and a guard the agent never had, added to an attempt by its context alone,
pausing and ending a running task with a reason that says whose fault it is."""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.attempt import Attempt, Outcome
from flashnode.attempt.diskwatch import DiskCaps, DiskWatch, Look
from flashnode.attempt.guards.base import Action, Beside, End, Guard, Pause, Resume, Running
from flashnode.attempt.guards.cancel import CancelGuard
from flashnode.attempt.guards.disk import DiskGuard
from flashnode.attempt.guards.lease import LeaseGuard
from flashnode.attempt.guards.restart import RestartGuard
from flashnode.attempt.guards.sampling import SamplingGuard
from flashnode.attempt.guards.supervisor import Supervisor
from flashnode.attempt.guards.suspension import SuspensionGuard
from flashnode.attempt.guards.timeout import TimeoutGuard
from flashnode.config.settings import Settings
from flashnode.errors import AttemptFailed, AttemptLapsed, Detached, DiskFull, Stopped
from flashnode.runners.base import Handle, RunResult, SuspendFailed
from flashnode.runners.plan import TaskPlan
from flashnode.sandbox.diskuse import Space
from flashnode.sandbox.outputs import Usage


class Task:
    """A task that needs ``work`` seconds of running (not paused) time on the fake clock."""

    def __init__(self, clock: FakeClock, work: float = math.inf, refuse: bool = False) -> None:
        self.clock, self.work, self.refuse = clock, work, refuse
        self.last = clock.now
        self.done = 0.0
        self.frozen = self.ended = False
        self.detachable = False
        self.calls: list[str] = []

    def _advance(self) -> None:
        if not (self.frozen or self.ended):
            self.done += self.clock.now - self.last
        self.last = self.clock.now

    def exited(self) -> bool:
        self._advance()
        return self.ended or self.done >= self.work

    def terminate(self, grace: float) -> None:
        self._advance()
        self.calls.append(f"terminate {grace:g}")
        self.ended = True

    def suspend(self) -> None:
        self._advance()
        if self.refuse:
            raise SuspendFailed("cannot freeze it")
        self.calls.append("suspend")
        self.frozen = True

    def resume(self) -> None:
        self._advance()
        self.calls.append("resume")
        self.frozen = False

    def detach(self) -> bool:
        return self.detachable

    def disk_bytes(self) -> int:
        return 0

    def result(self) -> RunResult:
        return RunResult(exit_code=None, signal=15) if self.ended else RunResult(0)

    def pids(self) -> set[int]:
        return set()

    def cpu_seconds(self) -> float | None:
        return self.done

    def lease_left(self, seconds: float) -> None:
        pass

    def last_output(self) -> str:
        return ""


@dataclass
class View:
    """A running task as a guard sees it, set by hand."""

    handle: Any = None
    paused_since: float | None = None
    paused_before: float = 0.0


@dataclass
class Asking:
    lease_lost: bool = False
    detaching: bool = False
    cancelled: AttemptFailed | AttemptLapsed | None = None
    cancel_grace: float = 0.0
    suspend_reason: str | None = None
    suspend_sources: dict[str, float] = field(default_factory=dict)


# --- each guard alone ---------------------------------------------------------------------------


def test_the_timeout_ends_the_task_at_its_time_the_tasks_fault_and_waits_while_paused() -> None:
    guard, view = TimeoutGuard(started=100.0, timeout=10.0, kill_grace=3.0), View()
    assert guard.turn(109.9, view) is None and guard.next_at(view) == 110.0
    ended = guard.turn(110.0, view)
    assert isinstance(ended, End) and ended.fault == "task" and ended.grace == 3.0
    assert "timed out after 10 s" in str(ended.why)
    paused = View(paused_since=105.0)  # no timeout while paused ...
    assert guard.turn(200.0, paused) is None and guard.next_at(paused) == math.inf
    resumed = View(paused_before=20.0)  # ... and the time paused moves it on
    assert guard.turn(129.0, resumed) is None and guard.next_at(resumed) == 130.0


def test_a_suspension_pauses_resumes_and_past_its_bound_ends_the_task_as_the_owners() -> None:
    asks = Asking()
    guard = SuspensionGuard(asks, max_suspend=60.0, gpu_yield_stop=300.0, kill_grace=5.0)
    running, paused = View(), View(paused_since=100.0)
    assert guard.turn(100.0, running) is None
    asks.suspend_reason, asks.suspend_sources = "the owner paused it", {"owner": 100.0}
    assert guard.turn(100.0, running) == Pause("the owner paused it")
    assert guard.turn(159.0, paused) is None and guard.next_at(paused) == 160.0  # asked once
    ended = guard.turn(160.0, paused)
    assert isinstance(ended, End) and ended.fault == "owner" and isinstance(ended.why, Stopped)
    assert "suspended for longer than 60 s (the owner paused it)" in str(ended.why)
    asks.suspend_sources = {"gpu": 100.0}  # the owner's use of its GPU: the courtesy's bound more
    assert guard.next_at(paused) == 460.0
    asks.suspend_reason, asks.suspend_sources = None, {}
    assert guard.turn(200.0, paused) == Resume()


def test_a_lost_lease_a_cancel_and_a_restart_end_the_task_each_their_way() -> None:
    asks, view = Asking(), View(handle=Task(FakeClock()))
    guards: list[Guard] = [LeaseGuard(asks, 10.0), CancelGuard(asks), RestartGuard(asks)]
    assert all(g.turn(0.0, view) is None and g.next_at(view) == math.inf for g in guards)
    asks.lease_lost = True
    assert guards[0].turn(0.0, view) == End(None, 1.0)  # nothing to report, a short grace
    asks.cancelled, asks.cancel_grace = Stopped("agent stopping"), 7.0
    cancelled = guards[1].turn(0.0, view)
    assert cancelled == End(asks.cancelled, 7.0) and cancelled.fault == "owner"
    asks.detaching = True  # a task its runner cannot let go of is left to the cancel
    assert guards[2].turn(0.0, view) is None
    view.handle.detachable = True
    let_go = guards[2].turn(0.0, view)
    assert isinstance(let_go, End) and isinstance(let_go.why, Detached) and let_go.fault is None


def _disk_guard(
    clock: FakeClock, usage: Usage, space: Space | None, tmp_path: Path, first: Look | None = None
) -> tuple[DiskGuard, list[tuple[int, int]]]:
    held: list[tuple[int, int]] = []
    s = Settings(coordinator="http://127.0.0.1:1", state_dir=tmp_path, task_disk_files=1000)
    guard = DiskGuard(
        DiskWatch(DiskCaps(bytes=1 << 30, files=1000), first, clock.now),
        s,
        clock,
        lambda: space,
        lambda: usage,
        lambda nbytes, files: held.append((nbytes, files)),
        clock.now,
    )
    return guard, held


def test_the_disk_guard_walks_the_task_and_ends_one_past_its_cap_as_its_own_fault(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    view = View(handle=Task(clock))
    usage = Usage(output_bytes=0, output_files=0, disk_bytes=4096, disk_files=10)
    guard, held = _disk_guard(clock, usage, None, tmp_path)
    assert guard.turn(clock.now, view) is None and held == []  # not before its first walk
    clock.now = guard.next_at(view)
    assert guard.turn(clock.now, view) is None and held == [(4096, 10)]
    assert guard.next_at(view) == clock.now + 0.5
    many = Usage(output_bytes=0, output_files=0, disk_bytes=0, disk_files=1001)
    over, _ = _disk_guard(clock, many, None, tmp_path)
    clock.now += 1.0
    ended = over.turn(clock.now, view)
    assert isinstance(ended, End) and ended.fault == "task" and "task_disk_files" in str(ended.why)


def test_the_disk_guard_ends_a_task_on_a_full_disk_it_did_not_fill_as_the_nodes_fault(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    room = Space(free_bytes=1 << 40, total_bytes=1 << 41, free_inodes=10**6, total_inodes=10**7)
    usage = Usage(output_bytes=0, output_files=0, disk_bytes=10, disk_files=1)
    guard, _ = _disk_guard(clock, usage, room, tmp_path, first=Look(room, 10, 1))
    view = View(handle=Task(clock))
    clock.now += 0.01
    assert guard.turn(clock.now, view) is None  # the disk as it was
    guard.space = lambda: Space(0, 1 << 41, 10**6, 10**7)  # full, and not by the task's files
    clock.now = guard.next_at(view)
    ended = guard.turn(clock.now, view)
    assert isinstance(ended, End) and isinstance(ended.why, DiskFull) and ended.fault == "node"
    assert view.handle.calls[0] == "suspend"  # measured frozen


def test_a_task_whose_files_stay_as_they_were_is_walked_less_and_less_often(
    tmp_path: Path,
) -> None:
    """A sleeping task: walks 0.5 s, then 1, 2, 4 and 8 s apart (no further); the walk that
    finds its files changed brings them back to 0.5 s."""
    clock = FakeClock()
    room = Space(free_bytes=1 << 40, total_bytes=1 << 41, free_inodes=10**6, total_inodes=10**7)
    usage = Usage(output_bytes=0, output_files=0, disk_bytes=4096, disk_files=10)
    guard, held = _disk_guard(clock, usage, room, tmp_path, first=Look(room, 4096, 10))
    view = View(handle=Task(clock))
    gaps = []
    for _ in range(7):
        walked = len(held)
        while len(held) == walked:  # the disk's readings come between the walks
            clock.now = guard.next_at(view)
            assert guard.turn(clock.now, view) is None
        gaps.append(guard.next_walk - clock.now)
    assert gaps == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    guard.usage = lambda: Usage(output_bytes=0, output_files=0, disk_bytes=8192, disk_files=11)
    clock.now = guard.next_walk
    assert guard.turn(clock.now, view) is None and held[-1] == (8192, 11)
    assert guard.next_walk - clock.now == 0.5


def test_with_the_disk_unknown_a_quiet_task_is_still_walked_every_half_second(
    tmp_path: Path,
) -> None:
    """Without the disk's readings nothing would set off a walk at once: no quiet walks."""
    clock = FakeClock()
    usage = Usage(output_bytes=0, output_files=0, disk_bytes=4096, disk_files=10)
    guard, held = _disk_guard(clock, usage, None, tmp_path)
    view = View(handle=Task(clock))
    for _ in range(5):
        clock.now = guard.next_at(view)
        assert guard.turn(clock.now, view) is None
        assert guard.next_walk - clock.now == 0.5
    assert len(held) == 5


# --- the supervisor -----------------------------------------------------------------------------


class Told:
    def __init__(self) -> None:
        self.since: list[float | None] = []
        self.ended: list[dict[str, Any]] = []
        self.kept: list[float] = []
        self.frozen: list[float | None] = []

    def paused(self, since: float | None) -> None:
        self.since.append(since)

    def pause_ended(self, entry: dict[str, Any]) -> None:
        self.ended.append(entry)

    def keep_paused(self, seconds: float, frozen_since: float | None = None) -> None:
        self.kept.append(seconds)
        self.frozen.append(frozen_since)


class Scripted:
    """A guard that asks, at given times since its start, what its script says."""

    def __init__(self, clock: FakeClock, script: list[tuple[float, Action]]) -> None:
        self.t0, self.script = clock.now, list(script)

    def turn(self, now: float, task: Running) -> Action | None:
        if self.script and now >= self.t0 + self.script[0][0]:
            return self.script.pop(0)[1]
        return None

    def next_at(self, task: Running) -> float:
        return self.t0 + self.script[0][0] if self.script else math.inf


def supervise(
    task: Task, clock: FakeClock, *guards: Guard, before: float = 0.0
) -> tuple[End | None, Supervisor, Told]:
    told = Told()
    supervisor = Supervisor(task, guards, clock, threading.Event(), told, 9.0, before)
    return supervisor.run(), supervisor, told


def test_the_supervisor_pauses_and_resumes_the_task_and_keeps_each_pause() -> None:
    clock = FakeClock()
    task, t0 = Task(clock, work=10.0), clock.now
    script = Scripted(clock, [(2.0, Pause("the owner is here")), (7.0, Resume())])
    ended, supervisor, told = supervise(task, clock, script, before=3.0)
    assert ended is None and task.calls == ["suspend", "resume"] and task.done >= 10.0
    assert told.since == [t0 + 2.0, None] and told.kept == [3.0 + 5.0]
    assert [(p["seconds"], p["why"]) for p in told.ended] == [(5.0, "the owner is here")]
    assert supervisor.paused_total(clock.now) == 5.0 and supervisor.pause_count == 1


def test_the_first_guard_to_end_the_task_says_why_and_the_task_is_stopped_with_its_grace() -> None:
    clock = FakeClock()
    task = Task(clock)
    first = Scripted(clock, [(4.0, End(AttemptLapsed("over its bandwidth"), 2.0))])
    later = Scripted(clock, [(4.0, End(AttemptFailed("never reached"), 0.0))])
    ended, _, _ = supervise(task, clock, first, later)
    assert ended is not None and str(ended.why) == "over its bandwidth" and ended.fault == "node"
    assert task.calls == ["terminate 2"]


def test_a_task_that_cannot_be_paused_is_stopped_as_the_owners_word_wins() -> None:
    clock = FakeClock()
    task = Task(clock, refuse=True)
    ended, _, told = supervise(task, clock, Scripted(clock, [(1.0, Pause("on battery"))]))
    assert ended is not None and isinstance(ended.why, Stopped) and ended.fault == "owner"
    assert "cannot freeze it, while asked to suspend it (on battery)" in str(ended.why)
    assert task.calls == ["terminate 9"] and told.since == []


def test_a_task_let_go_of_while_paused_keeps_its_time_paused_and_is_not_stopped() -> None:
    clock = FakeClock()
    task = Task(clock)
    script = [(1.0, Pause("heat")), (4.0, End(Detached()))]
    ended, supervisor, told = supervise(task, clock, Scripted(clock, script), before=2.0)
    assert ended is not None and isinstance(ended.why, Detached)
    assert task.calls == ["suspend"] and told.kept == [2.0 + 3.0]
    supervisor.finish(clock.now)
    assert [p["why"] for p in told.ended] == ["heat"]


# --- a new guard, beside a real attempt ---------------------------------------------------------


class SlowRunner(FakeRunner):
    """Its task needs 20 s of running time."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.handle: Task | None = None

    def start(self, plan: TaskPlan) -> Handle:
        plan.record({"fake": True})
        plan.workspace.task_uid = os.geteuid()
        (plan.workspace.out / "metrics.json").write_text(json.dumps({"ok": 1}))
        self.handle = Task(self.clock, work=20.0)
        return self.handle


class Quota:
    """A rule the agent never had: paused from 2 s to 5 s of the task's life, ended at 8 s."""

    def __init__(self, beside: Beside) -> None:
        self.t0, self.clock = beside.started, beside.clock
        assert beside.lease.task_id and beside.settings.runner

    def turn(self, now: float, task: Running) -> Action | None:
        if now >= self.t0 + 8.0:
            return End(AttemptLapsed("over its quota: not the task's fault"), 0.5)
        if self.t0 + 2.0 <= now < self.t0 + 5.0 and task.paused_since is None:
            return Pause("its quota refills")
        if now >= self.t0 + 5.0 and task.paused_since is not None:
            return Resume()
        return None

    def next_at(self, task: Running) -> float:
        now = self.clock.monotonic()
        return min(t for t in (self.t0 + 2.0, self.t0 + 5.0, self.t0 + 8.0, math.inf) if t > now)


@pytest.mark.parametrize("added", [True, False])
def test_a_guard_added_to_the_context_pauses_and_ends_a_running_task(
    tmp_path: Path, added: bool
) -> None:
    clock = FakeClock()
    runner = SlowRunner(clock)
    ctx = context(tmp_path, clock, FakeCoordinator(clock), runner)
    if added:
        ctx = ctx.__class__(**{**ctx.__dict__, "guards": (Quota,)})
    outcome = Attempt(ctx, lease(0, timeout_seconds=100)).run()
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    if not added:  # the control: without it, the task runs its 20 s and commits
        assert outcome is Outcome.COMMITTED and "pauses" not in entry
        return
    assert outcome is Outcome.LAPSED and entry["reason"] == "over its quota: not the task's fault"
    assert runner.handle is not None and runner.handle.calls == [
        "suspend",
        "resume",
        "terminate 0.5",
    ]
    [pause] = entry["pauses"]["list"]
    assert pause["why"] == "its quota refills" and pause["seconds"] == pytest.approx(3, abs=0.6)


def test_sampling_reads_at_its_interval_and_never_bursts_after_a_late_turn() -> None:
    taken: list[float] = []
    clock = FakeClock()
    guard = SamplingGuard(lambda: taken.append(clock.now), 1.0, clock.now)
    view = View()
    for at in (0.5, 1.0, 1.5, 2.0, 7.3, 7.4, 8.3):
        clock.now = 1000.0 + at
        assert guard.turn(clock.now, view) is None  # it never acts on the task
    assert [round(t - 1000.0, 1) for t in taken] == [1.0, 2.0, 7.3, 8.3]
    assert guard.next_at(view) == pytest.approx(1009.3)


def test_sampling_a_quiet_task_comes_twice_as_far_apart_each_time_until_it_is_busy() -> None:
    taken: list[float] = []
    quiet = [True]
    clock = FakeClock()
    guard = SamplingGuard(lambda: taken.append(clock.now), 1.0, clock.now, lambda: quiet[0])
    view = View()
    start = clock.now
    for _ in range(7):
        clock.now = guard.next_at(view)
        guard.turn(clock.now, view)
    assert [round(t - start) for t in taken] == [1, 3, 7, 15, 23, 31, 39]
    quiet[0] = False  # the reading at 47 s finds it busy: every second again
    for _ in range(3):
        clock.now = guard.next_at(view)
        guard.turn(clock.now, view)
    assert [round(t - start) for t in taken[-3:]] == [47, 48, 49]


def test_no_pause_outlasts_the_supervisors_bound_whichever_guard_holds_it() -> None:
    """A guard that pauses and never resumes (one the wiring added, say) cannot hold a task and
    its lease frozen for ever."""
    clock = FakeClock()
    task, t0 = Task(clock), clock.now
    told = Told()
    stuck = Scripted(clock, [(1.0, Pause("a rule that forgot its resume"))])
    supervisor = Supervisor(task, [stuck], clock, threading.Event(), told, 9.0, max_paused=30.0)
    ended = supervisor.run()
    assert ended is not None and isinstance(ended.why, Stopped) and ended.fault == "owner"
    assert "paused for longer than 30 s (a rule that forgot its resume)" in str(ended.why)
    assert clock.now == t0 + 31.0 and task.calls == ["suspend", "terminate 9"]


def test_a_runner_that_cannot_pause_has_a_pause_stop_its_task_and_no_frozen_walk(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    task = Task(clock)
    told = Told()
    asked = Scripted(clock, [(1.0, Pause("the owner is here"))])
    supervisor = Supervisor(task, [asked], clock, threading.Event(), told, 9.0, can_pause=False)
    ended = supervisor.run()
    assert ended is not None and isinstance(ended.why, Stopped)
    assert "its runner cannot pause a task (the owner is here)" in str(ended.why)
    assert task.calls == ["terminate 9"]
    room = Space(free_bytes=1 << 40, total_bytes=1 << 41, free_inodes=10**6, total_inodes=10**7)
    usage = Usage(output_bytes=0, output_files=0, disk_bytes=10, disk_files=1)
    guard, _ = _disk_guard(clock, usage, room, tmp_path, first=Look(room, 10, 1))
    guard.can_freeze = False
    view = View(handle=Task(clock))
    guard.space = lambda: Space(0, 1 << 41, 10**6, 10**7)
    clock.now += 1.0
    guard.turn(clock.now, view)
    assert "suspend" not in view.handle.calls  # measured running


def test_a_restart_lets_go_of_a_task_only_where_its_runner_re_attaches_one() -> None:
    asks, view = Asking(detaching=True), View(handle=Task(FakeClock()))
    view.handle.detachable = True
    assert RestartGuard(asks, reattach=False).turn(0.0, view) is None  # the cancel ends it
    assert isinstance(RestartGuard(asks, reattach=True).turn(0.0, view), End)


def test_a_task_let_go_of_paused_keeps_when_it_was_frozen_for_the_next_agent() -> None:
    clock = FakeClock()
    task = Task(clock)
    told = Told()
    script = [(1.0, Pause("heat")), (4.0, End(Detached()))]
    Supervisor(task, [Scripted(clock, script)], clock, threading.Event(), told, 9.0).run()
    assert told.kept == [3.0] and told.frozen == [clock.wall()]
