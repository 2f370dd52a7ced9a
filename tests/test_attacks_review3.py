"""Attacks on the change of 69ddce4..HEAD (what a task printed moved out of status.json and the
ledger into status-owner.json and the kept logs). Each test is one attack; each FAILS while the
hole it demonstrates is open; those left open are marked ``xfail(strict=True)`` with why."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
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

from flashnode import statefile
from flashnode.attempt import Attempt, Outcome
from flashnode.node.publisher import Publisher
from flashnode.owner import status
from flashnode.owner.ledger import Ledger
from flashnode.sandbox import logcap
from flashnode.sandbox.procs.helpers import json_schema_problem

SECRET = "API_KEY=sk-hostile-0123456789"  # what a task printed / wrote: the owner's alone






TASK = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "phase": "execute"}


# --- 1. the group still reads what a task put in a reason -------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="lines an older agent wrote stay in ledger.jsonl (and .1) until rotated out; `history`"
    " no longer shows them, but the file is still the group's: scrubbing it would move the"
    " offsets the ledger view keeps",
)
def test_an_upgraded_nodes_ledger_still_hands_the_group_the_stderr_an_older_agent_quoted(
    tmp_path: Path,
) -> None:
    """The ledger was 0640 group flashnode before this change too, with each failure's stderr
    lines in its reason. The change strips them from new lines only: the lines already there
    (and ledger.jsonl.1) stay the group's to read, and `flashnode history` prints them raw (only
    the console strips on read)."""
    path = tmp_path / "ledger.jsonl"
    old = {"lease_id": "ls-0", "outcome": "failed", "reason": f"exit code 3: {SECRET}"}
    path.write_text(json.dumps(old) + "\n")  # as the agent before the upgrade appended it
    ledger = Ledger.shared(path)  # the upgraded agent starts
    ledger.append({"lease_id": "ls-1", "outcome": "committed", "reason": ""})
    seen = view_only_reads(path)
    assert seen is None or SECRET not in seen


@pytest.mark.xfail(
    strict=True,
    reason="reasons other than an exit verdict (a schema check, an output's name, a build's"
    " stderr) quote what the task wrote whole: it needs a field of its own, not a pattern",
)
def test_a_value_a_task_wrote_in_metrics_json_reaches_the_group_through_the_schema_reason(
    tmp_path: Path,
) -> None:
    """A job declaring a json_schema: the node's check quotes the offending value of the task's
    metrics.json ("'<value>' is not of type 'number'"). That reason is not an exit verdict, so
    ``without_output`` leaves it whole: into the ledger and status.json (group flashnode's).
    (Output file names quoted by outputs.py and a build's stderr quoted by envbuild's reason
    take the same way.)"""
    clock = FakeClock()
    runner = FakeRunner(metrics={"loss": SECRET})
    ctx = context(tmp_path, clock, FakeCoordinator(clock), runner)
    ctx = dataclasses.replace(
        ctx, ledger=Ledger.shared(tmp_path / "ledger.jsonl"), schema_check=json_schema_problem
    )
    schema = {"type": "object", "properties": {"loss": {"type": "number"}}}
    attempt = Attempt(ctx, lease(0, validators={"json_schema": schema}))
    assert attempt.run() is Outcome.FAILED
    reason = attempt.ended[1] if attempt.ended else ""
    assert SECRET in reason  # the attack took: the task's own value is in its reason
    seen = view_only_reads(tmp_path / "ledger.jsonl")
    assert seen is None or SECRET not in seen
    last = {"lease_id": "ls-0", "job_id": "j1", "task_id": "t", "outcome": "failed"}
    Publisher(clock, sink=QuietSink()).publish(
        node_view(tmp_path, counters={}, last_ended={**last, "reason": reason})
    )
    seen = view_only_reads(tmp_path / status.STATUS_FILE)
    assert seen is None or SECRET not in seen


# --- 2. the owner loses or is misinformed ------------------------------------------------------


def test_on_a_full_disk_the_owner_loses_the_running_tasks_last_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status.json is padded so that, on a full disk, it is written in place and still says
    what runs. status-owner.json has no such room: its write fails quietly, status.json moves on
    to a new updated_at, and the owner's `flashnode status` shows `last output  -` (as if the
    task printed nothing) while the task prints on: before the change it showed the line."""
    clock = FakeClock()
    publisher = Publisher(clock, QuietSink())
    publisher.publish(node_view(tmp_path, counters={}, running=({**TASK, "last_output": "a"},)))
    real = statefile.write

    def full(path: Path, data: bytes, *args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(statefile, "write", full)
    clock.sleep(60)  # a heartbeat period on
    running = ({**TASK, "last_output": "epoch 7 loss 0.12"},)
    publisher.publish(node_view(tmp_path, counters={}, running=running, beats=1))
    monkeypatch.setattr(statefile, "write", real)
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())
    read = status.read(tmp_path)
    assert read is not None and read["updated_at"] == 1.7e9 + clock.now  # the new one, in place
    shown = status.render(read, None, read["updated_at"])
    assert "last output  epoch 7 loss 0.12" in shown, shown


def test_a_status_read_racing_a_publish_drops_the_last_line_for_the_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status.read` reads status.json, then status-owner.json; a publish in between (the agent
    writes up to ten a second on news) leaves the two with different updated_at, and the owner
    is shown no last line at all (nor told why): the read is not retried as a torn status.json
    is."""
    clock = FakeClock()
    publisher = Publisher(clock, QuietSink())
    publisher.publish(node_view(tmp_path, counters={}, running=({**TASK, "last_output": "a"},)))
    raced: list[bool] = []

    def alive(pid: int) -> bool:  # called between the two reads
        if not raced:
            raced.append(True)
            clock.sleep(60)
            running = ({**TASK, "last_output": "b"},)
            publisher.publish(node_view(tmp_path, counters={}, running=running, beats=1))
        return pid == os.getpid()

    monkeypatch.setattr(status, "agent_alive", alive)
    read = status.read(tmp_path)
    assert raced and read is not None
    assert read["running"][0].get("last_output") in ("a", "b"), read["running"][0]


def test_with_keep_logs_0_the_ledger_points_the_owner_at_logs_that_were_never_kept(
    tmp_path: Path,
) -> None:
    """The ledger keeps a failure's reason without its stderr lines, "they are in the kept logs:
    flashnode logs LEASE". With keep_logs = 0 (allowed: ge=0) nothing is kept, so the lines are
    gone from the node for good and the pointer leads nowhere (and so after keep_logs later
    attempts rotate them out). Before the change the owner's ledger had them."""
    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner(code=3), keep_logs=0)
    data = lease(0)
    assert Attempt(ctx, data).run() is Outcome.FAILED
    [line] = ctx.ledger.records()
    reason = str(line["reason"])
    if "flashnode logs" in reason:
        assert logcap.find(tmp_path, data["lease_id"]) is not None, reason
    else:
        assert "not kept, keep_logs = 0" in reason, reason  # says so, points nowhere


def test_a_payload_string_shaped_like_an_exit_verdict_cuts_the_owners_reason(
    tmp_path: Path,
) -> None:
    """``without_output`` looks for "exit code N: " anywhere in a reason, not where
    ``_verdict`` puts it (its start). A lease payload quoted in a refusal (a module name, an env
    name, an output file's name) that holds it makes the ledger keep only what comes before,
    and claim there were task lines to read with `flashnode logs`: the owner never learns why
    the attempt failed (no task ran, nothing is kept)."""
    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner())
    data = lease(0, argv=None, module="exit code 0: nothing to see")
    assert Attempt(ctx, data).run() is Outcome.FAILED
    [line] = ctx.ledger.records()
    assert "is not on this node's allowlist" in str(line["reason"]), line["reason"]


class _NamingRunner(FakeRunner):
    """A task that leaves an output whose very name is what it wants shown (a symlink)."""

    def start(self, plan: Any) -> Any:
        handle = super().start(plan)
        os.symlink("/etc/hostname", plan.workspace.out / SECRET)
        return handle


@pytest.mark.xfail(
    strict=True,
    reason="reasons other than an exit verdict quote what the task wrote whole (see above)",
)
def test_an_output_name_the_task_chose_reaches_the_group_through_the_ledger(
    tmp_path: Path,
) -> None:
    """outputs.py quotes the offending file's name in the reason ("out/<name> is a symlink"):
    the task's own text, kept whole in the ledger the group reads."""
    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), _NamingRunner())
    ctx = dataclasses.replace(ctx, ledger=Ledger.shared(tmp_path / "ledger.jsonl"))
    assert Attempt(ctx, lease(0)).run() is Outcome.FAILED
    seen = view_only_reads(tmp_path / "ledger.jsonl")
    assert seen is None or SECRET not in seen
