"""Suspension of a running task by the owner's controls, against fakes and a fake clock: time
suspended does not count against the timeout, a suspension longer than allowed gives the lease
back (never ``fail``), and a task that cannot be suspended is ended the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeCoordinator, context, lease

from flashnode.attempt import Attempt, Outcome
from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.runners.base import Handle, Runner, RunnerEnv, RunResult, SuspendFailed
from flashnode.runners.findings import Finding
from flashnode.runners.plan import TaskPlan


class WorkingHandle:
    """A task that needs ``work`` seconds of running (not suspended) time to finish; a script
    of (time since start, suspend reason or None[, its source]) plays the owner's controls (and
    the courtesy's sources)."""

    def __init__(
        self,
        clock: FakeClock,
        work: float,
        script: list[tuple[Any, ...]],
        attempt: Attempt,
        refuse: bool,
    ) -> None:
        self.clock, self.work, self.script, self.attempt = clock, work, list(script), attempt
        self.refuse = refuse
        self.t0 = self.last = clock.now
        self.done = 0.0
        self.suspended = False
        self.terminated = False
        self.calls: list[tuple[float, str]] = []

    def _advance(self) -> None:
        now = self.clock.now
        if not self.suspended and not self.terminated:
            self.done += now - self.last
        self.last = now
        while self.script and now - self.t0 >= self.script[0][0]:
            _, reason, *source = self.script.pop(0)
            self.attempt.request_suspension(reason, *source)

    def exited(self) -> bool:
        self._advance()
        return self.terminated or self.done >= self.work

    def terminate(self, grace: float) -> None:
        self._advance()
        self.calls.append((self.clock.now - self.t0, "terminate"))
        self.suspended, self.terminated = False, True

    def suspend(self) -> None:
        self._advance()
        if self.refuse:
            raise SuspendFailed("cannot freeze the task's cgroup (Permission denied)")
        self.calls.append((self.clock.now - self.t0, "suspend"))
        self.suspended = True

    def resume(self) -> None:
        self._advance()
        self.calls.append((self.clock.now - self.t0, "resume"))
        self.suspended = False

    def result(self) -> RunResult:
        return RunResult(exit_code=None, signal=15) if self.terminated else RunResult(0)

    def pids(self) -> set[int]:
        return set()

    def cpu_seconds(self) -> float | None:
        return self.done

    def disk_bytes(self) -> int:
        return 0

    def lease_left(self, seconds: float) -> None:
        pass

    def last_output(self) -> str:
        return f"{self.done:.0f} s of work done"

    def detach(self) -> bool:
        return False


class WorkingRunner(Runner):
    name = "fake"

    def __init__(
        self,
        clock: FakeClock,
        work: float,
        script: list[tuple[Any, ...]],
        refuse: bool = False,
    ) -> None:
        self.clock, self.work, self.script, self.refuse = clock, work, script, refuse
        self.attempt: Attempt | None = None
        self.handle: WorkingHandle | None = None

    @classmethod
    def preflight(cls, settings: Settings, slots: int = 1) -> list[Finding]:
        return []

    @classmethod
    def create(cls, settings: Settings, env: RunnerEnv) -> WorkingRunner:
        raise NotImplementedError

    def check(self, task: Task, settings: Settings) -> None:
        pass

    def start(self, plan: TaskPlan) -> Handle:
        assert self.attempt is not None
        plan.record({"fake": True})
        plan.workspace.task_uid = os.geteuid()
        (plan.workspace.out / "metrics.json").write_text(json.dumps({"ok": 1}))
        self.handle = WorkingHandle(self.clock, self.work, self.script, self.attempt, self.refuse)
        return self.handle


def run(
    tmp_path: Path,
    work: float,
    script: list[tuple[Any, ...]],
    timeout: float,
    refuse: bool = False,
    **settings: Any,
) -> tuple[Outcome, Attempt, FakeCoordinator, WorkingHandle, dict[str, Any]]:
    clock = FakeClock()
    waits = [0]
    wait = clock.wait

    def counted(event: Any, timeout: float) -> bool:
        waits[0] += 1
        if waits[0] > 10_000:  # time stands still: a wait that spins
            raise AssertionError(f"the attempt's waits spin (the last for {timeout} s)")
        return wait(event, timeout)

    clock.wait = counted  # type: ignore[method-assign]
    coord = FakeCoordinator(clock)
    runner = WorkingRunner(clock, work, script, refuse)
    ctx = context(tmp_path, clock, coord, runner, **settings)
    attempt = runner.attempt = Attempt(ctx, lease(0, timeout_seconds=timeout))
    outcome = attempt.run()
    assert runner.handle is not None
    entry = json.loads((tmp_path / "ledger.jsonl").read_text().splitlines()[-1])
    entry["waits"] = waits[0]
    return outcome, attempt, coord, runner.handle, entry


def names(coord: FakeCoordinator) -> list[str]:
    return [c[1] for c in coord.calls]


