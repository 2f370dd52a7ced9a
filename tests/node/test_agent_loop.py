"""The main loop against a fake coordinator, a fake runner and a fake clock."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.errors import CoordinatorUnavailable, Unregistered
from flashnode.evidence.inventory import registration
from flashnode.node.agent import Agent
from flashnode.sandbox.diskuse import Space
from flashnode.sandbox.limits import Limits


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
    # Doubling from ~0.5 s, each step jittered into [0.5, 1.0] of itself, capped at 8 s.
    steps = [0.5, 1, 2, 4, 8, 8, 8, 8]
    for gap, step in zip(idle, steps):
        assert 0.5 * step - 1e-6 <= gap <= step + 1e-6
    # After work the node claims about every second for a while (pacing.py's alert window).
    after_work = gaps(claims[9:12])
    assert all(0.6 - 1e-6 <= gap <= 1.2 + 1e-6 for gap in after_work)


def test_claims_again_at_once_after_an_attempt_ends(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0), lease(1), lease(2)])
    agent = make_agent(tmp_path, coord, clock, max_tasks=3)
    agent.run()
    assert [c[1] for c in coord.calls if c[1] in ("claim", "complete")] == ["claim", "complete"] * 3
    completes, claims = coord.names("complete"), coord.names("claim")
    assert claims[1] == completes[0] and claims[2] == completes[1]
    assert agent.workers.stats.outcomes == {"committed": 3}


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
    assert g[0] >= 0.5 and max(g) <= 60 + 1e-6
    assert all(b >= a * 0.49 for a, b in zip(g, g[1:]))  # non-decreasing up to jitter
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
    assert agent.workers.stats.outcomes == {"committed": 1}


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
    assert gaps(heartbeats)[1:] and all(4.49 <= g <= 5.51 for g in gaps(heartbeats)[1:-1])


def test_node_heartbeat_about_every_five_seconds_while_idle_and_a_last_one_on_exit(
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
    assert all(4.5 - 1e-6 <= g <= 5.5 + 1e-6 for g in gaps(beats)[:-1])
    assert [c[2] for c in coord.calls if c[1] == "node_heartbeat"][-1] == "terminating"


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
        space=lambda: Space(free["bytes"], 100 << 30, 1 << 20, 1 << 20),
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
    assert sum("below min_free_bytes" in r.message for r in caplog.records) == 1
    assert sum("claiming again" in r.message for r in caplog.records) == 1


def test_few_free_inodes_stop_claims_like_low_disk(tmp_path: Path) -> None:
    """Plenty of bytes but almost no inodes left: no file can be made, so the node holds
    claiming below min_free_bytes' share of the inodes (1 GiB of 100 GiB: 1% of them)."""
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0)])
    inodes = {"free": 5_000}
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=1, min_free_bytes=1 << 30)
    agent = Agent(
        ctx,
        coord,
        lambda current: registration(current, "node-1"),
        space=lambda: Space(50 << 30, 100 << 30, inodes["free"], 1_000_000),
    )
    held: list[str] = []
    original = coord.node_heartbeat

    def heartbeat(hb: object) -> None:
        held.extend(h.reason for h in agent.decision.holds if h.rule == "disk")
        if clock.now > 1030:
            inodes["free"] = 500_000
        original(hb)  # type: ignore[arg-type]

    coord.node_heartbeat = heartbeat  # type: ignore[method-assign,assignment]
    agent.run()
    claims = coord.names("claim")
    assert claims and claims[0] > 1030
    assert held and "5000 inodes free" in held[0] and "below 10000" in held[0], held


