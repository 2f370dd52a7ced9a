"""Never lose a computed result: coordinator outages and restarts, agent restarts, drain, reload;
and a result kept for the next start is nobody's but the agent's meanwhile. Real coordinator,
real agent processes, and a TCP proxy that stalls or resets connections."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import DRAIN, AgentProcess, CoordinatorServer, argv_job, shared_dir, wait_for
from proxy import Proxy

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
METRICS = "echo '{\"ok\": 1}' > metrics.json"


def slow_task(seconds: int) -> list[str]:
    return ["sh", "-c", f"sleep {seconds}; {METRICS}"]


def journal_state(agent: AgentProcess) -> str | None:
    records = list((agent.state_dir / "outbox").glob("*.json"))
    if not records:
        return None
    try:
        return str(json.loads(records[0].read_text()).get("state"))
    except (OSError, ValueError):
        return None


@pytest.fixture
def proxy(coordinator: CoordinatorServer) -> Iterator[Proxy]:
    p = Proxy(coordinator.port)
    yield p
    p.close()


def test_result_computed_across_a_coordinator_outage_commits(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(slow_task(10), lease_seconds=60))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for("the task to be leased", lambda: coordinator.tasks(job)[0]["state"] == "LEASED")
    coordinator.stop()
    time.sleep(20)  # the outage itself: the task finishes while the coordinator is away
    coordinator.start()  # same port and data: it forgot the node, it kept the lease
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    [task] = coordinator.tasks(job)
    assert task["attempts"] == 1  # committed by the attempt that ran through the outage
    wait_for(
        "the commit in the ledger",
        lambda: agent.ledger() and agent.ledger()[-1]["outcome"] == "committed",
    )


def test_agent_killed_before_its_commit_commits_after_restart(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], proxy: Proxy
) -> None:
    job = coordinator.submit(argv_job(slow_task(2), lease_seconds=60))
    first = start_agent(proxy.url, *TRUSTED, env=FAST)
    wait_for("the claim", lambda: journal_state(first) == "running")
    proxy.set_mode("stall")  # the upload will hang
    wait_for("the task to finish (outbox)", lambda: journal_state(first) == "finished", timeout=30)
    first.proc.kill()
    first.proc.wait()
    proxy.set_mode("forward")
    second = start_agent(proxy.url, *TRUSTED, env=FAST, state_dir=first.state_dir)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert coordinator.tasks(job)[0]["attempts"] == 1
    wait_for(
        "the resumed commit in the ledger",
        lambda: second.ledger() and second.ledger()[-1]["outcome"] == "committed",
    )
    assert "resuming the commit" in second.log


def test_a_drain_lets_a_running_task_finish_and_commit(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(slow_task(5)))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for("the task to be leased", lambda: coordinator.tasks(job)[0]["state"] == "LEASED")
    agent.signal(DRAIN)
    assert agent.wait(30) == 0, agent.log
    assert coordinator.job(job)["state"] == "SUCCEEDED"
    assert "draining" in agent.log


def test_a_drain_past_its_deadline_lets_the_lease_lapse_without_spending_failures(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(slow_task(60), max_attempts=2))
    agent = start_agent(coordinator.url, *TRUSTED, env={**FAST, "FLASHNODE_DRAIN_SECONDS": "1"})
    wait_for("the task to be leased", lambda: coordinator.tasks(job)[0]["state"] == "LEASED")
    agent.signal(DRAIN)
    assert agent.wait(30) == 0, agent.log
    # Draining is the node's doing, not the task's: no `fail` (which would spend the task's
    # failure budget); the lease lapses (the expiry budget, meant for churn) and the ledger says
    # why.
    assert [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"] == []
    [entry] = agent.ledger()
    assert (entry["outcome"], entry["reason"]) == ("lapsed", "node draining")
    assert not any(agent.state_dir.joinpath("attempts").iterdir())


def test_connection_resets_for_30_s_lose_nothing_and_stay_bounded(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], proxy: Proxy
) -> None:
    job = coordinator.submit(argv_job(slow_task(15), lease_seconds=60))
    agent = start_agent(proxy.url, *TRUSTED, env=FAST)
    wait_for("the claim", lambda: journal_state(agent) == "running")
    proxy.set_mode("reset")
    time.sleep(30)  # the outage itself: the task finishes while every connection is reset
    proxy.set_mode("forward")
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    assert coordinator.tasks(job)[0]["attempts"] == 1
    # Node heartbeats every 5 s, lease renewals and upload retries with backoff: no tight loop.
    assert 3 <= proxy.connections["reset"] <= 40, proxy.connections


def test_sighup_reloads_pools_and_takes_the_new_pools_work(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    config = tmp_path / "flashnode.toml"
    config.write_text('runner = "trusted"\npools = ["team-a"]\n')
    job = coordinator.submit(argv_job(["sh", "-c", METRICS], pool="team-b"))
    agent = start_agent(coordinator.url, "--config", str(config), env=FAST)
    agent.wait_log("registered as node")
    assert coordinator.tasks(job)[0]["attempts"] == 0
    config.write_text('runner = "trusted"\npools = ["team-a", "team-b"]\n')
    agent.signal(signal.SIGHUP)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=30) == "SUCCEEDED"
    assert "configuration reloaded: pools team-a,team-b" in agent.log


def test_a_reload_lowering_the_output_cap_leaves_the_running_task_its_own(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
    drop_dir: Path,
) -> None:
    config = tmp_path / "flashnode.toml"
    config.write_text('runner = "trusted"\npools = ["team-a"]\nmax_output_total_bytes = "10M"\n')
    started, go = drop_dir / "started", drop_dir / "go"
    script = (
        "head -c 2000000 /dev/zero > blob;"
        f" touch {started}.{{n}}; while [ ! -e {go} ]; do sleep 0.1; done;"
        " echo '{{\"ok\": 1}}' > metrics.json"  # braces doubled: the command is a template
    )
    coordinator.submit(argv_job(["sh", "-c", script], params=[{"n": 0}, {"n": 1}], max_attempts=1))
    agent = start_agent(coordinator.url, "--config", str(config), env=FAST)
    wait_for("the first task to write its 2 MB", lambda: Path(f"{started}.0").exists())
    config.write_text('runner = "trusted"\npools = ["team-a"]\nmax_output_total_bytes = "1M"\n')
    agent.signal(signal.SIGHUP)
    agent.wait_log("configuration reloaded")
    go.touch()  # its outputs are checked (while it runs and after) under the reloaded settings
    ledger = agent.wait_ledger(2, timeout=60)
    by_task = {r["task_id"]: r for r in ledger}
    # Claimed under a 10 MB cap, it keeps it; the next claim gets the reloaded 1 MB.
    assert by_task["task-000"]["outcome"] == "committed", by_task["task-000"]
    assert by_task["task-001"]["outcome"] == "failed"
    assert "1048576 bytes" in by_task["task-001"]["reason"]


@pytest.mark.usefixtures("as_root")
def test_a_result_kept_for_the_next_start_is_out_of_reach_of_the_slots_later_tasks() -> None:
    """The agent stops while a finished result is being committed: the result stays in the
    outbox, and its workspace for the next start to commit. The slot's later tasks run as the
    same user as the task that wrote it; one of them, knowing the lease id (every task sees
    its own in its cgroup, and the tree's), reads the other job's result by its host path, or
    changes it before it is committed. The kept workspace is sealed: the agent's, mode 0700."""
    from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

    from flashnode.attempt import Attempt
    from flashnode.errors import Stopped
    from flashnode.runners.base import Handle
    from flashnode.runners.plan import TaskPlan
    from flashnode.sandbox.removal import remove_tree

    user = pwd.getpwnam("flashnode-task-0")
    top = shared_dir("flashnode-kept-")  # a path every user can reach, up to the state dir
    top.chmod(0o711)
    state_dir = top / "state"
    (state_dir / "attempts").mkdir(parents=True)
    for d in (state_dir, state_dir / "attempts"):
        d.chmod(0o711)  # as a root agent with the trusted runner makes them

    class SlotUser(FakeRunner):
        def start(self, plan: TaskPlan) -> Handle:
            handle = super().start(plan)
            ws = plan.workspace
            (ws.out / "metrics.json").write_text('{"secret": "of another job"}')
            ws.hand_over(user.pw_uid, user.pw_gid, inputs_for="group")
            os.chown(ws.out / "metrics.json", user.pw_uid, user.pw_gid)
            return handle

    clock = FakeClock()
    coord = FakeCoordinator(clock)
    attempt = Attempt(context(state_dir, clock, coord, SlotUser()), lease(0))
    real_upload = coord.upload

    def upload(key: str, fh: Any, size: int) -> str:  # the agent stops during the commit
        attempt.cancel(Stopped("agent stopping"), 0.0)
        return real_upload(key, fh, size)

    coord.upload = upload  # type: ignore[method-assign]
    assert attempt.run().value == "lapsed"
    root = state_dir / "attempts" / "ls-000000000000"
    assert (state_dir / "outbox" / "ls-000000000000.json").exists()  # kept for the next start
    as_slot_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    for attack in (["cat", f"{root}/out/metrics.json"], ["touch", f"{root}/out/metrics.json"]):
        done = subprocess.run([*as_slot_user, *attack], capture_output=True, text=True, cwd="/")
        assert done.returncode != 0 and "secret" not in done.stdout, (attack, done.stdout)
    st = root.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), os.getegid(), 0o700)
    remove_tree(top)
