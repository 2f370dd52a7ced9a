"""The runtime per container task (issue 45) against a scripted engine: a ``container_runtime``
or ``public_runtime`` the engine lacks stops the runner at its start with the fix (and a reload
to one is refused); a pool whose runtime it lacks is not advertised; a lease whose runtime it
lacks lapses (the node's shortcoming), saying why. The real
engine, runc and gVisor: ``test_container_runtimes.py``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from scripted_engine import Containers, Engine

from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.errors import AttemptLapsed, PrerequisiteError
from flashnode.evidence import inventory
from flashnode.evidence.gpupool import GpuPool
from flashnode.runners.base import RunnerEnv
from flashnode.runners.container import runner as runner_module
from flashnode.runners.container.preflight import runtimes
from flashnode.runners.container.runner import ContainerRunner
from flashnode.runners.findings import Ok, Problem
from flashnode.runners.registry import capabilities

IMAGE = "flashnode-test/busybox:1"


def runner(monkeypatch: pytest.MonkeyPatch, engine: Engine, **given: Any) -> ContainerRunner:
    monkeypatch.setattr(runner_module, "connect", lambda settings, timeout=60: engine)
    return ContainerRunner.create(settings(**given), RunnerEnv("node-a", GpuPool([])))


def settings(**given: Any) -> Settings:
    return Settings(coordinator="http://127.0.0.1:8100", state_dir=Path("/nonexistent"), **given)


def task(pool: str | None, gpus: int = 0) -> Task:
    return Task(task_id="t", output_prefix="o", argv=("true",), image=IMAGE, pool=pool, gpus=gpus)


def test_a_container_runtime_the_engine_lacks_stops_the_runner_at_its_start_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(PrerequisiteError) as refused:
        runner(monkeypatch, Engine("runc"), container_runtime="runsc")
    said = str(refused.value)
    assert "container_runtime 'runsc' is not a runtime of the engine" in said
    assert "(it has runc)" in said
    assert '"runtimes": {"runsc": {"path": "/usr/bin/runsc"}}' in said
    assert "/etc/docker/daemon.json" in said
    runner(monkeypatch, Engine("runc", "runsc"), container_runtime="runsc")  # it has it: runs


def test_a_pool_whose_runtime_the_engine_lacks_is_not_advertised_and_the_owner_is_told(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    given = {
        "allowed_images": (IMAGE,),
        "pools": ("team", "open", "lab"),
        "pool_runtimes": {"open": "runsc", "lab": "runc"},
    }
    with caplog.at_level(logging.WARNING):
        r = runner(monkeypatch, Engine("runc"), **given)
    s = settings(**given)
    assert r.pools(s) == ("team", "lab")
    offer = capabilities(s).offer(s, r.module_capable, r.pools(s))
    registration = inventory.registration(s, "node-a", offer)
    assert registration.capabilities.pools == ["team", "lab"]
    [warned] = [m for m in caplog.messages if "not advertised" in m]
    assert warned.startswith("pool open is not advertised: its runtime 'runsc'")
    # The engine gets runsc and the owner reloads: the pool is advertised again.
    r.client = Engine("runc", "runsc")
    r.reconfigure(s)
    assert r.pools(s) == ("team", "open", "lab")


def test_a_public_runtime_the_engine_lacks_stops_the_start_and_a_reload_to_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Work from no pool cannot be refused before it is placed here: a node whose engine lacks
    its runtime would take each such lease and let it lapse, spending the task's attempts."""
    given: dict[str, Any] = {"allowed_images": (IMAGE,), "pools": ("team",)}
    with pytest.raises(PrerequisiteError) as refused:
        runner(monkeypatch, Engine("runc"), public_runtime="gvisor", **given)
    assert str(refused.value) == (
        "public_runtime 'gvisor' is not a runtime of the engine at unix:///var/run/docker.sock"
        " (it has runc): the engine calls it 'runsc': name it so, and apt-get install runsc,"
        ' then add "runtimes": {"runsc": {"path": "/usr/bin/runsc"}} to /etc/docker/daemon.json'
        " and reload or restart docker (systemctl reload docker)"
    )
    r = runner(monkeypatch, Engine("runc", "runsc"), public_runtime="runsc", **given)
    with pytest.raises(PrerequisiteError, match="public_runtime 'kata' is not a runtime"):
        r.reconfigure(settings(public_runtime="kata", **given))
    assert r.settings.public_runtime == "runsc"  # the running configuration is kept