def test_gpus_are_reserved_at_claim_so_the_next_claim_sees_them_held(tmp_path: Path) -> None:
    import threading as th

    from flashnode.coordinator.messages import GpuInfo
    from flashnode.evidence.gpupool import Device, GpuPool

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0, gpus=1), lease(1, gpus=1), lease(2, gpus=1)])
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=3, slots=2)
    ctx = dataclasses.replace(
        ctx, gpus=GpuPool([Device(GpuInfo(index=i), str(i)) for i in range(2)])
    )
    deferred: list[object] = []
    seen: list[tuple[int, int]] = []

    def start_later(fn: object, name: str) -> None:
        if name.startswith("attempt-"):
            deferred.append(fn)

    ctx = dataclasses.replace(ctx, start_thread=start_later)
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
    assert len(coord.names("claim")) == 3 and agent.workers.stats.outcomes == {"committed": 3}
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

    ctx = dataclasses.replace(ctx, start_thread=start)
    agent = Agent(
        ctx, coord, lambda current: registration(current, "node-1"), reload=lambda: lowered
    )
    original_wait = clock.wait

    def wait(event: th.Event, timeout: float) -> bool:
        if deferred and agent.settings is lowered:
            deferred.pop(0)()  # type: ignore[operator]  # the reload came while it ran
            return True
        if deferred and not agent.reloader.requested:
            agent.request_reload()  # SIGHUP: lower the output cap under the running attempt
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    # The first attempt, claimed before the reload, kept its cap; the next one has the new one.
    outcomes = [(r["task_id"], r["outcome"], r["reason"]) for r in ctx.ledger.records()]
    assert outcomes[0] == ("task-000", "committed", "")
    assert outcomes[1][:2] == ("task-001", "failed") and "past 1 bytes" in outcomes[1][2]


def test_a_running_attempt_keeps_the_settings_and_limits_it_was_claimed_under_across_a_reload(
    tmp_path: Path,
) -> None:
    """A reload swaps the settings and the per-task limits as one: the attempt running through
    it starts its task with the limits it was claimed under, and reads its settings from the
    same snapshot; the next claim gets both new ones."""
    import threading as th

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0), lease(1)])
    runner = FakeRunner()
    ctx = context(tmp_path, clock, coord, runner, max_tasks=2)
    before = Limits(memory_bytes=1 << 30, cpus=2.0, pids=100)
    after = Limits(memory_bytes=1 << 29, cpus=1.0, pids=50)
    ctx = dataclasses.replace(ctx, limits=before)
    grace = ctx.settings.kill_grace_seconds
    reloaded = ctx.settings.model_copy(update={"kill_grace_seconds": grace + 3})
    seen: list[tuple[float, Limits]] = []
    deferred: list[Callable[[], None]] = []

    def start(fn: Callable[[], None], name: str) -> None:
        if name.startswith("attempt-"):
            deferred.append(fn)
        elif name == "reload":
            fn()

    ctx = dataclasses.replace(ctx, start_thread=start)
    agent = Agent(
        ctx,
        coord,
        lambda current: registration(current, "node-1"),
        reload=lambda: reloaded,
        limits=lambda new: after if new is reloaded else before,
    )
    original_wait = clock.wait

    def wait(event: th.Event, timeout: float) -> bool:
        if deferred and agent.settings is reloaded:
            attempt = agent.workers.attempts()[0]
            seen.append((attempt.ctx.settings.kill_grace_seconds, attempt.ctx.limits))
            deferred.pop(0)()  # the attempt runs on, after the reload came
            return True
        if deferred and not agent.reloader.requested:
            agent.request_reload()  # SIGHUP while the first attempt runs
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    assert len(runner.started) == 2
    assert seen[0] == (grace, before)
    assert runner.started[0].limits == before
    assert seen[1] == (grace + 3, after)
    assert runner.started[1].limits == after
    assert agent.workers.stats.outcomes == {"committed": 2}


