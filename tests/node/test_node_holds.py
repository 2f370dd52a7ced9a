"""The node's own holds end to end. The black-hole guard: a node whose task interpreter breaks
stops claiming after a few failures, says why (status, log, metrics), and takes work again by
itself once its own checks pass. The backoff after a lease the coordinator's watchdog revoked."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import AgentProcess, CoordinatorServer, argv_job, free_port, wait_for

TASK_PYTHON = os.environ.get("FLASHNODE_TEST_TASK_PYTHON", "/opt/flashnode-task-venv/bin/python")
POOL = "team-a"
TRUSTED = ("--runner", "trusted", "--pool", POOL)


def trainer_job(name: str, trials: int, max_attempts: int) -> dict[str, Any]:
    return {
        "apiVersion": "flashml.dev/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "execution": {"backend": "leases"},
            "image": {"repository": "local/tier1", "tag": "dev"},
            "placement": {"pool": POOL},
            "retryPolicy": {"maxTaskAttempts": max_attempts, "allowPartial": True},
            "workload": {
                "type": "hyperparameter_search",
                "parameters": {
                    "module": "flashml_workloads.sgd_trainer",
                    "trials": [{"steps": 2000, "lr": 0.1, "seed": n} for n in range(trials)],
                    "inputs": {"dataset": "artifact://shared/sgd.csv"},
                    "lease_seconds": 60,
                },
            },
        },
    }


def dataset() -> bytes:
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        x = [rng.uniform(-1, 1) for _ in range(3)]
        rows.append(",".join(f"{v:.6f}" for v in x) + f",{int(x[0] > 0)}")
    return ("\n".join(rows) + "\n").encode()


def interpreter(path: Path, body: str) -> None:
    """Replace the task interpreter at once (a new file renamed over the old)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("#!/bin/sh\n" + body + "\n")
    tmp.chmod(0o755)
    tmp.rename(path)


