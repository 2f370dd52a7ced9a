"""With the coordinator stopped while a task runs, `flashnode status` keeps telling the truth:
status.json is rewritten every heartbeat period (its `updated_at` moves), it says the coordinator
is unreachable and which conversations fail, the task's output moves on, and the task whose lease
ran out meanwhile is no longer shown as running. Real agent, real coordinator."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import AgentProcess, CoordinatorServer, argv_job, run_flashnode, wait_for

from flashnode.owner import status

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
STEPS = (
    "import sys, time\n"
    "for i in range(400):\n"
    "    print(f'step {i}', flush=True)\n"
    "    time.sleep(0.5)\n"
)


def written(state_dir: Path) -> dict[str, Any]:
    """status.json as the owner reads it, with what the task printed ({} before the first)."""
    return status.read(state_dir) or {}


def test_with_the_coordinator_stopped_status_is_rewritten_and_says_what_fails(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(argv_job(["python3", "-c", STEPS], lease_seconds=30, max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    state_dir = agent.state_dir
    wait_for(
        "the task's output in status",
        lambda: (
            (r := written(state_dir).get("running"))
            and (r[0].get("last_output") or "")[:4] == "step"
        ),
        timeout=60,
    )
    coordinator.stop()
    down = wait_for(
        "status to say the coordinator fails",
        lambda: (s := written(state_dir))["coordinator_problems"] and s,
    )
    assert down["fresh_for_s"] == 5.0
    # Rewritten while the coordinator is down, though the status text stays the same; the
    # task's newest output line moves with it (not frozen at the moment the coordinator left).
    later = wait_for(
        "status rewritten with newer output",
        lambda: (
            (s := written(state_dir))["updated_at"] > down["updated_at"]
            and s["running"]
            and s["running"][0].get("last_output") != down["running"][0].get("last_output")
            and s
        ),
        timeout=20,
    )
    assert later["coordinator_problems"]
    # The lease runs out while the coordinator is away: the task is no longer shown running.
    lost = wait_for(
        "the lost lease to leave the running list",
        lambda: (s := written(state_dir))["running"] == [] and s["last_ended"] and s,
        timeout=60,
    )
    assert lost["last_ended"]["job_id"] == job, lost["last_ended"]
    assert lost["last_ended"]["outcome"] in ("lost", "lapsed"), lost["last_ended"]
    # Still rewritten, every period: a few more times while nothing changes.
    seen = {lost["updated_at"]}
    wait_for(
        "three more rewrites",
        lambda: seen.add(written(state_dir)["updated_at"]) or len(seen) >= 4,
        timeout=30,
        every=0.5,
    )
    done = run_flashnode("status", "--state-dir", str(state_dir))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "state       coordinator unreachable since" in text, text
    assert "coordinator node heartbeat failing since" in text, text
    assert "STALE" not in text, text  # the agent lives and writes: fresh, though failing
    assert "running     0" in text, text
    assert "lease left" not in text, text
    # The coordinator is back: the problems clear by themselves.
    coordinator.start()
    wait_for(
        "the coordinator problems to clear",
        lambda: written(state_dir)["coordinator_problems"] == [],
        timeout=60,
    )
    assert agent.proc.poll() is None
