"""The main loop with the owner's controls and metrics, against fakes and a fake clock."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.config.schedule import Pause
from flashnode.errors import CoordinatorUnavailable
from flashnode.evidence.inventory import registration
from flashnode.node.agent import Agent
from flashnode.node.controls import Controls
from flashnode.node.rules import Readers, Rules


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def attempt_finished(
        self,
        outcome: str,
        seconds: float | None,
        cpu_percent: float | None = None,
        gpu_percent: float | None = None,
    ) -> None:
        self.calls.append(("attempt_finished", outcome))

    def claim_finished(self, seconds: float, result: str) -> None:
        self.calls.append(("claim_finished", result))

    def coordinator_error(self, conversation: str) -> None:
        self.calls.append(("coordinator_error", conversation))

    def coordinator_working(self, conversation: str) -> None:
        self.calls.append(("coordinator_working", conversation))

    def status_published(self) -> None:
        self.calls.append(("status_published", None))

    def uploaded(self, nbytes: int) -> None:
        self.calls.append(("uploaded", nbytes))

    def downloaded(self, nbytes: int) -> None:
        self.calls.append(("downloaded", nbytes))

    def set_running(self, running: int, suspended: int = 0) -> None:
        self.calls.append(("set_running", (running, suspended)))

    def set_controls(self, paused: bool, held: Iterable[str]) -> None:
        self.calls.append(("set_controls", (paused, tuple(held))))

    def close(self) -> None:
        pass

    def of(self, name: str) -> list[Any]:
        return [arg for n, arg in self.calls if n == name]


def test_no_claims_while_paused_heartbeats_go_on_and_resume_claims(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    pause: dict[str, Pause | None] = {"now": Pause("drain", None, clock.wall())}
    controls = Controls(Rules(), Readers(pause=lambda: pause["now"]), clock)
    metrics = RecordingMetrics()
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=1)
    ctx = dataclasses.replace(ctx, metrics=metrics)
    agent = Agent(ctx, coord, lambda current: registration(current, "node-1"), controls=controls)
    seen: dict[str, Any] = {}
    original = coord.node_heartbeat

    def heartbeat(hb: Any) -> None:
        if clock.now > 1030 and pause["now"] is not None:
            seen["status"] = json.loads((tmp_path / "status.json").read_text())
            pause["now"] = None  # flashnode resume
            seen["resumed_at"] = clock.now
        original(hb)

    coord.node_heartbeat = heartbeat  # type: ignore[method-assign]
    agent.run()
    claims = coord.names("claim")
    assert claims and claims[0] >= seen["resumed_at"]  # not one claim while paused
    beats = [(t, status) for t, n, status in coord.calls if n == "node_heartbeat"]
    paused_beats = [b for b in beats if b[0] <= seen["resumed_at"]]
    assert len(paused_beats) >= 6 and {s for _, s in paused_beats} == {"online"}
    status = seen["status"]
    assert "not claiming: paused by the owner until `flashnode resume`" in status["state"]
    assert status["controls"]["paused"]["mode"] == "drain"
    assert [h["rule"] for h in status["controls"]["held_by"]] == ["pause"]
    assert agent.workers.stats.outcomes == {"committed": 1}
    # Metrics follow the same turns: paused, then not; one claim, with work; one attempt.
    controls_seen = metrics.of("set_controls")
    assert controls_seen[0] == (True, ("pause",)) and controls_seen[-1] == (False, ())
    assert metrics.of("claim_finished") == ["work"]
    assert metrics.of("attempt_finished") == ["committed"]
    assert sum(metrics.of("uploaded")) == sum(len(v) for v in coord.uploads.values())


def test_claim_errors_and_empty_claims_are_counted(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(
        clock,
        claims=[CoordinatorUnavailable("refused"), None, CoordinatorUnavailable("x"), lease(0)],
    )
    metrics = RecordingMetrics()
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=1)
    ctx = dataclasses.replace(ctx, metrics=metrics)
    agent = Agent(ctx, coord, lambda current: registration(current, "node-1"))
    agent.run()
    assert metrics.of("claim_finished") == ["error", "empty", "error", "work"]
    assert metrics.of("coordinator_error") == ["claim", "claim"]
    # failing until it works again: what flashnode_coordinator_failing shows
    told = [n for n, arg in metrics.calls if n.startswith("coordinator_") and arg == "claim"]
    assert told == ["coordinator_error", "coordinator_working"] * 2
    assert "registration" in metrics.of("coordinator_working")
    assert metrics.of("downloaded") == [] and metrics.of("attempt_finished") == ["committed"]


def test_a_window_rule_holds_claims_until_the_fake_clock_enters_it(tmp_path: Path) -> None:
    """FakeClock's wall clock starts at 1.7e9 + 1000 s: Tuesday 2023-11-14 22:30:00 UTC."""
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    ctx = context(
        tmp_path,
        clock,
        coord,
        FakeRunner(),
        max_tasks=1,
        run_windows=("Tue 22:31-23:00",),
        run_windows_timezone="UTC",
    )
    controls = Controls(Rules.from_settings(ctx.settings), Readers(), clock)
    agent = Agent(ctx, coord, lambda current: registration(current, "node-1"), controls=controls)
    agent.run()
    first = datetime.fromtimestamp(1.7e9 + coord.names("claim")[0], timezone.utc)
    assert (first.weekday(), first.hour, first.minute) == (1, 22, 31), first
    assert len(coord.names("node_heartbeat")) >= 12  # a minute outside the window, online


