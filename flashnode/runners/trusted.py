"""The trusted runner: argv tasks of the owner's team pools, on the host, without a container.

Arbitrary code on the host is pool-only, three locks together (DESIGN.md §5): this node runs
trusted with at least one pool, the task's ``pool`` is one of them, and its isolation says
``allowFallback: true``. The coordinator checks this at placement; ``check`` checks it again.

The task sees its workspace as ``/work``: an argument or ``env`` value that is ``/work`` or starts
with ``/work/`` (also after the first ``=`` of ``--opt=/work/...``) is rewritten to the attempt
directory. Its environment is built, never inherited: a short allowlist from the agent's own
environment, then the payload's ``env``, then ``PATH``, ``HOME``, ``TMPDIR``, ``FLASHML_WORK_DIR``
and the ownership token.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flashnode import procs
from flashnode.cgroups import AttemptCgroup, Hierarchy, Limits
from flashnode.errors import AttemptFailed
from flashnode.runners.base import Handle, Runner
from flashnode.settings import Settings
from flashnode.slots import Device, GpuPool
from flashnode.wire import MODULES, Task
from flashnode.workspace import Workspace

log = logging.getLogger(__name__)

INHERITED = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORK = "/work"


def map_work(value: str, root: str) -> str:
    """Rewrite a ``/work`` path (alone, or after the first '=') to the attempt directory."""
    if value == WORK or value.startswith(WORK + "/"):
        return root + value[len(WORK) :]
    head, eq, tail = value.partition("=")
    if eq and (tail == WORK or tail.startswith(WORK + "/")):
        return head + eq + root + tail[len(WORK) :]
    return value


def task_env(
    task: Task, ws: Workspace, token: str, agent_env: Mapping[str, str], own_user: bool = True
) -> dict[str, str]:
    """The task's environment. A task run as another user gets the system PATH: the agent's
    may name directories only the agent's user can enter."""
    root = str(ws.root)
    env = {k: agent_env[k] for k in INHERITED if k in agent_env}
    env.update({k: map_work(v, root) for k, v in task.env.items()})
    env.update(
        PATH=agent_env.get("PATH", DEFAULT_PATH) if own_user else DEFAULT_PATH,
        HOME=root,
        TMPDIR=str(ws.tmp),
        FLASHML_WORK_DIR=root,
    )
    env[procs.OWNER_ENV] = token
    return env


class TrustedHandle:
    def __init__(self, proc: procs.TaskProcess) -> None:
        self._proc = proc
        self._oom = False

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    @property
    def image_digest(self) -> str:
        return ""

    def terminate(self, grace: float) -> None:
        self._proc.terminate(grace)

    def finish(self) -> None:
        self._proc.kill()
        self._proc.close()
        if self._proc.cgroup is not None:
            self._oom = self._proc.cgroup.oom_killed()
            self._proc.cgroup.remove()

    def stderr_tail(self) -> str:
        return self._proc.stderr.tail.decode("utf-8", "replace")

    def failure(self) -> str | None:
        return "out of memory" if self._oom else None

    def pids(self) -> set[int]:
        return self._proc.pids()

    def cpu_seconds(self) -> float | None:
        return self._proc.cpu_seconds()


