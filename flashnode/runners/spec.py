"""What both runners share about a task's start: the StartSpec, the module spec file, GPU
visibility and the ``/work`` mapping (where a task cannot see its workspace at ``/work``: the
trusted runner's same-user mode)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnode.config.settings import Settings
from flashnode.coordinator.lease import Task
from flashnode.evidence.gpupool import Device
from flashnode.runners.base import ModuleSpec, StartSpec
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.workspace import CKPT as CKPT
from flashnode.sandbox.workspace import WORK as WORK
from flashnode.sandbox.workspace import Workspace

# The command a module task runs, with the interpreter, spec and output directory filled in.
MODULE_ARGV = ("-m", "{module}", "--spec", "{spec}", "--out", "{out}")


@dataclass
class Preparation:
    """What the phases before the run add to the task's start (checkpoints, job environments,
    lent data); ``build`` copies it into the StartSpec."""

    agent_env: dict[str, str] = field(default_factory=dict)  # values may name /work paths
    python: str | None = None  # a module task's interpreter, instead of task_python
    path_prefix: list[str] = field(default_factory=list)  # host dirs first on PATH (trusted)
    environment: str | None = None  # the job environment's directory (trusted), if any
    read_only_binds: list[tuple[str, str]] = field(default_factory=list)  # (host, /work/...)
    module_inputs: dict[str, str] = field(default_factory=dict)  # more spec inputs: /work paths


def contract_env(job_id: str, lease_id: str) -> dict[str, str]:
    """flashruntime's task contract (its ``launchers/local.py``), the same in both runners: the
    output directory (also the task's working directory), the checkpoint directory the relay
    watches, and the ids of the job and of this attempt (the lease)."""
    return {
        "FLASHML_OUTPUT_DIR": f"{WORK}/out",
        "FLASHML_CKPT_DIR": f"{WORK}/out/{CKPT}",
        "FLASHML_JOB_ID": job_id,
        "FLASHML_ATTEMPT_ID": lease_id,
    }


def build(
    task: Task,
    job_id: str,
    lease_id: str,
    slot: int,
    workspace: Workspace,
    gpus: list[Device],
    gpu_node: bool,
    limits: Limits,
    on_exit: Callable[[], None],
    record: Callable[[dict[str, Any]], None],
    prepared: Preparation | None = None,
    max_file_bytes: int | None = None,
) -> StartSpec:
    prepared = prepared or Preparation()
    module = None
    if task.module is not None:
        inputs = {i.name: f"{WORK}/inputs/{i.dest}" for i in task.inputs}
        inputs.update(prepared.module_inputs)
        module = ModuleSpec(task.task_id, dict(task.params), inputs)
    return StartSpec(
        lease_id=lease_id,
        slot=slot,
        workspace=workspace,
        argv=task.argv,
        module=module,
        module_name=task.module,
        env=dict(task.env),
        gpus=tuple(gpus),
        gpu_node=gpu_node,
        image=task.image,
        limits=limits,
        on_exit=on_exit,
        record=record,
        stdout=workspace.logs / "stdout.txt",
        stderr=workspace.logs / "stderr.txt",
        agent_env={**contract_env(job_id, lease_id), **prepared.agent_env},
        python=prepared.python,
        path_prefix=tuple(prepared.path_prefix),
        environment=prepared.environment,
        read_only_binds=tuple(prepared.read_only_binds),
        max_file_bytes=max_file_bytes,
    )


def map_work(value: str, root: str) -> str:
    """Rewrite a ``/work`` path (alone, or after the first '=') to ``root``."""
    if value == WORK or value.startswith(WORK + "/"):
        return root + value[len(WORK) :]
    head, eq, tail = value.partition("=")
    if eq and (tail == WORK or tail.startswith(WORK + "/")):
        return head + eq + root + tail[len(WORK) :]
    return value


def write_module_spec(spec: StartSpec, root: str, gid: int | None = None) -> Path:
    """Write ``spec.json`` into the workspace (the agent's file, readable by the task), its
    input paths under ``root`` (``/work``; the workspace's host path in the trusted runner's
    same-user mode)."""
    assert spec.module is not None
    path = spec.workspace.root / "spec.json"
    body = {
        "task_id": spec.module.task_id,
        "params": spec.module.params,
        "inputs": {k: map_work(v, root) for k, v in spec.module.inputs.items()},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(body, fh, sort_keys=True)
    if gid is not None:
        os.chown(path, os.geteuid(), gid)
        path.chmod(0o640)
    else:
        path.chmod(0o644)
    return path


def module_argv(python: str, module: str, spec: str, out: str) -> list[str]:
    return [python, *(a.format(module=module, spec=spec, out=out) for a in MODULE_ARGV)]


def cuda_visible(spec: StartSpec, renumbered: bool) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the task: its GPUs only, and none at all for a task holding
    none on a GPU node; None (unset) on a node without GPUs. ``renumbered``: the runtime maps the
    given devices to 0..n-1 (a container's device request)."""
    if not spec.gpus and not spec.gpu_node:
        return None
    if renumbered:
        return ",".join(str(i) for i in range(len(spec.gpus)))
    return ",".join(d.visible for d in spec.gpus)


def task_limits(settings: Settings, slots: int, memory_bytes: int, cores: int) -> Limits:
    """The per-task limits: what the owner set, else a share of the machine per slot (three
    quarters of its memory, its cores, split between the slots), and ``task_pids``. The
    machine-wide CPU cap (``machine_cpus``) is applied by each runner on top of these."""
    slots = max(slots, 1)
    memory = settings.task_memory_bytes or max(memory_bytes * 3 // 4 // slots, 64 * 1024 * 1024)
    cpus = settings.task_cpus or max(cores / slots, 1.0)
    return Limits(memory, cpus, settings.task_pids)


def machine_cpus(settings: Settings, cores: int) -> float | None:
    """``task_cpu_percent`` of the machine, in CPUs: what all tasks together may use (None: no
    cap). The trusted runner sets it as the quota of the tasks' parent cgroup; the container
    runner, which has no common parent, splits it between the slots."""
    percent = settings.task_cpu_percent
    return None if percent is None else max(cores * percent / 100.0, 0.01)


def min_cpus(a: float | None, b: float | None) -> float | None:
    """The tighter of two CPU limits (None: no limit)."""
    return b if a is None else a if b is None else min(a, b)
