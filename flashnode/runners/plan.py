"""The task's plan (``TaskPlan``): everything a runner needs to start one task, resolved once,
before the runner is called, by ``resolve``.

``resolve`` folds together the task, its lease, its slot and workspace, what each phase before
the run contributed (a ``Contribution``: variables, module inputs, an interpreter, ``PATH``
entries, read-only views, its release) and the few facts the runner states about itself
(``RunnerFacts``: where it shows the workspace, its module interpreter, ``HOME``, whether it
renumbers GPUs, its base ``PATH``). The plan says everything as the task will see it: its argv
(a module task's included), its environment, its working directory, its GPUs. A runner only
carries the plan out (its user, sandbox, cgroup, container), adding what exists only at launch
time (the ownership token).

Where a runner cannot show the workspace at ``/work`` (the trusted runner's same-user mode), an
argument, an ``env`` value or a module input that is ``/work`` or starts with ``/work/`` (also
after the first ``=`` of ``--opt=/work/...``) is rewritten to the workspace's host path.

The task's environment, each layer over the one before: the runner's own (the trusted runner:
the agent's locale), the payload's ``env``, flashruntime's contract variables, the phases'
variables (in their order), then ``PATH`` (the phases' entries first, where the runner states a
base ``PATH``), ``HOME``, ``TMPDIR``, ``FLASHML_WORK_DIR`` and ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnode.coordinator.lease import Lease, Task
from flashnode.errors import AttemptLapsed
from flashnode.evidence.gpupool import Device
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.workspace import CKPT as CKPT
from flashnode.sandbox.workspace import WORK as WORK
from flashnode.sandbox.workspace import Workspace

# The command a module task runs, after its interpreter.
MODULE_ARGV = ("-m", "{module}", "--spec", "{root}/spec.json", "--out", "{root}/out")


@dataclass(frozen=True)
class Contribution:
    """What one phase before the run adds to the task's start, and what it holds for the task
    until the attempt has ended (``release``, called once by the attempt's end, whatever way it
    ends). Values name paths as ``/work/...``."""

    env: Mapping[str, str] = field(default_factory=dict)  # variables, over the contract's
    module_inputs: Mapping[str, str] = field(default_factory=dict)  # more spec.json inputs
    python: str | None = None  # a module task's interpreter, instead of the runner's
    path: tuple[str, ...] = ()  # host directories first on the task's PATH
    environment: str | None = None  # the job environment's directory, the only one it sees
    views: tuple[tuple[str, str], ...] = ()  # read-only views: (host path, /work/... target)
    datasets: bool = False  # dataset slices laid out in the workspace's data/
    release: Callable[[], None] | None = None


@dataclass(frozen=True)
class RunnerFacts:
    """What a runner states about how it shows a task its workspace (``Runner.facts``)."""

    root: str = WORK  # where the task sees its workspace: /work, or its host path
    python: str | None = None  # a module task's interpreter, where no phase gave one
    home: str = f"{WORK}/tmp"  # HOME and TMPDIR: the workspace's tmp/ (its disk is counted)
    path: str | None = None  # the task's PATH after the phases' entries (None: left alone)
    env: Mapping[str, str] = field(default_factory=dict)  # under everything (the locale)
    group: int | None = None  # the group that reads the agent's files in the workspace


@dataclass(frozen=True)
class TaskPlan:
    """Everything a runner needs to start one task, resolved once (``resolve``)."""

    lease_id: str
    slot: int
    workspace: Workspace
    image: str
    argv: tuple[str, ...]  # as the task runs it: interpreter and spec of a module task included
    env: Mapping[str, str]  # all of it but what exists only at launch (the ownership token)
    cwd: str  # the output directory, as the task sees it (flashruntime's contract)
    views: tuple[tuple[str, str], ...]  # lent data: (host path, /work/... target), read-only
    datasets: Path | None  # the dataset slices' directory (read-only at /work/data), if any
    environment: str | None  # the job environment's directory, the only one the task sees
    module_spec: Mapping[str, Any] | None  # spec.json's content, for a module task
    gpus: tuple[Device, ...]  # the GPUs this attempt holds, and no other
    gpu_node: bool  # this node has GPUs: a task holding none must see none
    limits: Limits
    on_exit: Callable[[], None]  # called (from any thread) when the main process exits
    record: Callable[[dict[str, Any]], None]  # what a restarted agent needs to find the task
    stdout: Path
    stderr: Path
    # The largest file the task may make (RLIMIT_FSIZE, both limits; None: no limit): a file
    # that size is past its disk cap already, so the watch sees it, and the owner's disk keeps
    # what the cap leaves free, however fast the task writes.
    max_file_bytes: int | None = None
    # The task's pool (None: work from no pool, the public queue): a container runner's
    # runtime is chosen by it (``Settings.runtime_for``).
    pool: str | None = None

    @property
    def spec_file(self) -> Path:
        """Where the agent writes a module task's spec.json (``write_module_spec``)."""
        return self.workspace.root / "spec.json"


