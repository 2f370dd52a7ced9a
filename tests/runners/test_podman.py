"""The docker runner against Podman's Docker-compatible socket (issue 45): a Podman service of the
test session's own (``podman system service`` on a socket in a temporary directory; skipped,
saying why, where ``podman`` is not installed or its service does not answer), the test image
imported into it, and agents pointed at it with ``FLASHNODE_DOCKER_HOST``, against a real
coordinator: a locked-down task with its limits and its output, an image pinned by digest, a
timeout, the owner's pause, a stop of the agent (its container rejoined), a crash (its leftover
removed), the disk cap, the module probe, and the doctor naming the engine."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from badcoord import BadCoordinator, lease_answer
from boxes import IMAGE, LABEL, box_job, import_image, ours, start, unique
from harness import AgentProcess, CoordinatorServer, processes_in, wait_for
from seat import TICKING, Seat, goes_on, last_tick, release, running
from test_container import COUNTING, FAKE_PYTHON, PROBE, PYBOX
from test_container_runtimes import HIDE

from flashnode.config.settings import Settings
from flashnode.runners.container.preflight import engine_and_images
from flashnode.runners.findings import Ok

docker = pytest.importorskip("docker")

# What else the task reports: the places Podman would make writable, its open-file limit, and a
# line of output the agent keeps.
LOOK = (
    f"{PROBE}; echo said-on-stdout"
    "; (touch /run/x 2>/dev/null && echo run-writable || echo run-shut) > /work/out/places.txt"
    "; (touch /var/tmp/x 2>/dev/null && echo var-tmp-writable || echo var-tmp-shut)"
    " >> /work/out/places.txt"
    "; ulimit -n > /work/out/nofile.txt"
)


@dataclass
class Podman:
    """A Podman service of this session's: ``host`` for ``docker_host``, ``client`` the Docker
    SDK's client of it."""

    host: str
    client: Any
    nodes: list[str] = field(default_factory=list)

    def node(self, name: str) -> str:
        """A node id no other run used, whose containers the session removes at its end (a
        failed test's agent is killed, and its containers' watches cannot reach this service
        once it has stopped)."""
        made = unique(name)
        self.nodes.append(made)
        return made

    def env(self, **more: str) -> dict[str, str]:
        return {"FLASHNODE_DOCKER_HOST": self.host, **more}

    def remove_leftovers(self) -> None:
        for node in self.nodes:
            for container in ours(self.client, node):
                container.remove(force=True)


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    program = shutil.which("podman")
    if program is None:
        pytest.skip("podman is not installed (.ci/run installs Debian's)")
    # A short path of its own: a unix socket's path is capped at 107 bytes.
    home = Path(tempfile.mkdtemp(prefix="flashnode-podman-"))
    sock = home / "podman.sock"
    log = (home / "service.log").open("wb")
    service = subprocess.Popen(
        [program, "--log-level=error", "system", "service", "--time=0", f"unix://{sock}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    client: Any = None

    def answers() -> bool:
        nonlocal client
        if service.poll() is not None:
            return True  # gone: stop waiting, and say so below
        if not sock.exists():
            return False
        # Made once the socket is there (a client asks the engine's version as it is made).
        client = client or docker.DockerClient(base_url=f"unix://{sock}", timeout=60)
        return bool(client.ping())

    try:
        with contextlib.suppress(AssertionError):  # said below, as a skip
            wait_for("the Podman service to answer", answers, timeout=30)
        if service.poll() is not None or client is None:
            said = (home / "service.log").read_text(errors="replace")[-500:]
            pytest.skip(f"podman system service does not answer here: {said}")
        import_image(client, IMAGE)
        import_image(client, PYBOX, {"bin/python": FAKE_PYTHON})
        podman = Podman(f"unix://{sock}", client)
        try:
            yield podman
        finally:
            podman.remove_leftovers()
    finally:
        if client is not None:
            client.close()
        service.terminate()
        try:
            service.wait(15)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def test_a_locked_down_task_under_podman_commits_with_its_images_digest_and_its_output(
    podman: Podman,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = recording_coordinator.submit(box_job(["sh", "-c", LOOK]))
    node = podman.node("podman")
    env = podman.env()
    agent = start(start_agent, recording_coordinator.url, node, "--max-tasks", "1", env=env)
    assert agent.wait(90) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    artifact = recording_coordinator.artifact
    seen = json.loads(artifact(f"jobs/{job}/task-000/metrics.json"))
    assert seen["uid"] != 0
    assert seen["nets"].split() == ["lo"]
    assert set(seen["cap"].replace("CapEff", "").strip()) == {"0"}
    assert seen["rootfs_writable"] is False and seen["inputs_writable"] is False
    assert seen["tmp_writable"] is True and seen["home_writable"] is True
    # Podman's writable /run and /var/tmp under a read-only root are shut, as under Docker.
    places = artifact(f"jobs/{job}/task-000/places.txt").decode().split()
    assert places == ["run-shut", "var-tmp-shut"]
    # The engine's own open-file limit, not Podman's 1048576 (which this host may refuse).
    assert 0 < int(artifact(f"jobs/{job}/task-000/nofile.txt")) < 1048576
    [complete] = recording_coordinator.recorded("/complete")
    assert complete["evidence"]["image_digest"] == podman.client.images.get(IMAGE).id
    [entry] = agent.wait_ledger(1)
    kept = agent.state_dir / "logs" / entry["lease_id"] / "stdout.txt"
    assert kept.read_text().splitlines() == ["said-on-stdout"]
    assert "container engine: Podman" in agent.log
    assert ours(podman.client, node) == []


def test_an_image_pinned_by_its_digest_runs_under_podman(
    podman: Podman, start_agent: Callable[..., AgentProcess]
) -> None:
    image = podman.client.images.get(IMAGE)
    [digest] = [d.partition("@")[2] for d in image.attrs["RepoDigests"]][:1]
    pinned = f"flashnode-test/busybox@{digest}"
    bad = BadCoordinator()
    try:
        bad.claims = [lease_answer(1, image=pinned, pool=None, isolation={"tier": "sandboxed"})]
        node = podman.node("podman-digest")
        env = podman.env(FLASHNODE_ALLOWED_IMAGES=pinned)
        agent = start(start_agent, bad.url, node, "--max-tasks", "1", env=env)
        assert agent.wait(60) == 0, agent.log
        [(_, complete)] = bad.completes
        assert complete["evidence"]["image_digest"] == image.id, agent.log
    finally:
        bad.close()
    assert ours(podman.client, node) == []


def test_a_task_under_podman_has_its_limits_and_past_its_time_its_container_is_removed(
    podman: Podman,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    coordinator.submit(box_job(["sleep", "600"], max_attempts=1, lease_seconds=30))
    node = podman.node("podman-timeout")
    env = podman.env(FLASHNODE_MAX_TASK_SECONDS="4")
    agent = start(start_agent, coordinator.url, node, env=env)
    [container] = wait_for("the container", lambda: ours(podman.client, node), timeout=60)
    container.reload()
    host = container.attrs["HostConfig"]
    assert host["Memory"] > 0 and host["NanoCpus"] > 0 and host["PidsLimit"] > 0
    assert host["ReadonlyRootfs"] is True and host["NetworkMode"] == "none"
    assert "no-new-privileges" in host["SecurityOpt"]
    wait_for("the container to be removed", lambda: not ours(podman.client, node), timeout=30)
    record = wait_for("the attempt's record", lambda: agent.ledger() and agent.ledger()[-1])
    assert (record["outcome"], record["reason"]) == ("failed", "timed out after 4 s")


@pytest.mark.usefixtures("as_root")
def test_a_file_a_task_under_podman_removed_but_keeps_open_counts_against_its_disk_cap(
    podman: Podman,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    # Podman answers no ``top``: the task's processes are its container's cgroup's.
    job = coordinator.submit(box_job(["sh", "-c", HIDE], max_attempts=1))
    env = podman.env(FLASHNODE_TASK_DISK_BYTES="50M", FLASHNODE_MAX_OUTPUT_TOTAL_BYTES="50M")
    node = podman.node("podman-disk")
    agent = start(start_agent, coordinator.url, node, "--max-tasks", "1", env=env)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED", agent.log
    [reason] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "task_disk_bytes" in reason and "was stopped" in reason, reason
    assert ours(podman.client, node) == []


def test_under_podman_an_owner_rule_pauses_the_container_and_lets_it_go_on(
    podman: Podman,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    # Root Podman pauses through the cgroup freezer, as Docker does (cgroup v1 or v2).
    seat = Seat(tmp_path)
    job = coordinator.submit(box_job(["sh", "-c", TICKING]))
    node = podman.node("podman-pause")
    agent = start(start_agent, coordinator.url, node, env={**seat.env(), **podman.env()})
    wait_for("a printed line", lambda: "tick" in ((running(agent) or {}).get("last_output") or ""))
    [container] = ours(podman.client, node)

    def paused() -> bool:
        container.reload()
        return bool(container.attrs["State"]["Paused"])

    seat.active()
    wait_for("the container to be paused", paused, timeout=15)
    paused_at = last_tick(container)
    seat.idle()
    wait_for("the container to run again", lambda: not paused(), timeout=15)
    goes_on(container, paused_at)
    release(container)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "SUCCEEDED"
    entry = agent.wait_ledger()[-1]
    assert entry["outcome"] == "committed" and entry["timings"]["suspended"] > 0


def test_a_restarted_agent_removes_its_leftover_podman_container_and_nothing_else(
    podman: Podman,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    coordinator.submit(box_job(["sleep", "600"], max_attempts=2))
    bystanders = [
        podman.client.containers.create(IMAGE, ["sleep", "600"], labels={LABEL: "another-node"}),
        podman.client.containers.create(IMAGE, ["sleep", "600"]),
    ]
    try:
        node = podman.node("podman-restart")
        first = start(start_agent, coordinator.url, node, env=podman.env())
        [leftover] = wait_for("the container", lambda: ours(podman.client, node), timeout=60)
        first.proc.kill()
        first.proc.wait()
        # A crash that took the container's watch too: nothing for the next start to rejoin.
        for pid in processes_in(first.state_dir):
            os.kill(pid, signal.SIGKILL)
        second = start(
            start_agent, coordinator.url, node, state_dir=first.state_dir, env=podman.env()
        )
        second.wait_log("registered as node", timeout=60)
        assert leftover.id not in [c.id for c in ours(podman.client, node)]
        for b in bystanders:
            b.reload()  # still there: not this node's
    finally:
        for b in bystanders:
            b.remove(force=True)


def test_under_podman_a_container_outlives_its_agents_stop_and_the_next_start_commits_it(
    podman: Podman,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = coordinator.submit(box_job(["sh", "-c", COUNTING]))
    node = podman.node("podman-rejoin")
    first = start(start_agent, coordinator.url, node, env=podman.env())
    [container] = wait_for("the container", lambda: ours(podman.client, node), timeout=60)
    wait_for("its second line", lambda: b"line 2" in container.logs(), timeout=30)
    first.signal(signal.SIGTERM)
    assert first.wait(15) == 0, first.log
    container.reload()
    assert container.status == "running"  # the engine runs it on while no agent is there
    second = start(start_agent, coordinator.url, node, state_dir=first.state_dir, env=podman.env())
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert coordinator.tasks(job)[0]["attempts"] == 1
    [entry] = second.wait_ledger(1)
    assert entry["outcome"] == "committed", entry
    kept = second.state_dir / "logs" / entry["lease_id"] / "stdout.txt"
    assert kept.read_text().splitlines() == [f"line {i}" for i in range(1, 9)]
    wait_for("its container removed", lambda: ours(podman.client, node) == [])


def test_module_tasks_are_on_under_podman_when_the_image_imports_them(
    podman: Podman,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    node = podman.node("podman-module")
    env = podman.env(FLASHNODE_ALLOWED_IMAGES=PYBOX)
    agent = start(start_agent, coordinator.url, node, env=env)
    agent.wait_log("registered as node", timeout=60)
    assert f"module tasks on, in {PYBOX}" in agent.log
    probes = podman.client.containers.list(
        all=True, filters={"label": f"dev.flashnode.probe={node}"}, ignore_removed=True
    )
    assert probes == []


def test_the_doctor_names_podman_and_its_version_and_its_probe_runs(
    podman: Podman, tmp_path: Path
) -> None:
    s = Settings(
        coordinator="http://127.0.0.1:8100",
        state_dir=tmp_path,
        allowed_images=(IMAGE,),
        docker_host=podman.host,
        container_runtime="runc",
    )
    found = {f.what: f for f in engine_and_images(s)}
    engine = found["docker engine"]
    version = podman.client.version()["Version"]
    assert isinstance(engine, Ok) and engine.detail.startswith(f"Podman {version}"), found
    # The probe container runs under Podman (its rlimits given): a runtime that runs nothing
    # would be a Problem.
    runc = found["runtime runc"]
    assert isinstance(runc, Ok) and "a probe ran under it" in runc.detail, found
