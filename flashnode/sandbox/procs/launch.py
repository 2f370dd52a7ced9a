"""A task's launch chain, started and waiting for its script (``Launch``).

The chain is started first and its last step waits on a pipe; the agent records how to find it
(pid, cgroup, token) and only then sends the script (``TaskProcess.go``), so that no code of the
task runs before the record exists, and one record suffices. The chain can be started ahead,
before its task is known (the trusted runner starts the next one of a slot while the last task's
result is committed): nothing of a task is in it until ``go``. A chain whose pipe closes without
the whole script (the agent gone, ``discard``) exits with ``SETUP_FAILED`` and runs nothing. The
chain's parent is its supervisor (``supervisor.py``), not the agent: it outlives an agent's
restart.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from pathlib import Path

from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.procs import TaskUser
from flashnode.sandbox.procs.chain import PRIVILEGED_ENV, last_step, plan
from flashnode.sandbox.procs.mounts import Sandbox
from flashnode.sandbox.procs.supervisor import Supervised, new_home


class Launch:
    """A task's chain, started and waiting for its script (see the module docstring): in
    ``cgroup`` and ``sandbox``, as ``user``, in ``cwd`` (bound at ``/work`` where the sandbox
    says so), under a supervisor of its own (``supervisor.py``: in a new directory under
    ``homes``, or a temporary one; it keeps the task ``reattach_seconds`` for an agent that went
    away to come back; ``hold``: a descriptor it keeps open while it lives, the lock of the
    task's user). ``TaskProcess`` takes it over."""

    def __init__(
        self,
        cwd: Path,
        cgroup: AttemptCgroup | None = None,
        user: TaskUser | None = None,
        sandbox: Sandbox | None = None,
        homes: Path | None = None,
        reattach_seconds: float = 0.0,
        hold: int | None = None,
    ) -> None:
        self.cgroup, self.user, self.sandbox = cgroup, user, sandbox
        script_r, self.script_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fault_r, fault_w = os.pipe()
        home = None
        try:
            if user is not None:  # the last step opens these by name, as the user
                os.fchown(script_r, user.uid, user.gid)
                os.fchown(err_w, user.uid, user.gid)
            home = new_home(homes)
            fds = {
                "script_r": script_r,
                "out_w": out_w,
                "err_w": err_w,
                "fault_w": fault_w,
                "out_r": out_r,
                "err_r": err_r,
                "fault_r": fault_r,
                **({"hold": hold} if hold is not None else {}),
            }
            self.supervised = Supervised.start(
                last_step(err_w),
                plan(cgroup, user, sandbox),
                cwd,
                PRIVILEGED_ENV,
                fds,
                home,
                reattach_seconds,
            )
        except BaseException:
            os.close(self.script_w)
            if home is not None:
                with contextlib.suppress(OSError):
                    for p in home.iterdir():
                        p.unlink()
                    home.rmdir()
            raise
        finally:
            for fd in (script_r, out_w, err_w, fault_w, out_r, err_r, fault_r):
                os.close(fd)
        self.pid = self.supervised.pid
        self.start_time = self.supervised.start_time

    def alive(self) -> bool:
        """Still waiting (a chain whose setup failed has exited)."""
        sup = self.supervised
        if not sup.ended:
            poller = select.poll()  # not select(): the agent may hold descriptors past 1023
            poller.register(sup.fileno(), select.POLLIN)
            if poller.poll(0):
                sup.hear()
        return not sup.ended

    def take(self) -> int:
        """Hand the script's pipe to the task that runs in this chain: from here on it is its to
        close (and the supervisor its to end), and ``discard`` leaves them."""
        fd, self.script_w = self.script_w, -1
        return fd

    def discard(self) -> None:
        """End a launch no task took: its pipe closes (it exits without running anything), its
        group is killed, its supervisor ends, its cgroup is removed."""
        if self.script_w < 0:
            return
        with contextlib.suppress(OSError):
            os.close(self.script_w)
        self.script_w = -1
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)
        self.supervised.done()
        self.supervised.remove()
        if self.cgroup is not None:
            self.cgroup.remove()