def test_a_reload_on_its_own_thread_writes_nothing_the_loop_reads_until_its_next_turn(
    tmp_path: Path,
) -> None:
    """The reload's thread swaps the configuration and nothing else: the loop's own parts (the
    node's holds, the session with the coordinator) take the new settings on the loop's
    thread, at its next turn, where no attempt or rule reads them half changed."""
    import threading as th

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[None] * 6 + [lease(0)])
    ctx = context(tmp_path, clock, coord, FakeRunner(), max_tasks=1)
    new = ctx.settings.model_copy(update={"quarantine_after": 7, "pools": ("team-a", "team-b")})
    seen: list[tuple[int, bool, int]] = []
    agent: Agent

    def start(fn: Callable[[], None], name: str) -> None:
        if name == "reload":
            thread = th.Thread(target=fn, name=name)
            thread.start()
            thread.join()
            registered = agent.session.registered
            seen.append((agent.holds.quarantine.after, registered, len(coord.names("register"))))
        else:
            inline(fn, name)

    inline = ctx.start_thread
    ctx = dataclasses.replace(ctx, start_thread=start)
    agent = Agent(ctx, coord, lambda current: registration(current, "node-1"), reload=lambda: new)
    original_wait = clock.wait

    def wait(event: th.Event, timeout: float) -> bool:
        if agent.session.registered and not seen and not agent.reloader.requested:
            agent.request_reload()
        return original_wait(event, timeout)

    clock.wait = wait  # type: ignore[method-assign]
    agent.run()
    assert agent.reloader.current.settings is new
    assert seen == [(5, True, 1)]  # as the reload's thread left them
    assert agent.holds.quarantine.after == 7
    registered = [arg for _, name, arg in coord.calls if name == "register"]
    assert [r.capabilities.pools for r in registered] == [["team-a"], ["team-a", "team-b"]]
    assert agent.workers.outcomes() == {"committed": 1}


# --- the node's own holds: the black-hole guard, the backoff after a revoked lease -----------


def held_agent(
    tmp_path: Path,
    coord: FakeCoordinator,
    clock: FakeClock,
    runner: FakeRunner,
    health: object = None,
    **settings: object,
) -> Agent:
    """An agent whose attempts and quarantine checks run inline."""
    ctx = context(tmp_path, clock, coord, runner, **settings)

    def start(fn: object, name: str) -> None:
        if name.startswith("attempt-") or name == "quarantine-check":
            fn()  # type: ignore[operator]

    ctx = dataclasses.replace(ctx, start_thread=start)
    return Agent(
        ctx,
        coord,
        lambda current: registration(current, "node-1"),
        health=health,  # type: ignore[arg-type]
    )


def stop_at(agent: Agent, clock: FakeClock, coord: FakeCoordinator, at: float) -> list[str]:
    """Stop the agent at ``at`` on the fake clock; what it said it was held by, turn by turn."""
    held: list[str] = []
    original = coord.node_heartbeat

    def heartbeat(hb: object) -> None:
        held.append(agent.decision.hold_reason or "")
        if clock.now >= at:
            agent.request_stop()
        original(hb)  # type: ignore[arg-type]

    coord.node_heartbeat = heartbeat  # type: ignore[method-assign,assignment]
    return held


def test_a_node_that_lapses_attempt_after_attempt_quarantines_itself_until_its_checks_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(n, job=f"j{n}") for n in range(8)])
    runner = FakeRunner()
    runner.lapse = "container engine unavailable (ConnectionError)"
    checks: list[float] = []

    def health(settings: object) -> list[str]:
        checks.append(clock.now)
        if clock.now > 1400:  # the owner fixed the node by then
            runner.lapse = ""
            return []
        return ["docker: no engine answers; fix: start the Docker engine"]

    agent = held_agent(
        tmp_path, coord, clock, runner, health, quarantine_after=3, quarantine_check_seconds=120
    )
    held = stop_at(agent, clock, coord, 1700)
    with caplog.at_level(logging.INFO):
        agent.run()
    claims = coord.names("claim")
    outcomes = [r["outcome"] for r in agent.ctx.ledger.records()]
    assert outcomes[:3] == ["lapsed"] * 3 and set(outcomes[3:]) == {"committed"}
    # No claim between the third lapse and the first check that passed (every 120 s).
    assert claims[3] > 1400 and claims[3] - claims[2] >= 120
    assert checks[0] == claims[2] and all(b - a >= 119.9 for a, b in zip(checks, checks[1:]))
    why = next(h for h in held if "quarantined" in h)
    assert "3 attempts in a row ended through this node's fault" in why
    assert "container engine unavailable" in why and "no engine answers" in why
    assert sum("quarantined:" in r.message for r in caplog.records) <= 2  # not once per turn
    assert any("quarantine ends" in r.message for r in caplog.records)


