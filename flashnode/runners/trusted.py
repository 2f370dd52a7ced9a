"""The trusted runner: argv tasks of the owner's team pools, and allowlisted module tasks, on the
host without a container.

Arbitrary code on the host is pool-only, three locks together (docs/design.md §5): this node runs
trusted with at least one pool, the task's ``pool`` is one of them, and its isolation says
``allowFallback: true``. The coordinator checks this at placement; ``check`` checks it again.

The privilege boundary: an agent running as root runs each slot's task as that slot's own user
(``<task_user>-<slot>``), with its workspace readable by that user's group only, in its own cgroup
and mount/IPC namespaces (private ``/tmp``, ``/var/tmp``, ``/dev/shm``); see sandbox/procs/ for how
the task's environment reaches only the task. An agent that is not root cannot switch users and
refuses to run trusted work unless the owner set ``allow_same_user``.

The task sees its workspace as ``/work``: a root agent binds it there in the task's own mount
namespace (``procs.mounts.Sandbox.work``; the host's ``/work``, an empty directory the package or
the agent makes, is only the mount point), so every ``/work/...`` path works wherever the task names
it. In the same-user mode there is no namespace: ``facts`` says the task sees the attempt
directory instead, and its plan names that (``runners.plan``). Its environment is the plan's,
never inherited: over the locale from the agent's, the payload's ``env``, the phases' variables,
then ``PATH`` (the system's for a task user; the agent's own in the same-user mode), ``HOME``,
``TMPDIR``, ``FLASHML_WORK_DIR`` and the GPUs it holds; ``start`` adds the ownership token.

Lent directories are covered at their host paths in every task's namespace
(``procs.mounts.cover_fstab``, rewritten on a reload), so that a task reaches lent data only at the
labels it asked for.

What lies between a slot's tasks (the turnover after a task, the chain kept ahead for the next)
is the slot pool's (slots.py): ``start`` takes the slot's chain from it, and the handle hands the
slot back once the task's processes are gone.

Its host checks are flashnode.runners.trustedhost; a running task's handle is
flashnode.runners.trustedhandle.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flashnode import statefile
from flashnode.caches.envcache import ENVS_DIR, PYTHON_DIR
from flashnode.config.settings import Settings
from flashnode.coordinator.lease import MODULES, Task
from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.runners.base import Handle, Runner, RunnerEnv
from flashnode.runners.findings import Finding, Ok, Problem
from flashnode.runners.plan import WORK, RunnerFacts, TaskPlan
from flashnode.runners.slots import SlotPool
from flashnode.runners.spec import machine_cpus, min_cpus
from flashnode.runners.trustedhandle import TrustedHandle
from flashnode.runners.trustedhost import (
    make_work_dir,
    passable,
    under_private_dir,
    users_and_sandbox,
)
from flashnode.runners.userlocks import UserLocks
from flashnode.sandbox import cgroups, procs
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.helpers import python_imports
from flashnode.sandbox.procs.launch import Launch
from flashnode.sandbox.procs.mounts import (
    ENVS_TABLE,
    PRIVATE_DIRS,
    EnvsTables,
    Sandbox,
    cover_fstab,
    private_table,
)
from flashnode.sandbox.procs.supervisor import HOMES, sweep_homes
from flashnode.sandbox.procs.task import TaskProcess
from flashnode.sandbox.workspace import Workspace

log = logging.getLogger(__name__)

LOCALE = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
PRIVATE_TMP_BYTES = 256 * 1024 * 1024


class TrustedRunner(Runner):
    name = "trusted"

    def __init__(
        self,
        settings: Settings,
        env: RunnerEnv,
        users: list[procs.TaskUser] | None,
        hierarchy: cgroups.Hierarchy | None,
        sandbox: bool,
        agent_env: Mapping[str, str] | None = None,
    ) -> None:
        self.env = env
        self.users = users
        self.user_locks: UserLocks | None = None  # what holds ``users`` for this agent
        self.hierarchy = hierarchy
        self.sandbox = sandbox
        self.agent_env = dict(os.environ if agent_env is None else agent_env)
        self.settings = settings
        self.module_capable = False
        self.task_python: str | None = None
        # The CPU limit of each running task's cgroup (by name), for a reloaded machine cap.
        self._task_cpus: dict[str, float | None] = {}
        self._cpu_cap: float | None = None
        self._cpu_lock = threading.Lock()
        # One table of a task's private mounts, written once (the job environments' cover is
        # put together by a table that adds to it: ``_tables``).
        private = private_table(PRIVATE_TMP_BYTES)
        self._fstab = ""
        if sandbox:
            self._fstab = str(settings.state_dir / "sandbox.fstab")
            settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            statefile.write(Path(self._fstab), private.encode(), 0o600)
        # And one of the covers over the lent directories (their set changes on a reload).
        self._covers = self._cover_table(settings)
        if sandbox:
            for old in settings.state_dir.glob("covers-*.fstab"):
                if str(old) != self._covers:
                    old.unlink(missing_ok=True)
            # The job environments' covers, one per set kept: written by this run as its tasks
            # need them (``_tables``), and only those are used.
            for old in settings.state_dir.glob(f"{ENVS_TABLE}*.fstab"):
                old.unlink(missing_ok=True)
        self._envs_tables = EnvsTables(settings.state_dir, private)
        # Whether the job environments' directory lies under a private directory: asked once
        # (the state dir stays where it is for the agent's life), not at every task's start.
        self._envs_private = under_private_dir(settings.state_dir / ENVS_DIR) is not None
        # Each slot's turnover after its task, and its next chain kept ahead: only where every
        # task gets the same chain (its own user, a cgroup, the sandbox, a state dir outside the
        # private directories).
        self.slots = SlotPool(
            settings.state_dir,
            hierarchy,
            self._blank_sandbox,
            ahead=sandbox and users is not None and under_private_dir(settings.state_dir) is None,
            launcher=self._chain,
        )
        self._rejoined: set[str] = set()  # the supervisors' directories of rejoined tasks
        self._rejoined_cgroups: set[str] = set()  # ... and their cgroups' names
        self._lost_slots: set[int] = set()  # slots whose user another agent took (``_hold``)
        self._rejoined_uids: set[int] = set()  # the users rejoined tasks run as, until they end

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def preflight(cls, settings: Settings, slots: int = 1) -> list[Finding]:
        found = list(users_and_sandbox(settings, slots))
        if settings.task_python and not any(isinstance(f, Problem) and f.fatal for f in found):
            why = python_imports(settings.task_python, MODULES)
            if why:
                found.append(
                    Problem(
                        "module tasks",
                        f"off: {settings.task_python} cannot import the allowlisted modules"
                        f" ({why})",
                        f"{settings.task_python} -m pip install flashruntime torch,"
                        " or unset task_python",
                        code=None,
                    )
                )
            else:
                found.append(Ok("module tasks", f"on, under {settings.task_python}"))
        hidden = under_private_dir(settings.state_dir) if os.geteuid() == 0 else None
        if hidden is not None:
            found.append(
                Problem(
                    "job environments",
                    f"the state dir {settings.state_dir} lies under {hidden}, which tasks get a"
                    " private copy of: tasks with dependencies are refused",
                    f"choose a state_dir outside {', '.join(PRIVATE_DIRS)}",
                    code=None,
                )
            )
        return found

    @classmethod
    def create(cls, settings: Settings, env: RunnerEnv) -> TrustedRunner:
        users = None
        locks = None
        sandbox = False
        if os.geteuid() == 0:
            assert settings.task_user
            for d in (settings.state_dir, settings.state_dir / "attempts"):
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
            locks = UserLocks(settings.task_user)  # held for the agent's whole life
            users = locks.take(env.slots, settings.state_dir)
            sandbox = True
            passable(settings.state_dir)
            make_work_dir()
            log.info(
                "trusted tasks run as %s (one user per slot)",
                ", ".join(u.name for u in users),
            )
        else:
            log.warning(
                "trusted tasks run as this agent's own user (uid %d, allow_same_user): they can"
                " read and do whatever this agent can",
                os.geteuid(),
            )
        hierarchy, why = cgroups.detect(clock=env.clock)
        if hierarchy is None:
            log.warning("no per-task cgroups (%s): limits rely on process groups and tokens", why)
        else:
            log.info("per-task cgroups in %s", hierarchy.describe())
        runner = cls(settings, env, users, hierarchy, sandbox)
        runner.user_locks = locks
        runner.reconfigure(settings)
        return runner

    def reconfigure(self, settings: Settings) -> None:
        self.settings = settings
        self._covers = self._cover_table(settings)  # the next chain covers the new set
        self._apply_cpu_cap(settings)
        locks = self.user_locks
        if self.users is not None and locks is not None and len(self.users) < self.env.slots:
            self.users = locks.take(self.env.slots, settings.state_dir)
        python = settings.task_python
        capable = False
        if python:
            why = python_imports(python, MODULES)
            capable = why is None
            if why:
                log.warning(
                    "module tasks off: %s cannot import the allowlisted modules (%s)", python, why
                )
            else:
                log.info("module tasks on, under %s", python)
        self.task_python, self.module_capable = python, capable

    def _cover_table(self, settings: Settings) -> str:
        """The table of the covers of every lent directory, for the chains from now on."""
        if not self.sandbox:
            return ""
        return cover_fstab(settings.state_dir, settings.local_data.values())

    def _blank_sandbox(self) -> Sandbox:
        """The sandbox of a task with nothing of its own (no read-only views, no hidden GPUs, no
        job environment): a chain kept ahead's."""
        fstab, envs = self._tables(None)
        return Sandbox(PRIVATE_TMP_BYTES, fstab=fstab, work=True, covers=self._covers, envs=envs)

    def _tables(self, environment: str | None) -> tuple[str, str]:
        """The sandbox's table of private mounts and the job environments' directory it covers
        (``Sandbox.fstab``, ``Sandbox.envs``): a task sees only its own environment (``None``:
        none) and the managed interpreters, never another job's (whose files are
        world-readable for task users, and whose paths are in every task's command line)."""
        root = self.settings.state_dir / ENVS_DIR
        if self._envs_private or not root.is_dir():
            return self._fstab, ""  # none, or out of the task's sight already (private)
        kept = [root / PYTHON_DIR, *([Path(environment)] if environment else [])]
        found = tuple(str(p) for p in kept if p.is_relative_to(root) and p.is_dir())
        return self._envs_tables.table(str(root), found), str(root)

    def _apply_cpu_cap(self, settings: Settings) -> None:
        """``task_cpu_percent`` of the machine for all tasks together: the CPU quota of the
        attempts' parent cgroup, changed live (running tasks included) on a reload."""
        cap = machine_cpus(settings, os.cpu_count() or 1)
        if self.hierarchy is None:
            if cap is not None:
                log.warning("task_cpu_percent is not applied: this host gives tasks no cgroups")
            return
        with self._cpu_lock:
            try:
                self.hierarchy.set_cpu_cap(cap, dict(self._task_cpus))
            except OSError as exc:
                if cap is not None:
                    log.error("cannot apply task_cpu_percent: %s", exc.strerror or exc)
                return
            if cap != self._cpu_cap:
                log.info(
                    "tasks together use at most %s", "all CPUs" if cap is None else f"{cap:g} CPUs"
                )
            self._cpu_cap = cap

    # --- the contract -------------------------------------------------------------------------

    def facts(self, workspace: Workspace, slot: int) -> RunnerFacts:
        # Where the task sees its workspace: /work, bound in its own mount namespace (a root
        # agent), else its host path (the same-user mode).
        root = WORK if self.sandbox else str(workspace.root)
        user = self.users[slot] if self.users else None
        return RunnerFacts(
            root=root,
            python=self.task_python,
            home=f"{root}/tmp",
            path=SYSTEM_PATH if user else self.agent_env.get("PATH", SYSTEM_PATH),
            env={k: self.agent_env[k] for k in LOCALE if k in self.agent_env},
            group=user.gid if user else None,
        )

    def check(self, task: Task, settings: Settings) -> None:
        self._check_code(task, settings.pools)
        if tuple(self.settings.pools) != tuple(settings.pools):
            try:
                self._check_code(task, self.settings.pools)
            except AttemptFailed as exc:
                raise AttemptLapsed(f"{exc} since this lease was claimed (a reload)") from None
        if task.local_inputs and not self.sandbox:
            raise AttemptLapsed("this node lends data to tasks only when the agent runs as root")
        if task.dependencies and self.sandbox:
            hidden = under_private_dir(self.settings.state_dir)
            if hidden is not None:
                raise AttemptLapsed(
                    f"job environments under {self.settings.state_dir} are hidden from tasks,"
                    f" which get a private {hidden}: move the state dir"
                )

    def _check_code(self, task: Task, pools: Sequence[str]) -> None:
        if task.module is not None and not task.dependencies:
            # Allowlisted installed code, not the task's own: no sandbox fallback needed, but a
            # task placed for a pool still has to be one of ours.
            if not self.module_capable:
                raise AttemptLapsed("this node runs no module tasks (task_python)")
            if task.pool is not None and task.pool not in pools:
                raise AttemptFailed(f"refused: pool {task.pool!r} is not one this node serves")
            return
        # An argv task, or a module task with dependencies: the job chooses the code it installs,
        # so it is the job's own code, pool-only like argv.
        if task.argv is None and task.module is None:
            raise AttemptFailed("the trusted runner runs argv and module tasks only")
        if not pools:
            raise AttemptFailed("refused: this node serves no pool, so it runs no trusted work")
        if not task.pool:
            raise AttemptFailed(
                "refused: trusted work that runs the job's own code must name a pool, and this"
                " task names none"
            )
        if task.pool not in pools:
            raise AttemptFailed(f"refused: pool {task.pool!r} is not one this node serves")
        if task.isolation is None or not task.isolation.allow_fallback:
            raise AttemptFailed(
                "refused: the task's isolation does not allow running outside a sandbox"
            )

    def _after(
        self,
        slot: int,
        user: procs.TaskUser | None,
        name: str,
        cgroup: cgroups.AttemptCgroup | None,
        let_go: Callable[[], None],
    ) -> None:
        """Once the task's processes are all gone: the slot's turnover, off the attempt's way
        (the slot's next start waits for it), which first lets go of the task's supervisor
        (``let_go``). A user a rejoined task's supervisor held is held again first (once that
        supervisor exited); one another agent took meanwhile is never run as again."""
        self._forget(name)
        if user is not None:
            self._rejoined_uids.discard(user.uid)
            if self.user_locks is not None and self.user_locks.borrowed(user):
                let_go()  # its supervisor lets go of the user's lock as it exits
                let_go = _nothing
            user = self._hold(slot, user)
            if user is None:
                let_go()
                return
        self.slots.turn_over(slot, user, cgroup, let_go)

    def _hold(self, slot: int, user: procs.TaskUser) -> procs.TaskUser | None:
        """``user`` held by this agent again once no task of its earlier run holds it (else
        another free user for ``slot``); None when there is none: the slot takes no work."""
        locks = self.user_locks
        if locks is None or locks.relock(user):
            return user
        other = locks.replace(slot)
        if self.users is not None and other is not None:
            self.users[slot] = other
            log.warning(
                "slot %d: another agent took its task user %s meanwhile; it runs as %s now",
                slot,
                user.name,
                other.name,
            )
            return other
        log.error(
            "slot %d: another agent took its task user %s, and no other is free: the slot"
            " takes no more work until a restart",
            slot,
            user.name,
        )
        self._lost_slots.add(slot)
        return None

    def prime(self) -> None:
        """Each free slot's chain started ahead for its first task (``SlotPool.prime``): not
        for a slot whose rejoined task runs on (its turnover will), nor one whose user still
        has a process that outlived an earlier run (no chain waits beside one)."""
        running = set(self._rejoined_uids)
        for slot, user in enumerate(self.users or []):
            if user.uid in running or slot in self._lost_slots:
                continue
            left = procs.processes_of(user.uid)
            if left:
                log.warning(
                    "slot %d: %d process(es) of %s outlived an earlier run (pid %d): no chain"
                    " is started ahead for its first task",
                    slot,
                    len(left),
                    user.name,
                    left[0],
                )
                continue
            self.slots.prime(slot, user)

    def slot_usable(self, slot: int) -> bool:
        return slot not in self._lost_slots

    def reconcile(self) -> None:
        self.slots.reconcile(keep=self._rejoined_cgroups)
        sweep_homes(self.settings.state_dir, self._rejoined)
        # The users an earlier run's tasks held that no rejoined task runs as: this agent's
        # again now that those tasks are ended (or another user for the slot).
        running = set(self._rejoined_uids)
        for slot, user in enumerate(self.users or []):
            if user.uid not in running:
                self._hold(slot, user)

    def close(self) -> None:
        self.slots.close()

    def start(self, plan: TaskPlan) -> Handle:
        ws = plan.workspace
        if plan.slot in self._lost_slots:
            raise AttemptLapsed(f"slot {plan.slot}'s task user is another agent's now")
        user = self.users[plan.slot] if self.users else None
        if user is not None:
            passable(self.settings.state_dir)
        if plan.views and not self.sandbox:
            raise AttemptLapsed("this node lends data to tasks only when the agent runs as root")
        # Bound in the workspace, which is then bound at /work with them.
        binds = tuple((src, dst.removeprefix(f"{WORK}/")) for src, dst in plan.views)
        if any("\n" in path for bind in binds for path in bind):
            raise AttemptLapsed("cannot lend a directory whose path holds a newline")
        sandbox = None
        if self.sandbox:
            fstab, envs = self._tables(plan.environment)
            sandbox = Sandbox(
                PRIVATE_TMP_BYTES,
                binds,
                hidden_gpus(plan),
                fstab,
                work=True,
                covers=self._covers,
                envs=envs,
            )
        launch = None
        name = ws.root.name
        try:
            ahead = self.slots.take(plan.slot, sandbox)  # once the slot's turnover is done
            if ahead is not None:
                launch = ahead.launch
                try:
                    ws.move_into(ahead.work)  # where the chain has bound /work
                except OSError as exc:
                    log.warning("cannot use the chain started ahead (%s)", exc.strerror or exc)
                    ahead.discard()
                    launch = None
            if user is not None:
                ws.hand_over(user.uid, user.gid, inputs_for="group")
            else:
                ws.task_uid = os.geteuid()
            argv = list(plan.argv)
            env = {**plan.env, procs.OWNER_ENV: procs.new_token()}
            limits = plan.limits
            with self._cpu_lock:
                # Below the machine cap: cgroup v1 refuses a child quota above its parent's.
                capped = dataclasses.replace(limits, cpus=min_cpus(limits.cpus, self._cpu_cap))
                if launch is not None and launch.cgroup is not None:
                    try:
                        launch.cgroup.apply(capped)
                    except OSError as exc:
                        log.warning("cannot limit the cgroup made ahead (%s)", exc.strerror or exc)
                        launch.discard()
                        launch = None
                if launch is None:
                    launch = self._launch(ws.root, capped, user, sandbox, argv[0])
                cgroup = launch.cgroup
                name = next(iter(cgroup.paths.values())).name if cgroup else ws.root.name
                if cgroup is not None:
                    self._task_cpus[name] = limits.cpus
            proc = TaskProcess(
                argv,
                env,
                cwd=ws.root,
                workdir=Path(plan.cwd),  # flashruntime's contract: its output directory
                stdout=plan.stdout,
                stderr=plan.stderr,
                log_max_bytes=self.settings.log_max_bytes,
                on_exit=plan.on_exit,
                clock=self.env.clock,
                launch=launch,
                hold=True,
                max_file_bytes=plan.max_file_bytes,
            )
        except BaseException as exc:
            # No chain may be left waiting with nobody to send or end it: the slot's next task
            # (the same user) could write a script of its own into it, through /proc, and have
            # a process outside its cgroup that outlives it.
            if launch is not None:
                launch.discard()
            self._forget(name)
            if isinstance(exc, UnicodeEncodeError):
                raise AttemptFailed("the task's argv or env cannot be encoded") from None
            raise
        try:
            # Before any code of the task runs: what finds its processes again after a crash.
            plan.record(proc.identity())
        except BaseException:
            proc.kill()
            proc.close()
            if cgroup is not None:
                cgroup.remove()
            self._forget(name)
            raise
        proc.go()
        return TrustedHandle(
            proc,
            lambda let_go: self._after(plan.slot, user, name, cgroup, let_go),
            private=PRIVATE_DIRS if sandbox is not None else (),
            workspace=ws.root,
        )

    def _launch(
        self,
        cwd: Path,
        limits: Limits,
        user: procs.TaskUser | None,
        sandbox: Sandbox | None,
        program: str,
    ) -> Launch:
        """A task's chain started now, in a cgroup of its own (named for its workspace)."""
        cgroup = None
        if self.hierarchy is not None:
            try:
                cgroup = self.hierarchy.create(cwd.name, limits)
            except OSError as exc:
                raise AttemptLapsed(f"cannot create the task's cgroup: {exc.strerror}") from None
        try:
            return self._chain(cwd, cgroup, user, sandbox)
        except OSError as exc:  # the node's (its supervisor, the last step's sh)
            if cgroup is not None:
                cgroup.remove()
            raise AttemptLapsed(
                f"cannot start the launch of {program[:100]!r}: {exc.strerror or exc}"
            ) from None

    def _chain(
        self,
        cwd: Path,
        cgroup: cgroups.AttemptCgroup | None,
        user: procs.TaskUser | None,
        sandbox: Sandbox | None,
    ) -> Launch:
        """A chain under its supervisor, in the state dir: it outlives this agent's restart."""
        s, locks = self.settings, self.user_locks
        hold = locks.fd_of(user) if locks is not None and user is not None else None
        if locks is not None and user is not None and hold is None:
            raise OSError(f"task user {user.name} is not held by this agent")  # fail closed
        homes = s.state_dir / HOMES
        return Launch(cwd, cgroup, user, sandbox, homes, s.reattach_seconds, hold)

    def rejoin(
        self,
        identity: Mapping[str, Any],
        slot: int,
        workspace: Workspace,
        on_exit: Callable[[], None],
    ) -> Handle | None:
        user = self.users[slot] if self.users and slot < len(self.users) else None
        if identity.get("uid") != (user.uid if user else os.geteuid()):
            return None  # not a user this agent holds for that slot now: it cannot be turned over
        proc = TaskProcess.rejoin(identity, on_exit, self.env.clock)
        if proc is None:
            return None
        cgroup = proc.cgroup
        name = next(iter(cgroup.paths.values())).name if cgroup else workspace.root.name
        try:
            handle = TrustedHandle(
                proc,
                lambda let_go: self._after(slot, user, name, cgroup, let_go),
                private=PRIVATE_DIRS if self.sandbox else (),
                workspace=workspace.root,
            )
        except BaseException:
            proc.detach()  # not rejoined: ``reconcile`` ends it with its supervisor
            raise
        self._rejoined.add(str(identity.get("supervisor")))
        self._rejoined_cgroups.add(name)
        if user is not None:
            self._rejoined_uids.add(user.uid)
        return handle

    def _forget(self, name: str) -> None:
        with self._cpu_lock:
            self._task_cpus.pop(name, None)

    def reap(self, identity: Mapping[str, Any]) -> None:
        paths, version = identity.get("cgroup"), identity.get("cgroup_version")
        cgroup = None
        if isinstance(paths, dict) and version in (1, 2):
            cgroup = cgroups.AttemptCgroup(
                version, {k: Path(v) for k, v in paths.items()}, self.env.clock
            )
            cgroup.thaw()  # a task the earlier run left suspended dies only once thawed
        procs.reap(identity, self.env.clock)
        if cgroup is not None:
            cgroup.remove()


def _nothing() -> None:
    pass


def hidden_gpus(plan: TaskPlan, dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The GPU device files the task must not open: every /dev/nvidia<N> but those of the GPUs
    it holds (CUDA_VISIBLE_DEVICES is advice; the files are 0666). It sees them as /dev/null."""
    if not plan.gpu_node:
        return ()
    files = [d.device_file for d in plan.gpus]
    if None in files:
        log.warning("GPU device files unknown: the task can open every GPU of this node")
        return ()
    keep = {Path(f).name for f in files if f is not None}
    found = sorted(p for p in dev.glob("nvidia[0-9]*") if p.name[6:].isdigit())
    return tuple(str(p) for p in found if p.name not in keep)
