"""The docker runner against the real Docker engine: a locked-down container per task."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from badcoord import BadCoordinator, lease_answer
from boxes import IMAGE, LABEL, box_job, import_image, ours, start, unique
from harness import AgentProcess, CoordinatorServer, processes_in, wait_for
from proxy import Proxy

from flashnode.runners.container.runner import LABEL_LEASE, LABEL_PROBE

docker = pytest.importorskip("docker")


# A stand-in interpreter: imports "succeed", and a module run records its spec and writes metrics.
FAKE_PYTHON = """#!/bin/sh
[ "$1" = "-c" ] && exit 0
cat "$4" > "$6/spec-seen.json"
echo "{\\"module\\": \\"$2\\"}" > "$6/metrics.json"
"""
PYBOX = "flashnode-test/pybox:1"


@pytest.fixture(scope="session")
def module_image(engine: Any) -> str:
    return import_image(engine, PYBOX, {"bin/python": FAKE_PYTHON})


PROBE = (
    'printf \'{"uid": %s, "nets": "%s", "cap": "%s", "rootfs_writable": %s, "tmp_writable": %s, "inputs_writable": %s, "home": "%s", "tmpdir": "%s", "home_writable": %s}\''
    " $(id -u) \"$(ls /sys/class/net | tr '\\n' ' ')\" \"$(grep CapEff /proc/self/status | tr -d '\\t' | cut -d: -f2 2>/dev/null || grep CapEff /proc/self/status)\""
    " $(touch /x 2>/dev/null && echo true || echo false) $(touch /tmp/x 2>/dev/null && echo true || echo false)"
    " $(touch /work/inputs/x 2>/dev/null && echo true || echo false)"
    " \"$HOME\" \"$TMPDIR\" $(touch \"$HOME/x\" 2>/dev/null && echo true || echo false)"
    " > /work/out/metrics.json"
)


def test_allowed_image_runs_locked_down_and_commits_with_its_digest(
    engine: Any,
    image: str,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = recording_coordinator.submit(box_job(["sh", "-c", PROBE]))
    node = unique("dock")
    agent = start(start_agent, recording_coordinator.url, node, "--max-tasks", "1")
    assert agent.wait(60) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = json.loads(recording_coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert seen["uid"] != 0
    assert seen["nets"].split() == ["lo"]
    assert set(seen["cap"].replace("CapEff", "").strip()) == {"0"}
    assert seen["rootfs_writable"] is False and seen["inputs_writable"] is False
    assert seen["tmp_writable"] is True
    # HOME and TMPDIR as on the trusted runner: the workspace's tmp/, the task's to write.
    assert (seen["home"], seen["tmpdir"], seen["home_writable"]) == ("/work/tmp", "/work/tmp", True)
    [complete] = recording_coordinator.recorded("/complete")
    assert complete["evidence"]["image_digest"] == engine.images.get(image).id
    [registration] = recording_coordinator.recorded("/nodes/register")
    assert registration["argv_capable"] and registration["sandbox_capable"]
    assert not registration["unsandboxed_argv_capable"]
    assert ours(engine, node) == []


@pytest.mark.parametrize("how", ["timeout", "lease-lost"])
def test_stopped_containers_are_removed(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    how: str,
) -> None:
    job = coordinator.submit(box_job(["sleep", "600"], max_attempts=1, lease_seconds=30))
    env = {"FLASHNODE_MAX_TASK_SECONDS": "2"} if how == "timeout" else {}
    node = unique(f"dock-{how}")
    agent = start(start_agent, coordinator.url, node, env=env)
    wait_for("the container", lambda: ours(engine, node))
    if how == "lease-lost":
        coordinator.cancel(job)
    wait_for("the container to be removed", lambda: not ours(engine, node), timeout=30 / 3 + 5)
    record = wait_for("the attempt's record", lambda: agent.ledger() and agent.ledger()[-1])
    assert record["outcome"] == ("failed" if how == "timeout" else "lost")
    if how == "timeout":
        assert record["reason"] == "timed out after 2 s"


def test_images_not_allowed_or_latest_are_refused_without_a_container(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = coordinator.submit(box_job(["true"], image="python:3.11-slim", max_attempts=1))
    node = unique("dock-policy")
    agent = start(start_agent, coordinator.url, node, "--max-tasks", "1")
    assert agent.wait(60) == 0, agent.log
    [failed] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "not on this node's allowed_images" in failed
    bad = (
        BadCoordinator()
    )  # the real coordinator refuses latest at submission; a hostile one may not
    try:
        bad.claims = [
            lease_answer(
                1, image="flashnode-test/busybox:latest", pool=None, isolation={"tier": "sandboxed"}
            ),
            lease_answer(
                2, image="flashnode-test/busybox", pool=None, isolation={"tier": "sandboxed"}
            ),
        ]
        # An owner cannot allow them either: the agent refuses to start, naming the image.
        refused = start(
            start_agent,
            bad.url,
            node,
            env={"FLASHNODE_ALLOWED_IMAGES": f"{IMAGE},flashnode-test/busybox:latest"},
        )
        assert refused.wait(60) == 78, refused.log
        assert "'flashnode-test/busybox:latest' is not pinned" in refused.log
        agent = start(start_agent, bad.url, node, "--max-tasks", "2")
        assert agent.wait(60) == 0, agent.log
        reasons = dict(bad.fails)
        assert (
            "tagged latest" in reasons["ls-000000000001"]
            and "has no tag" in reasons["ls-000000000002"]
        )
    finally:
        bad.close()
    assert ours(engine, node) == []


def test_restarted_agent_removes_its_leftover_container_and_nothing_else(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    coordinator.submit(box_job(["sleep", "600"], max_attempts=2))
    bystanders = [
        engine.containers.create(image, ["sleep", "600"], labels={LABEL: "another-node"}),
        engine.containers.create(image, ["sleep", "600"]),
    ]
    try:
        node = unique("dock-restart")
        first = start(start_agent, coordinator.url, node)
        [leftover] = wait_for("the container", lambda: ours(engine, node))
        first.proc.kill()
        first.proc.wait()
        # A crash that took the container's watch too: nothing for the next start to rejoin.
        for pid in processes_in(first.state_dir):
            os.kill(pid, signal.SIGKILL)
        assert [c.id for c in ours(engine, node)] == [leftover.id]
        second = start(start_agent, coordinator.url, node, state_dir=first.state_dir)
        second.wait_log("registered as node")
        assert leftover.id not in [c.id for c in ours(engine, node)]
        for b in bystanders:
            b.reload()  # still there: not this node's
    finally:
        for b in bystanders:
            b.remove(force=True)


COUNTING = (
    "for i in $(seq 1 8); do echo line $i; sleep 1; done; echo '{\"lines\": 8}' > metrics.json"
)


def test_a_stop_mid_task_leaves_its_container_running_and_the_next_start_commits_it(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = coordinator.submit(box_job(["sh", "-c", COUNTING]))
    node = unique("dock-rejoin")
    first = start(start_agent, coordinator.url, node)
    [container] = wait_for("the container", lambda: ours(engine, node))
    wait_for("its second line", lambda: b"line 2" in container.logs(), timeout=30)
    stopped_at = time.monotonic()
    first.signal(signal.SIGTERM)
    assert first.wait(15) == 0, first.log
    assert time.monotonic() - stopped_at <= 10, first.log
    container.reload()
    assert container.status == "running"  # the engine runs it on while no agent is there

    second = start(start_agent, coordinator.url, node, state_dir=first.state_dir)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert coordinator.tasks(job)[0]["attempts"] == 1
    [entry] = second.wait_ledger(1)
    assert entry["outcome"] == "committed", entry
    kept = second.state_dir / "logs" / entry["lease_id"] / "stdout.txt"
    assert kept.read_text().splitlines() == [f"line {i}" for i in range(1, 9)]
    wait_for("its container removed", lambda: ours(engine, node) == [])


def test_a_container_left_with_no_agent_back_is_removed_after_reattach_seconds(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    coordinator.submit(box_job(["sleep", "600"]))
    node = unique("dock-gone")
    agent = start(start_agent, coordinator.url, node, env={"FLASHNODE_REATTACH_SECONDS": "2"})
    wait_for("the container", lambda: ours(engine, node))
    agent.proc.kill()
    agent.proc.wait()
    wait_for("its container removed", lambda: ours(engine, node) == [], timeout=20)


@pytest.fixture
def engine_proxy() -> Iterator[Proxy]:
    if not os.path.exists("/var/run/docker.sock"):
        pytest.skip("the engine is not on /var/run/docker.sock")
    path = Path(tempfile.mkdtemp(prefix="flashnode-engine-")) / "docker.sock"
    proxy = Proxy(unix_listen=str(path), unix_target="/var/run/docker.sock")
    yield proxy
    proxy.close()
    shutil.rmtree(path.parent, ignore_errors=True)


def test_engine_going_away_lets_the_lease_lapse_and_claims_resume_when_it_is_back(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    engine_proxy: Proxy,
) -> None:
    socket_path = engine_proxy._listener.getsockname()
    job = coordinator.submit(box_job(["sleep", "600"], max_attempts=1))
    node = unique("dock-engine")
    agent = start(
        start_agent,
        coordinator.url,
        node,
        env={"FLASHNODE_DOCKER_HOST": f"unix://{socket_path}"},
    )
    wait_for(
        "the container to run",
        lambda: [c for c in ours(engine, node) if c.status == "running"],
    )
    engine_proxy.set_mode("reset")  # the engine goes away, as far as the agent can tell
    agent.wait_log("container engine stopped answering", timeout=60)
    # The node's engine failed, not the task: no `fail` spends its failure budget; the lease is
    # left to lapse and the ledger says why.
    entry = wait_for("the ledger line", lambda: agent.ledger() and agent.ledger()[-1], timeout=60)
    assert entry["outcome"] == "lapsed" and "container engine unavailable" in entry["reason"]
    assert [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"] == []
    second = coordinator.submit(box_job(["sh", "-c", "echo '{}' > /work/out/metrics.json"]))
    assert coordinator.tasks(second)[0]["attempts"] == 0  # no claims while the engine is away
    engine_proxy.set_mode("forward")
    assert coordinator.wait_state(second, {"FAILED", "SUCCEEDED"}, timeout=60) == "SUCCEEDED"
    wait_for("the orphaned container to be removed", lambda: not ours(engine, node), timeout=30)
    assert agent.proc.poll() is None


def test_a_container_made_as_its_agent_is_killed_is_removed_after_reattach_seconds(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    engine_proxy: Proxy,
) -> None:
    engine_proxy.lose_answer_to = f'"{LABEL_LEASE}"'.encode()
    engine_proxy.hold_lost = True  # the engine made it; the agent is killed before it hears so
    socket_path = engine_proxy._listener.getsockname()
    coordinator.submit(box_job(["sleep", "600"]))
    node = unique("dock-killed")
    agent = start(
        start_agent,
        coordinator.url,
        node,
        env={"FLASHNODE_DOCKER_HOST": f"unix://{socket_path}", "FLASHNODE_REATTACH_SECONDS": "2"},
    )
    assert engine_proxy.lost.wait(60), agent.log
    assert len(ours(engine, node)) == 1
    agent.proc.kill()
    agent.proc.wait()
    wait_for("its container removed", lambda: ours(engine, node) == [], timeout=20)


@pytest.mark.parametrize("label", [LABEL_LEASE, LABEL_PROBE], ids=["task", "probe"])
def test_a_container_whose_create_answer_was_lost_is_removed(
    label: str,
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    engine_proxy: Proxy,
) -> None:
    engine_proxy.lose_answer_to = f'"{label}"'.encode()  # in the create's body
    socket_path = engine_proxy._listener.getsockname()
    job = coordinator.submit(box_job(["sh", "-c", "echo '{}' > /work/out/metrics.json"]))
    node = unique("dock-lost")
    agent = start(
        start_agent, coordinator.url, node, env={"FLASHNODE_DOCKER_HOST": f"unix://{socket_path}"}
    )
    assert engine_proxy.lost.wait(60), agent.log
    # The engine made the container; the agent never heard its id.
    made = json.loads(engine_proxy.lost_answer.partition(b"\r\n\r\n")[2].splitlines()[-1])["Id"]

    def removed() -> bool:
        try:
            engine.containers.get(made)
        except docker.errors.NotFound:
            return True
        return False

    wait_for("the container it never heard of removed", removed, timeout=30)
    assert coordinator.wait_state(job, {"FAILED", "SUCCEEDED"}, timeout=60) == "SUCCEEDED"
    assert agent.proc.poll() is None


def test_module_tasks_run_inside_the_image_with_their_spec(
    engine: Any,
    module_image: str,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    spec = {
        "apiVersion": "flashml.dev/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "hpo"},
        "spec": {
            "execution": {"backend": "leases"},
            "image": {"repository": "flashnode-test/pybox", "tag": "1"},
            "workload": {
                "type": "hyperparameter_search",
                "parameters": {
                    "module": "flashml_workloads.sklearn_trial",
                    "grid": {"C": [0.5]},
                    "lease_seconds": 60,
                },
            },
        },
    }
    job = recording_coordinator.submit(spec)
    node = unique("dock-module")
    agent = start(
        start_agent,
        recording_coordinator.url,
        node,
        "--max-tasks",
        "1",
        env={"FLASHNODE_ALLOWED_IMAGES": PYBOX},
    )
    assert agent.wait(60) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    [registration] = recording_coordinator.recorded("/nodes/register")
    assert registration["module_capable"] is True
    seen = json.loads(recording_coordinator.artifact(f"jobs/{job}/trial-000/spec-seen.json"))
    assert seen["task_id"] == "trial-000" and seen["params"] == {"C": 0.5}
    metrics = json.loads(recording_coordinator.artifact(f"jobs/{job}/trial-000/metrics.json"))
    assert metrics == {"module": "flashml_workloads.sklearn_trial"}
    assert ours(engine, node) == []


# --- bounded engine logs, default limits, no leftover probes -----------------------------------


def test_the_engine_keeps_a_bounded_log_and_tasks_get_default_limits(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    line = "flood " * 100
    job = coordinator.submit(
        box_job(["sh", "-c", f"while :; do echo '{line}'; done"], lease_seconds=30)
    )
    node = unique("dock-flood")
    agent = start(start_agent, coordinator.url, node, env={"FLASHNODE_LOG_MAX_BYTES": "1M"})
    running = wait_for(
        "the container", lambda: [c for c in ours(engine, node) if c.status == "running"]
    )
    container = running[0]
    container.reload()
    host = container.attrs["HostConfig"]
    assert host["LogConfig"] == {
        "Type": "json-file",
        "Config": {"max-size": "1048576", "max-file": "2"},
    }
    assert host["Memory"] > 0 and host["NanoCpus"] > 0 and host["PidsLimit"] > 0
    log_path = Path(container.attrs["LogPath"])
    wait_for("the engine log to rotate", lambda: log_path.with_name(log_path.name + ".1").exists())
    logs = list(log_path.parent.glob(log_path.name + "*"))
    assert sum(p.stat().st_size for p in logs) <= 2 * (1 << 20) + (64 << 10), logs
    coordinator.cancel(job)  # the lease is lost at its next renewal (every 10 s)
    wait_for("the container to be removed", lambda: not ours(engine, node), timeout=30)
    assert agent.proc.poll() is None


def test_the_module_probe_leaves_no_container_in_an_image_without_python(
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    node = unique("dock-probe")
    agent = start(start_agent, coordinator.url, node)
    agent.wait_log("registered as node")
    agent.signal(signal.SIGHUP)
    agent.wait_log("configuration reloaded")
    probes = engine.containers.list(
        all=True, filters={"label": f"dev.flashnode.probe={node}"}, ignore_removed=True
    )
    assert probes == []
    assert "module tasks on" not in agent.log