class TrustedRunner(Runner):
    name = "trusted"

    def __init__(
        self,
        pools: tuple[str, ...],
        log_max_bytes: int,
        cgroups: Hierarchy | None = None,
        limits: Limits | None = None,
        user: procs.TaskUser | None = None,
        pool: GpuPool | None = None,
        agent_env: Mapping[str, str] | None = None,
    ) -> None:
        self.pools = pools
        self.log_max_bytes = log_max_bytes
        self.cgroups = cgroups
        self.limits = limits or Limits()
        self.user = user
        self.pool = pool or GpuPool()
        self.task_python: str | None = None
        self.module_capable = False
        self.agent_env = dict(os.environ if agent_env is None else agent_env)

    def reconfigure(self, settings: Settings) -> None:
        self.pools = settings.pools
        self.log_max_bytes = settings.log_max_bytes
        self.limits = Limits(settings.task_memory_bytes, settings.task_cpus, settings.task_pids)
        self.task_python = settings.task_python
        self.module_capable = False
        if self.task_python:
            why = procs.python_imports(self.task_python, MODULES, self.user)
            self.module_capable = why is None
            if why:
                log.warning(
                    "module tasks off: %s cannot import the allowlisted modules (%s)",
                    self.task_python,
                    why,
                )
            else:
                log.info("module tasks on, under %s", self.task_python)

    def check(self, task: Task) -> None:
        if task.module is not None:
            # Allowlisted installed code, not the task's own: no sandbox fallback needed, but a
            # task placed for a pool still has to be one of ours.
            if not self.module_capable:
                raise AttemptFailed("refused: this node runs no module tasks (task_python)")
            if task.pool is not None and task.pool not in self.pools:
                raise AttemptFailed(f"refused: pool {task.pool!r} is not one this node serves")
            return
        if task.argv is None:
            raise AttemptFailed("the trusted runner runs argv and module tasks only")
        if not self.pools:
            raise AttemptFailed("refused: this node serves no pool, so it runs no trusted work")
        if not task.pool:
            raise AttemptFailed(
                "refused: trusted argv work must name a pool, and this task names none"
            )
        if task.pool not in self.pools:
            raise AttemptFailed(f"refused: pool {task.pool!r} is not one this node serves")
        if task.isolation is None or not task.isolation.allow_fallback:
            raise AttemptFailed(
                "refused: the task's isolation does not allow running outside a sandbox"
            )

    def start(
        self,
        task: Task,
        workspace: Workspace,
        on_exit: Callable[[], None],
        record: Callable[[dict[str, Any]], None],
        gpus: list[Device],
    ) -> Handle:
        root = str(workspace.root)
        token = procs.new_token()
        if task.module is not None:
            assert self.task_python is not None
            inputs = {i.name: str(workspace.inputs / i.dest) for i in task.inputs}
            spec = workspace.write_spec(task.task_id, task.params, inputs)
            argv = [
                self.task_python,
                "-m",
                task.module,
                "--spec",
                str(spec),
                "--out",
                str(workspace.out),
            ]
        else:
            assert task.argv is not None
            argv = [map_work(a, root) for a in task.argv]
        env = task_env(task, workspace, token, self.agent_env, own_user=self.user is None)
        if gpus or self.pool.devices:
            # Only the GPUs this attempt was given; none at all for a task that asked for none.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d.visible for d in gpus)
        uid = self.user.uid if self.user else os.geteuid()
        if self.user is not None:
            workspace.hand_over(self.user.uid, self.user.gid)
        cgroup = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.create(workspace.root.name, self.limits)
            except OSError as exc:
                raise AttemptFailed(f"cannot create the task's cgroup: {exc.strerror}") from None
        # Before anything runs: what finds the task's processes again after a crash.
        record(
            {
                "token": token,
                "uid": uid,
                "cgroup": {k: str(v) for k, v in cgroup.paths.items()} if cgroup else None,
                "cgroup_version": cgroup.version if cgroup else None,
            }
        )
        try:
            proc = procs.TaskProcess(
                argv,
                env,
                cwd=workspace.root,
                stdout=workspace.logs / "stdout.txt",
                stderr=workspace.logs / "stderr.txt",
                log_max_bytes=self.log_max_bytes,
                on_exit=on_exit,
                cgroup=cgroup,
                user=self.user,
            )
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            raise AttemptFailed(f"cannot start {argv[0][:100]!r}: {exc.strerror or exc}") from None
        record(proc.identity())
        return TrustedHandle(proc)

    def reap(self, identity: dict[str, Any]) -> None:
        procs.reap(identity)
        paths, version = identity.get("cgroup"), identity.get("cgroup_version")
        if isinstance(paths, dict) and version in (1, 2):
            AttemptCgroup(version, {k: Path(v) for k, v in paths.items()}).remove()