def test_fast_failures_across_jobs_quarantine_a_node_whose_checks_fail_but_one_jobs_do_not(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    one_job = FakeCoordinator(clock, claims=[lease(n) for n in range(4)])
    (tmp_path / "a").mkdir()
    agent = held_agent(
        tmp_path / "a", one_job, clock, FakeRunner(code=1), quarantine_after=3, max_tasks=4
    )
    agent.run()
    assert len(one_job.names("claim")) == 4  # a broken job fails on every node: not our fault
    assert agent.holds.quarantine.hold() is None

    clock = FakeClock()
    jobs = FakeCoordinator(clock, claims=[lease(n, job=f"j{n % 2}") for n in range(4)])
    agent = held_agent(
        tmp_path, jobs, clock, FakeRunner(code=1), lambda s: ["python: broken"], quarantine_after=3
    )
    stop_at(agent, clock, jobs, 1100)
    agent.run()
    assert len(jobs.names("claim")) == 3
    hold = agent.holds.quarantine.hold()
    assert hold is not None and "3 attempts of 2 jobs in a row failed within 60 s" in hold.reason
    assert "exit code 1" in hold.reason and "its checks fail: python: broken" in hold.reason


def test_fast_failures_across_jobs_do_not_quarantine_a_node_whose_checks_pass(
    tmp_path: Path,
) -> None:
    """Two jobs whose tasks fail at once (``exit 1``) are their authors' doing: the node runs
    its checks, and as they pass, it claims on."""
    clock = FakeClock()
    checks: list[float] = []
    jobs = FakeCoordinator(clock, claims=[lease(n, job=f"j{n % 2}") for n in range(7)])
    agent = held_agent(
        tmp_path,
        jobs,
        clock,
        FakeRunner(code=1),
        lambda s: checks.append(clock.now) or [],
        quarantine_after=3,
        max_tasks=7,
    )
    agent.run()
    claims = jobs.names("claim")
    assert len(claims) == 7 and agent.holds.quarantine.hold() is None
    assert claims[-1] - claims[0] < 1  # never held for a check interval
    assert len(checks) == 2  # after the third failure in a row, and again after the sixth


def test_one_success_resets_the_count(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(n, job=f"j{n}") for n in range(5)])
    runner = FakeRunner()
    outcomes = iter(["sandbox failing", "sandbox failing", "", "sandbox failing", ""])
    original = runner.check

    def check(task: object) -> None:
        runner.lapse = next(outcomes)
        original(task)  # type: ignore[arg-type]

    runner.check = check  # type: ignore[method-assign]
    agent = held_agent(tmp_path, coord, clock, runner, quarantine_after=3, max_tasks=5)
    agent.run()
    assert len(coord.names("claim")) == 5 and agent.holds.quarantine.hold() is None


def test_endings_that_are_not_the_nodes_fault_neither_count_nor_reset() -> None:
    from flashnode.attempt.record import Outcome
    from flashnode.node.guard import Ending, Quarantine

    q = Quarantine(3, 60, FakeClock())
    fault = Ending(Outcome.LAPSED, "disk full (No space left on device)", "j", node_fault=True)
    q.record(fault)
    q.record(fault)
    for neutral in (
        Ending(Outcome.LAPSED, "node draining", "j"),  # a drain, a stop, a pause --now
        Ending(Outcome.LOST, "lease lost (410)", "j"),
        Ending(Outcome.REJECTED, "", "j"),
        Ending(Outcome.FAILED, "exit code 1", "j", seconds=3600.0),  # slow: the task's own
    ):
        q.record(neutral)
    assert q.hold() is None and q.streak == 0  # the slow failure broke the streak
    for _ in range(3):
        q.record(fault)
    hold = q.hold()
    assert hold is not None and hold.rule == "quarantine" and "disk full" in hold.reason


