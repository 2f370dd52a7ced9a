"""Refused credentials hold the node instead of ending it: it claims nothing, says why with the
fix, asks again every few minutes with the credentials read again, and at once when the stored
ones change; once the coordinator accepts them it works again by itself (fake clock)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease
from pydantic import SecretStr

from flashnode.config.credentials import StoredCredentials
from flashnode.config.settings import Settings
from flashnode.coordinator.messages import NodeHeartbeat, NodeRegistration
from flashnode.errors import ConfigError, CoordinatorError, CredentialsError
from flashnode.evidence.inventory import registration
from flashnode.node.agent import Agent
from flashnode.node.session import CREDENTIALS_RECHECK_S, CREDENTIALS_WATCH_S, Credentials
from flashnode.owner import status

REFUSED = "register: 401 invalid or missing node token"


@dataclass
class Refusing(FakeCoordinator):
    """A coordinator that refuses the registrations listed in ``register_errors``, in order."""

    register_errors: list[Exception] = field(default_factory=list)

    def register(self, registration: NodeRegistration) -> str:
        self._log("register", registration)
        if self.register_errors:
            raise self.register_errors.pop(0)
        return registration.node_id


class Stored:
    """The stored credentials: ``changed`` as a test sets it; each ``reread`` counted."""

    def __init__(self) -> None:
        self.changes = False
        self.rereads = 0
        self.error: Exception | None = None

    def changed(self) -> bool:
        return self.changes

    def reread(self) -> None:
        self.rereads += 1
        self.changes = False
        if self.error is not None:
            raise self.error


def make_agent(
    tmp_path: Path, coord: FakeCoordinator, clock: FakeClock, credentials: Credentials | None
) -> Agent:
    ctx = context(tmp_path, clock, coord, FakeRunner())
    return Agent(
        ctx, coord, lambda current: registration(current, "node-1"), credentials=credentials
    )


def run_until(agent: Agent, clock: FakeClock, until: float, each: Any = None) -> None:
    """Run the agent until the fake clock reaches ``until``; ``each(now)`` at every wait."""
    original = clock.wait

    def wait(event: Any, timeout: float) -> bool:
        if each is not None:
            each(clock.now)
        if clock.now >= until:
            agent.request_stop()
        return original(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()


def snapshot(tmp_path: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((tmp_path / status.STATUS_FILE).read_text())
    return found


def test_a_refused_registration_holds_and_asks_again_every_few_minutes(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = Refusing(clock, register_errors=[CredentialsError(REFUSED)] * 2, claims=[lease(0)])
    stored = Stored()
    agent = make_agent(tmp_path, coord, clock, stored)
    seen: list[dict[str, Any]] = []

    def look(now: float) -> None:
        if 1010 <= now < 1010.5:  # held: what status.json says meanwhile
            seen.append(snapshot(tmp_path))

    run_until(agent, clock, 1000 + 3 * CREDENTIALS_RECHECK_S, look)
    registers = coord.names("register")
    assert len(registers) == 3, registers
    # Every few minutes (jittered into [0.8, 1.0] of the recheck), never sooner.
    for a, b in zip(registers, registers[1:]):
        assert 0.8 * CREDENTIALS_RECHECK_S - 1e-6 <= b - a <= CREDENTIALS_RECHECK_S + 1.0
    claims = coord.names("claim")
    assert claims and min(claims) >= registers[-1]  # nothing claimed while refused
    assert stored.rereads == 2  # the credentials read again before each new try
    assert agent.workers.stats.outcomes == {"committed": 1}  # works again by itself
    held = seen[0]
    assert held["registered"] is False
    [hold] = held["controls"]["held_by"]
    assert hold["rule"] == "credentials" and REFUSED in hold["reason"]
    assert "flashnode login --coordinator http://127.0.0.1:1" in hold["fix"]
    assert "no restart" in hold["fix"]
    assert "not claiming: the coordinator refused this node's credentials" in held["state"]
    assert held["coordinator_problems"] == []  # refused is not unreachable
    accepted = snapshot(tmp_path)["registered_at"]  # the registration the coordinator took
    assert accepted == agent.session.registered_wall and accepted > held["updated_at"]


def test_changed_stored_credentials_are_tried_at_once(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = Refusing(clock, register_errors=[CredentialsError(REFUSED)])
    stored = Stored()
    agent = make_agent(tmp_path, coord, clock, stored)

    def login(now: float) -> None:
        if 1030 <= now < 1030.5:  # `flashnode login` stores a new token
            stored.changes = True

    run_until(agent, clock, 1060, login)
    first, second = coord.names("register")
    assert first == 1000 and 1030 <= second <= 1030 + CREDENTIALS_WATCH_S + 0.5
    assert stored.rereads == 1 and agent.session.refused is None and agent.session.registered


def test_a_refused_heartbeat_or_claim_holds_too(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = Refusing(
        clock,
        heartbeat_errors=[CredentialsError("node heartbeat: 401 invalid or missing node token")],
    )
    agent = make_agent(tmp_path, coord, clock, Stored())
    run_until(agent, clock, 1020)
    assert agent.session.refused is not None and not agent.session.registered
    assert [h.rule for h in agent.decision.holds] == ["credentials"]
    refused_at = coord.names("node_heartbeat")[0]
    assert all(t <= refused_at for t in coord.names("claim"))  # none after the refusal

    clock2 = FakeClock()
    coord2 = Refusing(clock2, claims=[CredentialsError("claim: 401 invalid or missing node token")])
    (tmp_path / "b").mkdir()
    agent2 = make_agent(tmp_path / "b", coord2, clock2, Stored())
    run_until(agent2, clock2, 1060)
    assert len(coord2.names("claim")) == 1 and len(coord2.names("register")) == 1
    assert "claim: 401" in (agent2.decision.hold_reason or "")


def test_credentials_that_cannot_be_read_keep_the_hold_and_say_why(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = Refusing(clock, register_errors=[CredentialsError(REFUSED)])
    stored = Stored()
    stored.error = ConfigError("token file /x is accessible to other users (mode 0644)")
    agent = make_agent(tmp_path, coord, clock, stored)
    run_until(agent, clock, 1000 + CREDENTIALS_RECHECK_S + 5)
    assert len(coord.names("register")) == 1  # not asked with credentials it could not read
    assert stored.rereads == 1
    refused = agent.session.refused
    assert refused is not None and "accessible to other users" in refused.error


def test_another_coordinators_token_is_never_handed_to_the_running_one(tmp_path: Path) -> None:
    """The owner moves the config to coordinator B and logs in there while the agent holds on
    A's refusal: B's token must not reach A; the hold says to restart."""
    a = Settings(coordinator="http://a.test:80", runner="trusted", state_dir=tmp_path)
    b = a.model_copy(update={"coordinator": "http://b.test:80", "token": SecretStr("TOKEN-B")})
    presented: list[tuple[str | None, str | None]] = []
    stored = StoredCredentials(a, lambda: b, lambda t, c: presented.append((t, c)), {})
    with pytest.raises(ConfigError, match="restart the agent"):
        stored.reread()
    assert presented == []
    stored = StoredCredentials(a, lambda: a, lambda t, c: presented.append((t, c)), {})
    stored.reread()
    assert presented == [(None, None)]


@dataclass
class BackWithOtherTokens(Refusing):
    """Its node heartbeats are refused once a claim was tried (and failed: it was down)."""

    def node_heartbeat(self, heartbeat: NodeHeartbeat) -> None:
        self._log("node_heartbeat", heartbeat.status)
        if self.names("claim"):
            raise CredentialsError("node heartbeat: 401 invalid or missing node token")


def test_a_refusal_clears_the_failures_of_conversations_the_hold_stops_trying(
    tmp_path: Path,
) -> None:
    """The coordinator came back with other tokens: the claim failed while it was down, then
    the heartbeat was refused. A refusal is an answer: the coordinator is not unreachable, and
    the claim, not tried while the hold lasts, must not show its old failure meanwhile."""
    clock = FakeClock()
    coord = BackWithOtherTokens(clock, claims=[CoordinatorError("claim: connection refused")] * 99)
    agent = make_agent(tmp_path, coord, clock, Stored())
    seen: list[dict[str, Any]] = []

    def look(now: float) -> None:
        if agent.session.refused is not None:
            seen.append(snapshot(tmp_path))

    run_until(agent, clock, 1000 + CREDENTIALS_RECHECK_S / 2, look)
    assert coord.names("claim") and coord.names("node_heartbeat")
    held = seen[-1]
    assert [h["rule"] for h in held["controls"]["held_by"]] == ["credentials"]
    assert held["coordinator_problems"] == [], held["coordinator_problems"]
    assert "unreachable" not in held["state"], held["state"]