def test_time_suspended_does_not_count_against_the_timeout(tmp_path: Path) -> None:
    # 8 s of work under a 10 s timeout, suspended from 2 s to 22 s: it finishes at 28 s.
    outcome, attempt, coord, handle, entry = run(
        tmp_path, work=8, script=[(2, "the owner is at the machine"), (22, None)], timeout=10
    )
    assert outcome is Outcome.COMMITTED, entry
    assert [what for _, what in handle.calls] == ["suspend", "resume"]
    (suspended_at, _), (resumed_at, _) = handle.calls
    assert suspended_at == pytest.approx(2, abs=0.51) and resumed_at == pytest.approx(22, abs=0.51)
    assert entry["timings"]["suspended"] == pytest.approx(20, abs=1.01)
    assert entry["evidence"]["wall_seconds"] == pytest.approx(8, abs=1.01)  # its running time
    [pause] = entry["pauses"]["list"]
    assert pause["why"] == "the owner is at the machine"
    assert pause["seconds"] == pytest.approx(20, abs=1.01)
    # The task's own CPU figure is over the time it could run, not over the suspension.
    assert entry["task_usage"]["cpu_percent_mean"] == pytest.approx(100, abs=15)
    assert "fail" not in names(coord) and attempt.suspended_since is None


def test_without_suspension_the_same_task_times_out(tmp_path: Path) -> None:
    """The control for the test above: the timeout does fire when nothing is suspended."""
    outcome, _, coord, _, entry = run(tmp_path, work=12, script=[], timeout=10)
    assert outcome is Outcome.FAILED and "timed out after 10 s" in entry["reason"]
    assert "fail" in names(coord)


@pytest.mark.parametrize(("max_suspend", "expected"), [(5.0, 5.0), (None, 60.0)])
def test_a_suspension_longer_than_allowed_gives_the_lease_back_without_fail(
    tmp_path: Path, max_suspend: float | None, expected: float
) -> None:
    """``max_suspend_seconds``, by default the lease's window (60 s in these leases)."""
    outcome, attempt, coord, handle, entry = run(
        tmp_path,
        work=100,
        script=[(1, "outside run_windows (next opens Mon 19:00)")],
        timeout=1000,
        max_suspend_seconds=max_suspend,
    )
    assert outcome is Outcome.LAPSED
    assert f"suspended for longer than {expected:g} s" in entry["reason"]
    assert "outside run_windows" in entry["reason"]
    assert "fail" not in names(coord) and "complete" not in names(coord)
    (_, first), (ended_at, last) = handle.calls[0], handle.calls[-1]
    assert (first, last) == ("suspend", "terminate")
    assert ended_at == pytest.approx(1 + expected, abs=0.6)
    assert attempt.record.state.value == "running"  # nothing spooled: the result is not kept
    assert not (tmp_path / "outbox" / f"{entry['lease_id']}.json").exists()


def test_a_task_that_cannot_be_suspended_is_ended_without_fail(tmp_path: Path) -> None:
    outcome, _, coord, handle, entry = run(
        tmp_path, work=100, script=[(1, "on battery")], timeout=1000, refuse=True
    )
    assert outcome is Outcome.LAPSED
    assert "cannot freeze the task's cgroup" in entry["reason"]
    assert "fail" not in names(coord)
    assert handle.terminated and handle.calls[-1][0] == pytest.approx(1, abs=0.51)


# --- the courtesy's sources ---------------------------------------------------------------


def test_a_pause_for_the_owners_gpu_use_past_the_tasks_deadline_waits_without_spinning(
    tmp_path: Path,
) -> None:
    # 8 s of work under a 10 s timeout; the owner uses its GPU from 5 s to 40 s: longer than
    # max_suspend_seconds, which does not bound that pause (gpu_yield_stop_seconds does).
    outcome, _, _, handle, entry = run(
        tmp_path,
        work=8,
        script=[(5, "the owner uses GPU 0: game (pid 9)", "gpu"), (40, None, "gpu")],
        timeout=10,
        max_suspend_seconds=5,
    )
    assert outcome is Outcome.COMMITTED, entry
    assert [what for _, what in handle.calls] == ["suspend", "resume"]
    assert entry["evidence"]["wall_seconds"] == pytest.approx(8, abs=1.01)
    assert entry["waits"] < 200  # a wait per watch of its files, not a spin past the deadline


def test_each_source_bounds_its_own_time_suspended(tmp_path: Path) -> None:
    # Paused for the owner's use from 1 s; heat joins at 50 s: max_suspend_seconds counts from
    # then, not from the pause's start.
    outcome, _, coord, handle, entry = run(
        tmp_path,
        work=100,
        script=[(1, "the owner uses GPU 0", "gpu"), (50, "GPU 0 at 90 °C", "heat")],
        timeout=1000,
        max_suspend_seconds=5,
    )
    assert outcome is Outcome.LAPSED and "fail" not in names(coord)
    assert handle.calls[-1][1] == "terminate"
    assert handle.calls[-1][0] == pytest.approx(55, abs=0.6)
    assert "GPU 0 at 90 °C" in entry["reason"] and "the lease lapses" in entry["reason"]


def test_a_pause_for_the_owners_gpu_use_is_bounded_even_if_the_courtesy_never_stops_it(
    tmp_path: Path,
) -> None:
    outcome, _, coord, handle, entry = run(
        tmp_path,
        work=100,
        script=[(1, "the owner uses GPU 0", "gpu")],
        timeout=1000,
        max_suspend_seconds=5,
        gpu_yield_stop_seconds=20,
    )
    assert outcome is Outcome.LAPSED and "fail" not in names(coord)
    assert handle.calls[-1][0] == pytest.approx(26, abs=0.6)
    assert "suspended for longer than 25 s" in entry["reason"]
