"""A trusted task's launch alone, as the agent starts one: the trusted runner's sandbox (its
private table, ``/work``), the slot's task user, a one-line shell that writes ``{}``, N in a row,
each waited for; wall time and the machine's busy CPU time (``/proc/stat``) per launch, then the
agent's own, its fork server's and the supervisors' and chains' (reaped by it) per launch.

    <venv>/bin/python benchmarks/launch.py [N]

Run with the Python of the agent to measure (a venv of each tree for an A/B: its fork server
imports the package that venv holds), as root, after ``scripts/task-users``. Not a test.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from flashnode.sandbox import procs
from flashnode.sandbox.procs import supervisor
from flashnode.sandbox.procs.chain import SYSTEM_PATH
from flashnode.sandbox.procs.mounts import Sandbox, private_table
from flashnode.sandbox.procs.task import TaskProcess


def busy_ms() -> int:
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) * 10  # USER_HZ = 100


def server_ms() -> tuple[int, int]:
    """The fork server's own CPU, and that of the supervisors it reaped (and their chains)."""
    pid = supervisor.SERVER._popen.pid  # type: ignore[union-attr]
    with open(f"/proc/{pid}/stat") as fh:
        f = [int(x) * 10 for x in fh.read().rsplit(")", 1)[1].split()[11:15]]
    return f[0] + f[1], f[2] + f[3]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    state = Path(tempfile.mkdtemp(prefix="flashnode-launch-", dir="/var/lib"))
    state.chmod(0o755)
    try:
        table = state / "private.fstab"
        table.write_text(private_table(1 << 20))
        sandbox = Sandbox(1 << 20, fstab=str(table), work=True)
        pw = pwd.getpwnam("flashnode-task-0")
        user = procs.TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid)

        def one(i: int) -> None:
            work = state / f"w{i}"
            work.mkdir()
            work.chmod(0o777)
            ended = threading.Event()
            proc = TaskProcess(
                ["sh", "-c", "echo {} > /work/metrics.json"],
                {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
                cwd=work,
                stdout=state / f"o{i}",
                stderr=state / f"e{i}",
                log_max_bytes=4096,
                on_exit=ended.set,
                user=user,
                sandbox=sandbox,
            )
            ended.wait()
            proc.exited.wait()
            proc.close()
            if not (work / "metrics.json").exists():
                raise SystemExit((state / f"e{i}").read_text())

        for i in range(10):  # warm-up: the fork server, the first supervisors
            one(-1 - i)
        t0, c0, a0, (s0, k0) = time.monotonic(), busy_ms(), os.times(), server_ms()
        for i in range(n):
            one(i)
        t1, c1, a1, (s1, k1) = time.monotonic(), busy_ms(), os.times(), server_ms()
        agent = (a1.user - a0.user + a1.system - a0.system) * 1000
        print(
            f"{sys.prefix}: {1000 * (t1 - t0) / n:.2f} ms a launch, machine CPU"
            f" {(c1 - c0) / n:.2f} ms (agent {agent / n:.2f}, fork server {(s1 - s0) / n:.2f},"
            f" supervisors and chains {(k1 - k0) / n:.2f})"
        )
    finally:
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