def test_one_jobs_dead_endpoints_never_quarantine_a_node_but_two_jobs_do() -> None:
    """Lapses at endpoints a job named (its data origin, its package index) say nothing of this
    node while one job has them: that job could bench every node it lands on. Once they span
    two jobs, they count like any node fault: a node whose own network is down fails every job
    alike. A node fault of any other kind counts as it always did."""
    from flashnode.attempt.record import Outcome
    from flashnode.node.guard import Ending, Quarantine

    def origin(job: str) -> Ending:
        why = f"dataset entry ds/a.bin: origin unreachable (connection refused) (4 tries) {job}"
        return Ending(Outcome.LAPSED, why, job, node_fault=True, job_endpoint=True)

    q = Quarantine(3, 60, FakeClock())
    for _ in range(10):
        q.record(origin("j1"))
    assert q.hold() is None and q.streak == 0
    q.record(origin("j2"))  # a second job: the network, most likely, is this node's
    hold = q.hold()
    assert hold is not None and "11 attempts in a row" in hold.reason, hold

    q = Quarantine(3, 60, FakeClock())
    disk = Ending(Outcome.LAPSED, "disk full (No space left on device)", "j1", node_fault=True)
    for ending in (disk, origin("j1"), disk):
        q.record(ending)
    assert q.hold() is None and q.streak == 2  # the job's own endpoint counts for nothing...
    q.record(Ending(Outcome.COMMITTED, "", "j3"))
    for ending in (origin("j1"), origin("j1"), disk, disk):
        q.record(ending)
    assert q.hold() is None  # ... nor breaks a row: a commit does
    q.record(disk)
    assert q.hold() is not None


def test_lapses_past_the_disks_room_across_jobs_quarantine_only_when_the_checks_fail() -> None:
    """Tasks of two jobs stopped past the room the disk had for them: the row has the node's
    checks run first (claiming nothing meanwhile); passing, it claims on and the row is over;
    failing (the disk is still short), the node is quarantined."""
    from flashnode.attempt.record import Outcome
    from flashnode.node.guard import Ending, Quarantine

    def outgrew(job: str) -> Ending:
        why = "the state dir's disk had only 31.0 MiB free above min_free_bytes when ..."
        return Ending(Outcome.LAPSED, why, job, True, 5.0, job_endpoint=True, outgrew_room=True)

    for problems in ([], ["state dir: 15 MiB free, below min_free_bytes (32 MiB)"]):
        q = Quarantine(3, 60, FakeClock())
        for job in ("j1", "j2", "j1"):
            q.record(outgrew(job))
        hold = q.hold()
        assert hold is not None and hold.reason.startswith("checking this node"), hold
        assert q.check_due()
        q.checked(problems)
        hold = q.hold()
        if problems:
            assert hold is not None and "quarantined" in hold.reason, hold
        else:
            assert hold is None and q.streak == 0


def test_a_task_starting_beside_running_ones_gets_only_the_room_they_leave(tmp_path: Path) -> None:
    """Each running task's caps less what it holds are set aside: the next task's cap is the
    rest of the room above min_free_bytes, and none once they take it all (it does not start,
    and the node's disk hold claims nothing meanwhile)."""
    from flashnode.attempt.diskwatch import Reserved, no_room
    from flashnode.config.settings import Settings
    from flashnode.errors import NoRoom
    from flashnode.sandbox.outputs import Usage

    s = Settings(coordinator="http://127.0.0.1:1", state_dir=tmp_path, min_free_bytes=16 << 20)
    space = Space(64 << 20, 64 << 20, 0, 0)
    empty = Usage(0, 0, 0, 0)
    reserved = Reserved()
    assert reserved.start("a", s, empty, space).bytes == 48 << 20
    reserved.held("a", 40 << 20, 10)  # 40 MiB written, 8 MiB more it may write
    now = Space(24 << 20, 64 << 20, 0, 0)
    left = reserved.left(now)
    assert left is not None and no_room(left, s.min_free_bytes), left
    with pytest.raises(NoRoom):
        reserved.start("b", s, empty, now)
    assert reserved.start("b", s, empty, Space(34 << 20, 64 << 20, 0, 0)).bytes == 10 << 20
    reserved.end("a")
    reserved.end("b")
    assert reserved.left(space) == space


