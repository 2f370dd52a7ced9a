"""The task's plan, resolved once from the task, the phases' contributions and what each runner
states about itself: what the task will run and see, in each runner."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fakes import lease

from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Lease, Task, parse_task
from flashnode.coordinator.messages import GpuInfo
from flashnode.errors import AttemptLapsed
from flashnode.evidence.gpupool import Device, GpuPool
from flashnode.runners.base import RunnerEnv
from flashnode.runners.container.runner import ContainerRunner
from flashnode.runners.plan import Contribution, RunnerFacts, TaskPlan, resolve, write_module_spec
from flashnode.runners.registry import RUNNERS
from flashnode.runners.trusted import TrustedRunner
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs import TaskUser
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.workspace import Workspace

MODULE = "flashml_workloads.sgd_trainer"
AGENT_ENV = {"PATH": "/home/owner/bin:/usr/bin", "LANG": "C.UTF-8", "SECRET": "the agent's"}


def settings(tmp_path: Path) -> Settings:
    return Settings(
        coordinator="http://127.0.0.1:1",
        runner="trusted",
        pools=("team-a",),
        state_dir=tmp_path / "state",
    )


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace.create(tmp_path / "attempts", "ls-000000000000")


@pytest.fixture
def trusted(tmp_path: Path) -> Iterator[TrustedRunner]:
    """A root agent's trusted runner: a task user per slot, /work bound in the task's sandbox."""
    user = TaskUser("flashnode-task-0", 60000, 60001)
    runner = TrustedRunner(
        settings(tmp_path), RunnerEnv("node-1", GpuPool()), [user], None, True, agent_env=AGENT_ENV
    )
    runner.task_python = "/opt/flashnode-task-venv/bin/python"
    yield runner
    runner.close()


@pytest.fixture
def same_user(tmp_path: Path) -> Iterator[TrustedRunner]:
    """An agent that is not root: the task runs as the agent's user, with no namespace."""
    runner = TrustedRunner(
        settings(tmp_path), RunnerEnv("node-1", GpuPool()), None, None, False, agent_env=AGENT_ENV
    )
    runner.task_python = "/usr/bin/python3"
    yield runner
    runner.close()


@pytest.fixture
def container(tmp_path: Path) -> ContainerRunner:
    return ContainerRunner(settings(tmp_path), RunnerEnv("node-1", GpuPool()), client=None)


def task_of(**payload: Any) -> tuple[Task, Lease]:
    data = Lease.model_validate(lease(**payload))
    return parse_task(data), data


def plan_of(
    ws: Workspace,
    facts: RunnerFacts,
    contributions: Sequence[Contribution] = (),
    gpus: Sequence[Device] = (),
    gpu_node: bool = False,
    renumbered: bool = False,
    **payload: Any,
) -> TaskPlan:
    task, data = task_of(**payload)
    return resolve(
        task,
        data,
        0,
        ws,
        facts,
        contributions,
        gpus=gpus,
        gpu_node=gpu_node,
        renumbered=renumbered,
        limits=Limits(1 << 30, 1.0, 64),
        on_exit=lambda: None,
        record=lambda identity: None,
    )


def module_payload() -> dict[str, Any]:
    inputs = {"train": "artifact://jobs/j1/train.csv"}
    return {"argv": None, "module": MODULE, "params": {"lr": 0.1}, "inputs": inputs}


# --- module tasks in each runner ------------------------------------------------------------


def test_a_module_task_runs_under_the_trusted_runners_task_python_at_work(
    ws: Workspace, trusted: TrustedRunner
) -> None:
    plan = plan_of(ws, trusted.facts(ws, 0), **module_payload())
    python = "/opt/flashnode-task-venv/bin/python"
    spec_out = ("--spec", "/work/spec.json", "--out", "/work/out")
    assert plan.argv == (python, "-m", MODULE, *spec_out)
    assert plan.module_spec == {
        "task_id": "task-000",
        "params": {"lr": 0.1},
        "inputs": {"train": "/work/inputs/train.csv"},
    }
    assert plan.cwd == "/work/out"
    # A task user's PATH is the system's, never the agent's; of the agent's own environment only
    # the locale passes.
    assert plan.env["PATH"] == SYSTEM_PATH and plan.env["LANG"] == "C.UTF-8"
    assert "SECRET" not in plan.env
    assert (plan.env["HOME"], plan.env["TMPDIR"], plan.env["FLASHML_WORK_DIR"]) == (
        "/work/tmp",
        "/work/tmp",
        "/work",
    )


