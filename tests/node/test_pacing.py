"""A fleet's pace (pacing.py): the waits alone, then many agent loops on fake clocks noticing one
event together, as a fleet of nodes on one coordinator does."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.config.settings import Settings
from flashnode.errors import CoordinatorUnavailable, Unregistered
from flashnode.evidence.inventory import registration
from flashnode.node.agent import Agent
from flashnode.node.pacing import SLOW_FACTOR, Pacing

SETTINGS = Settings(coordinator="http://127.0.0.1:1", runner="trusted", pools=("team-a",))


def test_idle_waits_double_within_their_jitter_band_up_to_the_cap_and_work_resets_them() -> None:
    pacing = Pacing(SETTINGS, random.Random(1))
    waits = [pacing.claimed(False, 0.001, 0.0) for _ in range(8)]
    for wait, step in zip(waits, [0.5, 1, 2, 4, 8, 8, 8, 8], strict=True):
        assert 0.5 * step <= wait <= step
    assert pacing.claimed(True, 0.001, 0.0) == 0.0
    assert pacing.claimed(False, 0.001, 0.0) <= 0.5


def test_after_an_attempt_claims_come_about_every_second_for_the_alert_window_then_back_off() -> (
    None
):
    pacing = Pacing(SETTINGS, random.Random(1))
    pacing.attempt_ended(100.0)
    now, waits = 100.0, []
    while now < 100.0 + SETTINGS.claim_alert_seconds:
        waits.append(pacing.claimed(False, 0.001, now))
        now += waits[-1]
    assert len(waits) >= 12 and all(0.6 <= w <= 1.2 for w in waits)
    after = [pacing.claimed(False, 0.001, now) for _ in range(6)]
    assert after[0] <= 0.5 and 4 <= after[-1] <= 8  # the idle doubling, from its start


def test_a_slow_answer_is_followed_by_a_longer_wait_than_it_took() -> None:
    pacing = Pacing(SETTINGS, random.Random(1))
    assert pacing.claimed(False, 3.0, 0.0) >= SLOW_FACTOR * 3.0
    assert pacing.claim_failed(10.0) >= SLOW_FACTOR * 10.0
    assert pacing.register_failed(10.0) >= SLOW_FACTOR * 10.0


def test_heartbeats_and_rejoins_stay_within_their_bands() -> None:
    pacing = Pacing(SETTINGS, random.Random(1))
    beats = [pacing.heartbeat() for _ in range(200)]
    assert all(4.5 <= b <= 5.5 for b in beats) and max(beats) - min(beats) > 0.5
    rejoins = [pacing.rejoin() for _ in range(200)]
    assert all(0 <= r < 5 for r in rejoins) and max(rejoins) - min(rejoins) > 4


# --- many nodes at once ---------------------------------------------------------------------


def fleet_agent(
    tmp_path: Path, seed: int, coord: FakeCoordinator, clock: FakeClock, **settings: object
) -> Agent:
    ctx = context(tmp_path, clock, coord, FakeRunner(), **settings)
    # Each node its own randomness, as each process has.
    ctx = dataclasses.replace(ctx, rng=random.Random(seed))
    return Agent(ctx, coord, lambda current: registration(current, f"node-{seed}"))


def stop_at(agent: Agent, clock: FakeClock, coord: FakeCoordinator, at: float) -> None:
    """Stop the agent's loop once its fake clock passes ``at``."""
    original = coord.claim

    def claim(node_id: str) -> object:
        if clock.now > at:
            agent.request_stop()
        return original(node_id)

    coord.claim = claim  # type: ignore[method-assign,assignment]


def most_in_one_window(times: list[float], window: float) -> int:
    times = sorted(times)
    return max(sum(1 for t in times[i:] if t - start < window) for i, start in enumerate(times))