def test_a_reload_applies_new_rules_to_the_running_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, FakeRunner())
    ctx = dataclasses.replace(ctx, start_thread=lambda fn, name: fn() if name == "reload" else None)
    controls = Controls(Rules.from_settings(ctx.settings), Readers(), clock)
    # The same settings with a window that is closed now (Tuesday 22:30 UTC on the fake clock).
    closed = ctx.settings.model_copy(
        update={"run_windows": ("Sat-Sun",), "run_windows_timezone": "UTC"}
    )
    agent = Agent(
        ctx,
        coord,
        lambda current: registration(current, "node-1"),
        reload=lambda: closed,
        controls=controls,
    )
    original = coord.node_heartbeat
    reloaded: list[float] = []

    def heartbeat(hb: Any) -> None:
        if clock.now > 1010 and not agent.settings.run_windows:
            agent.request_reload()  # SIGHUP
            reloaded.append(clock.now)
        if clock.now > 1060:
            agent.request_stop()
        original(hb)

    coord.node_heartbeat = heartbeat  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO):
        agent.run()
    claims = coord.names("claim")
    assert len(claims) > 3 and claims[-1] < reloaded[0] + 1  # none once the window rule holds
    assert len(coord.names("node_heartbeat")) >= 12  # online all along
    assert agent.decision.hold_reason is not None
    assert "outside run_windows: next opens Sat 00:00" in agent.decision.hold_reason
    assert any("owner control window holds claiming" in r.message for r in caplog.records)


def test_the_terminal_line_is_cut_to_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """A longer line would wrap, and the next redraw ("\\r") would not clear it."""
    import io

    from flashnode.owner.status import TerminalLine

    monkeypatch.setenv("COLUMNS", "40")
    out = io.StringIO()
    TerminalLine(out).status("running ls-1 (j/t) execute 1m05s, lease 52s left: step 3 of 10")
    shown = out.getvalue().split("\x1b[K", 1)[1]
    assert len(shown) == 39 and shown.endswith("…") and shown.startswith("running ls-1")


def test_the_last_output_line_cannot_drive_the_owners_terminal(tmp_path: Path) -> None:
    from flashnode.sandbox.logcap import CappedFile, latest_line

    out, err = CappedFile(tmp_path / "o", 1024), CappedFile(tmp_path / "e", 1024)
    out.write(b"step 1\nstep 2 \x1b]0;owned\x07\x1b[2J\xe2\x80\xae done\n\n")
    assert out.last_line == "step 2 \\x1b]0;owned\\x07\\x1b[2J\\u202e done"
    err.write(b"10%\r20%\r")  # a progress bar: its latest state
    assert latest_line(out, err) == "20%"
    out.write(b"x" * 500)
    assert len(latest_line(out, err)) == 160 and latest_line(out, err).endswith("…")
    out.close()
    err.close()
