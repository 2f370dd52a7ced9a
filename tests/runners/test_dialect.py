"""What the runner does differently under Podman (``dialect.py``), against scripted engines: told
apart by what the engine says of itself, a container given explicit rlimits and Podman's extra
tmpfs shut (the task's own settings kept), Docker's containers under gVisor given an init, a
rootless engine on cgroup v1 refused (it ignores the limits), a GPU lease refused. The real Podman service: ``test_podman.py``."""

from __future__ import annotations

import os
import resource
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import docker.types
import pytest

from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.errors import AttemptLapsed, PrerequisiteError
from flashnode.evidence.gpupool import GpuPool
from flashnode.runners.base import RunnerEnv
from flashnode.runners.container import runner as runner_module
from flashnode.runners.container.dialect import Dialect, dialect
from flashnode.runners.container.runner import ContainerRunner

IMAGE = "flashnode-test/busybox:1"
PODMAN = {"Version": "4.3.1", "Components": [{"Name": "Podman Engine", "Version": "4.3.1"}]}
DOCKER = {"Version": "20.10.24", "Components": [{"Name": "Engine"}, {"Name": "containerd"}]}


class Engine:
    def __init__(self, version: dict[str, Any], **info: Any) -> None:
        self._version, self._info = version, {"CgroupVersion": "2", **info}

    def version(self) -> dict[str, Any]:
        return self._version

    def info(self) -> dict[str, Any]:
        return self._info


def test_docker_is_left_as_it_is() -> None:
    spoken = dialect(Engine(DOCKER), "unix:///nonexistent.sock")
    assert spoken == Dialect(version="20.10.24", cgroup_version="2")
    kwargs = {"tmpfs": {"/tmp": "size=1"}}
    assert spoken.apply(dict(kwargs)) == kwargs
    assert spoken.describe() == "Docker 20.10.24, cgroup v2" and spoken.passes_gpus


def test_under_gvisor_dockers_containers_run_its_init_and_podmans_none() -> None:
    # Docker's containerd keeps the shim of a gVisor container whose start failed; the init
    # makes such a start an exit 127. Podman's go with the container, and it may have no init.
    docker_spoken = dialect(Engine(DOCKER), "unix:///nonexistent.sock")
    assert docker_spoken.apply({}, own_kernel=True) == {"init": True}
    assert "init" not in docker_spoken.apply({}, own_kernel=False)
    podman_spoken = dialect(Engine(PODMAN), "unix:///nonexistent.sock")
    assert "init" not in podman_spoken.apply({}, own_kernel=True)


def test_under_podman_a_container_gets_explicit_rlimits_and_no_writable_run_or_var_tmp() -> None:
    # No socket to ask: the agent's own limits, which an engine of the same host can give.
    spoken = dialect(Engine(PODMAN), "unix:///nonexistent.sock")
    assert spoken.name == "Podman" and not spoken.passes_gpus
    fsize = docker.types.Ulimit(name="fsize", soft=10, hard=10)
    made = spoken.apply({"ulimits": [fsize], "tmpfs": {"/tmp": "rw,size=1"}})
    limits = {u["Name"]: (u["Soft"], u["Hard"]) for u in made["ulimits"]}
    assert limits == {
        "fsize": (10, 10),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
    }
    assert made["tmpfs"]["/tmp"] == "rw,size=1"  # the task's own
    assert made["tmpfs"]["/run"].startswith("ro,") and made["tmpfs"]["/var/tmp"].startswith("ro,")


def test_under_podman_the_limits_are_those_of_the_process_that_serves_the_socket() -> None:
    # The engine here is this test's own process: its peer credentials name it.
    home = Path(tempfile.mkdtemp(prefix="flashnode-dialect-"))
    path = home / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)
        accepted: list[socket.socket] = []
        taker = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
        taker.start()
        spoken = dialect(Engine(PODMAN), f"unix://{path}")
        taker.join(5)
        for conn in accepted:
            conn.close()
    path.unlink()
    home.rmdir()
    limits = Path(f"/proc/{os.getpid()}/limits").read_text()
    soft, hard = spoken.ulimits["nofile"]
    assert f"Max open files            {soft:<21}{hard:<21}files" in limits


def test_rootless_podman_on_cgroup_v1_is_a_problem_and_on_v2_none() -> None:
    rootless = ["name=seccomp,profile=default", "name=rootless"]
    v1 = dialect(Engine(PODMAN, CgroupVersion="1", SecurityOptions=rootless), "tcp://x:1")
    [problem] = v1.problems()
    assert "cannot pause" in problem and "cgroup v2" in problem
    assert v1.describe() == "Podman 4.3.1, rootless, cgroup v1"
    v2 = dialect(Engine(PODMAN, CgroupVersion="2", SecurityOptions=rootless), "tcp://x:1")
    assert v2.problems() == []


class Containers:
    def list(self, **_: Any) -> list[Any]:
        return []


class Images:
    def get(self, name: str) -> Any:
        raise docker.errors.ImageNotFound(name)


class Podman(Engine):
    """A Podman engine that answers, with runc and no image."""

    def __init__(self, **info: Any) -> None:
        super().__init__(PODMAN, Runtimes={"runc": {"path": "/usr/bin/runc"}}, **info)
        self.containers, self.images = Containers(), Images()

    def ping(self) -> bool:
        return True


SETTINGS = Settings(
    coordinator="http://127.0.0.1:8100",
    state_dir=Path("/nonexistent"),
    allowed_images=(IMAGE,),
    docker_host="tcp://127.0.0.1:1",
)


def test_the_runner_does_not_start_on_rootless_podman_under_cgroup_v1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It would run every container without the sandbox's limits.
    engine = Podman(CgroupVersion="1", SecurityOptions=["name=rootless"])
    monkeypatch.setattr(runner_module, "connect", lambda settings, timeout=60: engine)
    with pytest.raises(PrerequisiteError) as refused:
        ContainerRunner.create(SETTINGS, RunnerEnv("node-a", GpuPool([])))
    assert "no memory, CPU or pids limit" in str(refused.value)


def test_a_gpu_lease_under_podman_lapses_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "connect", lambda settings, timeout=60: Podman())
    s = SETTINGS
    r = ContainerRunner.create(s, RunnerEnv("node-a", GpuPool([])))

    def task(gpus: int) -> Task:
        return Task(task_id="t", output_prefix="o", argv=("true",), image=IMAGE, gpus=gpus)

    with pytest.raises(AttemptLapsed) as lapsed:
        r.check(task(1), s)
    assert "cannot get its GPUs from Podman" in str(lapsed.value)
    r.check(task(0), s)
