"""The owner stays in charge, end to end: the real coordinator, the real agent process, real
tasks. Pause and resume through the CLI, suspension by an owner rule (the seat read through a
stand-in ``loginctl`` on the agent's PATH: the only part not real), the live view, metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from harness import AgentProcess, CoordinatorServer, argv_job, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from seat import Seat, running, snapshot

from flashnode.sandbox.cgroups import AttemptCgroup

TRUSTED = ("--runner", "trusted", "--pool", "team-a")
FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
PY = "python3"
# Prints a line every few units of light work until the file argv[2]/finish exists, then writes
# its metrics; with argv[2]/once it ends at once on any attempt after the first.
TASK = """
import json, os, sys, time
out, shared = sys.argv[1], sys.argv[2]
first = not os.path.exists(os.path.join(shared, "started"))
open(os.path.join(shared, "started"), "a").close()
n = 0
while first or not os.path.exists(os.path.join(shared, "once")):
    n += 1
    sum(range(20000)); time.sleep(0.02)
    if n % 5 == 0:
        print("tick", n, flush=True)
    if os.path.exists(os.path.join(shared, "finish")):
        break
json.dump({"n": n}, open(out, "w"))
"""


def flashnode(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    done = subprocess.run(
        [sys.executable, "-m", "flashnode", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def task_job(shared: Path, **extra: Any) -> dict[str, Any]:
    return argv_job([PY, "-c", TASK, "/work/out/metrics.json", str(shared)], **extra)


def expire(coordinator: CoordinatorServer, job: str) -> None:
    """The lease's deadline, now: the coordinator's operator lever (it spends the expiry budget,
    as the deadline would), so that a test does not wait out the 30 s lease floor."""
    r = coordinator.http.post(f"/jobs/{job}/tasks/task-000/force-expire", json={"reason": "test"})
    assert r.status_code == 200, r.text


def task_cgroup(agent: AgentProcess, lease_id: str) -> AttemptCgroup:
    record = json.loads((agent.state_dir / "outbox" / f"{lease_id}.json").read_text())
    process = record["process"]
    paths = {k: Path(v) for k, v in process["cgroup"].items()}
    return AttemptCgroup(process["cgroup_version"], paths)


# --- pause and resume ------------------------------------------------------------------------


def test_pause_through_the_cli_holds_claims_keeps_heartbeats_and_survives_a_restart(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    env = {**FAST, "FLASHNODE_HEARTBEAT_SECONDS": "1"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env)
    agent.wait_log("registered as node")
    out = flashnode("pause", "--state-dir", str(agent.state_dir))
    assert f"the running agent (pid {agent.proc.pid}) applies it" in out
    wait_for(
        "the agent to show the pause",
        lambda: "not claiming: paused" in snapshot(agent).get("state", ""),
    )
    first_beat = snapshot(agent)["last_heartbeat_at"]
    job = coordinator.submit(task_job(drop_dir))
    (drop_dir / "finish").touch()
    # A bounded window in which a claim would (wrongly) happen; heartbeats go on meanwhile.
    wait_for(
        "two more heartbeats",
        lambda: (snapshot(agent).get("last_heartbeat_at") or 0) > first_beat + 1.5,
        timeout=10,
    )
    assert coordinator.tasks(job)[0]["attempts"] == 0
    assert coordinator.tasks(job)[0]["state"] == "PENDING"
    shown = flashnode("status", "--state-dir", str(agent.state_dir))
    assert "pause: paused by the owner until `flashnode resume`" in shown

    # A restart keeps the pause: it is a file in the state dir.
    agent.signal(signal.SIGTERM)
    assert agent.wait(30) == 0, agent.log
    again = start_agent(coordinator.url, *TRUSTED, env=env, state_dir=agent.state_dir)
    again.wait_log("registered as node")
    again.wait_log("owner control pause holds claiming")
    beat = wait_for("a heartbeat", lambda: snapshot(again).get("last_heartbeat_at"))
    wait_for(
        "more heartbeats",
        lambda: (snapshot(again).get("last_heartbeat_at") or 0) > beat + 1.5,
        timeout=10,
    )
    assert coordinator.tasks(job)[0]["attempts"] == 0

    assert flashnode("resume", "--state-dir", str(again.state_dir)).startswith("resumed")
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert "claiming resumes" in again.log
    again.signal(signal.SIGTERM)
    assert again.wait(30) == 0


def test_pause_now_gives_the_running_lease_back_without_spending_the_failure_budget(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    job = coordinator.submit(task_job(drop_dir, max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    wait_for(
        "the task to print", lambda: "tick" in ((running(agent) or {}).get("last_output") or "")
    )
    (drop_dir / "once").touch()  # a later attempt ends at once
    flashnode("pause", "--now", "--state-dir", str(agent.state_dir))
    entry = wait_for("the ledger line", lambda: agent.ledger() and agent.ledger()[-1])
    assert entry["outcome"] == "lapsed", entry
    assert "paused by the owner" in entry["reason"] and "running tasks stopped" in entry["reason"]
    assert coordinator.job(job)["state"] not in ("FAILED", "SUCCEEDED")
    expire(coordinator, job)
    flashnode("resume", "--state-dir", str(agent.state_dir))
    # maxTaskAttempts 1: the job can succeed only if the lapse spent no failure.
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    outcomes = [r["outcome"] for r in agent.wait_ledger(2)]
    assert outcomes == ["lapsed", "committed"]


# --- suspension ------------------------------------------------------------------------------


def test_an_owner_rule_suspends_the_task_freezing_its_cgroup_and_resumes_it(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
    tmp_path: Path,
) -> None:
    seat = Seat(tmp_path)
    job = coordinator.submit(task_job(drop_dir))
    agent = start_agent(coordinator.url, *TRUSTED, env={**FAST, **seat.env()})
    live = wait_for(
        "the task to print",
        lambda: "tick" in ((running(agent) or {}).get("last_output") or "") and running(agent),
    )
    lease = live["lease_id"]
    # The live view: elapsed time, the lease's remaining time, bytes, the last line.
    assert live["phase"] == "execute" and live["elapsed_s"] >= 0
    assert 0 < live["lease_left_s"] <= 60
    assert live["bytes_uploaded"] == 0 and live["bytes_staged"] == 0
    shown = flashnode("status", "--state-dir", str(agent.state_dir))
    assert f"  {lease}  {job}/task-000" in shown and "last output  tick" in shown
    assert "lease left   " in shown

    cgroup = task_cgroup(agent, lease)
    wait_for("the task's cpu use", lambda: (cgroup.cpu_seconds() or 0) > 0.02)
    seat.active()
    held = wait_for(
        "the suspension",
        lambda: (running(agent) or {}).get("suspended_s") is not None and running(agent),
        timeout=15,
    )
    assert "the owner is at the machine" in held["suspend_reason"]
    assert "active: the owner is at the machine" in flashnode(
        "status", "--state-dir", str(agent.state_dir)
    )
    before = cgroup.cpu_seconds()
    printed = (agent.state_dir / "attempts" / lease / "logs" / "stdout.txt").stat().st_size
    wait_for(
        "a second suspended",
        lambda: (running(agent) or {}).get("suspended_s", 0) >= 1.5,
        timeout=10,
    )
    assert cgroup.cpu_seconds() == before  # frozen: not one more nanosecond of CPU
    assert (agent.state_dir / "attempts" / lease / "logs" / "stdout.txt").stat().st_size == printed
    assert coordinator.tasks(job)[0]["state"] == "LEASED"  # renewed while suspended

    seat.idle()
    wait_for(
        "the resumption", lambda: (running(agent) or {}).get("suspended_s", 0) is None, timeout=15
    )
    wait_for("cpu use again", lambda: (cgroup.cpu_seconds() or 0) > (before or 0), timeout=5)
    (drop_dir / "finish").touch()
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    entry = agent.wait_ledger()[-1]
    assert entry["outcome"] == "committed" and entry["timings"]["suspended"] >= 1.5
    assert "task suspended" in agent.log and "task resumed after" in agent.log


def test_a_suspension_longer_than_allowed_gives_the_lease_back_without_spending_the_failure_budget(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
    tmp_path: Path,
) -> None:
    seat = Seat(tmp_path)
    job = coordinator.submit(task_job(drop_dir, max_attempts=1))
    env = {**FAST, **seat.env(), "FLASHNODE_MAX_SUSPEND_SECONDS": "3"}
    agent = start_agent(coordinator.url, *TRUSTED, env=env)
    wait_for(
        "the task to print", lambda: "tick" in ((running(agent) or {}).get("last_output") or "")
    )
    (drop_dir / "once").touch()
    seat.active()
    entry = wait_for("the ledger line", lambda: agent.ledger() and agent.ledger()[-1], timeout=30)
    assert entry["outcome"] == "lapsed", entry
    assert "suspended for longer than 3 s" in entry["reason"]
    assert "the lease lapses" in entry["reason"]
    assert coordinator.job(job)["state"] not in ("FAILED", "SUCCEEDED")
    expire(coordinator, job)
    seat.idle()
    # maxTaskAttempts 1: only a lapse that spent no failure lets the second attempt run.
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    assert [r["outcome"] for r in agent.ledger()] == ["lapsed", "committed"]


# --- metrics ---------------------------------------------------------------------------------


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_the_metrics_endpoint_parses_and_its_counters_match_the_ledger_after_20_tasks(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    # Every fifth task fails; its job allows one attempt per task.
    script = (
        "import json,sys; n={n}; json.dump(dict(n=n), open(sys.argv[1],'w'));"
        " print('task', n); sys.exit(1 if n % 5 == 0 else 0)"
    )
    job = coordinator.submit(
        argv_job(
            [PY, "-c", script, "/work/out/metrics.json"],
            params=[{"n": n} for n in range(20)],
            max_attempts=1,
        )
    )
    address = f"127.0.0.1:{free_port()}"
    agent = start_agent(
        coordinator.url, *TRUSTED, env={**FAST, "FLASHNODE_METRICS_LISTEN": address}
    )
    agent.wait_log(f"metrics served at {address}")
    coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=180)
    wait_for("20 ledger lines", lambda: len(agent.ledger()) == 20, timeout=30)
    ledger = agent.ledger()
    by_outcome: dict[str, int] = {}
    for r in ledger:
        by_outcome[r["outcome"]] = by_outcome.get(r["outcome"], 0) + 1
    assert by_outcome == {"committed": 16, "failed": 4}

    def matches() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        m = scrape(address)
        counted = {
            dict(labels)["outcome"]: value
            for (name, labels), value in m.items()
            if name == "flashnode_attempts_total"
        }
        return m if counted == by_outcome else None

    m = wait_for("the counters to match the ledger", matches, timeout=10)
    assert m[("flashnode_attempt_duration_seconds_count", ())] == 20
    claims = sum(v for (n, _), v in m.items() if n == "flashnode_claim_duration_seconds_count")
    work = m[("flashnode_claim_duration_seconds_count", (("result", "work"),))]
    assert work == 20 and claims >= 20
    assert m[("flashnode_task_cpu_percent_count", ())] == 20
    assert ("flashnode_task_gpu_percent_count", ()) not in m or m[
        ("flashnode_task_gpu_percent_count", ())
    ] == 0  # not measured: left out, never counted as zero
    # Every byte the coordinator stored for this job came through the agent's uploads.
    stored = sum(len(coordinator.artifact(k)) for k in coordinator.artifacts(job))
    assert m[("flashnode_uploaded_bytes_total", ())] == stored
    assert m[("flashnode_running_attempts", ())] == 0 and m[("flashnode_paused", ())] == 0
    assert m[("flashnode_info", (("version", __import__("flashnode").__version__),))] == 1


def test_a_metrics_address_that_cannot_be_bound_stops_the_agent_at_start(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        agent = start_agent(
            coordinator.url, *TRUSTED, env={**FAST, "FLASHNODE_METRICS_LISTEN": address}
        )
        assert agent.wait(60) == 69, agent.log
    assert f"cannot serve metrics at {address}" in agent.log
    assert 'or to "off" to serve no metrics' in agent.log  # its own fix, not the doctor's
    assert "flashnode doctor" not in agent.log
    assert "registered as node" not in agent.log
