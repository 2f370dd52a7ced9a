"""A running trusted task as the attempt sees it (``TrustedHandle``): its wait, suspension and
termination, what it used, and the slot handed back once its processes are gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from flashnode.runners.base import RunResult, SuspendFailed
from flashnode.sandbox import diskuse
from flashnode.sandbox.procs.task import TaskProcess


class TrustedHandle:
    """``on_result``: called once the task's processes are all gone (its cgroup is left to it
    to remove), with what lets go of the task's supervisor (``TaskProcess.close``: it waits for
    the supervisor's exit), which it must call, off the attempt's way where it can: the result
    needs nothing of it. ``private``: the task's private directories (its sandbox's tmpfs
    mounts); ``workspace``: where it runs (the disk its removed-but-open files are looked for
    on)."""

    def __init__(
        self,
        proc: TaskProcess,
        on_result: Callable[[Callable[[], None]], None] = lambda let_go: let_go(),
        private: tuple[str, ...] = (),
        workspace: Path | None = None,
    ) -> None:
        self._proc = proc
        self._result: RunResult | None = None
        self._on_result = on_result
        self._private = private
        self._dev = os.stat(workspace).st_dev if workspace is not None else None

    def exited(self) -> bool:
        return self._proc.exited.is_set()

    def terminate(self, grace: float) -> None:
        self._proc.terminate(grace)

    def result(self) -> RunResult:
        if self._result is not None:
            return self._result
        self._proc.kill()  # whatever the task left running
        try:
            self._result = self._read()
        finally:
            self._on_result(self._proc.close)
        return self._result

    def _read(self) -> RunResult:
        lost = self._proc.lost
        oom = self._proc.cgroup.oom_killed() if self._proc.cgroup is not None else False
        code = self._proc.returncode
        tail = self._proc.stderr_tail().decode("utf-8", "replace")
        cause = None
        if lost:  # how it ended is not known: not held against the task
            cause = "the task's supervisor ended before the task did"
        elif not self._proc.launched:  # no code of the task ran: whatever ended it is the node's
            how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
            why = self._proc.setup_failure() or f"it ended before the task started, {how}"
            cause = f"task setup failed ({why})"
        return RunResult(
            exit_code=code if code is None or code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            oom=oom,
            cause=cause,
            node_fault=cause is not None,
            stderr_tail=tail,
        )

    def pids(self) -> set[int]:
        return self._proc.pids()

    def cpu_seconds(self) -> float | None:
        return self._proc.cpu_seconds()

    def disk_bytes(self) -> int:
        if self._proc.exited.is_set():
            return 0  # its namespace, its private directories and its open files are gone
        held = diskuse.private_bytes(self._proc.pid, self._private)
        if self._dev is not None:
            held += diskuse.unlinked_bytes(self._proc.pids(), self._dev)
        return held

    def suspend(self) -> None:
        try:
            self._proc.suspend()
        except OSError as exc:
            self._proc.resume()
            raise SuspendFailed(
                f"cannot freeze the task's cgroup ({exc.strerror or exc})"
            ) from None

    def resume(self) -> None:
        self._proc.resume()

    def last_output(self) -> str:
        return self._proc.last_line()

    def lease_left(self, seconds: float) -> None:
        self._proc.lease_left(seconds)

    def detach(self) -> bool:
        self._proc.detach()  # it runs on under its supervisor
        return True
