"""The status publisher: the status text and status.json from a frozen view of the node."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, node_view

from flashnode.clock import stamp
from flashnode.node.decision import Decision, Hold
from flashnode.node.publisher import NEWS_GAP_S, Publisher
from flashnode.node.session import Problem
from flashnode.owner import status


def written(state_dir: Path) -> dict[str, Any]:
    """status.json as the publisher wrote it (``status.read`` wants a live agent's pid)."""
    found: dict[str, Any] = json.loads((state_dir / status.STATUS_FILE).read_text())
    return found


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def status(self, text: str) -> None:
        self.lines.append(text)

    def send(self, **fields: str | int) -> None:
        pass

    def tick(self) -> None:
        pass


view = node_view


def test_the_text_says_what_holds_claiming_and_when_a_drain_stops_the_attempts(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    publisher = Publisher(clock)
    held = Decision(holds=(Hold("disk", "low disk: 1 GB free; claims resume above it"),))
    assert publisher.text(view(tmp_path), timed=True) == "idle"
    assert publisher.text(view(tmp_path, decision=held), timed=True) == (
        "idle | not claiming: low disk: 1 GB free; claims resume above it"
    )
    attempt = {"lease_id": "ls-1", "job_id": "j1", "task_id": "t1"}
    draining = view(
        tmp_path, draining=True, drain_deadline=clock.monotonic() + 60, running=(attempt,)
    )
    by = stamp(clock.wall() + 60)
    assert publisher.text(draining, timed=True) == (
        f"draining: 1 attempt(s) running, stopped by {by} at the latest (drain_seconds)"
    )


def test_failing_coordinator_conversations_are_shown_with_their_first_failure_and_last_error(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    publisher = Publisher(clock)
    since = clock.monotonic()
    clock.sleep(30)
    problems = (
        Problem("node heartbeat", since + 10, "timed out"),
        Problem("claim", since, "connection refused"),
    )
    failing = view(tmp_path, problems=problems)
    assert publisher.text(failing, timed=True) == (
        f"coordinator unreachable since {stamp(clock.wall() - 30)} (claim, node heartbeat)"
    )
    publisher.publish(failing)
    problems_shown = written(tmp_path)["coordinator_problems"]
    shown = [(p["conversation"], p["since"], p["error"]) for p in problems_shown]
    assert shown == [
        ("claim", clock.wall() - 30, "connection refused"),
        ("node heartbeat", clock.wall() - 20, "timed out"),
    ]


def test_status_json_is_written_when_something_changes_and_a_refused_reload_at_once(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    lines = Lines()
    publisher = Publisher(clock, lines, extra={"signals": {"pause": 10}}, totals=lambda: {"n": 1})
    publisher.publish(view(tmp_path))
    first = written(tmp_path)
    assert first["pid"] == os.getpid() and first["counters"] == {"committed": 2}
    assert first["signals"] == {"pause": 10} and first["totals"] == {"n": 1}
    clock.sleep(4)  # less than heartbeat_seconds (5)
    publisher.publish(view(tmp_path))  # nothing changed: the text line only
    same = written(tmp_path)
    assert same["updated_at"] == first["updated_at"]
    refused = {"at": clock.wall(), "reason": "changing runner needs a restart"}
    publisher.publish(view(tmp_path, reload_refused=refused))
    shown = written(tmp_path)
    assert shown["reload_refused"] == refused
    clock.sleep(5)
    publisher.publish(view(tmp_path, reload_refused=refused, beats=4))  # a heartbeat answered
    beat = written(tmp_path)
    assert beat["updated_at"] == clock.wall()
    publisher.publish(view(tmp_path, reload_refused=refused, beats=4), final=True)
    final = written(tmp_path)
    assert final["pid"] is None and final["state"] == "stopped"
    assert lines.lines == ["idle"] * 4 + ["stopped"]


def test_a_running_tasks_seconds_going_by_rewrite_status_json_only_each_heartbeat_period(
    tmp_path: Path,
) -> None:
    """The terminal line says the task's ages every turn; the file holds its times (its readers
    work the ages out), so it is rewritten for them no sooner than the heartbeat period."""
    clock = FakeClock()
    lines = Lines()
    publisher = Publisher(clock, lines)
    task = {
        "lease_id": "ls-1",
        "job_id": "j",
        "task_id": "t",
        "phase": "execute",
        "started_at": clock.wall(),
        "lease_expires_at": clock.wall() + 60,
    }
    running = view(tmp_path, running=(task,))
    publisher.publish(running)
    first = written(tmp_path)
    assert first["state"] == "running ls-1 (j/t) execute"
    for _ in range(4):
        clock.sleep(1)
        publisher.publish(running)
    assert written(tmp_path)["updated_at"] == first["updated_at"]
    assert lines.lines[0] == "running ls-1 (j/t) execute 0s, lease 1m00s left"
    assert lines.lines[-1] == "running ls-1 (j/t) execute 4s, lease 56s left"
    clock.sleep(1)
    publisher.publish(running)
    assert written(tmp_path)["updated_at"] == clock.wall()
    news = view(tmp_path, running=({**task, "phase": "commit"},))
    clock.sleep(NEWS_GAP_S)
    publisher.publish(news)  # news: at once, once NEWS_GAP_S passed since the last write
    assert written(tmp_path)["state"] == "running ls-1 (j/t) commit"


def test_news_within_the_gap_after_a_write_waits_for_the_first_call_after_the_gap(
    tmp_path: Path,
) -> None:
    """Tasks that take milliseconds change the state twice each: status.json follows them at
    most once every NEWS_GAP_S, and what it says is the latest, never one left behind."""
    clock = FakeClock()
    publisher = Publisher(clock)
    publisher.publish(view(tmp_path))
    assert written(tmp_path)["state"] == "idle"
    task = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "phase": "execute"}
    assert publisher.news_due() is None
    written_at = clock.monotonic()
    clock.sleep(NEWS_GAP_S / 2)
    publisher.publish(view(tmp_path, running=(task,)))
    publisher.publish(view(tmp_path, running=({**task, "lease_id": "ls-2"},)))
    assert written(tmp_path)["state"] == "idle"  # within the gap: not yet
    due = publisher.news_due()  # the loop wakes for it then
    assert due == written_at + NEWS_GAP_S
    clock.sleep(due - clock.monotonic() + 1e-9)
    publisher.publish(view(tmp_path, running=({**task, "lease_id": "ls-2"},)))
    assert written(tmp_path)["state"] == "running ls-2 (j/t) execute"
    assert publisher.news_due() is None
    clock.sleep(NEWS_GAP_S / 2)  # news that is gone again before its time: none waits
    publisher.publish(view(tmp_path))
    assert publisher.news_due() is not None
    publisher.publish(view(tmp_path, running=({**task, "lease_id": "ls-2"},)))
    assert publisher.news_due() is None
    publisher.publish(view(tmp_path), final=True)  # the final word never waits
    assert written(tmp_path)["state"] == "stopped"


def test_an_unwritable_status_file_is_said_once_and_its_recovery_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    publisher = Publisher(clock)
    real = status.write

    def full(state_dir: Path, snapshot: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(status, "write", full)
    with caplog.at_level(logging.INFO, logger="flashnode.node.publisher"):
        for beats in range(3):
            publisher.publish(view(tmp_path, beats=beats))
            clock.sleep(NEWS_GAP_S)
        monkeypatch.setattr(status, "write", real)
        publisher.publish(view(tmp_path, beats=9))
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "cannot write status.json (No space left on device): `flashnode status` lags",
        "status.json is written again",
    ]


def test_what_a_task_printed_is_the_owners_alone_beside_status_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd's STATUS is any local user's to read (`systemctl status`), status.json the group
    flashnode's: a task's last line (a job's secret) is in neither, but in the owner's file
    beside it, which `status.read` puts back for who may read it."""
    clock = FakeClock()
    lines = Lines()
    publisher = Publisher(clock, lines)
    task = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "phase": "execute"}
    publisher.publish(view(tmp_path, running=({**task, "last_output": "token=hunter2"},)))
    assert all("hunter2" not in line for line in lines.lines), lines.lines
    snapshot = written(tmp_path)
    assert "hunter2" not in json.dumps(snapshot)
    owners = tmp_path / status.OWNER_FILE
    assert stat.S_IMODE(owners.stat().st_mode) == 0o600
    assert json.loads(owners.read_text())["updated_at"] == snapshot["updated_at"]
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())  # the publisher's
    read = status.read(tmp_path)
    assert read is not None and read["running"][0]["last_output"] == "token=hunter2"


def test_an_earlier_snapshots_last_lines_are_never_put_back_into_a_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    publisher = Publisher(clock, Lines())
    task = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "phase": "execute"}
    publisher.publish(view(tmp_path, running=({**task, "last_output": "step 1"},)))
    clock.sleep(60)  # a heartbeat period on: rewritten, the task printed nothing since
    publisher.publish(view(tmp_path, running=(task,), beats=1))
    monkeypatch.setattr(status, "agent_alive", lambda pid: pid == os.getpid())
    read = status.read(tmp_path)
    assert read is not None and "last_output" not in read["running"][0]
    assert "output_hidden" not in read


def test_a_member_of_the_group_is_told_the_last_line_is_the_owners() -> None:
    task = {"lease_id": "ls-1", "job_id": "j", "task_id": "t", "phase": "execute"}
    snapshot = {"running": [task], "output_hidden": True, "updated_at": 0.0}
    assert "last output  owner only (sudo flashnode status)" in status.render(snapshot, None, 1.0)