def test_a_module_task_runs_under_the_images_python_in_a_container(
    ws: Workspace, container: ContainerRunner
) -> None:
    plan = plan_of(ws, container.facts(ws, 0), **module_payload())
    spec_out = ("--spec", "/work/spec.json", "--out", "/work/out")
    assert plan.argv == ("python", "-m", MODULE, *spec_out)
    assert plan.module_spec is not None
    assert plan.module_spec["inputs"] == {"train": "/work/inputs/train.csv"}
    # The image's own PATH, and nothing of the agent's environment.
    assert "PATH" not in plan.env and "LANG" not in plan.env
    # HOME and TMPDIR as in the trusted runner: the workspace's tmp/.
    assert (plan.env["HOME"], plan.env["TMPDIR"], plan.env["FLASHML_WORK_DIR"]) == (
        "/work/tmp",
        "/work/tmp",
        "/work",
    )


def test_a_phases_interpreter_wins_over_the_runners(ws: Workspace, trusted: TrustedRunner) -> None:
    env = Contribution(python="/state/envs/abc/bin/python", environment="/state/envs/abc")
    plan = plan_of(ws, trusted.facts(ws, 0), [env], **module_payload())
    assert plan.argv[0] == "/state/envs/abc/bin/python"
    assert plan.environment == "/state/envs/abc"


def test_a_module_task_with_no_interpreter_lets_the_lease_lapse(ws: Workspace) -> None:
    with pytest.raises(AttemptLapsed, match="no module tasks"):
        plan_of(ws, RunnerFacts(python=None), **module_payload())


def test_the_module_spec_is_written_by_the_agent_for_the_tasks_group(
    ws: Workspace, same_user: TrustedRunner
) -> None:
    facts = same_user.facts(ws, 0)
    resume = Contribution(module_inputs={"resume": "/work/inputs/resume/step-5"})
    plan = plan_of(ws, facts, [resume], **module_payload())
    write_module_spec(plan, facts.group)
    root = str(ws.root)
    body = json.loads(plan.spec_file.read_text())
    assert body["inputs"] == {
        "train": f"{root}/inputs/train.csv",
        "resume": f"{root}/inputs/resume/step-5",
    }
    assert plan.spec_file.stat().st_mode & 0o777 == 0o644  # no task group: readable by all
    assert plan.argv[-4:] == ("--spec", f"{root}/spec.json", "--out", f"{root}/out")


def test_an_argv_task_writes_no_module_spec(ws: Workspace, trusted: TrustedRunner) -> None:
    plan = plan_of(ws, trusted.facts(ws, 0))
    write_module_spec(plan, 0)
    assert plan.module_spec is None and not plan.spec_file.exists()


# --- /work where the task cannot see it -----------------------------------------------------


def test_the_same_user_mode_maps_work_in_argv_env_and_phase_variables(
    ws: Workspace, same_user: TrustedRunner
) -> None:
    plan = plan_of(
        ws,
        same_user.facts(ws, 0),
        [Contribution(env={"FLASHML_RESUME": "/work/inputs/resume/step-5"})],
        argv=["train", "/work/inputs/x", "--opt=/work/x", "--keep=/workshop", "/work"],
        env={"DATA": "/work/inputs/x", "OPT": "--o=/work/out", "NOT": "/workshop"},
    )
    root = str(ws.root)
    assert plan.argv == ("train", f"{root}/inputs/x", f"--opt={root}/x", "--keep=/workshop", root)
    env = plan.env
    assert (env["DATA"], env["OPT"], env["NOT"]) == (
        f"{root}/inputs/x",
        f"--o={root}/out",
        "/workshop",
    )
    assert env["FLASHML_RESUME"] == f"{root}/inputs/resume/step-5"
    assert env["FLASHML_OUTPUT_DIR"] == f"{root}/out"  # the contract's, mapped too
    assert env["PATH"] == AGENT_ENV["PATH"]  # the agent's own user: its own PATH
    assert plan.cwd == f"{root}/out"


