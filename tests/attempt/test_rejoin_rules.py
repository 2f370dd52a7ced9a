"""Letting go of a running task and rejoining it, against fakes and a fake clock: a stop leaves
the task running and its record for the next agent (no ledger line, no report); the next
agent's attempt commits it with its run counted from the task's own start; its lease is renewed
at once."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from fakes import FakeClock, FakeCoordinator, FakeHandle, FakeRunner, context, lease

from flashnode.attempt import Attempt, Outcome
from flashnode.attempt.keeper import LeaseKeeper
from flashnode.attempt.record import State
from flashnode.coordinator.lease import parse_lease
from flashnode.errors import LeaseLost, Stopped
from flashnode.runners.base import Handle, RunResult
from flashnode.runners.plan import TaskPlan


class LettingGo(FakeHandle):
    """A task that needs ``work`` seconds to finish; ``stop_at`` seconds in, the agent stops
    (the attempt is told to let go of it, as a SIGTERM does)."""

    def __init__(self, clock: FakeClock, work: float, stop_at: float | None, attempt: Attempt):
        super().__init__(0)
        self.clock, self.work, self.stop_at, self.attempt = clock, work, stop_at, attempt
        self.t0 = clock.now
        self.detached = self.terminated = False

    def exited(self) -> bool:
        if self.stop_at is not None and self.clock.now - self.t0 >= self.stop_at:
            self.stop_at = None
            self.attempt.detach(1.0)
        return self.terminated or self.clock.now - self.t0 >= self.work

    def detach(self) -> bool:
        self.detached = True
        return True

    def terminate(self, grace: float) -> None:
        self.terminated = True

    def result(self) -> RunResult:
        return RunResult(exit_code=None, signal=15) if self.terminated else RunResult(0)


class LettingGoRunner(FakeRunner):
    def __init__(self, clock: FakeClock, work: float, stop_at: float | None) -> None:
        super().__init__()
        self.clock, self.work, self.stop_at = clock, work, stop_at
        self.attempt: Attempt | None = None
        self.handle: LettingGo | None = None

    def start(self, plan: TaskPlan) -> Handle:
        assert self.attempt is not None
        plan.record({"fake": True})
        plan.workspace.task_uid = os.geteuid()
        (plan.workspace.out / "metrics.json").write_text(json.dumps({"ok": 1}))
        self.handle = LettingGo(self.clock, self.work, self.stop_at, self.attempt)
        return self.handle


class Heartbeats:
    """Attempt heartbeats answered from a script (None: renewed), their times kept."""

    def __init__(self, clock: FakeClock, answers: list[Exception | None]) -> None:
        self.clock, self.answers, self.times = clock, answers, []  # type: list[float]

    def attempt_heartbeat(self, lease_id: str) -> None:
        self.times.append(self.clock.now)
        answer = self.answers.pop(0) if self.answers else LeaseLost("gone", 410)
        if answer is not None:
            raise answer


def test_a_stopped_agent_leaves_its_task_running_and_its_record_for_the_next_agent(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = LettingGoRunner(clock, work=60, stop_at=5)
    ctx = context(tmp_path, clock, coord, runner)
    attempt = runner.attempt = Attempt(ctx, lease(0))
    assert attempt.run() is Outcome.DETACHED
    handle = runner.handle
    assert handle is not None and handle.detached and not handle.terminated
    assert not (tmp_path / "ledger.jsonl").exists()  # it has not ended: no ledger line
    assert [c[1] for c in coord.calls if c[1] in ("fail", "complete")] == []
    record = ctx.outbox.read(attempt.lease_id)
    assert record is not None and record.state is State.RUNNING and record.process
    assert record.task_started_at is not None
    assert (ctx.settings.state_dir / "attempts" / attempt.lease_id).is_dir()


def test_the_next_agent_commits_the_rejoined_task_counting_its_run_from_its_start(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = LettingGoRunner(clock, work=60, stop_at=20)
    ctx = context(tmp_path, clock, coord, runner)
    first = runner.attempt = Attempt(ctx, lease(0))
    assert first.run() is Outcome.DETACHED
    task = runner.handle
    assert task is not None
    clock.now += 5  # the restart
    record = ctx.outbox.read(first.lease_id)
    assert record is not None
    again = Attempt(ctx, record.lease, record.slot, record=record)
    task.attempt = again
    assert again.rejoin(task) is Outcome.COMMITTED
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    assert entry["outcome"] == "committed"
    # 60 s of work: 20 s before the stop, 5 s away (the task ran on), the rest rejoined.
    assert entry["evidence"]["wall_seconds"] >= 60
    assert [c[1] for c in coord.calls].count("complete") == 1
    assert ctx.outbox.read(first.lease_id) is None


def test_a_rejoined_lease_is_renewed_at_once_then_every_third_of_its_window() -> None:
    clock = FakeClock()
    hb = Heartbeats(clock, [None, None, LeaseLost("lease is no longer live", 410)])
    data = lease()
    data["lease_seconds"] = 60
    lost = threading.Event()
    keeper = LeaseKeeper(hb, parse_lease(data), clock, lost.set, renew_now=True)  # type: ignore[arg-type]
    start = clock.now
    keeper.run()
    assert [t - start for t in hb.times] == [0, 20, 40]


def test_a_rejoined_attempt_that_ends_before_watching_its_task_ends_the_task(
    tmp_path: Path,
) -> None:
    """Whatever ends a rejoined attempt early (its lease lost at the first renewal, the owner's
    pause at the first turn) ends its task too: nothing is left running without its attempt."""
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = LettingGoRunner(clock, work=60, stop_at=5)
    ctx = context(tmp_path, clock, coord, runner)
    first = runner.attempt = Attempt(ctx, lease(0))
    assert first.run() is Outcome.DETACHED
    task = runner.handle
    assert task is not None
    record = ctx.outbox.read(first.lease_id)
    assert record is not None
    again = Attempt(ctx, record.lease, record.slot, record=record)
    task.attempt = again
    again.cancel(Stopped("paused by the owner"), 0.0)
    assert again.rejoin(task) is Outcome.LAPSED
    assert task.terminated


class Freezing(LettingGo):
    """Runs only while not frozen; paused by the owner ``pause_at`` seconds in."""

    def __init__(self, clock: FakeClock, work: float, stop_at: float, attempt: Attempt):
        super().__init__(clock, work, stop_at, attempt)
        self.done, self.last, self.frozen = 0.0, clock.now, False
        self.pause_at: float | None = 10.0

    def _advance(self) -> None:
        if not self.frozen:
            self.done += self.clock.now - self.last
        self.last = self.clock.now

    def exited(self) -> bool:
        self._advance()
        if self.pause_at is not None and self.clock.now - self.t0 >= self.pause_at:
            self.pause_at = None
            self.attempt.request_suspension("the owner is here")
        if self.stop_at is not None and self.clock.now - self.t0 >= self.stop_at:
            self.stop_at = None
            self.attempt.detach(1.0)
        return self.terminated or self.done >= self.work

    def suspend(self) -> None:
        self._advance()
        self.frozen = True

    def resume(self) -> None:
        self._advance()
        self.frozen = False


def test_a_task_let_go_of_paused_is_not_charged_the_time_it_stayed_frozen(
    tmp_path: Path,
) -> None:
    """Paused by its owner 10 s in, let go of 10 s later (the agent stops), frozen while no agent
    runs (30 s), thawed by the next agent's rejoin: 40 s frozen in all, none of it its running
    time nor against its timeout."""
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = LettingGoRunner(clock, work=60, stop_at=20)
    ctx = context(tmp_path, clock, coord, runner)
    first = runner.attempt = Attempt(ctx, lease(0, timeout_seconds=90))
    task = Freezing(clock, 60, 20, first)
    start = runner.start

    def freezing(plan: TaskPlan) -> Handle:
        start(plan)
        return task

    runner.start = freezing  # type: ignore[method-assign]
    assert first.run() is Outcome.DETACHED and task.frozen
    clock.now += 30  # no agent: the task stays frozen
    record = ctx.outbox.read(first.lease_id)
    assert record is not None and "frozen_at" in record.timings
    task.resume()  # the runner's rejoin thaws it
    again = Attempt(ctx, record.lease, record.slot, record=record)
    task.attempt = again
    assert again.rejoin(task) is Outcome.COMMITTED  # within its 90 s timeout: 60 s of work
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    assert entry["evidence"]["wall_seconds"] == pytest.approx(60, abs=1.5)
    assert entry["timings"]["suspended"] == pytest.approx(40, abs=1.5)
    assert "frozen_at" not in entry["timings"]
