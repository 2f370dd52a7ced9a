"""A task's disk is bounded like its memory (issue 27, findings 3 and 4): everything it can write
(out/, tmp/ its HOME and TMPDIR, its private /tmp, files it removed but keeps open; a
container's /tmp and /work/out) counts against ``task_disk_bytes``, watched while it runs; its
outputs may hold at most ``max_output_files`` files. Past a cap the task is stopped and fails
with the reason, and nothing of it is uploaded. Real agents, the real coordinator, real tasks as
the slot's user."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from harness import AgentProcess, CoordinatorServer, argv_job

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5", "FLASHNODE_KILL_GRACE_SECONDS": "1"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")
CAPPED = {**FAST, "FLASHNODE_TASK_DISK_BYTES": "50M", "FLASHNODE_MAX_OUTPUT_TOTAL_BYTES": "50M"}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="private /tmp needs a root agent")

# Writes WHERE:MB ... (WHERE: a directory, or TMPDIR) in 4 MB steps, printing the MB written so
# far; then, with --hide, removes what it wrote but keeps it open; then sleeps SECONDS (--sleep)
# and writes metrics.json. No braces: the coordinator formats a command with the task's params.
FILL = r"""
import json, os, sys, time
args = sys.argv[1:]
hide = '--hide' in args
pause = float(args[args.index('--sleep') + 1]) if '--sleep' in args else 0.0
held, done = [], 0
for spec in [a for a in args if ':' in a]:
    where, mb = spec.rsplit(':', 1)
    where = os.environ['TMPDIR'] if where == 'TMPDIR' else where
    path = os.path.join(where, 'fill-%d.bin' % len(held))
    f = open(path, 'wb')
    for _ in range(int(mb) // 4):
        f.write(b'x' * (4 << 20))
        f.flush()
        done += 4
        print(done, flush=True)
        time.sleep(0.02)
    if hide:
        os.unlink(path)
    held.append(f)
time.sleep(pause)
print('done', flush=True)
json.dump(dict(written=done), open('metrics.json', 'w'))
"""


def run_one(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    args: list[str],
    env: dict[str, str] | None = None,
) -> tuple[str, list[str], list[str]]:
    """Run one FILL task: its job's state, its failure reasons, and what it printed."""
    job = coordinator.submit(argv_job(["python3", "-c", FILL, *args], max_attempts=1))
    agent = start_agent(
        coordinator.url, *TRUSTED, "--max-tasks", "1", env={**CAPPED, **(env or {})}
    )
    assert agent.wait(90) == 0, agent.log
    state = coordinator.wait_state(job, {"SUCCEEDED", "FAILED"})
    reasons = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    printed = coordinator.artifact(f"jobs/{job}/task-000/logs/stdout.txt").decode().split()
    if state == "FAILED":
        assert not any(k.endswith("metrics.json") for k in coordinator.artifacts(job))
    return state, reasons, printed


def test_a_task_writing_400_mb_into_its_tmp_under_a_50_mb_cap_is_stopped_and_fails(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    state, [reason], printed = run_one(coordinator, start_agent, ["TMPDIR:400"])
    assert state == "FAILED"
    assert "grew past 50 MiB (task_disk_bytes" in reason and "was stopped" in reason, reason
    assert "done" not in printed and int(printed[-1]) < 200, printed[-3:]


def test_a_file_removed_but_kept_open_still_counts(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    state, [reason], printed = run_one(
        coordinator, start_agent, ["TMPDIR:80", "--hide", "--sleep", "20"]
    )
    assert state == "FAILED" and "task_disk_bytes" in reason, reason
    assert "done" not in printed


@as_root
def test_the_private_tmp_counts_against_the_cap(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    state, [reason], printed = run_one(
        coordinator, start_agent, ["/tmp:28", "/dev/shm:28", "--sleep", "20"]
    )
    assert state == "FAILED" and "task_disk_bytes" in reason, reason
    assert "done" not in printed


def test_a_task_writing_within_its_cap_commits(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    spread = ["TMPDIR:20", ".:8", *(["/tmp:8"] if os.geteuid() == 0 else [])]
    state, reasons, printed = run_one(coordinator, start_agent, spread)
    assert state == "SUCCEEDED" and reasons == [], reasons
    assert printed[-1] == "done"


def test_twenty_thousand_empty_output_files_fail_without_being_uploaded(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    many = (
        "import json\n"
        "for i in range(20000): open('f%05d' % i, 'w').close()\n"
        "json.dump(dict(files=20000), open('metrics.json', 'w'))\n"
    )
    job = coordinator.submit(argv_job(["python3", "-c", many], max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    [reason] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "outputs grew past 5000 files (max_output_files)" in reason, reason
    assert not any(
        "/f0" in key or key.endswith("metrics.json") for key in coordinator.artifacts(job)
    )


@as_root
def test_a_containers_tmp_and_outputs_count_against_the_cap(
    box: str, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    from test_container import box_job, unique

    fill = (
        "head -c 31457280 /dev/zero > /tmp/a && head -c 31457280 /dev/zero > /work/out/b"
        " && echo written && sleep 20 && printf '\\173\\175' > /work/out/metrics.json"
    )
    job = coordinator.submit(box_job(["sh", "-c", fill], image=box, max_attempts=1))
    env = {**CAPPED, "FLASHNODE_ALLOWED_IMAGES": box}
    agent = start_agent(
        coordinator.url,
        "--runner",
        "docker",
        "--node-id",
        unique("disk"),
        "--max-tasks",
        "1",
        env=env,
    )
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED", agent.log
    [reason] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "task_disk_bytes" in reason and "was stopped" in reason, reason
