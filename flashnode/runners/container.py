"""The container runner: every task in a locked-down container, through the Docker Engine API
(the Docker SDK; the only module that imports ``docker``; no ``docker`` CLI).

Image policy: only the owner's ``allowed_images`` (exact ``repo:tag`` or ``repo@sha256:…``), never
``latest`` or untagged; a missing image is pulled only when ``pull_images`` is on.

Sandbox: no network, read-only root with a size-capped tmpfs ``/tmp``, all capabilities dropped,
``no-new-privileges``, a non-root user, pids/memory/CPU limits, private IPC, never privileged, no
Docker socket, and no host device except the GPUs the attempt was given. The workspace is mounted
at ``/work``: ``inputs/`` read-only, ``out/`` writable. Containers carry labels naming this node
and the attempt; at start the agent removes this node's labelled containers that no live attempt
owns, and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import requests

from flashnode.errors import AttemptFailed, PrerequisiteError
from flashnode.logcap import CappedFile
from flashnode.runners.base import Handle, Runner
from flashnode.settings import Settings
from flashnode.slots import Device, GpuPool
from flashnode.wire import MODULES, Task
from flashnode.workspace import Workspace

log = logging.getLogger(__name__)

LABEL_NODE = "dev.flashnode.node"
LABEL_LEASE = "dev.flashnode.lease"
LABEL_PROBE = "dev.flashnode.probe"  # the import check of module images: no task
WAIT_POLL_S = 30
ENGINE_ERRORS = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def image_problem(image: str, allowed: tuple[str, ...]) -> str | None:
    """Why ``image`` must not run here, or None."""
    if not image:
        return "the task names no image"
    if "@sha256:" not in image:
        name, _, tag = image.rpartition(":")
        if not name or "/" in tag:
            return f"image {image!r} has no tag; only pinned tags or digests run here"
        if tag == "latest":
            return f"image {image!r} is tagged latest; only pinned tags or digests run here"
    if image not in allowed:
        return f"image {image!r} is not on this node's allowed_images"
    return None


class CappedLog:
    """Copies a container's log stream into a size-capped file on its own thread."""

    def __init__(self, chunks: Iterator[bytes], path: Path, cap: int) -> None:
        self._file = CappedFile(path, cap)
        self._thread = threading.Thread(
            target=self._run, args=(chunks,), name="container-log", daemon=True
        )
        self._thread.start()

    @property
    def tail(self) -> bytes:
        return self._file.tail

    def _run(self, chunks: Iterator[bytes]) -> None:
        try:
            with contextlib.suppress(*ENGINE_ERRORS):
                for chunk in chunks:
                    self._file.write(chunk)
        finally:
            self._file.close()

    def join(self, timeout: float = 2.0) -> None:
        self._thread.join(timeout)


class ContainerHandle:
    def __init__(
        self, runner: ContainerRunner, container: Any, image_id: str, on_exit: Callable[[], None]
    ) -> None:
        self._runner = runner
        self._container = container
        self._image_id = image_id
        self._on_exit = on_exit
        self._code: int | None = None
        self._failure: str | None = None
        self._exited = threading.Event()
        self._logs: list[CappedLog] = []
        threading.Thread(target=self._wait, name=f"wait-{container.short_id}", daemon=True).start()

    def _follow(self, ws: Workspace, cap: int) -> None:
        for name, stream in (
            ("stdout.txt", {"stdout": True, "stderr": False}),
            ("stderr.txt", {"stdout": False, "stderr": True}),
        ):
            chunks = self._container.logs(stream=True, follow=True, **stream)
            self._logs.append(CappedLog(chunks, ws.logs / name, cap))

    def _wait(self) -> None:
        while True:
            try:
                result = self._container.wait(timeout=WAIT_POLL_S)
                self._code = int(result.get("StatusCode", -1))
                break
            except ENGINE_ERRORS as exc:
                if self._runner.engine_answers():
                    continue  # a long task: the wait request timed out, the engine is fine
                self._failure = f"container engine unavailable ({type(exc).__name__})"
                self._runner.engine_lost()
                break
        self._exited.set()
        self._on_exit()

    @property
    def returncode(self) -> int | None:
        if not self._exited.is_set():
            return None
        return self._code if self._code is not None else -1

    @property
    def image_digest(self) -> str:
        return self._image_id

    def terminate(self, grace: float) -> None:
        with contextlib.suppress(*ENGINE_ERRORS):
            self._container.stop(timeout=max(int(grace), 0))
        self._exited.wait(grace + 10)

    def finish(self) -> None:
        if self._failure is None:
            with contextlib.suppress(*ENGINE_ERRORS):
                self._container.reload()
                if self._container.attrs.get("State", {}).get("OOMKilled"):
                    self._failure = "out of memory"
        for capped in self._logs:
            capped.join()
        self._runner.remove(self._container.id)

    def stderr_tail(self) -> str:
        return self._logs[1].tail.decode("utf-8", "replace") if len(self._logs) > 1 else ""

    def failure(self) -> str | None:
        return self._failure

    def pids(self) -> set[int]:
        try:
            top = self._container.top(ps_args="-eo pid")
        except ENGINE_ERRORS:
            return set()
        titles = top.get("Titles") or []
        col = titles.index("PID") if "PID" in titles else 0
        return {int(row[col]) for row in top.get("Processes") or [] if str(row[col]).isdigit()}

    def cpu_seconds(self) -> float | None:
        try:
            stats = self._container.stats(stream=False, one_shot=True)
            return float(stats["cpu_stats"]["cpu_usage"]["total_usage"]) / 1e9
        except (*ENGINE_ERRORS, KeyError, TypeError, ValueError):
            return None