def test_a_fleet_that_notices_a_coordinator_restart_together_registers_again_apart(
    tmp_path: Path,
) -> None:
    """The attack on the coordinator is the fleet itself: 100 nodes whose claims meet a
    restarted coordinator at the same instant must not all re-register in that instant."""
    registers = []
    for seed in range(100):
        clock = FakeClock()
        coord = FakeCoordinator(clock, claims=[Unregistered("unregistered node")])
        agent = fleet_agent(tmp_path / str(seed), seed, coord, clock)
        stop_at(agent, clock, coord, 1020)
        agent.run()
        again = coord.names("register")[1:]  # the first is the start's
        assert len(again) == 1
        registers.append(again[0])
    assert max(registers) - min(registers) > 3.0
    assert most_in_one_window(registers, 0.1) <= 10


def test_nodes_started_together_drift_apart_instead_of_heartbeating_in_lockstep(
    tmp_path: Path,
) -> None:
    last_beats = []
    for seed in range(20):
        clock = FakeClock()
        coord = FakeCoordinator(clock)
        agent = fleet_agent(tmp_path / str(seed), seed, coord, clock)
        stop_at(agent, clock, coord, 1060)
        agent.run()
        beats = coord.names("node_heartbeat")
        assert all(4.5 - 1e-6 <= g <= 5.5 + 1e-6 for g in gaps(beats[:-1]))  # always online
        last_beats.append(beats[10])
    assert max(last_beats) - min(last_beats) > 1.0


class SlowCoordinator(FakeCoordinator):
    """Answers every claim after ``took`` seconds, as an overloaded coordinator does."""

    took = 3.0

    def claim(self, node_id: str) -> dict[str, object] | None:
        self.clock.now += self.took
        return super().claim(node_id)


def test_a_slow_coordinator_makes_a_node_ask_less_often_not_again_at_once(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    coord = SlowCoordinator(clock, claims=[None] * 50)
    agent = fleet_agent(tmp_path, 1, coord, clock)
    stop_at(agent, clock, coord, 1060)
    agent.run()
    claims = coord.names("claim")  # logged when answered
    # Each question waits for the last answer and then twice as long as it took.
    assert all(g >= (1 + SLOW_FACTOR) * coord.took - 1e-6 for g in gaps(claims))


def test_errors_back_off_with_wide_jitter_so_a_failing_fleet_does_not_retry_in_step(
    tmp_path: Path,
) -> None:
    fifth = []
    for seed in range(30):
        clock = FakeClock()
        errors = [CoordinatorUnavailable("connection refused") for _ in range(6)]
        coord = FakeCoordinator(clock, claims=[*errors, lease(0)])
        agent = fleet_agent(tmp_path / str(seed), seed, coord, clock)
        stop_at(agent, clock, coord, 1100)
        agent.run()
        fifth.append(coord.names("claim")[5])
    # Steps 1, 2, 4, 8, 16 s: drawn from [0.8, 1.0] of each, 30 nodes spread about 4 s.
    assert max(fifth) - min(fifth) > 6.0


class WorkArrives(FakeCoordinator):
    """A task at the first claim (the fake runner ends it at once); then 204 until ``quiet``
    seconds later; then a second task."""

    quiet = 0.0
    arrives_at = float("inf")

    def claim(self, node_id: str) -> dict[str, object] | None:
        self._log("claim")
        if len(self.names("claim")) == 1:
            self.arrives_at = self.clock.now + self.quiet
            return lease(0)
        if self.clock.now >= self.arrives_at:
            self._log("found")
            return lease(1)
        return None


def test_after_a_task_a_node_finds_work_that_arrives_seconds_later_within_the_dispatch_goal(
    tmp_path: Path,
) -> None:
    for quiet in (2.0, 4.0, 5.5, 7.0, 9.0, 12.0):
        clock = FakeClock()
        coord = WorkArrives(clock)
        coord.quiet = quiet
        agent = fleet_agent(tmp_path / str(quiet), int(quiet * 10), coord, clock, max_tasks=2)
        agent.run()
        assert coord.names("found")[0] - coord.arrives_at <= 1.2 + 1e-6, quiet


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 3) for a, b in zip(times, times[1:], strict=False)]