def test_a_lease_revoked_by_the_watchdog_is_not_claimed_straight_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from flashnode.errors import LeaseLost

    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0), lease(0), lease(1), lease(2)])
    runner = FakeRunner()
    revoked = LeaseLost(
        "attempt heartbeat: 410 lease ls-000000000000 revoked: no progress within 3s"
    )
    errors = iter([revoked, revoked, None, None])
    original = runner.start

    def start(spec: object) -> object:
        runner.start_error = next(errors)
        return original(spec)  # type: ignore[arg-type]

    runner.start = start  # type: ignore[method-assign,assignment]
    agent = held_agent(tmp_path, coord, clock, runner, max_tasks=4)
    held = stop_at(agent, clock, coord, 5000)
    with caplog.at_level(logging.INFO):
        agent.run()
    claims = coord.names("claim")
    g = gaps(claims)
    assert 48 <= g[0] <= 60.5  # about a minute after the first revocation
    assert 96 <= g[1] <= 120.5  # doubled after the second in a row
    assert g[2] < 1  # a commit resets it: back to claiming at once
    assert any("watchdog revoked lease ls-000000000000" in h for h in held)
    assert any("not claiming for" in r.message for r in caplog.records)
    assert [r["outcome"] for r in agent.ctx.ledger.records()] == [
        "lost",
        "lost",
        "committed",
        "committed",
    ]


def test_gpus_found_after_the_start_add_no_slot_the_runner_never_made(tmp_path: Path) -> None:
    """With ``slots = "auto"`` a slot per GPU, but only as many as at the start: the runner made
    users and sandboxes for those, and a slot past them would fail its task as the node's bug."""
    from flashnode.coordinator.messages import GpuInfo
    from flashnode.evidence.gpupool import Device, GpuPool

    clock = FakeClock()
    ctx = context(tmp_path, clock, FakeCoordinator(clock), FakeRunner(), slots="auto")
    ctx = dataclasses.replace(ctx, gpus=GpuPool([Device(GpuInfo(index=0), "0")]))
    agent = Agent(ctx, FakeCoordinator(clock), lambda current: registration(current, "node-1"))
    assert agent.workers.slots(agent.settings) == 1
    ctx.gpus.set_devices([Device(GpuInfo(index=i), str(i)) for i in range(3)])  # hot-plugged
    assert agent.workers.slots(agent.settings) == 1


def test_the_stop_line_says_in_words_how_the_attempts_ended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a Python dict (``{'committed': 2}``): words an owner reads in the journal."""
    clock = FakeClock()
    coord = FakeCoordinator(clock, claims=[lease(0), lease(1)])
    agent = make_agent(tmp_path, coord, clock, max_tasks=2)
    with caplog.at_level(logging.INFO):
        agent.run()
    [stopped] = [r.getMessage() for r in caplog.records if "agent stopped" in r.getMessage()]
    assert stopped == "agent stopped: 2 attempts ended: 2 committed"


def test_the_stop_lines_words_for_none_one_and_several_outcomes() -> None:
    from flashnode.node.workers import describe_outcomes

    assert describe_outcomes({}) == "no attempt ended"
    assert describe_outcomes({"failed": 1}) == "1 attempt ended: failed"
    many = {"lost": 1, "failed": 2, "committed": 3}
    assert describe_outcomes(many) == "6 attempts ended: 3 committed, 2 failed, 1 lost"
    # A task let go of for the next start has not ended.
    assert describe_outcomes({"committed": 7, "detached": 1}) == (
        "7 attempts ended: 7 committed; 1 task left running for the next start"
    )
    assert describe_outcomes({"detached": 2}) == (
        "no attempt ended; 2 tasks left running for the next start"
    )
