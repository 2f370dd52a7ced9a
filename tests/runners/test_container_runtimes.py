"""The container runner under each runtime, against the real engine (issue 45): its key tests
and its escape tests under runc and under gVisor (``runsc``, registered by ``.ci/run``; skipped,
saying why, where the engine has none or it cannot run here): the sandbox, the task's kernel, the
disk cap against a file removed but kept open, the timeout, the owner's pause, a restart of the
agent; the doctor's probe; and the pool policy with a real coordinator: a node whose engine lacks
the runtime of work from no pool does not start, saying why; a pool whose runtime it lacks is not
advertised, and the node works for the others. The rest of the runner's tests (``test_container.py``) run under the default."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from boxes import box_job, ours, start, unique
from harness import AgentProcess, CoordinatorServer, wait_for
from seat import TICKING, Seat, goes_on, last_tick, release, running
from test_container import COUNTING, PROBE

from flashnode.config.settings import Settings
from flashnode.errors import ExitCode
from flashnode.runners.container.engine import Engine
from flashnode.runners.container.handle import ContainerHandle
from flashnode.runners.container.preflight import engine_and_images
from flashnode.runners.findings import Ok, Problem

docker = pytest.importorskip("docker")

HOST_KERNEL = Path("/proc/version").read_text().strip()
ABSENT = "flashnode-absent"  # a runtime no engine has


@pytest.fixture(scope="session")
def runsc(engine: Any, image: str) -> str:
    """gVisor's runtime, where the engine has it and it runs a container here."""
    if "runsc" not in (engine.info().get("Runtimes") or {}):
        pytest.skip("the engine has no runsc runtime (.ci/run registers Debian's runsc)")
    try:
        engine.containers.run(image, ["true"], runtime="runsc", network_mode="none", remove=True)
    except docker.errors.DockerException as exc:
        pytest.skip(f"runsc cannot run a container here: {str(exc)[:300]}")
    return "runsc"


@pytest.fixture(params=["runc", "runsc"])
def runtime(request: pytest.FixtureRequest, engine: Any) -> str:
    name: str = request.param
    return request.getfixturevalue("runsc") if name == "runsc" else name


