"""Attacks on 414b468 (the fork server's answer deadline), 1f9ffb3 (a turnover thread per slot)
and 299b724 (a container node whose tasks could get no GPU registers none). Each test is one
attack and FAILS while the hole it shows is open.

The GPU decision (``ContainerRunner.passes_gpus``) reads the engine's runtimes as ``check``
does, and so shares its blind spots; where it is wrong towards "none", the node's GPUs are
never offered again (no GPU lease is placed here); where it is wrong towards "some", the GPU
leases the commit meant to keep away still come here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from scripted_engine import Engine, Images

from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.errors import AttemptLapsed
from flashnode.evidence.gpupool import GpuPool
from flashnode.runners.base import RunnerEnv
from flashnode.runners.container import runner as runner_module
from flashnode.runners.container.runner import ContainerRunner
from flashnode.runners.plan import TaskPlan
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs import supervisor
from flashnode.sandbox.workspace import Workspace

IMAGE = "flashnode-test/busybox:1"


def settings(state_dir: Path = Path("/nonexistent"), **given: Any) -> Settings:
    return Settings(coordinator="http://127.0.0.1:8100", state_dir=state_dir, **given)


def runner(monkeypatch: pytest.MonkeyPatch, engine: Engine, s: Settings) -> ContainerRunner:
    monkeypatch.setattr(runner_module, "connect", lambda settings, timeout=60: engine)
    return ContainerRunner.create(s, RunnerEnv("node-a", GpuPool([])))


# --- 299b724: the GPU decision -------------------------------------------------------------------


def test_an_engine_whose_default_runtime_is_gvisor_still_registers_gpus_no_task_can_get(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Settings that name no runtime run every container under the engine's default
    (``runtime: None`` in the create), and an owner who installs gVisor is told by its guide to
    make it the default (``"default-runtime": "runsc"``): then no task here gets a GPU, as
    surely as with ``container_runtime = "runsc"``. ``passes_gpus`` takes ``runtime is None``
    to pass GPUs without asking which runtime that is, so the node registers its GPUs and every
    GPU lease placed here starts in a container with no GPU (``check`` lets it through for the
    same reason): the leases the commit meant to keep away, now failing as the task's fault."""
    engine = Engine("runc", "runsc", args=("--platform=ptrace",), default="runsc")
    given: dict[str, Any] = {"allowed_images": (IMAGE,), "pools": ("team",)}
    r = runner(monkeypatch, engine, settings(**given))
    assert r.passes_gpus(settings(**given)) is False
    gpu_task = Task(task_id="t", output_prefix="o", argv=("true",), image=IMAGE, gpus=1)
    with pytest.raises(AttemptLapsed, match="passes no GPU"):
        r.check(gpu_task, settings(**given))


@pytest.mark.parametrize("flag", ["--nvproxy=True", "--nvproxy=1", "-nvproxy=TRUE"])
def test_gvisor_given_its_gpu_proxy_in_another_spelling_of_true_registers_no_gpu(
    monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """runsc parses its flags with Go's flag package: a boolean flag takes any of 1, t, T,
    true, TRUE, True (strconv.ParseBool), and one dash or two. ``Runtime.passes_gpus`` knows
    only ``nvproxy`` and ``nvproxy=true``: a gVisor runtime that does pass GPUs is taken for
    one that does not, and since 299b724 a node whose work all runs under it registers no GPU
    at all: its GPUs are never offered (before, only the GPU lease lapsed, saying why)."""
    engine = Engine("runc", "runsc", args=(flag,))
    every: dict[str, Any] = {
        "allowed_images": (IMAGE,),
        "pools": ("team",),
        "container_runtime": "runsc",
    }
    r = runner(monkeypatch, engine, settings(**every))
    assert r.passes_gpus(settings(**every)) is True


# --- 414b468: a start that fails at the fork server ----------------------------------------------


def test_a_container_watch_the_fork_server_did_not_answer_for_leaves_its_directory_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Since 414b468 a fork server that does not answer in time fails the start (OSError): the
    container runner lets the lease lapse, but leaves the watch's directory it made
    (``new_home``: root's, with the ``supervisor.log`` that ``_spawn`` opened in it) in
    ``tasks/`` until the agent's next start sweeps it; one per such start. The trusted runner's
    ``Launch`` removes its directory on the same failure."""
    state = tmp_path / "state"
    (state / "attempts").mkdir(parents=True)
    engine = Engine("runc")
    s = settings(state, allowed_images=(IMAGE,))
    r = runner(monkeypatch, engine, s)
    engine.images = Images(present=True)  # pulled since (no module probe at the start)

    def no_answer(spec: Any, fds: Any) -> Any:
        raise OSError(
            "cannot start a task's supervisor: its fork server did not answer in 10 s"
            " (it is started again)"
        )

    monkeypatch.setattr(supervisor.SERVER, "spawn", no_answer)
    ws = Workspace.create(state / "attempts", "lease-w")
    plan = TaskPlan(
        lease_id="lease-w",
        slot=0,
        workspace=ws,
        image=IMAGE,
        argv=("true",),
        env={},
        cwd="/work/out",
        views=(),
        datasets=None,
        environment=None,
        module_spec=None,
        gpus=(),
        gpu_node=False,
        limits=Limits(pids=64),
        on_exit=lambda: None,
        record=lambda identity: None,
        stdout=ws.logs / "stdout.txt",
        stderr=ws.logs / "stderr.txt",
    )
    with pytest.raises(AttemptLapsed, match="cannot start the container's watch"):
        r.start(plan)
    left = sorted(p.name for p in (state / supervisor.HOMES).iterdir())
    assert left == [], f"the watch's directories left in tasks/: {left}"
