"""`flashnode logs` finds the task without being told, and a finished task's output stays readable
on the node (the latest `keep_logs` attempts'), for `flashnode logs LEASE` and the console's
history. Real agents, real tasks, the real coordinator."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import AgentProcess, CoordinatorServer, argv_job, run_flashnode, wait_for

from flashnode.sandbox import logcap

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")


def test_logs_without_a_lease_follows_the_only_running_task_to_its_end(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    drop_dir: Path,
) -> None:
    go = drop_dir / "go"
    script = f"echo started; while [ ! -e {go} ]; do sleep 0.1; done; echo done >&2; echo '{{}}' > metrics.json"
    job = coordinator.submit(argv_job(["sh", "-c", script]))
    agent = start_agent(coordinator.url, *TRUSTED, env=FAST)
    state = ["--state-dir", str(agent.state_dir)]
    wait_for(
        "the task to print",
        lambda: (
            (found := logcap.find(agent.state_dir, _running(agent)))
            and (found[0] / "stdout.txt").exists()
            and b"started" in (found[0] / "stdout.txt").read_bytes()
        ),
    )
    follower = subprocess.Popen(
        [sys.executable, "-m", "flashnode", "logs", *state],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")},
    )
    try:
        assert follower.stdout is not None
        first = follower.stdout.readline()  # it found the task, and prints what it printed
        go.touch()
        rest, err = follower.communicate(timeout=60)  # it ends with the attempt
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()  # its pipes closed, its status read
    assert follower.returncode == 0, err
    assert first + rest == "started\n" and err == "done\n"
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    # No task runs now: one line that says what to name.
    idle = flashnode("logs", *state)
    assert idle.returncode == 1 and "no task runs now" in idle.stderr, idle.stderr


def _running(agent: AgentProcess) -> str:
    done = run_flashnode("status", "--json", "--state-dir", str(agent.state_dir))
    if done.returncode != 0:
        return "-"
    import json

    running = json.loads(done.stdout).get("running") or []
    return str(running[0]["lease_id"]) if running else "-"


def test_a_finished_tasks_output_is_kept_readable_and_rotated(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent(coordinator.url, *TRUSTED, env={**FAST, "FLASHNODE_KEEP_LOGS": "2"})
    for n in range(3):
        job = coordinator.submit(
            argv_job(["sh", "-c", f"echo out-{n}; echo err-{n} >&2; echo '{{}}' > metrics.json"])
        )
        assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    leases = [line["lease_id"] for line in agent.wait_ledger(3)]
    state = ["--state-dir", str(agent.state_dir)]
    kept = agent.state_dir / logcap.KEPT_DIR
    wait_for("the oldest to be rotated out", lambda: sorted(os.listdir(kept)) == sorted(leases[1:]))
    assert (kept).stat().st_mode & 0o777 == 0o700
    for n, lease in enumerate(leases[1:], 1):
        shown = flashnode("logs", lease, *state)
        assert shown.returncode == 0, shown.stderr
        assert (shown.stdout, shown.stderr) == (f"out-{n}\n", f"err-{n}\n")
        # -f on an ended attempt prints it and ends.
        assert flashnode("logs", "-f", lease, *state).stdout == f"out-{n}\n"
    gone = flashnode("logs", leases[0], *state)
    assert gone.returncode == 1 and "keep_logs" in gone.stderr
    assert not (agent.state_dir / "attempts" / leases[-1]).exists()  # the workspace went


def test_the_consoles_history_shows_a_finished_tasks_output(tmp_path: Path) -> None:
    from flashnode.console.app import App
    from flashnode.console.auth import Gate
    from flashnode.console.usage import UsageRing
    from flashnode.console.wiring import Wiring

    state = tmp_path / "state"
    logs = state / "attempts" / ".retired-ls-1" / "logs"
    logs.mkdir(parents=True)
    (logs / "stdout.txt").write_text("hello <script>alert(1)</script>\n")
    (logs / "stderr.txt").write_text("")
    logcap.keep(logs, state, "ls-1")
    assert not logs.exists() and (state / "logs" / "ls-1" / "stdout.txt").exists()
    wiring = Wiring(
        state_dir=state,
        settings=lambda: None,  # type: ignore[arg-type,return-value]
        config_file=None,
        validate=lambda path: None,
        overridden=lambda key: None,
        reload=lambda: None,
        node_view=lambda node: None,
        ring=UsageRing(gpu=lambda: None),
    )
    app = App(wiring, Gate(), frozenset(), "c")
    assert app.output_tail("ls-1") == {"stdout": "hello <script>alert(1)</script>", "stderr": ""}
    assert app.output_tail("../../etc") is None
