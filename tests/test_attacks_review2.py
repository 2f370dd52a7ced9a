"""Attacks on the change of c566fe8..HEAD (the trivial-task cycle, the console's output hiding,
the lease keeper's last try, the status file's timing). Each test is one attack, and failed
while the hole it demonstrates was open."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fakes import (
    FakeClock,
    FakeCoordinator,
    FakeRunner,
    QuietSink,
    context,
    lease,
    node_view,
    view_only_reads,
)

from flashnode.node.decision import Decision
from flashnode.node.publisher import Publisher
from flashnode.node.workers import Workers
from flashnode.owner import status
from flashnode.owner.ledger import Ledger
from flashnode.owner.status import without_output

SECRET = "API_KEY=sk-hostile-0123456789"  # what a task printed: the owner's alone, says b78eb92






def test_a_view_only_member_reads_no_task_output_in_status_json(tmp_path: Path) -> None:
    task = {
        "lease_id": "ls-1",
        "job_id": "j",
        "task_id": "t",
        "phase": "execute",
        "last_output": SECRET,  # Attempt.snapshot(): handle.last_output()
    }
    view = node_view(
        tmp_path,
        counters={},
        running=(task,),
        last_ended={
            "lease_id": "ls-0",
            "outcome": "failed",
            "reason": f"exit code 1: {SECRET}",  # Workers._last: the failure's stderr lines
        },
    )
    publisher = Publisher(FakeClock(), sink=QuietSink())
    publisher.publish(view)
    seen = view_only_reads(tmp_path / status.STATUS_FILE)
    assert seen is None or SECRET not in seen


def test_a_view_only_member_reads_no_task_output_in_the_ledger(tmp_path: Path) -> None:
    reason = f"exit code 3: {SECRET}"
    assert SECRET not in without_output(reason)  # what the console shows that level
    ledger = Ledger.shared(tmp_path / "ledger.jsonl")
    ledger.append({"lease_id": "ls-1", "outcome": "failed", "reason": reason})
    seen = view_only_reads(tmp_path / "ledger.jsonl")
    assert seen is None or SECRET not in seen


def test_running_metric_never_counts_a_settled_attempt_beside_the_next_task_of_its_slot(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    waiting: list = []

    def start_thread(fn, name: str) -> None:  # type: ignore[no-untyped-def]
        if name.startswith("attempt-"):
            waiting.append(fn)

    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner(), slots=1)
    ctx = dataclasses.replace(ctx, start_thread=start_thread)
    workers = Workers(ctx, clock, lambda: None)
    reported: list[tuple[int, int]] = []
    ctx.metrics.set_running = lambda running, suspended=0: reported.append(  # type: ignore
        (running, suspended)
    )
    append = ctx.ledger.append
    started_next = []

    def recording(entry: dict[str, object]) -> None:
        # The attempt settled: the loop claims the next task for its slot meanwhile, and the
        # owner controls' turn (every loop turn) reports what runs.
        if not started_next and workers.free_slot(ctx.settings) == 0:
            workers.start(lease(1), ctx)
            started_next.append(1)
            workers.obey(Decision(), 0.0)
        append(entry)

    ctx.ledger.append = recording  # type: ignore[method-assign]
    workers.start(lease(0), ctx)
    waiting.pop(0)()  # the first attempt runs to its end (the second waits)
    assert started_next, "the slot was not freed before the records (nothing to attack)"
    assert reported and max(r for r, _ in reported) <= workers.slots(ctx.settings), reported
