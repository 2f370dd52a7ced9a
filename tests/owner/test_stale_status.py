"""Never stale, never stale errors: status.json is rewritten every heartbeat period even when
nothing changed; a snapshot older than its promise renders as STALE with what fails; a last exit
is shown only while it still says something about this node (fake clock, no agent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fakes import FakeClock, node_view

from flashnode.console.app import _why
from flashnode.node.publisher import NodeView, Publisher
from flashnode.node.session import Problem
from flashnode.owner import status

NOW = 1.7e9


def view(tmp_path: Path, **changes: Any) -> NodeView:
    base = {"started_at": NOW - 600, "last_heartbeat_at": None, "counters": {}}
    return node_view(tmp_path, **{**base, **changes})


def written(tmp_path: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((tmp_path / status.STATUS_FILE).read_text())
    return found


def test_status_json_is_rewritten_every_heartbeat_period_while_nothing_changes(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    publisher = Publisher(clock)
    since = clock.monotonic()
    # The coordinator is down: the text stays the same, no heartbeat is answered.
    down = view(tmp_path, problems=(Problem("node heartbeat", since, "connection refused"),))
    publisher.publish(down)
    first = written(tmp_path)
    assert first["fresh_for_s"] == 5.0 and first["updated_at"] == clock.wall()
    times = []
    for _ in range(40):  # the loop's turns, every half second, for 20 s
        clock.sleep(0.5)
        publisher.publish(down)
        times.append(written(tmp_path)["updated_at"])
    rewritten = sorted(set(times) - {first["updated_at"]})
    assert len(rewritten) == 4  # every 5 s: not at every turn (the idle agent's CPU)
    gaps = [b - a for a, b in zip([first["updated_at"], *rewritten], rewritten)]
    assert all(g == 5.0 for g in gaps), gaps
    assert not status.staleness(written(tmp_path), clock.wall())["stale"]


def snapshot(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "node_id": "node-1",
        "coordinator": "http://127.0.0.1:1",
        "runner": "trusted",
        "pools": [],
        "state": "running ls-1 (j1/t1) running 2m00s",
        "registered": True,
        "started_at": NOW - 3600,
        "registered_at": NOW - 3500,
        "updated_at": NOW - 10,
        "fresh_for_s": 5.0,
        "coordinator_problems": [],
        "running": [{"lease_id": "ls-1", "job_id": "j1", "task_id": "t1", "phase": "running"}],
    }
    return {**base, **changes}


def test_a_snapshot_older_than_its_promise_renders_as_stale_and_says_what_fails() -> None:
    fresh = snapshot()
    assert status.staleness(fresh, NOW) == {
        "stale": False,
        "age_s": 10.0,
        "limit_s": 30.0,  # 3 periods of 5 s is below the floor
        "since": NOW - 10,
    }
    assert "STALE" not in status.render(fresh, now=NOW)
    # A slower heartbeat promises less: 3 periods of 20 s.
    assert not status.staleness(snapshot(fresh_for_s=20.0, updated_at=NOW - 50), NOW)["stale"]
    assert status.staleness(snapshot(fresh_for_s=20.0, updated_at=NOW - 61), NOW)["stale"]

    old = snapshot(
        updated_at=NOW - 300,
        coordinator_problems=[
            {"conversation": "node heartbeat", "since": NOW - 400, "error": "connection refused"}
        ],
    )
    stale = status.staleness(old, NOW)
    assert stale["stale"] and stale["age_s"] == 300.0
    text = status.render(old, now=NOW)
    lines = text.splitlines()
    at = 0  # said first, before what may no longer hold
    assert lines[at].startswith("STALE       status written 5m00s ago; it promises one every 5s")
    assert lines[at + 1] == "  failing: coordinator node heartbeat (below: since when, why)"
    assert "coordinator node heartbeat failing since" in text and "connection refused" in text
    assert "the agent's loop has not written status since" in lines[at + 2]
    assert "it may be stuck: see the journal" in lines[at + 2]
    assert "running     1 (as of " in text and ": stale)" in text
    # A snapshot with no time at all (an older agent's) cannot be trusted either.
    assert status.staleness(snapshot(updated_at=None), NOW)["stale"]


def test_a_refused_second_agent_is_not_this_nodes_error_while_the_agent_runs() -> None:
    locked = {"at": NOW - 5, "code": 75, "error": "another agent runs", "fix": "stop it first"}
    running = snapshot()
    assert status.current_exit(locked, running) is None
    assert "exit 75" not in status.render(running, locked, now=NOW)
    assert _why(running, {}, locked)["last_exit"] is None
    assert status.current_exit(locked, None) == locked  # no agent runs: it is what happened


def test_a_credentials_exit_clears_once_the_running_agent_registered_after_it() -> None:
    refused = {"at": NOW - 60, "code": 77, "error": "credentials refused", "fix": "login"}
    registered_since = snapshot(registered_at=NOW - 30)
    assert status.current_exit(refused, registered_since) is None
    assert "exit 77" not in status.render(registered_since, refused, now=NOW)
    assert _why(registered_since, {}, refused)["last_exit"] is None
    # Not registered since (or never): the refusal still holds, and is shown.
    for before in (snapshot(registered_at=NOW - 90), snapshot(registered_at=None)):
        assert status.current_exit(refused, before) == refused
        assert "exit 77" in status.render(before, refused, now=NOW)
        assert _why(before, {}, refused)["last_exit"]["code"] == 77
    # Any other error is shown as before.
    config = {"at": NOW - 60, "code": 78, "error": "configuration error", "fix": "correct it"}
    assert status.current_exit(config, registered_since) == config
    assert status.current_exit({"at": NOW, "code": 0, "error": "", "fix": ""}, None) is None


def test_an_exit_before_the_running_agent_started_no_longer_holds_but_one_beside_it_does() -> None:
    running = snapshot()  # started an hour ago
    for code in (69, 78, 1):  # a prerequisite, a setting it got past; a crash it restarted after
        before = {"at": NOW - 4000, "code": code, "error": "metrics port taken", "fix": "free it"}
        assert status.current_exit(before, running) is None
        assert f"exit {code}" not in status.render(running, before, now=NOW)
        assert _why(running, {}, before)["last_exit"] is None
        assert status.current_exit(before, None) == before  # no agent runs: what happened
    beside = {"at": NOW - 60, "code": 78, "error": "configuration error", "fix": "correct it"}
    assert status.current_exit(beside, running) == beside
    assert "an agent that started beside this one: exit 78" in status.render(running, beside, NOW)


def test_a_refused_token_is_why_no_heartbeat_goes_not_a_registration_to_come() -> None:
    held = {"rule": "credentials", "reason": "the coordinator refused this node's token (401)"}
    snapshot = {"registered": False, "controls": {"held_by": [held]}, "updated_at": 0.0}
    text = status.render(snapshot, None, 1.0)
    assert "heartbeat   none: the coordinator refuses this node's credentials" in text, text
    assert "not registered" not in text
