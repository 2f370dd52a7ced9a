"""The node's workers (one per slot) over fakes and the fake clock: which slot an attempt gets,
the GPUs it takes at once, its ending handed to the loop, the owner's stop and suspension."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.attempt import AttemptContext, Outcome
from flashnode.config.schedule import Pause
from flashnode.coordinator.messages import GpuInfo
from flashnode.errors import Stopped
from flashnode.evidence.gpupool import Device, GpuPool
from flashnode.node.decision import Decision, Hold
from flashnode.node.workers import Workers, task_cpu


class Threads:
    """Attempt threads held until the test runs them."""

    def __init__(self) -> None:
        self.waiting: list[Callable[[], None]] = []

    def __call__(self, fn: Callable[[], None], name: str) -> None:
        if name.startswith("attempt-"):
            self.waiting.append(fn)

    def run_all(self) -> None:
        while self.waiting:
            self.waiting.pop(0)()


def setup(
    tmp_path: Path, gpus: int = 0, **settings: object
) -> tuple[Workers, AttemptContext, Threads, list[int]]:
    clock = FakeClock()
    threads = Threads()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner(), **settings)
    pool = GpuPool([Device(GpuInfo(index=i), str(i)) for i in range(gpus)])
    ctx = dataclasses.replace(ctx, start_thread=threads, gpus=pool)
    woken: list[int] = []
    return Workers(ctx, clock, lambda: woken.append(1)), ctx, threads, woken


def test_attempts_take_the_lowest_free_slot_and_none_is_left_when_all_run(tmp_path: Path) -> None:
    workers, ctx, threads, _ = setup(tmp_path, slots=2)
    s = ctx.settings
    assert workers.free_slot(s) == 0
    workers.start(lease(0), ctx)
    assert workers.free_slot(s) == 1 and workers.could_take(s)
    workers.start(lease(1), ctx)
    assert [a.record.slot for a in workers.attempts()] == [0, 1]
    assert workers.free_slot(s) is None and not workers.could_take(s)
    assert workers.leases() == {"ls-000000000000", "ls-000000000001"}
    threads.run_all()
    assert workers.running() == 0 and workers.free_slot(s) == 0


def test_the_gpus_a_lease_asks_for_are_held_from_its_start_so_the_next_claim_waits(
    tmp_path: Path,
) -> None:
    workers, ctx, threads, _ = setup(tmp_path, gpus=2, slots=2)
    workers.start(lease(0, gpus=2), ctx)
    assert ctx.gpus.free == 0
    assert workers.free_slot(ctx.settings) == 1 and not workers.could_take(ctx.settings)
    threads.run_all()
    assert ctx.gpus.free == 2


def test_a_lease_asking_for_no_gpus_or_nonsense_takes_none(tmp_path: Path) -> None:
    workers, ctx, _, _ = setup(tmp_path, gpus=1, slots=3)
    for n, want in enumerate((0, True, "1")):
        workers.start(lease(n, gpus=want), ctx)
    assert ctx.gpus.free == 1


def test_an_ending_is_counted_at_once_and_handed_to_the_loop_once(tmp_path: Path) -> None:
    workers, ctx, threads, woken = setup(tmp_path)
    workers.start(lease(0), ctx)
    assert workers.ended() == [] and workers.stats.started == 1
    threads.run_all()
    assert woken == [1, 1]  # settled (its slot free), then ended
    [ended] = workers.ended()
    assert ended.outcome is Outcome.COMMITTED and ended.attempt.lease_id == "ls-000000000000"
    assert workers.ended() == []
    assert workers.stats.outcomes == {"committed": 1}
    assert workers.last_ended is not None
    assert (workers.last_ended["task_id"], workers.last_ended["outcome"]) == (
        "task-000",
        "committed",
    )


def test_a_settled_attempt_frees_its_slot_for_the_next_claim_while_it_writes_its_records(
    tmp_path: Path,
) -> None:
    workers, ctx, threads, woken = setup(tmp_path)
    s = ctx.settings
    workers.start(lease(0), ctx)
    assert workers.free_slot(s) is None
    seen: list[tuple[int | None, int, int, list[str]]] = []
    append = ctx.ledger.append

    def recording(entry: dict[str, object]) -> None:  # the attempt's records, being written
        status = [a.snapshot()["lease_id"] for a in workers.attempts() if not a.settled]
        seen.append((workers.free_slot(s), workers.running(), len(woken), status))
        append(entry)

    ctx.ledger.append = recording  # type: ignore[method-assign]
    threads.run_all()
    # Its task ended and its commit was answered: the loop was woken to claim for the slot,
    # while the attempt still counts as running (a drain or a stop waits for its records).
    assert seen == [(0, 1, 1, [])]
    assert workers.running() == 0 and woken == [1, 1]


def test_gpus_found_after_the_start_add_no_slot(tmp_path: Path) -> None:
    workers, ctx, _, _ = setup(tmp_path, gpus=1, slots="auto")
    assert workers.slots(ctx.settings) == 1
    ctx.gpus.set_devices([Device(GpuInfo(index=i), str(i)) for i in range(3)])
    assert workers.slots(ctx.settings) == 1


def test_the_owners_stop_cancels_running_attempts_as_not_their_tasks_fault(
    tmp_path: Path,
) -> None:
    workers, ctx, _, _ = setup(tmp_path, slots=2)
    workers.start(lease(0), ctx)
    workers.start(lease(1), ctx)
    pause = Pause(mode="now")
    workers.obey(Decision(stop_reason="paused by the owner", paused=pause), grace=3.0)
    for attempt in workers.attempts():
        assert isinstance(attempt.cancelled, Stopped)
        assert str(attempt.cancelled) == "paused by the owner" and attempt.cancel_grace == 3.0


def test_a_suspending_hold_asks_every_running_task_to_suspend_and_its_end_to_resume(
    tmp_path: Path,
) -> None:
    workers, ctx, _, _ = setup(tmp_path, slots=2)
    workers.start(lease(0), ctx)
    workers.start(lease(1), ctx)
    hold = Hold("battery", "on battery", suspends=True)
    workers.obey(Decision(holds=(hold,)), grace=0.0)
    assert [a.suspend_reason for a in workers.attempts()] == ["on battery", "on battery"]
    assert all(a.cancelled is None for a in workers.attempts())
    workers.obey(Decision(), grace=0.0)
    assert [a.suspend_reason for a in workers.attempts()] == [None, None]


def test_waiting_for_all_gives_up_at_the_deadline_and_says_how_many_run_on(
    tmp_path: Path,
) -> None:
    import threading

    workers, ctx, threads, _ = setup(tmp_path)
    workers.start(lease(0), ctx)
    ticks: list[float] = []
    clock = ctx.clock
    late = workers.wait_all(clock.monotonic() + 5, threading.Event(), lambda: ticks.append(1))
    assert late == 1 and 9 <= len(ticks) <= 11  # a tick about every half second
    threads.run_all()
    assert workers.wait_all(clock.monotonic() + 5, threading.Event(), lambda: None) == 0


class Task:
    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def cpu_seconds(self) -> float | None:
        return self.seconds


def test_task_cpu_is_none_when_one_running_task_cannot_be_measured() -> None:
    assert task_cpu([(1, Task(2.5)), (2, Task(0.5))]) == {"1": 2.5, "2": 0.5}
    assert task_cpu([(1, Task(2.5)), (2, Task(None))]) is None
    assert task_cpu([]) == {}


def test_a_slot_the_runner_cannot_use_is_never_offered_a_claim(tmp_path: Path) -> None:
    """A trusted slot whose task user another agent took (while a task of the agent's earlier
    run ran as it) takes no work: no claim is staged there only to lapse."""
    workers, ctx, _, _ = setup(tmp_path, slots=2)
    runner = ctx.runner
    assert isinstance(runner, FakeRunner)
    runner.slot_usable = lambda slot: slot != 0  # type: ignore[method-assign]
    assert workers.free_slot(ctx.settings) == 1
    workers.start(lease(0), ctx)
    assert [a.record.slot for a in workers.attempts()] == [1]
    assert workers.free_slot(ctx.settings) is None and not workers.could_take(ctx.settings)