class ContainerRunner(Runner):
    name = "docker"

    def __init__(
        self, settings: Settings, node_id: str, pool: GpuPool | None = None, client: Any = None
    ) -> None:
        self.node_id = node_id
        self.pool = pool or GpuPool()
        try:
            self.client = client or docker.DockerClient(base_url=settings.docker_host, timeout=60)
            self.client.ping()
        except ENGINE_ERRORS as exc:
            raise PrerequisiteError(
                f"no container engine answers at {settings.docker_host} ({_brief(exc)}):"
                " start Docker, or use --runner trusted for pool work"
            ) from None
        self._engine_up = True
        self._checked_at = time.monotonic()
        self._unremoved: set[str] = set()
        self._lock = threading.Lock()
        self.reconfigure(settings)

    def reconfigure(self, settings: Settings) -> None:
        self.settings = settings
        self.allowed = tuple(settings.allowed_images)
        self.user = settings.container_user or (
            "65534:65534" if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"
        )
        # Module tasks run `python -m MODULE` inside the task's image: only in allowed images
        # present here whose python imports every allowlisted module.
        self.module_images = {image for image in self.allowed if self._imports_modules(image)}
        self.module_capable = bool(self.module_images)
        if self.module_images:
            log.info("module tasks on, in %s", ", ".join(sorted(self.module_images)))

    def _imports_modules(self, image: str) -> bool:
        if image_problem(image, self.allowed):
            return False
        code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
        try:
            self.client.containers.run(
                image,
                ["python", "-c", code, *MODULES],
                user=self.user,
                network_mode="none",
                read_only=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges:true"],
                labels={LABEL_PROBE: self.node_id},
                remove=True,
            )
        except ENGINE_ERRORS:
            return False
        return True

    # --- engine health ---------------------------------------------------------------------

    def engine_answers(self) -> bool:
        try:
            self.client.ping()
            return True
        except ENGINE_ERRORS:
            return False

    def engine_lost(self) -> None:
        if self._engine_up:
            log.warning("container engine stopped answering: no claims until it is back")
        self._engine_up = False

    def ready(self) -> bool:
        """False while the engine is away (checked at most every 5 s); leftovers that could not
        be removed meanwhile are removed once it is back."""
        if self._engine_up:
            return True
        now = time.monotonic()
        if now - self._checked_at < 5:
            return False
        self._checked_at = now
        if self.engine_answers():
            log.info("container engine answers again: claiming again")
            self._engine_up = True
            for cid in list(self._unremoved):
                self.remove(cid)
        return self._engine_up

    # --- the contract ----------------------------------------------------------------------

    def check(self, task: Task) -> None:
        problem = image_problem(task.image, self.allowed)
        if problem:
            raise AttemptFailed(f"refused: {problem}")
        if task.module is not None and task.image not in self.module_images:
            raise AttemptFailed(f"refused: image {task.image!r} cannot run module tasks here")

    def _image(self, ref: str) -> Any:
        try:
            return self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            if not self.settings.pull_images:
                raise AttemptFailed(
                    f"image {ref!r} is not on this node, and pulling is off"
                ) from None
        except ENGINE_ERRORS as exc:
            raise AttemptFailed(f"container engine unavailable ({type(exc).__name__})") from None
        try:
            return self.client.images.pull(ref)
        except ENGINE_ERRORS as exc:
            raise AttemptFailed(f"cannot pull image {ref!r} ({type(exc).__name__})") from None

    def start(
        self,
        task: Task,
        workspace: Workspace,
        on_exit: Callable[[], None],
        record: Callable[[dict[str, Any]], None],
        gpus: list[Device],
    ) -> Handle:
        image = self._image(task.image)
        uid, _, gid = self.user.partition(":")
        if os.geteuid() == 0:
            workspace.hand_over(int(uid), int(gid or uid))
        s = self.settings
        env = dict(task.env)
        env.update(HOME="/tmp", TMPDIR="/tmp", FLASHML_WORK_DIR="/work")
        if gpus or self.pool.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
        kwargs: dict[str, Any] = {
            "image": image.id,
            "command": self._command(task, workspace),
            "environment": env,
            "user": self.user,
            "working_dir": "/work",
            "network_mode": "none",
            "read_only": True,
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={s.container_tmp_bytes},mode=1777"},
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges:true"],
            "ipc_mode": "private",
            "privileged": False,
            "pids_limit": s.task_pids or -1,
            "labels": {LABEL_NODE: self.node_id, LABEL_LEASE: workspace.root.name},
            "mounts": [
                docker.types.Mount(
                    "/work/inputs", str(workspace.inputs), type="bind", read_only=True
                ),
                docker.types.Mount("/work/out", str(workspace.out), type="bind", read_only=False),
            ],
        }
        if task.module is not None:
            spec = str(workspace.root / "spec.json")
            kwargs["mounts"].append(
                docker.types.Mount("/work/spec.json", spec, type="bind", read_only=True)
            )
        if s.task_memory_bytes:
            kwargs["mem_limit"] = s.task_memory_bytes
            kwargs["memswap_limit"] = s.task_memory_bytes
        if s.task_cpus:
            kwargs["nano_cpus"] = int(s.task_cpus * 1e9)
        if gpus:
            kwargs["device_requests"] = [
                docker.types.DeviceRequest(
                    device_ids=[d.visible for d in gpus], capabilities=[["gpu"]]
                )
            ]
        try:
            container = self.client.containers.create(**kwargs)
        except ENGINE_ERRORS as exc:
            raise self._engine_failure("cannot create the container", exc) from None
        record({"container": container.id})
        try:
            container.start()
            handle = ContainerHandle(self, container, str(image.id), on_exit)
            handle._follow(workspace, s.log_max_bytes)
        except ENGINE_ERRORS as exc:
            self.remove(container.id)
            raise self._engine_failure("cannot start the container", exc) from None
        return handle

    def _engine_failure(self, what: str, exc: BaseException) -> AttemptFailed:
        if self.engine_answers():
            return AttemptFailed(f"{what} ({_brief(exc)})")
        self.engine_lost()
        return AttemptFailed(f"container engine unavailable ({type(exc).__name__})")

    @staticmethod
    def _command(task: Task, workspace: Workspace) -> list[str]:
        if task.module is None:
            assert task.argv is not None
            return list(task.argv)
        inputs = {i.name: f"/work/inputs/{i.dest}" for i in task.inputs}
        workspace.write_spec(task.task_id, task.params, inputs)
        return ["python", "-m", task.module, "--spec", "/work/spec.json", "--out", "/work/out"]

    def remove(self, container_id: str) -> None:
        """Remove one of this node's containers, now or once the engine is back."""
        try:
            self.client.containers.get(container_id).remove(force=True)
        except docker.errors.NotFound:
            pass
        except ENGINE_ERRORS:
            with self._lock:
                self._unremoved.add(container_id)
            return
        with self._lock:
            self._unremoved.discard(container_id)

    def reap(self, identity: dict[str, Any]) -> None:
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
        """Remove this node's labelled containers: at start no attempt is live yet."""
        try:
            leftovers = self.client.containers.list(
                all=True, filters={"label": f"{LABEL_NODE}={self.node_id}"}
            )
        except ENGINE_ERRORS as exc:
            log.warning("cannot list leftover containers: %s", _brief(exc))
            return
        for container in leftovers:
            if container.labels.get(LABEL_NODE) == self.node_id:
                log.info(
                    "removing leftover container %s (lease %s)",
                    container.short_id,
                    container.labels.get(LABEL_LEASE),
                )
                self.remove(container.id)


def _brief(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return f"{type(exc).__name__}: {text}"[:200]