def test_a_lease_whose_runtime_the_engine_lost_lapses_saying_why_and_others_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given = {
        "allowed_images": (IMAGE,),
        "pools": ("team", "open"),
        "public_runtime": "runsc",
        "pool_runtimes": {"open": "runsc"},
    }
    r = runner(monkeypatch, Engine("runc", "runsc"), **given)
    s = settings(**given)
    r.runtimes.pop("runsc")  # the engine reloaded without it since the node's start
    with pytest.raises(AttemptLapsed) as lapsed:
        r.check(task(None), s)
    assert str(lapsed.value) == (
        "refused: work from no pool runs under runtime 'runsc' here, and the engine has no"
        " such runtime"
    )
    # A pool task the coordinator should never have placed here: refused all the same.
    with pytest.raises(AttemptLapsed, match="pool open runs under runtime 'runsc'"):
        r.check(task("open"), s)
    r.check(task("team"), s)  # the engine's default runtime: runs


def test_a_gpu_task_under_gvisor_without_its_gpu_proxy_lapses_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given = {"allowed_images": (IMAGE,), "pools": ("team",), "public_runtime": "runsc"}
    r = runner(monkeypatch, Engine("runc", "runsc", args=("--platform=ptrace",)), **given)
    s = settings(**given)
    with pytest.raises(AttemptLapsed) as lapsed:
        r.check(task(None, gpus=1), s)
    assert str(lapsed.value) == (
        "refused: a GPU task runs under runtime 'runsc' here, which passes no GPU"
        " (gVisor only with --nvproxy)"
    )
    r.check(task(None), s)  # no GPU: runs under gVisor
    r.check(task("team", gpus=1), s)  # runc passes it
    proxied = runner(monkeypatch, Engine("runc", "runsc", args=("--nvproxy=true",)), **given)
    proxied.check(task(None, gpus=1), s)


def test_a_node_none_of_whose_runtimes_passes_a_gpu_registers_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its GPU leases could only lapse here: the node registers no GPU where no task of any
    pool it advertises (nor of no pool) can be given one."""
    gvisor = Engine("runc", "runsc", args=("--platform=ptrace",))
    every = {"allowed_images": (IMAGE,), "pools": ("team",), "container_runtime": "runsc"}
    assert runner(monkeypatch, gvisor, **every).passes_gpus(settings(**every)) is False
    public = {"allowed_images": (IMAGE,), "pools": ("team",), "public_runtime": "runsc"}
    assert runner(monkeypatch, gvisor, **public).passes_gpus(settings(**public)) is True
    proxied = Engine("runc", "runsc", args=("--nvproxy=true",))
    assert runner(monkeypatch, proxied, **every).passes_gpus(settings(**every)) is True
    plain = {"allowed_images": (IMAGE,), "pools": ("team",)}
    podman = runner(monkeypatch, Engine("runc"), **plain)
    assert podman.passes_gpus(settings(**plain)) is True
    podman.dialect = dataclasses.replace(podman.dialect, passes_gpus=False)  # drops requests
    assert podman.passes_gpus(settings(**plain)) is False


class Probed:
    """A probe container that prints ``out``, or whose create fails with ``fails``."""

    def __init__(self, out: str, fails: str | None) -> None:
        self.out, self.fails = out, fails

    def start(self) -> None:
        if self.fails:
            raise docker.errors.APIError(self.fails)

    def wait(self, timeout: float) -> dict[str, int]:
        return {"StatusCode": 0}

    def logs(self, **_: Any) -> bytes:
        return self.out.encode()

    def remove(self, force: bool = False) -> None: ...


class ProbeEngine(Engine):
    """An engine whose probe containers fail under the runtimes in ``broken`` (None: the
    default), and see gVisor's kernel under runsc."""

    def __init__(
        self, *runtimes: str, broken: tuple[str | None, ...], default: str | None = None
    ) -> None:
        super().__init__(*runtimes, default=default)
        self.broken = broken
        self.made: list[dict[str, Any]] = []  # each create's arguments
        engine = self

        class Made(Containers):
            def create(self, image: str, command: list[str], **kw: Any) -> Probed:
                engine.made.append(kw)
                runtime = kw.get("runtime")
                gvisor = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016"
                out = gvisor if runtime == "runsc" else Path("/proc/version").read_text()
                fails = 'exec: "cat": not found' if runtime in engine.broken else None
                return Probed(out, fails)

            def get(self, name: str) -> Probed:
                return Probed("", None)

        self.containers = Made()


