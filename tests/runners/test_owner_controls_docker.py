"""Owner controls with the docker runner and the real engine: an owner rule pauses the task's
container and unpauses it, and the machine CPU cap reaches the container."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from boxes import box_job, ours, start, unique
from harness import AgentProcess, CoordinatorServer, wait_for
from seat import TICKING, Seat, goes_on, last_tick, release, running


def test_an_owner_rule_pauses_the_container_then_unpauses_it_and_the_cap_applies(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    seat = Seat(tmp_path)
    job = coordinator.submit(box_job(["sh", "-c", TICKING]))
    node = unique("dock-owner")
    env = {**seat.env(), "FLASHNODE_TASK_CPU_PERCENT": "50"}
    agent = start(start_agent, coordinator.url, node, env=env)
    wait_for("a printed line", lambda: "tick" in ((running(agent) or {}).get("last_output") or ""))
    [container] = ours(engine, node)
    cores = os.cpu_count() or 1
    assert container.attrs["HostConfig"]["NanoCpus"] == int(cores * 0.5 * 1e9)  # one slot

    seat.active()

    def state() -> dict[str, Any]:
        container.reload()
        return dict(container.attrs["State"])

    wait_for("the container to be paused", lambda: state()["Paused"], timeout=15)
    paused_at = last_tick(container)
    wait_for("the status", lambda: (running(agent) or {}).get("suspended_s") is not None)
    seat.idle()
    wait_for("the container to run again", lambda: not state()["Paused"], timeout=15)
    goes_on(container, paused_at)
    release(container)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    entry = agent.wait_ledger()[-1]
    assert entry["outcome"] == "committed" and entry["timings"]["suspended"] > 0
    wait_for("the container to be removed", lambda: not ours(engine, node))
