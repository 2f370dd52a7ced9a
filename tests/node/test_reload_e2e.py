"""A reload on a real agent: the per-task limits follow it from the next claim, and the task
running through it keeps the ones it was claimed under. A real agent, coordinator and task."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import AgentProcess, CoordinatorServer, argv_job, shared_dir, wait_for

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}

# The task's memory limit (its cgroup's) when it starts, and again once ``go`` exists.
PROBE = r"""
import json, os, sys, time
def memory():
    for line in open('/proc/self/cgroup'):
        _, controllers, path = line.strip().split(':', 2)
        if controllers == '':
            return open(f'/sys/fs/cgroup{path}/memory.max').read().strip()
        if 'memory' in controllers.split(','):
            return open(f'/sys/fs/cgroup/memory{path}/memory.limit_in_bytes').read().strip()
first = memory()
open(sys.argv[1] + '/started', 'w').close()
deadline = time.time() + 60
while sys.argv[2] == 'wait' and not os.path.exists(sys.argv[1] + '/go') and time.time() < deadline:
    time.sleep(0.1)
json.dump({'first': first, 'last': memory()}, open('metrics.json', 'w'))
"""


@pytest.mark.usefixtures("as_root", "task_cgroups")
def test_a_reload_changes_the_task_limits_from_the_next_claim_and_not_under_a_running_task(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    here = shared_dir("flashnode-reload-")
    here.chmod(0o1777)
    config = tmp_path / "flashnode.toml"
    base = 'pools = ["team-a"]\nrunner = "trusted"\n'
    config.write_text(base + 'task_memory_bytes = "256M"\n')
    first = coordinator.submit(argv_job(["python3", "-c", PROBE, str(here), "wait"]))
    agent = start_agent(coordinator.url, "--config", str(config), env=FAST)
    wait_for("the first task to start", lambda: (here / "started").exists(), timeout=60)
    config.write_text(base + 'task_memory_bytes = "128M"\n')
    agent.signal(signal.SIGHUP)
    agent.wait_log("configuration reloaded")
    (here / "go").touch()
    assert coordinator.wait_state(first, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    second = coordinator.submit(argv_job(["python3", "-c", PROBE, str(here), "now"]))
    assert coordinator.wait_state(second, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    before = json.loads(coordinator.artifact(f"jobs/{first}/task-000/metrics.json"))
    after = json.loads(coordinator.artifact(f"jobs/{second}/task-000/metrics.json"))
    assert before == {"first": str(256 << 20), "last": str(256 << 20)}, before
    assert after == {"first": str(128 << 20), "last": str(128 << 20)}, after