def hold(state_dir: Path, rule: str) -> str | None:
    done = subprocess.run(
        [sys.executable, "-m", "flashnode", "status", "--json", "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        return None
    held = json.loads(done.stdout)["controls"]["held_by"]
    return next((h["reason"] for h in held if h["rule"] == rule), None)


def quarantine_hold(state_dir: Path) -> str | None:
    return hold(state_dir, "quarantine")


@pytest.mark.usefixtures("task_python")
def test_a_node_whose_interpreter_breaks_quarantines_itself_and_comes_back_once_fixed(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    python = drop_dir / "python"
    interpreter(python, f'exec {TASK_PYTHON} "$@"')
    coordinator.put_artifact("shared/sgd.csv", dataset())
    port = free_port()
    env = {
        "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
        "FLASHNODE_TASK_PYTHON": str(python),
        "FLASHNODE_QUARANTINE_AFTER": "3",
        "FLASHNODE_QUARANTINE_CHECK_SECONDS": "2",
        "FLASHNODE_METRICS_LISTEN": f"127.0.0.1:{port}",
    }
    agent = start_agent(coordinator.url, *TRUSTED, env=env)
    agent.wait_log("module tasks on", timeout=120)

    interpreter(python, "echo 'python: the interpreter is broken' >&2; exit 1")
    first = coordinator.submit(trainer_job("first", trials=1, max_attempts=1))
    second = coordinator.submit(trainer_job("second", trials=2, max_attempts=3))

    # Three fast failures with one reason, across both jobs: it stops and says why.
    why = wait_for("the quarantine", lambda: quarantine_hold(agent.state_dir), timeout=60)
    assert "3 attempts of 2 jobs in a row failed" in why and "interpreter is broken" in why, why
    verdict = wait_for(
        "its checks' verdict",
        lambda: (w := quarantine_hold(agent.state_dir)) and "checks" in w and w,
    )
    assert "its checks fail: module tasks" in verdict, verdict
    assert [r["outcome"] for r in agent.ledger()] == ["failed"] * 3
    assert "quarantined: 3 attempts" in agent.log
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'flashnode_claiming_held{rule="quarantine"} 1.0' in scraped
    with pytest.raises(AssertionError):  # held: the second job's tasks wait
        wait_for("a claim while quarantined", lambda: len(agent.ledger()) > 3, timeout=6)

    # Fixed: its next check passes, and it takes the rest of the work by itself.
    interpreter(python, f'exec {TASK_PYTHON} "$@"')
    assert coordinator.wait_state(second, {"SUCCEEDED", "FAILED"}, timeout=120) == "SUCCEEDED"
    assert coordinator.wait_state(first, {"FAILED", "SUCCEEDED"}) == "FAILED"  # its one try
    assert "quarantine ends: this node passes its own checks" in agent.log
    assert quarantine_hold(agent.state_dir) is None
    assert [r["outcome"] for r in agent.wait_ledger(5)][3:] == ["committed"] * 2


def test_a_node_whose_lease_the_watchdog_revoked_does_not_claim_straight_back(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    silent = coordinator.submit(
        argv_job(
            ["sleep", "300"],
            pool=POOL,
            checkpoint={"watchdog_seconds": 3},
            lease_seconds=30,
            max_attempts=4,
        )
    )
    agent = start_agent(
        coordinator.url, *TRUSTED, env={"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
    )
    why = wait_for("the backoff", lambda: hold(agent.state_dir, "revoked"), timeout=60)
    assert "watchdog revoked lease" in why and "not claiming for" in why, why
    [line] = agent.ledger()
    assert line["outcome"] == "lost" and "revoked: no progress" in line["reason"], line
    # The task is back in the queue, and this node leaves it there for a while.
    wait_for("the task to be pending", lambda: coordinator.tasks(silent)[0]["state"] == "PENDING")
    with pytest.raises(AssertionError):
        wait_for(
            "a claim during the backoff",
            lambda: coordinator.tasks(silent)[0]["attempts"] > 1,
            timeout=10,
        )
    assert "watchdog revoked lease" in agent.log


def dead_origin_job(coordinator: CoordinatorServer, tasks: int) -> str:
    """A job each of whose tasks names a dataset origin that never answers (the job's own)."""
    dead = f"http://127.0.0.1:{free_port()}/shard.bin"
    entry = {
        "path": "shard.bin",
        "url": dead,
        "size": 4,
        "integrity": {"kind": "sha256", "value": "ab" * 32},
    }
    slices = [[{"name": "ds", "entries": [entry]}] for _ in range(tasks)]
    command = ["sh", "-c", "echo '{}' > metrics.json"]
    job = argv_job(command, dataset_slices=slices, max_attempts=1, lease_seconds=30)
    return coordinator.submit(job)


def test_one_jobs_dead_data_origin_benches_no_node_but_every_jobs_failing_does(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """A job names its own dataset origin; one that never answers is, to the node, an origin it
    cannot reach: the lease lapses (the job's failure budget is not the place for an outage
    that may as well be the node's own network). One such job must not bench the node, or it
    benches every node it lands on in turn (docker nodes too): after ``quarantine_after`` such
    lapses of one job the node still claims. A second job failing the same way makes it the
    node's most likely: the node quarantines itself."""
    env = {
        "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
        "FLASHNODE_DATASET_CACHE_BYTES": str(1 << 20),
        "FLASHNODE_DATASET_ALLOW_PRIVATE_ORIGINS": "true",
        "FLASHNODE_DATASET_FETCH_TIMEOUT_SECONDS": "2",
        "FLASHNODE_QUARANTINE_AFTER": "2",
    }
    first = dead_origin_job(coordinator, 2)
    agent = start_agent(coordinator.url, *TRUSTED, env=env)
    try:
        lines = agent.wait_ledger(2, timeout=120)
        assert [x["outcome"] for x in lines] == ["lapsed"] * 2, lines
        assert all(x["reason"].startswith("dataset entry ds/shard.bin") for x in lines), lines
        assert "quarantined" not in agent.log and quarantine_hold(agent.state_dir) is None
        coordinator.cancel(first)
        second = dead_origin_job(coordinator, 1)
        wait_for("the node to quarantine itself", lambda: quarantine_hold(agent.state_dir), 120)
        coordinator.cancel(second)
    finally:
        coordinator.cancel(first)


def test_two_jobs_whose_tasks_fail_fast_do_not_bench_a_node_whose_checks_pass(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """Tasks that fail at once are their authors' doing: one pool member's two jobs (``exit 1``,
    ``exit 2``: one reason once numbers are taken out) have the node run its checks, which
    pass, and it claims on; it is never quarantined, and the pool's next job is run at once."""
    first = coordinator.submit(
        argv_job(["sh", "-c", "exit 1"], params=[{"n": i} for i in range(3)], max_attempts=1)
    )
    second = coordinator.submit(
        argv_job(["sh", "-c", "exit 2"], params=[{"n": i} for i in range(3)], max_attempts=1)
    )
    agent = start_agent(
        coordinator.url, *TRUSTED, env={"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
    )
    try:
        for job in (first, second):
            coordinator.wait_state(job, {"FAILED", "SUCCEEDED"}, timeout=120)
        honest = coordinator.submit(argv_job(["true"]))
        state = coordinator.wait_state(honest, {"FAILED", "SUCCEEDED"}, timeout=60)
    except AssertionError:
        state = "not run within 60 s"
    held = [line for line in agent.log.splitlines() if "quarantined" in line]
    assert held == [], f"a healthy node benched by two jobs' own failures ({state}): {held}"
    assert state != "not run within 60 s"
    assert "this node passes its own checks: the failures are the tasks' own" in agent.log