def test_the_doctor_tells_a_broken_runtime_from_an_image_it_cannot_probe_in() -> None:
    s = settings(allowed_images=(IMAGE,), container_runtime="runsc")
    [found] = runtimes(s, ProbeEngine("runc", "runsc", broken=()), IMAGE)
    assert isinstance(found, Ok) and "a probe saw gVisor's kernel" in found.detail
    [broken] = runtimes(s, ProbeEngine("runc", "runsc", broken=("runsc",)), IMAGE)
    assert isinstance(broken, Problem) and broken.fatal
    assert "did not run under it" in broken.why and "--network=none" in broken.fix
    assert "docker run --rm --runtime runsc --init" in broken.fix  # the probe's own way
    # cat fails under the default runtime too: the image cannot tell, the runtime is not blamed.
    [unsure] = runtimes(s, ProbeEngine("runc", "runsc", broken=("runsc", None)), IMAGE)
    assert isinstance(unsure, Problem) and not unsure.fatal
    assert "no probe could run" in unsure.why


def test_the_doctor_fails_a_missing_runtime_work_from_no_pool_needs_and_warns_of_a_pools() -> None:
    s = settings(
        allowed_images=(IMAGE,),
        pools=("lab",),
        public_runtime="gvisor",
        pool_runtimes={"lab": "kata"},
    )
    public, pool = runtimes(s, ProbeEngine("runc", "runsc", broken=()), IMAGE)
    assert isinstance(public, Problem) and public.fatal
    assert "work from no pool cannot run here" in public.why
    assert public.fix.startswith("the engine calls it 'runsc': name it so")
    assert isinstance(pool, Problem) and not pool.fatal and "pool lab cannot run here" in pool.why


def test_probe_containers_under_gvisor_run_the_engines_init_as_tasks_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Docker's containerd keeps the shim of a gVisor container whose start failed (a program
    not in the image): the doctor's probe and the module probe there run the engine's init
    first, under gVisor named or the engine's default (the tasks': test_container_runtimes.py)."""
    doctor = ProbeEngine("runc", "runsc", broken=())
    list(runtimes(settings(allowed_images=(IMAGE,), container_runtime="runsc"), doctor, IMAGE))
    assert [(kw["runtime"], kw.get("init")) for kw in doctor.made] == [("runsc", True)]
    under_runc = ProbeEngine("runc", "runsc", broken=())
    list(runtimes(settings(allowed_images=(IMAGE,), container_runtime="runc"), under_runc, IMAGE))
    assert [(kw["runtime"], kw.get("init")) for kw in under_runc.made] == [("runc", None)]
    for engine, given in (
        (ProbeEngine("runc", "runsc", broken=()), {"container_runtime": "runsc"}),
        (ProbeEngine("runc", "runsc", broken=(), default="runsc"), {}),
    ):
        engine.images.present = True
        runner(monkeypatch, engine, allowed_images=(IMAGE,), **given)
        assert [kw.get("init") for kw in engine.made] == [True], given