def test_a_task_is_locked_down_and_sees_its_runtimes_kernel(
    runtime: str,
    engine: Any,
    image: str,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    look = f"{PROBE}; cat /proc/version > /work/out/version.txt"
    job = recording_coordinator.submit(box_job(["sh", "-c", look]))
    node = unique(f"rt-{runtime}")
    env = {"FLASHNODE_CONTAINER_RUNTIME": runtime}
    agent = start(start_agent, recording_coordinator.url, node, "--max-tasks", "1", env=env)
    assert agent.wait(90) == 0, agent.log
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    seen = json.loads(recording_coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert seen["uid"] != 0
    assert seen["nets"].split() == ["lo"]
    assert set(seen["cap"].replace("CapEff", "").strip()) == {"0"}
    assert seen["rootfs_writable"] is False and seen["inputs_writable"] is False
    assert seen["tmp_writable"] is True and seen["home_writable"] is True
    kernel = recording_coordinator.artifact(f"jobs/{job}/task-000/version.txt").decode().strip()
    if runtime == "runsc":  # gVisor's own kernel, not the host's
        assert kernel != HOST_KERNEL and kernel.startswith("Linux version"), kernel
    else:
        assert kernel == HOST_KERNEL
    assert ours(engine, node) == []


def test_a_task_past_its_time_under_gvisor_is_stopped_and_its_container_removed(
    runsc: str,
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    coordinator.submit(box_job(["sleep", "600"], max_attempts=1, lease_seconds=30))
    node = unique("rt-timeout")
    env = {"FLASHNODE_CONTAINER_RUNTIME": runsc, "FLASHNODE_MAX_TASK_SECONDS": "3"}
    agent = start(start_agent, coordinator.url, node, env=env)
    [container] = wait_for("the container", lambda: ours(engine, node), timeout=60)
    container.reload()
    assert container.attrs["HostConfig"]["Runtime"] == "runsc"
    wait_for("the container to be removed", lambda: not ours(engine, node), timeout=30)
    record = wait_for("the attempt's record", lambda: agent.ledger() and agent.ledger()[-1])
    assert (record["outcome"], record["reason"]) == ("failed", "timed out after 3 s")
    assert record["runtime"] == "runsc"
    assert "running (docker runner, runtime runsc, timeout 3 s)" in agent.log


def test_the_doctor_runs_a_probe_under_each_runtime_and_names_one_the_engine_lacks(
    runsc: str, engine: Any, image: str, tmp_path: Path
) -> None:
    s = Settings(
        coordinator="http://127.0.0.1:8100",
        state_dir=tmp_path,
        allowed_images=(image,),
        pools=("team", "open"),
        container_runtime="runc",
        public_runtime=runsc,
        pool_runtimes={"open": ABSENT},
    )
    found = {f.what: f for f in engine_and_images(s)}
    assert found["runtime runc"] == Ok(
        "runtime runc", "every container task, pool team; registered (runc); a probe ran under it"
    )
    gvisor = found["runtime runsc"]
    assert isinstance(gvisor, Ok) and "a probe saw gVisor's kernel" in gvisor.detail
    assert HOST_KERNEL not in gvisor.detail
    absent = found[f"runtime {ABSENT}"]
    assert isinstance(absent, Problem) and not absent.fatal  # only pool open needs it
    assert "pool open cannot run here" in absent.why and "daemon.json" in absent.fix
    fatal = Settings(**{**s.model_dump(), "container_runtime": ABSENT, "pool_runtimes": {}})
    [missing] = [f for f in engine_and_images(fatal) if f.what == f"runtime {ABSENT}"]
    assert isinstance(missing, Problem) and missing.fatal
    assert "every container task" in missing.why


def test_a_node_without_its_public_runtime_does_not_start_and_one_without_a_pools_works_on(
    engine: Any,
    image: str,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """Work from no pool cannot be refused before it is placed: a node whose engine lacks its
    runtime would take each such lease and let it lapse, spending the task's attempts."""
    node = unique("rt-policy")
    pools = {"FLASHNODE_POOLS": "team-a,team-b"}
    refused = start(
        start_agent,
        recording_coordinator.url,
        node,
        env={**pools, "FLASHNODE_PUBLIC_RUNTIME": ABSENT},
    )
    assert refused.wait(60) == ExitCode.UNAVAILABLE, refused.log
    assert f"runtime {ABSENT}: not registered with the engine" in refused.log
    assert "work from no pool cannot run here" in refused.log
    assert recording_coordinator.recorded("/leases/claim") == []
    team = box_job(["sh", "-c", "echo '{}' > /work/out/metrics.json"])
    team["spec"]["placement"] = {"pool": "team-a"}
    env = {**pools, "FLASHNODE_POOL_RUNTIMES": f"team-b={ABSENT}"}
    agent = start(start_agent, recording_coordinator.url, node, env=env)
    job = recording_coordinator.submit(team)
    assert recording_coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    assert agent.proc.poll() is None
    [registration, *_] = recording_coordinator.recorded("/nodes/register")
    assert registration["capabilities"]["pools"] == ["team-a"]
    assert "pool team-b is not advertised" in agent.log


class NoWatch:
    """The container's watch, not wanted here: the test removes its container itself."""

    def done(self) -> None: ...

    def remove(self) -> None: ...


def test_under_gvisor_the_tasks_processes_are_its_sandboxes_on_the_host_never_the_hosts_pid_1(
    runsc: str, engine: Any, image: str, tmp_path: Path
) -> None:
    # The engine lists a gVisor container's processes by the sandbox's own pids (1, 2...): read
    # as host pids they would be the host's init and kernel threads, whose open files the disk
    # watch would count and whose use the sampler would report.
    container = engine.containers.run(
        image, ["sleep", "60"], runtime=runsc, network_mode="none", detach=True
    )
    try:
        listed = {int(row[0]) for row in container.top(ps_args="-eo pid")["Processes"]}
        handle = ContainerHandle(
            Engine(engine),
            container,
            "",
            lambda: None,
            (tmp_path / "stdout", tmp_path / "stderr"),
            tmp_path,
            NoWatch(),  # type: ignore[arg-type]
            1 << 20,
            own_kernel=True,
        )
        pids = handle.pids()
        container.reload()
        assert container.attrs["State"]["Pid"] in pids
        assert 1 not in pids and not pids & listed - {container.attrs["State"]["Pid"]}
        for pid in pids:  # the sandbox, its gofer, the ptrace platform's stubs
            assert container.id in Path(f"/proc/{pid}/cgroup").read_text(), pid
    finally:
        container.remove(force=True)


# 30 MB removed but kept open, 30 MB in a file: 60 MB against a 50 MB cap, only half of it
# visible to a walk of out/. No braces: the coordinator formats a command with the task's params.
HIDE = (
    "exec 3>/work/out/a && head -c 31457280 /dev/zero >&3 && rm /work/out/a"
    " && head -c 31457280 /dev/zero > /work/out/b && echo written && sleep 60"
    " && printf '\\173\\175' > /work/out/metrics.json"
)


@pytest.mark.usefixtures("as_root")
def test_a_file_the_task_removed_but_keeps_open_counts_against_its_disk_cap(
    runtime: str,
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = coordinator.submit(box_job(["sh", "-c", HIDE], max_attempts=1))
    env = {
        "FLASHNODE_CONTAINER_RUNTIME": runtime,
        "FLASHNODE_TASK_DISK_BYTES": "50M",
        "FLASHNODE_MAX_OUTPUT_TOTAL_BYTES": "50M",
    }
    node = unique(f"rt-disk-{runtime}")
    agent = start(start_agent, coordinator.url, node, "--max-tasks", "1", env=env)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED", agent.log
    [reason] = [e["message"] for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert "task_disk_bytes" in reason and "was stopped" in reason, reason
    assert ours(engine, node) == []


def test_under_gvisor_a_container_outlives_its_agents_restart_and_is_rejoined_and_committed(
    runsc: str,
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    job = coordinator.submit(box_job(["sh", "-c", COUNTING]))
    node = unique("rt-rejoin")
    env = {"FLASHNODE_CONTAINER_RUNTIME": runsc}
    first = start(start_agent, coordinator.url, node, env=env)
    [container] = wait_for("the container", lambda: ours(engine, node), timeout=60)
    wait_for("its second line", lambda: b"line 2" in container.logs(), timeout=30)
    first.signal(signal.SIGTERM)
    assert first.wait(15) == 0, first.log
    container.reload()
    assert container.status == "running"
    second = start(start_agent, coordinator.url, node, state_dir=first.state_dir, env=env)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert coordinator.tasks(job)[0]["attempts"] == 1
    [entry] = second.wait_ledger(1)
    assert entry["outcome"] == "committed", entry
    wait_for("its container removed", lambda: ours(engine, node) == [])


def test_under_gvisor_an_owner_rule_pauses_the_container_and_lets_it_go_on(
    runsc: str,
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    seat = Seat(tmp_path)
    job = coordinator.submit(box_job(["sh", "-c", TICKING]))
    node = unique("rt-pause")
    agent = start(
        start_agent, coordinator.url, node, env={**seat.env(), "FLASHNODE_CONTAINER_RUNTIME": runsc}
    )
    wait_for("a printed line", lambda: "tick" in ((running(agent) or {}).get("last_output") or ""))
    [container] = ours(engine, node)

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


def engine_shims_of_no_container(engine: Any) -> set[str]:
    """The ids that containerd shims still serve which the engine has no container for."""
    containers = {c.id for c in engine.containers.list(all=True, ignore_removed=True)}
    served = set()
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if argv and "containerd-shim" in argv[0] and "-id" in argv[:-1]:
            served.add(argv[argv.index("-id") + 1])
    return served - containers


def test_under_gvisor_a_task_whose_program_is_not_in_its_image_fails_and_leaves_no_engine_process(
    runsc: str,
    engine: Any,
    image: str,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
) -> None:
    """runsc fails the start of such a container, and Docker's containerd then keeps its shim
    for good, through the container's removal: one process a task, a job's way to fill the
    owner's memory. The agent's own probe at its start (python in an image that has none) is
    such a start too."""
    left = engine_shims_of_no_container(engine)
    job = coordinator.submit(box_job(["/no/such/program"], max_attempts=1))
    node = unique("rt-missing")
    agent = start(start_agent, coordinator.url, node, env={"FLASHNODE_CONTAINER_RUNTIME": runsc})
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=90) == "FAILED"
    wait_for("its container removed", lambda: ours(engine, node) == [])
    wait_for(
        "no engine process left for a container the engine no longer has",
        lambda: engine_shims_of_no_container(engine) <= left,
    )
    [entry] = agent.wait_ledger(1)
    assert entry["outcome"] == "failed" and entry["runtime"] == "runsc", entry
    assert entry["reason"].startswith("exit code 127"), entry


def test_a_node_whose_tasks_all_run_under_gvisor_without_its_gpu_proxy_registers_no_gpu(
    runsc: str,
    recording_coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    fake_nvml: Any,
) -> None:
    """Its GPU leases could only lapse (no GPU reaches a gVisor container without --nvproxy,
    which .ci/run does not give it): the machine's GPU is not registered."""
    gpu = "devices 1\nname NVIDIA H200\nmemory_mb 143771\ndriver 550.54.15\ncc 9 0\nutil 0 0\n"
    env = {**fake_nvml.script(gpu), "FLASHNODE_CONTAINER_RUNTIME": runsc}
    agent = start(start_agent, recording_coordinator.url, unique("rt-nogpu"), env=env)
    agent.wait_log("registered as node", timeout=60)
    [registration] = recording_coordinator.recorded("/nodes/register")
    assert registration["capabilities"]["gpus"] == [], registration["capabilities"]
