"""A running container as the attempt sees it (``ContainerHandle``): its wait (through the
engine's outages), pause and unpause, stop, what it used and held, and its removal once its
result is read. It stands on the engine the runner shares (``engine.Engine``), never on the
runner itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from flashnode.runners.base import RunResult, SuspendFailed
from flashnode.runners.container import ENGINE_ERRORS, brief
from flashnode.runners.container.engine import Engine
from flashnode.sandbox import diskuse
from flashnode.sandbox.logcap import Pump, latest_line
from flashnode.sandbox.procs.supervisor import Supervised

WAIT_POLL_S = 30


class ContainerHandle:
    """``watch``: the container's watch (``supervisor.py``), which removes it when the agent
    went and none came back within ``reattach_seconds``. Its output is read from the engine's
    copy from the start (a rejoined container's whole output again) into ``logs`` (``stdout``
    and ``stderr``), each capped at ``log_max_bytes``. ``engine`` is told when it
    stops answering, and removes the container once its result is read."""

    def __init__(
        self,
        engine: Engine,
        container: Any,
        image_id: str,
        on_exit: Callable[[], None],
        logs: tuple[Path, Path],
        workspace: Path,
        watch: Supervised,
        log_max_bytes: int,
        own_kernel: bool = False,
    ):
        self._engine = engine
        self._container = container
        self._image_id = image_id
        self._watch = watch
        self._on_exit = on_exit
        self._code: int | None = None
        self._cause: str | None = None
        self._done = threading.Event()
        self._paused = False
        self._result: RunResult | None = None
        self._dev = os.stat(workspace).st_dev
        self._main_pid: int | None = None  # the container's first process, on the host
        # Under a runtime with a kernel of its own (gVisor) the engine lists the sandbox's pids:
        # the task's processes on the host are its cgroup's (the sandbox and its gofer).
        self._own_kernel = own_kernel
        self._logs = [
            Pump(
                _follow(container, out, self._done),
                path,
                log_max_bytes,
                "container-log",
                ENGINE_ERRORS,
            )
            for out, path in ((True, logs[0]), (False, logs[1]))
        ]
        threading.Thread(target=self._wait, name=f"wait-{container.short_id}", daemon=True).start()

    def _wait(self) -> None:
        while True:
            try:
                result = self._container.wait(timeout=WAIT_POLL_S)
                self._code = int(result.get("StatusCode", -1))
                break
            except ENGINE_ERRORS as exc:
                if self._engine.answers():
                    continue  # a long task: the wait request timed out, the engine is fine
                self._cause = f"container engine unavailable ({type(exc).__name__})"
                self._engine.lost()
                break
        self._done.set()
        self._on_exit()

    def exited(self) -> bool:
        return self._done.is_set()

    def terminate(self, grace: float) -> None:
        with contextlib.suppress(SuspendFailed):
            self.resume()  # a paused container cannot act on SIGTERM
        with contextlib.suppress(*ENGINE_ERRORS):
            self._container.stop(timeout=max(int(grace), 0))
        self._done.wait(grace + 10)

    def suspend(self) -> None:
        """``docker pause``: the engine freezes the container's cgroup."""
        if self._paused:
            return
        try:
            self._container.pause()
        except ENGINE_ERRORS as exc:
            raise SuspendFailed(f"cannot pause the container ({brief(exc)})") from None
        self._paused = True

    def resume(self) -> None:
        if not self._paused:
            return
        try:
            self._container.unpause()
        except ENGINE_ERRORS as exc:
            raise SuspendFailed(f"cannot unpause the container ({brief(exc)})") from None
        self._paused = False

    def lease_left(self, seconds: float) -> None:
        self._watch.lease_left(seconds)

    def detach(self) -> bool:
        self._watch.detach()  # the engine runs it on; its watch waits for the next agent
        return True

    def last_output(self) -> str:
        return latest_line(*(capped.file for capped in self._logs))

    def result(self) -> RunResult:
        if self._result is not None:
            return self._result
        oom = False
        if self._cause is None:
            with contextlib.suppress(*ENGINE_ERRORS):
                self._container.reload()
                oom = bool(self._container.attrs.get("State", {}).get("OOMKilled"))
        for capped in self._logs:
            capped.join(5.0)
        self._engine.remove(self._container.id)
        self._watch.done()
        self._watch.remove()
        code = self._code
        self._result = RunResult(
            exit_code=code,
            oom=oom,
            cause=self._cause,
            node_fault=self._cause is not None,
            stderr_tail=self._logs[1].tail.decode("utf-8", "replace"),
            image_digest=self._image_id,
        )
        return self._result

    def pids(self) -> set[int]:
        if self._own_kernel:
            main = self._pid()
            return (_cgroup_members(main) or {main}) if main is not None else set()
        try:
            top = self._container.top(ps_args="-eo pid")
        except ENGINE_ERRORS:
            top = {}  # Podman 4's answer to a top is empty: its cgroup tells instead
        titles = top.get("Titles") or []
        col = titles.index("PID") if "PID" in titles else 0
        found = {int(row[col]) for row in top.get("Processes") or [] if str(row[col]).isdigit()}
        if found or self._done.is_set():
            return found
        main = self._pid()
        return (_cgroup_members(main) or {main}) if main is not None else set()

    def disk_bytes(self) -> int:
        """Its ``/tmp`` (a tmpfs), seen through its first process (an agent that is not root
        cannot look: ``/tmp`` is still capped by its size), and what it removed but keeps open
        under ``/work/out``."""
        if self._done.is_set():
            return 0
        held = diskuse.unlinked_bytes(self.pids(), self._dev)
        main = self._pid()
        if main is not None and not self._own_kernel:  # gVisor's /tmp is in its own memory
            held += diskuse.private_bytes(main, ("/tmp",))
        return held

    def _pid(self) -> int | None:
        """The container's first process on the host (under gVisor: its sandbox)."""
        if self._main_pid is None:
            with contextlib.suppress(*ENGINE_ERRORS, KeyError, TypeError, ValueError):
                self._container.reload()
                self._main_pid = int(self._container.attrs["State"]["Pid"]) or None
        return self._main_pid

    def cpu_seconds(self) -> float | None:
        try:
            stats = self._container.stats(stream=False, one_shot=True)
            return float(stats["cpu_stats"]["cpu_usage"]["total_usage"]) / 1e9
        except (*ENGINE_ERRORS, KeyError, TypeError, ValueError):
            return None


def _follow(container: Any, stdout: bool, ended: threading.Event) -> Iterator[bytes]:
    """One of the container's streams from its start, followed, read on the pump's thread.
    Podman answers a followed log only once the container has printed something or ended
    (Docker at once): while it is silent the request times out, and is made again (nothing was
    read yet, so nothing repeats) until the container has ended."""
    while True:
        try:
            chunks = container.logs(stream=True, follow=True, stdout=stdout, stderr=not stdout)
        except requests.exceptions.Timeout:
            if ended.is_set():
                return  # an ended container's log is answered at once: the engine hangs
            continue
        yield from chunks
        return


def _cgroup_members(pid: int) -> set[int]:
    """The processes of ``pid``'s cgroup (v2's, or v1's pids controller), as this host sees
    them; empty where it cannot tell."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers and "pids" not in controllers.split(","):
            continue
        base = Path("/sys/fs/cgroup", *([] if not controllers else ["pids"]))
        try:
            procs = (base / path.lstrip("/") / "cgroup.procs").read_text().split()
        except OSError:
            continue
        return {int(p) for p in procs if p.isdigit()}
    return set()
