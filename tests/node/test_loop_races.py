"""The loop against races with the owner's signals: a reload that lands while the node heartbeat
is in flight claims nothing under the registration it replaces, and a stop requested in the
middle of a turn still drains. Each test is the race, made to happen with a fake clock and
threads run where the race needs them."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fakes import (
    FakeClock,
    FakeCoordinator,
    FakeRunner,
    context,
    inline_threads,
    lease,
    trusted_runner,
)

from flashnode.coordinator.lease import Lease, parse_task
from flashnode.coordinator.messages import NodeHeartbeat, NodeRegistration
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.evidence.inventory import registration
from flashnode.node.agent import Agent


class PoolCoordinator(FakeCoordinator):
    """Hands out its leases only to a node whose latest registration serves the lease's pool,
    as the real coordinator places them."""

    def __init__(self, clock: FakeClock, leases: list[dict[str, Any]]) -> None:
        super().__init__(clock)
        self.queue = leases
        self.pools: list[str] = []

    def register(self, reg: NodeRegistration) -> str:
        self.pools = list(reg.capabilities.pools)
        return super().register(reg)

    def claim(self, node_id: str) -> dict[str, Any] | None:
        self._log("claim", tuple(self.pools))
        for i, found in enumerate(self.queue):
            if found["payload"]["pool"] in self.pools:
                return self.queue.pop(i)
        return None


def test_a_reload_that_lands_while_the_heartbeat_is_in_flight_claims_nothing_under_the_old_pools(
    tmp_path: Path,
) -> None:
    """The owner drops pool team-a (they stopped trusting it) and reloads. The reload's thread
    finishes while the node heartbeat is in flight (a slow coordinator: seconds). The session
    checked the settings before the heartbeat, the reloader is no longer busy after it, so the
    loop claims in the same turn under the registration that still serves team-a: a team-a
    lease arrives, the attempt (snapshot: the new settings) refuses it as a pool the node does
    not serve, and reports ``fail``: the task's failure budget is spent for the owner's reload.
    Before the split the reload's thread unset ``registered`` itself, and no claim could follow
    until the node had registered again with its new pools."""
    clock = FakeClock()
    coord = PoolCoordinator(clock, [lease(0)])  # a team-a lease waits in the queue
    runner = trusted_runner(("team-a",))
    ctx = context(tmp_path, clock, coord, runner, max_tasks=1)
    new = ctx.settings.model_copy(update={"pools": ("team-b",)})
    pending: list[Callable[[], None]] = []

    def start(fn: Callable[[], None], name: str) -> None:
        if name == "reload":
            pending.append(fn)  # the reload's thread: it runs while the heartbeat is in flight
        else:
            inline_threads(fn, name)

    ctx = dataclasses.replace(ctx, start_thread=start)
    agent = Agent(ctx, coord, lambda current: registration(current, "node-1"), reload=lambda: new)
    register, heartbeat = coord.register, coord.node_heartbeat

    def registered(reg: NodeRegistration) -> str:
        node = register(reg)
        if list(reg.capabilities.pools) == ["team-a"]:
            agent.request_reload()  # SIGHUP right after the node joined
        return node

    def beat(hb: NodeHeartbeat) -> None:
        heartbeat(hb)
        while pending:  # the reload's thread ends during this (slow) call
            pending.pop(0)()
        if clock.now > 1030:
            agent.request_stop()

    coord.register = registered  # type: ignore[method-assign]
    coord.node_heartbeat = beat  # type: ignore[method-assign,assignment]
    original_wait = clock.wait

    def wait(event: threading.Event, timeout: float) -> bool:
        if clock.now > 1060:
            agent.request_stop()
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    assert agent.reloader.current.settings is new
    claimed_under = [arg for _, name, arg in coord.calls if name == "claim"]
    assert ("team-a",) not in claimed_under, "a claim went out under the pools the owner dropped"
    assert coord.names("fail") == [], "the task was failed for the owner's reload"


def test_a_stop_requested_while_the_turn_weighs_the_owner_controls_still_drains(
    tmp_path: Path,
) -> None:
    """``flashnode drain`` (a package's removal) is a drain: running attempts get
    ``drain_seconds`` to finish. The signal handler only sets a flag, at any moment of a turn.
    Arriving after ``Drain.tick`` but before ``Drain.stopping`` (while the owner controls are
    evaluated, or the ledger flushed), ``stopping`` sees a drain whose deadline was never set
    (0.0) and stops every running attempt at once: their work is lost, the drain skipped."""
    from flashnode.node.decision import Decision

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    deferred: list[Callable[[], None]] = []
    ctx = context(tmp_path, clock, coord, FakeRunner(), drain_seconds=600)

    def start(fn: Callable[[], None], name: str) -> None:
        if name.startswith("attempt-"):
            deferred.append(fn)  # the attempt runs on its own thread, for a while
        else:
            inline_threads(fn, name)

    ctx = dataclasses.replace(ctx, start_thread=start)
    agent: Agent
    asked: list[float] = []

    class Controls:
        def evaluate(self) -> Decision:
            if agent.workers.running() and not asked:
                asked.append(clock.now)
                agent.request_drain()  # `flashnode drain` lands while the rules are weighed
            return Decision()

        def reconfigure(self, rules: object) -> None:
            pass

    agent = Agent(
        ctx,
        coord,
        lambda current: registration(current, "node-1"),
        controls=Controls(),  # type: ignore[arg-type]
    )
    original_wait = clock.wait

    def wait(event: threading.Event, timeout: float) -> bool:
        if deferred and asked:
            deferred.pop(0)()  # the attempt goes on to its end, well inside the drain
            return True
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    assert agent.workers.outcomes() == {"committed": 1}, agent.workers.last_ended


def test_a_pool_the_owner_left_after_the_claim_is_refused_without_blaming_the_task() -> None:
    """A lease claimed while the node served team-a reaches the runner after the owner left
    team-a (a reload during the claim call): the runner refuses it, the owner's latest word, but
    lets the lease lapse instead of failing the task; a pool the node did not serve when it
    claimed is still the task's fault."""
    runner = trusted_runner(("team-b",))  # reloaded: team-a left
    claimed_under = runner.settings.model_copy(update={"pools": ("team-a",)})
    task = parse_task(Lease.model_validate(lease(0)))
    with pytest.raises(AttemptLapsed, match="since this lease was claimed"):
        runner.check(task, claimed_under)
    with pytest.raises(AttemptFailed, match="not one this node serves"):
        runner.check(task, runner.settings)
