"""The main loop against a fake coordinator, a fake runner and a fake clock."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.agent import Agent
from flashnode.errors import CoordinatorUnavailable, CredentialsError, Unregistered
from flashnode.inventory import registration


def make_agent(
    tmp_path: Path, coordinator: FakeCoordinator, clock: FakeClock, **settings: object
) -> Agent:
    ctx = context(tmp_path, clock, coordinator, FakeRunner(), **settings)
    return Agent(ctx, coordinator, lambda current: registration(current, "node-1"))


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 3) for a, b in zip(times, times[1:])]


def test_empty_queue_backs_off_with_jitter_up_to_the_cap_and_resets_on_work(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[None] * 8 + [lease(0)] + [None, None] + [lease(1)])
    agent = make_agent(tmp_path, coord, clock, max_tasks=2)
    agent.run()
    claims = coord.names("claim")
    idle = gaps(claims[:9])
    # Doubling from ~0.5 s, each step jittered into [0.8, 1.0] of itself, capped at 7 s.
    steps = [0.5, 1, 2, 4, 7, 7, 7, 7]
    for gap, step in zip(idle, steps):
        assert 0.8 * step - 1e-6 <= gap <= step + 1e-6
    # After work the backoff starts over at ~0.5 s.
    after_work = gaps(claims[9:12])
    assert after_work[0] <= 0.5 + 1e-6


def test_claims_again_at_once_after_an_attempt_ends(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0), lease(1), lease(2)])
    agent = make_agent(tmp_path, coord, clock, max_tasks=3)
    agent.run()
    assert [c[1] for c in coord.calls if c[1] in ("claim", "complete")] == ["claim", "complete"] * 3
    completes, claims = coord.names("complete"), coord.names("claim")
    assert claims[1] == completes[0] and claims[2] == completes[1]
    assert agent.stats.outcomes == {"committed": 3}


def test_transport_errors_back_off_exponentially_and_log_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    errors = [CoordinatorUnavailable("connection refused") for _ in range(12)]
    coord = FakeCoordinator(clock, claims=[*errors, lease(0)])
    agent = make_agent(tmp_path, coord, clock, max_tasks=1)
    with caplog.at_level(logging.INFO):
        agent.run()
    claims = coord.names("claim")
    assert len(claims) == 13
    g = gaps(claims)
    assert g[0] >= 0.8 and max(g) <= 60 + 1e-6
    assert all(b >= a * 0.79 for a, b in zip(g, g[1:]))  # non-decreasing up to jitter
    assert sum(g) > 200  # no tight loop: 12 failures spread over minutes
    assert sum("claim failing" in r.message for r in caplog.records) == 1
    assert sum("claim works again" in r.message for r in caplog.records) == 1


def test_claim_403_unregistered_registers_again_and_claims(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[Unregistered("unregistered node"), lease(0)])
    agent = make_agent(tmp_path, coord, clock, max_tasks=1)
    agent.run()
    names = [c[1] for c in coord.calls]
    assert names[:2] == ["register", "node_heartbeat"]
    i = names.index("claim")
    assert names[i : i + 3] == ["claim", "register", "claim"]
    assert agent.stats.outcomes == {"committed": 1}


def test_node_heartbeat_404_registers_again(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, heartbeat_errors=[Unregistered("unknown node")])
    agent = make_agent(tmp_path, coord, clock)
    coord.claims = [None] * 3

    def stop_after_ten_seconds() -> None:
        if clock.now > 1010:
            agent.request_stop()

    original = coord.claim
    coord.claim = lambda node_id: (stop_after_ten_seconds(), original(node_id))[1]  # type: ignore[method-assign]
    agent.run()
    registers = coord.names("register")
    assert len(registers) == 2
    heartbeats = coord.names("node_heartbeat")
    assert gaps(heartbeats)[1:] and all(4.99 <= g <= 5.01 for g in gaps(heartbeats)[1:-1])


def test_node_heartbeat_every_five_seconds_while_idle_and_a_last_one_on_exit(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    agent = make_agent(tmp_path, coord, clock)
    original = coord.claim

    def claim(node_id: str) -> object:
        if clock.now > 1030:
            agent.request_stop()
        return original(node_id)

    coord.claim = claim  # type: ignore[method-assign,assignment]
    agent.run()
    beats = coord.names("node_heartbeat")
    assert len(beats) >= 6
    assert all(abs(g - 5.0) < 1e-6 for g in gaps(beats)[:-1])
    assert [c[2] for c in coord.calls if c[1] == "node_heartbeat"][-1] == "terminating"


def test_refused_credentials_end_the_agent(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[CredentialsError("401 invalid or missing node token")])
    agent = make_agent(tmp_path, coord, clock)
    with pytest.raises(CredentialsError):
        agent.run()


def test_low_disk_stops_claims_and_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    free = {"bytes": 10 << 20}
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=1)
    agent = Agent(
        ctx,
        coord,
        lambda current: registration(current, "node-1"),
        free_bytes=lambda: free["bytes"],
    )
    original = coord.node_heartbeat

    def heartbeat(hb: object) -> None:
        if clock.now > 1030:
            free["bytes"] = 10 << 30
        original(hb)  # type: ignore[arg-type]

    coord.node_heartbeat = heartbeat  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.INFO):
        agent.run()
    claims = coord.names("claim")
    assert claims and claims[0] > 1030  # no claim while below the floor
    assert sum("below the" in r.message for r in caplog.records) == 1
    assert sum("claiming again" in r.message for r in caplog.records) == 1


def test_gpus_are_reserved_at_claim_so_the_next_claim_sees_them_held(tmp_path: Path) -> None:
    import threading as th

    from flashnode.gpupool import Device, GpuPool
    from flashnode.wire import GpuInfo

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0, gpus=1), lease(1, gpus=1), lease(2, gpus=1)])
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=3, slots=2)
    ctx.gpus = GpuPool([Device(GpuInfo(index=i), str(i)) for i in range(2)])
    deferred: list[object] = []
    seen: list[tuple[int, int]] = []

    def start_later(fn: object, name: str) -> None:
        if name.startswith("attempt-"):
            deferred.append(fn)

    ctx.start_thread = start_later  # type: ignore[assignment]
    agent = Agent(ctx, coord, lambda current: registration(current, "node-1"))
    original_wait = clock.wait

    def wait(event: th.Event, timeout: float) -> bool:
        if deferred:  # the attempts start only once the loop has claimed what it may
            seen.append((len(deferred), ctx.gpus.free))
            deferred.pop(0)()  # type: ignore[operator]
            return True
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    assert seen[0] == (2, 0)  # two claims, both GPUs held before either attempt ran
    assert len(coord.names("claim")) == 3 and agent.stats.outcomes == {"committed": 3}
    assert ctx.gpus.free == 2


def test_an_attempt_keeps_the_settings_it_was_claimed_under_across_a_reload(
    tmp_path: Path,
) -> None:
    import threading as th

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0), lease(1)])
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=2)
    lowered = ctx.settings.model_copy(update={"max_output_total_bytes": 1})
    deferred: list[object] = []

    def start(fn: object, name: str) -> None:
        if name.startswith("attempt-"):
            deferred.append(fn)
        elif name == "reload":
            fn()  # type: ignore[operator]

    ctx.start_thread = start  # type: ignore[assignment]
    agent = Agent(
        ctx, coord, lambda current: registration(current, "node-1"), reload=lambda: lowered
    )
    original_wait = clock.wait

    def wait(event: th.Event, timeout: float) -> bool:
        if deferred and agent.settings is lowered:
            deferred.pop(0)()  # type: ignore[operator]  # the reload came while it ran
            return True
        if deferred and not agent._reload_requested:
            agent.request_reload()  # SIGHUP: lower the output cap under the running attempt
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    # The first attempt, claimed before the reload, kept its cap; the next one has the new one.
    outcomes = [(r["task_id"], r["outcome"], r["reason"]) for r in ctx.ledger.records()]
    assert outcomes[0] == ("task-000", "committed", "")
    assert outcomes[1][:2] == ("task-001", "failed") and "larger than 1 bytes" in outcomes[1][2]