def test_with_a_sandbox_work_stays_work(ws: Workspace, trusted: TrustedRunner) -> None:
    plan = plan_of(ws, trusted.facts(ws, 0), argv=["ls", "--dir=/work/inputs"])
    assert plan.argv == ("ls", "--dir=/work/inputs")
    assert plan.env["FLASHML_OUTPUT_DIR"] == "/work/out"


# --- GPUs -------------------------------------------------------------------------------------

GPUS = [Device(GpuInfo(index=i), str(i), minor=i) for i in range(4)]


def test_a_task_sees_only_its_own_gpus_by_the_hosts_numbers_on_the_host(
    ws: Workspace, trusted: TrustedRunner
) -> None:
    plan = plan_of(ws, trusted.facts(ws, 0), gpus=GPUS[2:], gpu_node=True)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,3" and plan.gpus == tuple(GPUS[2:])


def test_a_container_sees_its_gpus_renumbered(ws: Workspace, container: ContainerRunner) -> None:
    assert RUNNERS["docker"].capabilities(container.settings).gpu_addressing == "renumbered"
    plan = plan_of(ws, container.facts(ws, 0), gpus=GPUS[2:], gpu_node=True, renumbered=True)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1" and plan.gpus == tuple(GPUS[2:])


@pytest.mark.parametrize("renumbered", [False, True])
def test_a_task_holding_no_gpu_on_a_gpu_node_sees_none(ws: Workspace, renumbered: bool) -> None:
    plan = plan_of(ws, RunnerFacts(), gpu_node=True, renumbered=renumbered)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "" and plan.gpu_node


def test_a_node_without_gpus_leaves_cuda_visible_devices_unset(ws: Workspace) -> None:
    assert "CUDA_VISIBLE_DEVICES" not in plan_of(ws, RunnerFacts()).env


# --- whose variable wins ----------------------------------------------------------------------


def test_payload_env_is_under_the_contract_which_is_under_the_phases(
    ws: Workspace, trusted: TrustedRunner
) -> None:
    payload_env = {
        "LANG": "de_DE.UTF-8",  # over the runner's locale
        "FLASHML_JOB_ID": "someone-else",  # the contract's
        "FLASHML_RESUME": "/etc/shadow",  # a phase's
        "VIRTUAL_ENV": "/payload/venv",  # a phase's
        "HOME": "/root",  # the runner's
        "PATH": "/payload/bin",  # the runner's and the phases'
        "FOO": "bar",
    }
    phases = [
        Contribution(env={"FLASHML_RESUME": "/work/out/ckpt/step-5", "SHARED": "first"}),
        Contribution(env={"VIRTUAL_ENV": "/state/envs/abc", "SHARED": "second"}, path=("/e/bin",)),
        Contribution(path=("/f/bin",)),
    ]
    plan = plan_of(ws, trusted.facts(ws, 0), phases, env=payload_env)
    env = plan.env
    assert env["LANG"] == "de_DE.UTF-8" and env["FOO"] == "bar"
    assert env["FLASHML_JOB_ID"] == "j1" and env["FLASHML_ATTEMPT_ID"] == "ls-000000000000"
    assert env["FLASHML_RESUME"] == "/work/out/ckpt/step-5"
    assert env["VIRTUAL_ENV"] == "/state/envs/abc" and env["SHARED"] == "second"
    assert env["HOME"] == "/work/tmp"
    assert env["PATH"] == f"/e/bin:/f/bin:{SYSTEM_PATH}"


# --- read-only views --------------------------------------------------------------------------


def test_views_and_datasets_reach_the_plan(ws: Workspace, trusted: TrustedRunner) -> None:
    lent = Contribution(views=(("/srv/scans", "/work/inputs/scans"),), datasets=True)
    plan = plan_of(ws, trusted.facts(ws, 0), [Contribution(), lent])
    assert plan.views == (("/srv/scans", "/work/inputs/scans"),)
    assert plan.datasets == ws.data
    assert plan_of(ws, trusted.facts(ws, 0)).datasets is None


@pytest.mark.parametrize(
    "target", ["/etc", "/work", "/work/", "/work/../etc", "/work/inputs/../../x"]
)
def test_a_view_outside_the_workspace_lets_the_lease_lapse(ws: Workspace, target: str) -> None:
    with pytest.raises(AttemptLapsed, match="outside the workspace"):
        plan_of(ws, RunnerFacts(), [Contribution(views=(("/srv/scans", target),))])
