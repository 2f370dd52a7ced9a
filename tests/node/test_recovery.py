"""What an earlier run of the agent left, dealt with before the first claim, over fakes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.attempt import Outcome
from flashnode.attempt.record import AttemptRecord, State
from flashnode.node.recovery import recover


class ReapFails(FakeRunner):
    def reap(self, process: dict[str, Any]) -> None:
        if process.get("pid") == 666:
            raise RuntimeError("cannot reap")


def test_unfinished_attempts_and_stray_workspaces_lapse_with_a_ledger_line_each(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner())
    ctx.outbox.write(AttemptRecord(lease=lease(0), state=State.RUNNING))
    (tmp_path / "attempts" / "ls-000000000000").mkdir(parents=True)
    (tmp_path / "attempts" / "ls-000000000007").mkdir()  # a crash before its record
    (tmp_path / "attempts" / ".ls-000000000008.retired").mkdir()  # an ended attempt's
    counted: list[Outcome] = []
    recover(ctx, counted.append)
    assert counted == [Outcome.LAPSED, Outcome.LAPSED]
    lines = [(r["lease_id"], r["outcome"], r["reason"]) for r in ctx.ledger.records()]
    assert lines == [
        ("ls-000000000000", "lapsed", "agent restarted"),
        ("ls-000000000007", "lapsed", "agent restarted before the task started"),
    ]
    assert ctx.outbox.leases() == [] and list((tmp_path / "attempts").iterdir()) == []
    assert "fail" not in [c[1] for c in ctx.coordinator.calls]  # not the tasks' fault


def test_one_leftover_that_cannot_be_recovered_is_dropped_and_the_others_still_are(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), ReapFails())
    ctx.outbox.write(AttemptRecord(lease=lease(0), state=State.RUNNING, process={"pid": 666}))
    clock.now += 1  # the outbox recovers oldest first
    ctx.outbox.write(AttemptRecord(lease=lease(1), state=State.RUNNING, process={"pid": 7}))
    (ctx.outbox.dir / "ls-000000000002.json").write_text("not a record")
    counted: list[Outcome] = []
    recover(ctx, counted.append)
    assert counted == [Outcome.LAPSED]
    assert [r["lease_id"] for r in ctx.ledger.records()] == ["ls-000000000001"]
    assert ctx.outbox.leases() == []