def contract_env(job_id: str, lease_id: str) -> dict[str, str]:
    """flashruntime's task contract (its ``launchers/local.py``), the same in every runner: the
    output directory (also the task's working directory), the checkpoint directory the relay
    watches, and the ids of the job and of this attempt (the lease)."""
    return {
        "FLASHML_OUTPUT_DIR": f"{WORK}/out",
        "FLASHML_CKPT_DIR": f"{WORK}/out/{CKPT}",
        "FLASHML_JOB_ID": job_id,
        "FLASHML_ATTEMPT_ID": lease_id,
    }


def resolve(
    task: Task,
    lease: Lease,
    slot: int,
    workspace: Workspace,
    facts: RunnerFacts,
    contributions: Sequence[Contribution],
    *,
    gpus: Sequence[Device],
    gpu_node: bool,
    renumbered: bool = False,
    limits: Limits,
    on_exit: Callable[[], None],
    record: Callable[[dict[str, Any]], None],
    max_file_bytes: int | None = None,
) -> TaskPlan:
    """The task's plan. ``renumbered``: the task sees its GPUs as 0..n-1 (the runner's
    ``gpu_addressing``). Raises AttemptLapsed for what this node cannot give it (no module
    interpreter, a read-only view outside the workspace)."""
    root = facts.root
    views = tuple(view for c in contributions for view in c.views)
    for _, target in views:
        rel = target.removeprefix(f"{WORK}/")
        if rel == target or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise AttemptLapsed("a read-only view lies outside the workspace")
    module_spec = None
    if task.module is not None:
        python = facts.python
        for c in contributions:
            python = c.python or python
        if python is None:
            raise AttemptLapsed("this node runs no module tasks (task_python)")
        inputs = {i.name: f"{WORK}/inputs/{i.dest}" for i in task.inputs}
        for c in contributions:
            inputs.update(c.module_inputs)
        module_spec = {
            "task_id": task.task_id,
            "params": dict(task.params),
            "inputs": {k: map_work(v, root) for k, v in inputs.items()},
        }
        argv = (python, *(a.format(module=task.module, root=root) for a in MODULE_ARGV))
    else:
        assert task.argv is not None
        argv = tuple(map_work(a, root) for a in task.argv)
    env = dict(facts.env)
    env.update({k: map_work(v, root) for k, v in task.env.items()})
    for layer in (contract_env(lease.job_id, lease.lease_id), *(c.env for c in contributions)):
        env.update({k: map_work(v, root) for k, v in layer.items()})
    if facts.path is not None:
        env["PATH"] = ":".join([*(p for c in contributions for p in c.path), facts.path])
    env.update(HOME=facts.home, TMPDIR=facts.home, FLASHML_WORK_DIR=root)
    visible = cuda_visible(gpus, gpu_node, renumbered)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    environment = None
    for c in contributions:
        environment = c.environment or environment
    return TaskPlan(
        lease_id=lease.lease_id,
        slot=slot,
        workspace=workspace,
        image=task.image,
        argv=argv,
        env=env,
        cwd=f"{root}/out",
        views=views,
        datasets=workspace.data if any(c.datasets for c in contributions) else None,
        environment=environment,
        module_spec=module_spec,
        gpus=tuple(gpus),
        gpu_node=gpu_node,
        limits=limits,
        on_exit=on_exit,
        record=record,
        stdout=workspace.logs / "stdout.txt",
        stderr=workspace.logs / "stderr.txt",
        max_file_bytes=max_file_bytes,
        pool=task.pool,
    )


def map_work(value: str, root: str) -> str:
    """Rewrite a ``/work`` path (alone, or after the first '=') to ``root``."""
    if value == WORK or value.startswith(WORK + "/"):
        return root + value[len(WORK) :]
    head, eq, tail = value.partition("=")
    if eq and (tail == WORK or tail.startswith(WORK + "/")):
        return head + eq + root + tail[len(WORK) :]
    return value


def cuda_visible(gpus: Sequence[Device], gpu_node: bool, renumbered: bool) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the task: its GPUs only, and none at all for a task holding
    none on a GPU node; None (unset) on a node without GPUs. ``renumbered``: the runtime maps the
    given devices to 0..n-1 (a container's device request)."""
    if not gpus and not gpu_node:
        return None
    if renumbered:
        return ",".join(str(i) for i in range(len(gpus)))
    return ",".join(d.visible for d in gpus)


def write_module_spec(plan: TaskPlan, group: int | None = None) -> None:
    """Write a module task's ``spec.json`` into the workspace, before the runner starts it (the
    agent's file: readable by ``group``, the task's, or by everyone where None); nothing for an
    argv task."""
    if plan.module_spec is None:
        return
    path = plan.spec_file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(plan.module_spec, fh, sort_keys=True)
    if group is not None:
        os.chown(path, os.geteuid(), group)
        path.chmod(0o640)
    else:
        path.chmod(0o644)
