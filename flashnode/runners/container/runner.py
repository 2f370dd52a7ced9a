"""The container runner (``ContainerRunner``): the owner's image policy applied, each task
started in the sandbox the package's docstring describes, the module probe of allowed images,
and this node's labelled containers removed, nothing else; the engine's health and each
container's removal are ``engine``'s, which the handles share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types

from flashnode.config.settings import Settings
from flashnode.coordinator.lease import MODULES, Task
from flashnode.errors import AttemptFailed, AttemptLapsed, PrerequisiteError
from flashnode.runners.base import Handle, Runner, RunnerEnv
from flashnode.runners.container import (
    ENGINE_ERRORS,
    Runtime,
    brief,
    connect,
    image_present,
    image_problem,
    runtime_fix,
    runtimes_in,
)
from flashnode.runners.container.dialect import Dialect, dialect
from flashnode.runners.container.engine import Engine
from flashnode.runners.container.handle import ContainerHandle
from flashnode.runners.container.preflight import engine_and_images
from flashnode.runners.findings import Finding
from flashnode.runners.plan import RunnerFacts, TaskPlan
from flashnode.runners.spec import machine_cpus, min_cpus
from flashnode.sandbox.procs.supervisor import HOMES, Gone, Supervised, new_home, sweep_homes
from flashnode.sandbox.removal import remove_tree
from flashnode.sandbox.workspace import Workspace

log = logging.getLogger(__name__)

LABEL_NODE = "dev.flashnode.node"
LABEL_LEASE = "dev.flashnode.lease"
LABEL_PROBE = "dev.flashnode.probe"  # the import check of module images: no task
PROBE_WAIT_S = 60


class ContainerRunner(Runner):
    name = "docker"

    def __init__(self, settings: Settings, env: RunnerEnv, client: Any) -> None:
        self.env = env
        self.node_id = env.node_id
        self.client = client
        self.engine = Engine(client)
        self._rejoined: set[str] = set()  # containers an earlier run let go of, rejoined
        self._rejoined_homes: set[str] = set()  # ... and their watches' directories
        self.module_images: set[str] = set()
        self.runtimes: dict[str, Runtime] = {}  # the engine's, read at each (re)configure
        self.default_runtime: str | None = None  # ... and its default runtime
        self.dialect = Dialect()  # what the engine does differently, asked of it at ``create``
        self._apply(settings)

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def preflight(cls, settings: Settings, slots: int = 1) -> list[Finding]:
        return list(engine_and_images(settings))

    @classmethod
    def create(cls, settings: Settings, env: RunnerEnv) -> ContainerRunner:
        try:
            client = connect(settings)
            client.ping()
        except ENGINE_ERRORS as exc:
            raise PrerequisiteError(
                f"no container engine answers at {settings.docker_host} ({brief(exc)}):"
                " start Docker, or run the trusted runner for pool work (runner = 'trusted')"
            ) from None
        runner = cls(settings, env, client)
        runner.dialect = dialect(client, settings.docker_host)
        log.info("container engine: %s at %s", runner.dialect.describe(), settings.docker_host)
        for problem in runner.dialect.problems():  # the sandbox's limits would not hold
            raise PrerequisiteError(f"the container engine at {settings.docker_host}: {problem}")
        runner.remove_labelled(LABEL_PROBE)
        runner.reconfigure(settings)
        return runner

    def _apply(self, settings: Settings) -> None:
        self.settings = settings
        self.allowed = tuple(settings.allowed_images)
        self.user = settings.container_user or (
            "65534:65534" if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"
        )

    def reconfigure(self, settings: Settings) -> None:
        """Take ``settings`` (at the start, and at a reload: PrerequisiteError refuses them, and
        the reload keeps the running ones)."""
        runtimes = self._engine_runtimes()
        unrunnable = _unrunnable(settings, runtimes)
        if unrunnable is not None:
            raise PrerequisiteError(unrunnable)
        self._apply(settings)
        self.runtimes = runtimes
        for pool in settings.pools:
            if self._missing_runtime(settings, pool):
                log.warning(
                    "pool %s is not advertised: its runtime %r is not one of the engine's (%s;"
                    " then reload flashnode)",
                    pool,
                    settings.runtime_for(pool),
                    runtime_fix(str(settings.runtime_for(pool)), runtimes),
                )
        # Module tasks run `python -m MODULE` inside the task's image: only in allowed images
        # present here whose python imports every allowlisted module.
        self.module_images = {image for image in self.allowed if self._imports_modules(image)}
        self.module_capable = bool(self.module_images)
        if self.module_images:
            log.info("module tasks on, in %s", ", ".join(sorted(self.module_images)))

    def _engine_runtimes(self) -> dict[str, Runtime]:
        """The engine's runtimes, and its default (``default_runtime``: a container created
        with none named runs under it, gVisor where the owner's daemon.json says so)."""
        try:
            info = self.client.info()
        except ENGINE_ERRORS as exc:
            log.warning("cannot read the engine's runtimes: %s", brief(exc))
            return self.runtimes  # what it had: an engine away now is the guards' to notice
        default = info.get("DefaultRuntime")
        self.default_runtime = default if isinstance(default, str) and default else None
        return runtimes_in(info)

    def _runtime(self, settings: Settings, pool: str | None) -> str | None:
        """The runtime a task of ``pool`` runs under: the one the settings name, else the
        engine's default (None: not known)."""
        return settings.runtime_for(pool) or self.default_runtime

    def _own_kernel(self, runtime: str | None) -> bool:
        runtime = runtime or self.default_runtime
        found = self.runtimes.get(runtime or "")
        return runtime is not None and found is not None and found.own_kernel(runtime)

    def _missing_runtime(self, settings: Settings, pool: str | None) -> str | None:
        """The runtime a task of ``pool`` must run under when the engine lacks it, else None."""
        runtime = settings.runtime_for(pool)
        return runtime if runtime is not None and runtime not in self.runtimes else None

    def runtime(self, pool: str | None) -> str | None:
        return self.settings.runtime_for(pool)

    def pools(self, settings: Settings) -> tuple[str, ...]:
        """The pools whose runtime the engine has: a pool it lacks is not advertised, so the
        coordinator never places its tasks here (docs/protocol.md §6, the pool gate)."""
        return tuple(p for p in settings.pools if not self._missing_runtime(settings, p))

    def passes_gpus(self, settings: Settings) -> bool:
        """Where the engine drops device requests (Podman's Docker API), or every advertised
        pool's runtime (and that of work from no pool) passes none (gVisor without
        ``--nvproxy``), no task here gets a GPU."""
        if not self.dialect.passes_gpus:
            return False
        for pool in (None, *self.pools(settings)):
            runtime = self._runtime(settings, pool)
            found = self.runtimes.get(runtime or "")
            if runtime is None or found is None or found.passes_gpus(runtime):
                return True
        return False

    def _imports_modules(self, image: str) -> bool:
        """Run the import probe in a sandboxed container, bounded in time; the container is
        removed in every case, created-but-never-started included."""
        if image_problem(image, self.allowed) or not image_present(self.client, image):
            return False
        code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
        # Under the runtime tasks run under by default: the image's python must import there.
        runtime = self.settings.container_runtime
        runtime = runtime if runtime in self.runtimes else None
        name = f"flashnode-probe-{secrets.token_hex(8)}"  # removed by name: a create that
        try:  # timed out may still have made it
            probe = {
                "image": image,
                "command": ["python", "-c", code, *MODULES],
                "name": name,
                "user": self.user,
                "network_mode": "none",
                "read_only": True,
                "cap_drop": ["ALL"],
                "security_opt": ["no-new-privileges:true"],
                "labels": {LABEL_PROBE: self.node_id},
                "mem_limit": 512 * 1024 * 1024,
                "pids_limit": 256,
                "runtime": runtime,
            }
            made = self.dialect.apply(probe, self._own_kernel(runtime))
            container = self.client.containers.create(**made)
            container.start()
            status = container.wait(timeout=PROBE_WAIT_S)
            return int(status.get("StatusCode", 1)) == 0
        except ENGINE_ERRORS:
            return False
        finally:
            self.remove(name)

    # --- engine health ---------------------------------------------------------------------

    def ready(self) -> bool:
        """False while the engine is away (``Engine.ready``)."""
        return self.engine.ready()

    # --- the contract ----------------------------------------------------------------------

    def check(self, task: Task, settings: Settings) -> None:
        problem = image_problem(task.image, tuple(settings.allowed_images))
        if problem:
            raise AttemptFailed(f"refused: {problem}")
        problem = image_problem(task.image, self.allowed)
        if problem:
            raise AttemptLapsed(f"refused: {problem} since this lease was claimed (a reload)")
        if task.extra_dependencies:
            # The coordinator places these only where can_install_dependencies: never here.
            raise AttemptLapsed("a container node installs no extra_dependencies")
        if task.module is not None and task.image not in self.module_images:
            raise AttemptLapsed(f"image {task.image!r} cannot run module tasks here")
        # Work from no pool cannot be withheld from the coordinator (a pool can: ``pools``): a
        # lease whose runtime the engine lacks is this node's shortcoming, not the task's. The
        # runtime is the one the settings now name (the owner's latest word), as ``start`` uses.
        missing = self._missing_runtime(self.settings, task.pool)
        if missing is not None:
            whose = "work from no pool" if task.pool is None else f"pool {task.pool}"
            raise AttemptLapsed(
                f"refused: {whose} runs under runtime {missing!r} here, and the engine has no"
                " such runtime"
            )
        if task.gpus and not self.dialect.passes_gpus:
            raise AttemptLapsed(
                f"refused: a GPU task cannot get its GPUs from {self.dialect.name} here (its"
                " Docker API drops device requests): run GPU work under Docker"
            )
        runtime = self._runtime(self.settings, task.pool)
        found = self.runtimes.get(runtime or "")
        if task.gpus and runtime is not None and found and not found.passes_gpus(runtime):
            raise AttemptLapsed(
                f"refused: a GPU task runs under runtime {runtime!r} here, which passes no GPU"
                " (gVisor only with --nvproxy)"
            )

    def _image(self, ref: str) -> Any:
        try:
            return self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            if not self.settings.pull_images:
                raise AttemptFailed(
                    f"image {ref!r} is not on this node, and pulling is off"
                ) from None
        except ENGINE_ERRORS as exc:
            raise self._engine_failure("cannot read the image", exc) from None
        try:
            return self.client.images.pull(ref)
        except ENGINE_ERRORS as exc:
            raise AttemptLapsed(f"cannot pull image {ref!r} ({type(exc).__name__})") from None

    def facts(self, workspace: Workspace, slot: int) -> RunnerFacts:
        # The workspace at /work, HOME and TMPDIR its tmp/ (as in the trusted runner: the same
        # world in both), the image's python and PATH.
        return RunnerFacts(python="python")

    def start(self, plan: TaskPlan) -> Handle:
        image = self._image(plan.image)
        ws = plan.workspace
        uid, _, gid = self.user.partition(":")
        if os.geteuid() == 0:
            ws.hand_over(int(uid), int(gid or uid), inputs_for="everyone")
        else:
            ws.task_uid = os.geteuid()
        s = self.settings
        mounts = [
            docker.types.Mount("/work/inputs", str(ws.inputs), type="bind", read_only=True),
            docker.types.Mount("/work/out", str(ws.out), type="bind", read_only=False),
            docker.types.Mount("/work/tmp", str(ws.tmp), type="bind", read_only=False),
        ]
        if plan.module_spec is not None:  # written by the agent before the start
            mounts.append(
                docker.types.Mount(
                    "/work/spec.json", str(plan.spec_file), type="bind", read_only=True
                )
            )
        if plan.datasets is not None:  # dataset slices, laid out by the data phase
            mounts.append(
                docker.types.Mount("/work/data", str(plan.datasets), type="bind", read_only=True)
            )
        # Lent directories at /work/inputs/<label> (the mount points exist in inputs/).
        for src, target in plan.views:
            mounts.append(docker.types.Mount(target, src, type="bind", read_only=True))
        runtime = s.runtime_for(plan.pool)
        log_bytes = max(s.log_max_bytes, 1024 * 1024)
        tmp_bytes = min(s.container_tmp_bytes, s.task_disk_bytes)  # it counts against both
        kwargs: dict[str, Any] = {
            "image": image.id,
            "command": list(plan.argv),
            "environment": dict(plan.env),
            "user": self.user,
            "working_dir": plan.cwd,  # flashruntime's contract: its output directory
            "network_mode": "none",
            "read_only": True,
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={tmp_bytes},mode=1777"},
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges:true"],
            "ipc_mode": "private",
            "privileged": False,
            "pids_limit": plan.limits.pids or -1,
            "labels": {LABEL_NODE: self.node_id, LABEL_LEASE: plan.lease_id},
            "mounts": mounts,
            "runtime": runtime,  # None: the engine's default
            # The engine's own copy of the output stays bounded; the agent keeps its capped copy.
            "log_config": docker.types.LogConfig(
                type="json-file", config={"max-size": str(log_bytes), "max-file": "2"}
            ),
        }
        if plan.max_file_bytes is not None:  # RLIMIT_FSIZE, soft and hard: in bytes
            size = plan.max_file_bytes
            kwargs["ulimits"] = [docker.types.Ulimit(name="fsize", soft=size, hard=size)]
        if plan.limits.memory_bytes:
            kwargs["mem_limit"] = plan.limits.memory_bytes
            kwargs["memswap_limit"] = plan.limits.memory_bytes
        # The machine cap has no common parent cgroup here: each container gets its slot's share.
        cap = machine_cpus(s, os.cpu_count() or 1)
        cpus = min_cpus(plan.limits.cpus, None if cap is None else cap / max(self.env.slots, 1))
        if cpus:
            kwargs["nano_cpus"] = int(cpus * 1e9)
        if plan.gpus:
            kwargs["device_requests"] = [
                docker.types.DeviceRequest(
                    device_ids=[d.visible for d in plan.gpus], capabilities=[["gpu"]]
                )
            ]
        # Its watch first, by the name the container will have: no container exists that
        # nothing removes once the agent is gone (an agent killed right after the create).
        name = kwargs["name"] = f"flashnode-{secrets.token_hex(8)}"
        try:
            home = new_home(s.state_dir / HOMES)
        except OSError as exc:
            raise AttemptLapsed(f"cannot start the container's watch ({exc})") from None
        try:
            watch = Supervised.watch(name, s.docker_host, home, s.reattach_seconds)
        except OSError as exc:  # a watch forked whose answer was lost goes by itself
            remove_tree(home)
            raise AttemptLapsed(f"cannot start the container's watch ({exc})") from None
        doing = "create"
        try:
            made = self.dialect.apply(kwargs, self._own_kernel(runtime))
            container = self.client.containers.create(**made)
            doing = "start"
            plan.record({"container": container.id, "supervisor": str(home)})
            container.start()
            doing = "watch"
            watch.answer()
            watch.started()
            logs = (plan.stdout, plan.stderr)
            return ContainerHandle(
                self.engine,
                container,
                str(image.id),
                plan.on_exit,
                logs,
                ws.root,
                watch,
                s.log_max_bytes,
                self._own_kernel(runtime),
            )
        except BaseException as exc:
            self.remove(name)  # by name: a create that timed out may still have made it
            watch.done()
            watch.remove()
            if isinstance(exc, Gone) or (doing == "watch" and isinstance(exc, OSError)):
                raise AttemptLapsed(f"cannot start the container's watch ({exc})") from None
            if isinstance(exc, ENGINE_ERRORS):
                raise self._engine_failure(f"cannot {doing} the container", exc) from None
            raise

    def rejoin(
        self,
        identity: Mapping[str, Any],
        slot: int,
        workspace: Workspace,
        on_exit: Callable[[], None],
    ) -> Handle | None:
        cid, home = identity.get("container"), identity.get("supervisor")
        if not isinstance(cid, str) or not isinstance(home, str):
            return None
        try:
            container = self.client.containers.get(cid)
        except ENGINE_ERRORS:
            return None
        if container.labels.get(LABEL_NODE) != self.node_id:
            return None
        try:
            watch = Supervised.connect(Path(home))
        except Gone:
            return None
        if container.status == "paused":  # paused when let go of: the controls pause it again
            with contextlib.suppress(*ENGINE_ERRORS):
                container.unpause()
        logs = (workspace.logs / "stdout.txt", workspace.logs / "stderr.txt")
        image = str(container.attrs.get("Image", ""))
        try:
            handle = ContainerHandle(
                self.engine,
                container,
                image,
                on_exit,
                logs,
                workspace.root,
                watch,
                self.settings.log_max_bytes,
                self._own_kernel(container.attrs.get("HostConfig", {}).get("Runtime")),
            )
        except BaseException:
            watch.detach()  # not rejoined: ``reconcile`` removes it, its watch ended
            raise
        self._rejoined.add(container.id)
        self._rejoined_homes.add(home)
        return handle

    def _engine_failure(self, what: str, exc: BaseException) -> Exception:
        if self.engine.answers():
            return AttemptFailed(f"{what} ({brief(exc)})")
        self.engine.lost()
        return AttemptLapsed(f"container engine unavailable ({type(exc).__name__})")

    def remove(self, container_id: str) -> None:
        """Remove one of this node's containers, now or once the engine is back."""
        self.engine.remove(container_id)

    def reap(self, identity: Mapping[str, Any]) -> None:
        cid = identity.get("container")
        if not isinstance(cid, str):
            return
        try:
            labels = self.client.containers.get(cid).labels
        except ENGINE_ERRORS:
            return
        if labels.get(LABEL_NODE) == self.node_id:
            self.remove(cid)

    def reconcile(self) -> None:
        """Remove this node's labelled containers but those rejoined: at start no other attempt
        is live yet."""
        self.remove_labelled(LABEL_NODE, keep=self._rejoined)
        sweep_homes(self.settings.state_dir, self._rejoined_homes)

    def remove_labelled(self, label: str, keep: set[str] | frozenset[str] = frozenset()) -> None:
        try:
            leftovers = self.client.containers.list(
                all=True, filters={"label": f"{label}={self.node_id}"}, ignore_removed=True
            )
        except ENGINE_ERRORS as exc:
            log.warning("cannot list leftover containers: %s", brief(exc))
            return
        for container in leftovers:
            if container.labels.get(label) == self.node_id and container.id not in keep:
                log.info(
                    "removing leftover container %s (%s)",
                    container.short_id,
                    container.labels.get(LABEL_LEASE, "module probe"),
                )
                self.remove(container.id)


def _unrunnable(settings: Settings, runtimes: Mapping[str, Runtime]) -> str | None:
    """Why the engine cannot take what ``settings`` send it from every pool or from none: a
    ``container_runtime`` or ``public_runtime`` it lacks. A node cannot refuse work from no pool
    before it is placed here (the protocol has no way): it would take each such lease and let it
    lapse, spending the task's attempts, so it does not start (or reload) so configured."""
    for key in ("container_runtime", "public_runtime"):
        runtime = getattr(settings, key)
        if runtime is not None and runtime not in runtimes:
            has = ", ".join(sorted(runtimes)) or "none"
            return (
                f"{key} {runtime!r} is not a runtime of the engine at {settings.docker_host}"
                f" (it has {has}): {runtime_fix(runtime, runtimes)}"
            )
    return None
