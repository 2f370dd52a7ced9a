"""The node's session with the coordinator over a fake coordinator and the fake clock:
registration, the heartbeat, registering again, the claim's answer."""

from __future__ import annotations

import logging
import random

import pytest
from fakes import FakeClock, FakeCoordinator, lease

from flashnode.config.settings import Settings
from flashnode.coordinator.messages import NodeRegistration
from flashnode.errors import CoordinatorUnavailable, Unregistered
from flashnode.evidence.inventory import registration
from flashnode.node.pacing import Pacing
from flashnode.node.session import Session
from flashnode.owner.metrics import NullMetrics

SETTINGS = Settings(coordinator="http://127.0.0.1:1", runner="trusted", pools=("team-a",))


def session(coord: FakeCoordinator, clock: FakeClock) -> Session:
    def describe(s: Settings) -> NodeRegistration:
        return registration(s, "node-1")

    pacing = Pacing(SETTINGS, random.Random(3))
    return Session(coord, describe, clock, pacing, NullMetrics())


def test_the_first_turn_registers_and_only_a_later_one_may_claim() -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    s = session(coord, clock)
    assert s.turn(clock.monotonic(), SETTINGS, draining=False) is False
    assert s.registered and s.node_id == "node-1"
    assert s.turn(clock.monotonic(), SETTINGS, draining=False) is True
    assert [c[1] for c in coord.calls] == ["register", "node_heartbeat"]
    assert s.claim_due(clock.monotonic())
    got = s.claim(held=set())
    assert got is not None and got["lease_id"] == "ls-000000000000"


def test_heartbeats_follow_the_pacing_and_say_draining_while_the_node_drains() -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    s = session(coord, clock)
    for _ in range(40):
        s.turn(clock.monotonic(), SETTINGS, draining=clock.now > 1010)
        clock.now += 0.5
    beats = [(t, arg) for t, n, arg in coord.calls if n == "node_heartbeat"]
    gaps = [b[0] - a[0] for a, b in zip(beats, beats[1:])]
    assert all(4.5 <= g <= 6.0 for g in gaps)
    assert beats[0][1] == "online" and beats[-1][1] == "draining"
    assert s.beats == len(beats)


def test_a_reload_registers_again_under_the_new_settings_at_the_next_turn() -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    s = session(coord, clock)
    s.turn(clock.monotonic(), SETTINGS, draining=False)
    reloaded = SETTINGS.model_copy(update={"pools": ("team-a", "team-b")})
    assert s.turn(clock.monotonic(), reloaded, draining=False) is False
    [first, second] = [arg for _, n, arg in coord.calls if n == "register"]
    assert first.capabilities.pools == ["team-a"]
    assert second.capabilities.pools == ["team-a", "team-b"]
    assert s.turn(clock.monotonic(), reloaded, draining=False) is True  # and only once


def test_a_forgotten_node_registers_again_within_the_rejoin_spread() -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, heartbeat_errors=[Unregistered("unknown node")])
    s = session(coord, clock)
    s.turn(clock.monotonic(), SETTINGS, draining=False)
    forgotten_at = clock.monotonic()
    s.turn(forgotten_at, SETTINGS, draining=False)
    assert not s.registered
    while not s.registered:
        clock.now += 0.1
        s.turn(clock.monotonic(), SETTINGS, draining=False)
    assert clock.monotonic() - forgotten_at < 5.1
    assert s.claim_due(clock.monotonic())  # then it claims at once


def test_a_claim_answer_naming_a_lease_running_here_is_ignored() -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    s = session(coord, clock)
    s.turn(clock.monotonic(), SETTINGS, draining=False)
    assert s.claim(held={"ls-000000000000"}) is None
    assert not s.claim_due(clock.monotonic())  # paced as an empty answer, not at once


def test_a_failing_conversation_is_logged_once_and_once_more_when_it_works_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    down = CoordinatorUnavailable("connection refused")
    coord = FakeCoordinator(clock, claims=[down, down, down, None])
    s = session(coord, clock)
    s.turn(clock.monotonic(), SETTINGS, draining=False)
    with caplog.at_level(logging.INFO, logger="flashnode.node.session"):
        for _ in range(4):
            clock.now = max(clock.now, s.wake_at(may_claim=True))
            s.claim(held=set())
            if _ < 3:
                assert "claim" in s.problems
    assert "claim" not in s.problems
    messages = [r.getMessage() for r in caplog.records]
    assert sum("claim failing" in m for m in messages) == 1
    assert sum("claim works again" in m for m in messages) == 1


def test_a_failing_conversation_whose_cause_changes_says_the_new_cause_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The coordinator's port, first refused, is then held by a local squatter the guard
    refuses: the log says so (once), not only the first cause."""
    clock = FakeClock()
    down = CoordinatorUnavailable("connection refused")
    squat = CoordinatorUnavailable("held by uid 65534: no credentials are sent there")
    coord = FakeCoordinator(clock, claims=[down, squat, squat, None])
    s = session(coord, clock)
    s.turn(clock.monotonic(), SETTINGS, draining=False)
    with caplog.at_level(logging.INFO, logger="flashnode.node.session"):
        for _ in range(4):
            clock.now = max(clock.now, s.wake_at(may_claim=True))
            s.claim(held=set())
    messages = [r.getMessage() for r in caplog.records]
    assert sum("claim failing" in m and "connection refused" in m for m in messages) == 1
    assert sum("still failing" in m and "no credentials are sent there" in m for m in messages) == 1
    assert sum("claim works again" in m for m in messages) == 1


def test_goodbye_is_said_only_by_a_registered_node() -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    s = session(coord, clock)
    s.goodbye()
    assert coord.calls == []
    s.turn(clock.monotonic(), SETTINGS, draining=False)
    s.goodbye()
    assert coord.calls[-1][1:] == ("node_heartbeat", "terminating")
