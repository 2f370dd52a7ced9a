"""`flashnode status` always says why the node is not working, and what to do: every
hold with its fix, the refused reload with the line that refused it, a coordinator it cannot
reach, how the last agent exited (after it is gone, and in the console of the next one), what the
node gave across restarts, times with their zone. Real agents against the real coordinator."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import TokenCoordinator
from consoleharness import ConsoleAgent
from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    free_port,
    run_flashnode,
    shared_dir,
    wait_for,
)

from flashnode.clock import moment
from flashnode.owner import status
from flashnode.owner.ledgerview import CHECKPOINT_FILE, LedgerView

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
ZONE = time.strftime("%Z")


def status_text(state_dir: Path) -> str:
    done = run_flashnode("status", "--state-dir", str(state_dir))
    assert "Traceback" not in done.stdout + done.stderr
    return done.stdout


# --- every hold with its fix -------------------------------------------------------------------


def test_status_names_the_disk_floor_the_pause_and_the_window_each_with_its_fix(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    # A window that is closed now: today's weekday, an hour that ended two hours ago.
    ago = time.localtime(time.time() - 7200)
    day = time.strftime("%a", ago)
    window = f"{day} {ago.tm_hour:02d}:00-{ago.tm_hour:02d}:30"
    env = {**FAST, "FLASHNODE_MIN_FREE_BYTES": "1000T", "FLASHNODE_RUN_WINDOWS": window}
    agent = start_agent(coordinator.url, *TRUSTED, env=env)
    paused = flashnode("pause", "--for", "2h", "--state-dir", str(agent.state_dir))
    assert paused.returncode == 0, paused.stderr
    text = wait_for(
        "three holds in status",
        lambda: (t := status_text(agent.state_dir)).count("    fix: ") >= 3 and t,
    )
    assert "claiming    held" in text
    lines = text.splitlines()

    def fix_of(rule: str) -> str:
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {rule}: "))
        assert lines[at + 1].startswith("    fix: "), text
        return lines[at + 1]

    assert "lower min_free_bytes" in fix_of("disk")
    assert "flashnode resume" in fix_of("pause")
    assert "change run_windows" in fix_of("window")
    # The window's next opening is never ambiguous: a weekday, the zone, and how far.
    assert re.search(rf"next opens {day} \d\d:00 {ZONE} \(in 6d2\dh\)", text), text
    # The pause's end, with its zone and how far (and its weekday when it ends on another day).
    until = rf"(\w\w\w )?\d\d:\d\d {ZONE} \(in 1h5\dm\)"
    assert re.search(rf"paused by the owner until {until}", text), text
    # The console shows the same holds with the same fixes.
    snapshot = json.loads(flashnode("status", "--json", "--state-dir", str(agent.state_dir)).stdout)
    assert {h["rule"]: bool(h["fix"]) for h in snapshot["controls"]["held_by"]} == {
        "pause": True,
        "window": True,
        "disk": True,
    }


# --- a refused reload, a coordinator it cannot reach ------------------------------------------


def test_a_refused_reload_shows_in_status_with_the_line_that_refused_it(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    config = tmp_path / "flashnode.toml"
    config.write_text('# mine\npools = ["team-a"]\nrunner = "trusted"\n\n')
    agent = start_agent(coordinator.url, "--config", str(config), env=FAST)
    wait_for("the agent to register", lambda: "registered as node" in agent.log)
    config.write_text(config.read_text() + 'run_windows = ["Mondy 10:00-12:00"]\n')
    agent.signal(signal.SIGHUP)
    text = wait_for(
        "the refused reload in status",
        lambda: "refused" in (t := status_text(agent.state_dir)) and t,
    )
    assert f"(in {config}, line 5)" in text and "unknown day 'Mondy'" in text, text
    assert re.search(rf"reload      refused at \d\d:\d\d:\d\d {ZONE} \(", text), text
    assert "  fix: correct the config file" in text and "systemctl reload flashnode" in text


def test_a_coordinator_it_cannot_reach_is_named_with_its_error_and_fix(
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent(f"http://127.0.0.1:{free_port()}", *TRUSTED, env=FAST)
    text = wait_for(
        "the failing registration in status",
        lambda: "failing" in (t := status_text(agent.state_dir)) and t,
    )
    assert "heartbeat   none yet: not registered with the coordinator" in text, text
    assert "None" not in text
    assert re.search(rf"coordinator registration failing since \d\d:\d\d:\d\d {ZONE}", text), text
    assert "  fix: check that the coordinator runs" in text


# --- how the last agent exited ------------------------------------------------------------------


def test_refused_credentials_hold_with_the_fix_and_clear_once_a_fixed_token_registers(
    flashnode: Callable[..., Any],
    token_coordinator: TokenCoordinator,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    server = token_coordinator.server
    token_file = tmp_path / "token"
    token_file.write_text("not-the-token")
    token_file.chmod(0o600)
    state_dir = shared_dir("flashnode-state-")
    port = free_port()
    agent = start_agent(
        server.url,
        *TRUSTED,
        "--node-id",
        "node-x",
        "--token-file",
        str(token_file),
        env={
            **FAST,
            **token_coordinator.agent_env(),
            "FLASHNODE_UI_LISTEN": f"127.0.0.1:{port}",
        },
        state_dir=state_dir,
    )
    # Refused: the agent runs on, holding, and status says why and the fix (no exit 77).
    text = wait_for(
        "the credentials hold in status",
        lambda: "  credentials: the coordinator refused" in (t := status_text(state_dir)) and t,
        timeout=60,
    )
    assert "claiming    held" in text and "401" in text, text
    assert "    fix: store a token (and join code) that" in text and "no restart" in text, text
    console = ConsoleAgent(agent, port, tmp_path)
    console.wait_console()
    client, _ = console.session()
    why = client.get("/api/state").json()["why"]
    assert [h["rule"] for h in why["holds"]] == ["credentials"], why
    # A second agent on the same state dir exits 75: not this node's error, not shown.
    second = flashnode("work", *TRUSTED, "--coordinator", server.url, "--state-dir", str(state_dir))
    assert second.returncode == 75
    assert "exit 75" not in status_text(state_dir)
    assert client.get("/api/state").json()["why"]["last_exit"] is None
    # The right token stored where the agent reads it: it registers by itself, the hold is gone.
    fresh = tmp_path / "token.new"
    fresh.write_text(token_coordinator.token)
    fresh.chmod(0o600)
    fresh.replace(token_file)
    wait_for(
        "the hold to clear", lambda: "claiming    held" not in status_text(state_dir), timeout=30
    )
    state = client.get("/api/state").json()
    assert state["why"]["holds"] == [] and state["stale"]["stale"] is False, state
    assert agent.proc.poll() is None


def test_a_configuration_error_is_kept_where_status_finds_it(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    config = tmp_path / "c.toml"
    config.write_text(
        f'coordinator = "http://127.0.0.1:9"\nstate_dir = "{state_dir}"\nslots = -1\n'
    )
    done = flashnode("work", "--config", str(config))
    assert done.returncode == 78
    text = flashnode("status", "--config", str(config)).stdout
    assert "exit 78 at" in text and f"slots = -1 (in {config}, line 3)" in text, text
    assert "  fix: correct the setting named" in text


# --- what the node gave, across restarts ------------------------------------------------------


def test_totals_survive_a_restart(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    state_dir = shared_dir("flashnode-state-")
    first = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=state_dir)
    for _ in range(2):
        job = coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    failing = coordinator.submit(argv_job(["sh", "-c", "exit 3"], max_attempts=1))
    coordinator.wait_state(failing, {"SUCCEEDED", "FAILED"})
    first.wait_ledger(3)
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0
    assert (state_dir / CHECKPOINT_FILE).exists()
    stopped = status_text(state_dir)
    assert "all time: 2 committed, 1 failed, 0 lapsed" in stopped, stopped

    start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=state_dir)
    text = wait_for(
        "the new agent's status",
        lambda: (
            (r := flashnode("status", "--state-dir", str(state_dir))).returncode == 0 and r.stdout
        ),
    )
    assert "given       today: 2 committed, 1 failed, 0 lapsed;" in text or (
        "today: 0 committed" in text  # the first tasks ended before midnight
    )
    assert "            all time: 2 committed, 1 failed, 0 lapsed;" in text, text
    assert "counters" not in text


def test_the_totals_checkpoint_spares_a_start_the_whole_ledger(tmp_path: Path) -> None:
    now = time.mktime((2027, 1, 15, 12, 0, 0, 0, 0, -1))  # local noon: 10 s ago is today
    ledger = tmp_path / "ledger.jsonl"
    line = {"outcome": "committed", "ended_at": now - 10, "evidence": {"wall_seconds": 3600}}
    line["task_usage"] = {"cpu_percent_mean": 100.0}
    ledger.write_text((json.dumps(line) + "\n") * 3)
    checkpoint = tmp_path / CHECKPOINT_FILE
    first = LedgerView(ledger, clock=lambda: now, checkpoint=checkpoint)
    assert first.totals()["all_time"]["tasks"] == 3
    first.save()
    # What the checkpoint covers is never read again: garbled in place, it still counts.
    size = ledger.stat().st_size
    with ledger.open("r+b") as fh:
        fh.write(b"x" * (size - 1))
    with ledger.open("a") as fh:
        fh.write(json.dumps({**line, "outcome": "failed"}) + "\n")
    second = LedgerView(ledger, clock=lambda: now, checkpoint=checkpoint)
    totals = second.totals()
    assert totals["all_time"]["outcomes"] == {"committed": 3, "failed": 1}
    assert totals["all_time"]["cpu_hours"] == pytest.approx(4.0)
    assert totals["today"]["outcomes"] == {"committed": 3, "failed": 1}
    # A checkpoint of another ledger (a new inode) is not used.
    ledger.unlink()
    ledger.write_text(json.dumps(line) + "\n")
    third = LedgerView(ledger, clock=lambda: now, checkpoint=checkpoint)
    assert third.totals()["all_time"]["tasks"] == 1


def test_times_carry_their_zone_and_how_far_they_are() -> None:
    now = time.mktime((2027, 1, 15, 12, 0, 0, 0, 0, -1))  # local noon: 5 min ago is today
    assert re.fullmatch(rf"\d\d:\d\d:\d\d {ZONE} \(5m00s ago\)", moment(now - 300, now))
    assert re.fullmatch(
        rf"\w\w\w \d\d:\d\d {ZONE} \(in 6d23h\)",
        moment(now + 6 * 86400 + 82800, now, seconds=False),
    )
    record = {"at": now - 60, "code": 78, "error": "configuration error: x", "fix": "y"}
    lastexit_lines = status.exit_lines(record, now)
    assert lastexit_lines == [
        f"last exit   exit 78 at {moment(now - 60, now)}: configuration error: x",
        "  fix: y",
    ]
