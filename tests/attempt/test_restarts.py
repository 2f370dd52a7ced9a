"""Restarts never cost a task: a stop lets go of running tasks in seconds, the next start on the
same state dir re-attaches them and carries their attempts to commit; with no next start, or
after a crash, nothing of a task outlives ``reattach_seconds``. Real coordinator, real agent
processes, real tasks under their supervisors."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

from harness import (
    AgentProcess,
    CoordinatorServer,
    argv_job,
    processes_with,
    run_flashnode,
    wait_for,
)

from flashnode.console.app import _why

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")


def counting(seconds: int, marker: str = "") -> list[str]:
    """A task that prints one numbered line a second, then writes its metrics."""
    return [
        "sh",
        "-c",
        f"for i in $(seq 1 {seconds}); do echo line $i; sleep 1; done {marker};"
        f" echo '{{\"lines\": {seconds}}}' > metrics.json",
    ]


def printed(agent: AgentProcess, line: str) -> bool:
    """Whether the running task's stdout holds ``line``."""
    return any(
        line in p.read_text(errors="replace")
        for p in (agent.state_dir / "attempts").glob("*/logs/stdout.txt")
    )


def kept_stdout(agent: AgentProcess, lease_id: str) -> list[str]:
    return (agent.state_dir / "logs" / lease_id / "stdout.txt").read_text().splitlines()


def test_a_stop_mid_task_returns_in_seconds_and_the_next_start_commits_it_in_its_first_attempt(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(counting(12), lease_seconds=60))
    first = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for("the task's third line", lambda: printed(first, "line 3"), timeout=60)
    stopped_at = time.monotonic()
    first.signal(signal.SIGTERM)
    assert first.wait(15) == 0, first.log
    assert time.monotonic() - stopped_at <= 10, first.log
    assert "run on for the next start" in first.log
    assert first.ledger() == []  # nothing ended: no ledger line

    second = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=first.state_dir)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    [task] = coordinator.tasks(job)
    assert task["attempts"] == 1  # one claim: the attempt went on under the second agent
    [entry] = second.wait_ledger(1)
    assert entry["outcome"] == "committed"
    assert "re-attached 1 task(s) after a restart" in second.log
    # Its output whole: what it printed while no agent was there too.
    assert kept_stdout(second, entry["lease_id"]) == [f"line {i}" for i in range(1, 13)]
    assert entry["evidence"]["wall_seconds"] >= 12  # its run counted from its own start
    shown = run_flashnode("status", "--state-dir", str(second.state_dir)).stdout
    assert "re-attached 1 task(s) after a restart" in shown, shown
    # The console says it too, from the same status.
    snapshot = json.loads((second.state_dir / "status.json").read_text())
    assert _why(snapshot, snapshot.get("controls") or {}, None)["rejoined"] == 1


def test_a_crashed_agent_started_again_rejoins_its_task_and_commits_it(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(counting(10), lease_seconds=60))
    first = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for("the task's second line", lambda: printed(first, "line 2"), timeout=60)
    first.proc.kill()
    first.proc.wait()
    time.sleep(5)  # the owner's service manager starts it again a while later
    second = start_agent(coordinator.url, *TRUSTED, env=FAST, state_dir=first.state_dir)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert coordinator.tasks(job)[0]["attempts"] == 1
    [entry] = second.wait_ledger(1)
    assert entry["outcome"] == "committed"
    assert kept_stdout(second, entry["lease_id"]) == [f"line {i}" for i in range(1, 11)]


def test_with_no_agent_back_nothing_of_the_task_outlives_reattach_seconds(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    marker = f"# flashnode-test-{tmp_path.name}"  # in the task's command line
    job = coordinator.submit(argv_job(counting(120, marker), lease_seconds=60))
    env = {**FAST, "FLASHNODE_REATTACH_SECONDS": "3"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env)
    wait_for("the task's first line", lambda: printed(agent, "line 1"), timeout=60)
    agent.signal(signal.SIGTERM)
    assert agent.wait(15) == 0, agent.log
    assert processes_with(marker), "the task should run on while an agent may come back"
    left = time.monotonic()
    wait_for("nothing of the task", lambda: not processes_with(marker), timeout=20)
    assert time.monotonic() - left <= 3 + 5
    supervisors = agent.state_dir / "tasks"
    wait_for("its supervisor gone too", lambda: not any(supervisors.iterdir()), timeout=5)
    assert coordinator.tasks(job)[0]["state"] != "SUCCEEDED"


def test_a_crashed_agent_never_back_leaves_nothing_running(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    marker = f"# flashnode-test-{tmp_path.name}"
    coordinator.submit(argv_job(counting(120, marker), lease_seconds=60))
    agent = start_agent(coordinator.url, *TRUSTED, env={**FAST, "FLASHNODE_REATTACH_SECONDS": "2"})
    wait_for("the task's first line", lambda: printed(agent, "line 1"), timeout=60)
    agent.proc.kill()
    agent.proc.wait()
    wait_for("nothing of the task", lambda: not processes_with(marker), timeout=20)


def test_flashnode_drain_lets_the_running_task_finish_then_stops_the_agent(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(counting(4), lease_seconds=60))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for("the task's first line", lambda: printed(agent, "line 1"), timeout=60)
    done = run_flashnode("drain", "--wait", "--state-dir", str(agent.state_dir))
    assert done.returncode == 0, done.stderr
    assert "drains: it takes no new work; 1 task(s) run" in done.stdout, done.stdout
    assert "at the latest (drain_seconds)" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("the agent has stopped"), done.stdout
    assert agent.wait(5) == 0
    assert coordinator.job(job)["state"] == "SUCCEEDED"
    [entry] = agent.ledger()
    assert entry["outcome"] == "committed"
