"""A task's launch chain, started and waiting for its script (``Launch``).

The chain is started first and its last step waits on a pipe; the agent records how to find it
(pid, cgroup, token) and only then sends the script (``TaskProcess.go``), so that no code of the
task runs before the record exists, and one record suffices. The chain can be started ahead,
before its task is known (the trusted runner starts the next one of a slot while the last task's
result is committed): nothing of a task is in it until ``go``. A chain whose pipe closes without
the whole script (the agent gone, ``discard``) exits with ``SETUP_FAILED`` and runs nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.procs import TaskUser, start_time
from flashnode.sandbox.procs.chain import PRIVILEGED_ENV, command
from flashnode.sandbox.procs.mounts import Sandbox


class Launch:
    """A task's chain, started and waiting for its script (see the module docstring): in
    ``cgroup`` and ``sandbox``, as ``user``, in ``cwd`` (bound at ``/work`` where the sandbox
    says so), its pipes open. ``TaskProcess`` takes it over."""

    def __init__(
        self,
        cwd: Path,
        cgroup: AttemptCgroup | None = None,
        user: TaskUser | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        self.cgroup, self.user, self.sandbox = cgroup, user, sandbox
        script_r, self.script_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.fault_r, fault_w = os.pipe()
        try:
            if user is not None:  # the last step opens these by name, as the user
                os.fchown(script_r, user.uid, user.gid)
                os.fchown(err_w, user.uid, user.gid)
            self.popen = subprocess.Popen(
                command(cgroup, user, sandbox, err_w),
                env=PRIVILEGED_ENV,
                cwd=cwd,
                stdin=script_r,
                stdout=out_w,
                stderr=fault_w,
                pass_fds=(err_w,),
                start_new_session=True,
                close_fds=True,
                umask=0o077,
            )
        except BaseException:
            for fd in (self.script_w, self.out_r, self.err_r, self.fault_r):
                os.close(fd)
            raise
        finally:
            for fd in (script_r, out_w, err_w, fault_w):
                os.close(fd)
        self.pid = self.popen.pid
        self.start_time = start_time(self.pid)

    def alive(self) -> bool:
        """Still waiting (a chain whose setup failed has exited)."""
        return self.popen.poll() is None

    def take(self) -> tuple[int, int, int, int]:
        """Hand the pipes (script, stdout, stderr, fault channel) to the task that runs in this
        chain: from here on they are its to close, and ``discard`` leaves them."""
        fds = (self.script_w, self.out_r, self.err_r, self.fault_r)
        self.script_w = self.out_r = self.err_r = self.fault_r = -1
        return fds

    def discard(self) -> None:
        """End a launch no task took: its pipe closes (it exits without running anything), its
        group is killed, its cgroup removed."""
        for fd in (self.script_w, self.out_r, self.err_r, self.fault_r):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.script_w = self.out_r = self.err_r = self.fault_r = -1
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
