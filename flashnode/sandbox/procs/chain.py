"""The launch chain: its steps as root (``plan``, taken by ``enter``: the cgroup, the
namespaces and mounts, the limits, the task's user) and its last step's shell, which takes the
task's environment and arguments from a script on its standard input (``env_script``).

The privilege boundary: every process that runs with the agent's privileges on the way to the
task (the chain's first process, which takes ``plan``'s steps) is started with a fixed, minimal
environment. The task's own environment and arguments are applied by the last step, a shell
already running as the task's user, which reads them as a script from its standard input and
then execs the task. So no payload variable (``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ...) ever
reaches a privileged process.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.procs import TaskUser, enter
from flashnode.sandbox.procs.mounts import (
    ENVS_STAGE,
    ENVS_TABLE,
    PRIVATE_DIRS,
    Sandbox,
    agent_kept,
    mqueue_mounts,
)

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The only environment of the privileged steps before the task's own exec.
PRIVILEGED_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
SETUP_FAILED = enter.SETUP_FAILED  # a setup step failed (with a "flashnode:" line)
LAUNCHED = b"flashnode launched the task\n"  # the last step's word before the exec


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def env_script(
    env: Mapping[str, str],
    argv: Sequence[str],
    cwd: Path | None = None,
    max_file_bytes: int | None = None,
) -> bytes:
    """The script the last step of the chain sources: enter ``cwd`` (first: no variable of the
    task's can change what it means), limit the size of any file the task makes to
    ``max_file_bytes`` (rounded up to the shell's 512-byte blocks; soft and hard, so that the
    task cannot raise it), export exactly ``env`` (names are checked by the wire parser), set
    the arguments, and, last, say it is whole (``FLASHNODE_GO``: a payload cannot set that
    name, and it is never exported). Each export goes through ``command``: a name the shell
    refuses to take (dash's ``OPTIND`` with a value that is not a number, bash's read-only
    ``UID``) is then left out with a message, where a bare ``export`` would end the shell before
    the task runs and make the task's own payload look like the launch failing."""
    enter = f"cd -- {_quote(str(cwd))} || {{ echo 'flashnode: cannot enter the workspace' >&2;"
    lines = [f"{enter} exit {SETUP_FAILED}; }}\n"] if cwd is not None else []
    if max_file_bytes is not None:
        blocks = _file_size_blocks(max_file_bytes)
        fail = "{ echo 'flashnode: cannot limit the size of files' >&2;"
        lines.append(f"ulimit -f {blocks} || {fail} exit {SETUP_FAILED}; }}\n")
    lines += [f"command export {k}={_quote(v)}\n" for k, v in env.items()]
    lines.append("set -- " + " ".join(_quote(a) for a in argv) + "\n")
    lines.append("FLASHNODE_GO=1\n")
    return "".join(lines).encode("utf-8", "surrogateescape")


def _file_size_blocks(max_bytes: int) -> int:
    """``max_bytes`` in the 512-byte blocks of the shell's ``ulimit -f``, rounded up, and no
    more than the hard limit the chain inherits (which an unprivileged shell cannot raise)."""
    blocks = -(-max_bytes // 512)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    return blocks if hard == resource.RLIM_INFINITY else min(blocks, hard // 512)


def env_file(env: Mapping[str, str], argv: Sequence[str]) -> int:
    """A memory file holding ``env_script(env, argv)``, at offset 0, for a chain that may run
    at once (``popen_as``)."""
    fd = os.memfd_create("flashnode-task-env")
    try:
        os.write(fd, env_script(env, argv))
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


# As the task's user: take the task's environment and arguments from the script on stdin (once it
# is whole), then run the task with stdin from /dev/null.
APPLY_ENV = '. /dev/stdin && [ "$FLASHNODE_GO" = 1 ] || exit 125; exec "$@" </dev/null'
# The same, last step of a launch: say on the fault channel (stderr until here) that the task's
# exec comes next, and give the task its own stderr in the channel's place (the pipe passed on
# descriptor %d, opened again by name: the shell addresses only descriptors 0-9 by number, so
# that descriptor stays open in the task too, a second copy of its stderr).
APPLY_LAUNCH = (
    '. /dev/stdin && [ "$FLASHNODE_GO" = 1 ] || exit 125; printf "%s" >&2;'
    ' exec "$@" </dev/null 2>/proc/self/fd/%d'
)


@functools.lru_cache(maxsize=1)
def _may_drop_bounding_set() -> bool:
    """Whether this process holds CAP_SETPCAP (the packaged unit's bounding set has no need of
    it: a task that runs with no_new_privs as its own uid gains no capability either way)."""
    try:
        with open("/proc/self/status") as fh:
            eff = next(line for line in fh if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(eff.split()[1], 16) & (1 << 8))


def plan(
    cgroup: AttemptCgroup | None,
    user: TaskUser | None,
    sandbox: Sandbox | None,
    rlimits: Mapping[str, int] | None = None,
) -> dict[str, Any] | None:
    """The steps (``enter.enter``) that put a chain in ``cgroup``, in ``sandbox``, as ``user``,
    with ``rlimits`` (``enter.RLIMITS``' names: soft and hard, set before the user is taken),
    as JSON; None when there are none."""
    if cgroup is None and user is None and sandbox is None and not rlimits:
        return None
    if sandbox and any("\n" in p for bind in sandbox.read_only_binds for p in bind):
        raise ValueError("a read-only view's path holds a newline")
    if sandbox and bool(sandbox.envs) != os.path.basename(sandbox.fstab).startswith(ENVS_TABLE):
        raise ValueError("the job environments' cover is put together by the sandbox's table")
    steps: dict[str, Any] = {
        "cgroup": list(cgroup.procs_files) if cgroup else [],
        "sandbox": sandbox is not None,
        "rlimits": dict(rlimits or {}),
        "user": None,
    }
    if user is not None:
        # No supplementary groups, no capabilities, and no_new_privs: no setuid binary can
        # raise the task's privileges again.
        bounding = _may_drop_bounding_set()
        steps["user"] = {"uid": user.uid, "gid": user.gid, "bounding": bounding}
    if sandbox is not None:
        agent = agent_kept() if sandbox.keep_agent and not sandbox.fstab else ()
        steps |= {
            "no_network": sandbox.no_network,
            "fstab": sandbox.fstab,
            "private": list(PRIVATE_DIRS),
            "tmpfs": f"mode=1777,size={sandbox.tmp_bytes}",
            "agent": [list(k) for k in agent],
            "mqueues": mqueue_mounts(),
            "binds": [list(b) for b in sandbox.read_only_binds],
            "work": sandbox.work,
            "covers": sandbox.covers,
            "envs": sandbox.envs,
            "envs_stage": ENVS_STAGE,
            "hidden": list(sandbox.hidden_devices),
        }
    return steps


def last_step(stderr_fd: int | None = None) -> list[str]:
    """The command line of the chain's last step, as the task's user: it takes the task's
    environment and arguments from stdin (``env_script``). ``stderr_fd``: a launch's (the
    chain's stderr is its fault channel; the task's stderr comes on this descriptor)."""
    apply = APPLY_ENV
    if stderr_fd is not None:
        apply = APPLY_LAUNCH % (LAUNCHED.decode().replace("\n", "\\n"), stderr_fd)
    return ["/bin/sh", "-c", apply, "flashnode-task"]


def command(
    cgroup: AttemptCgroup | None,
    user: TaskUser | None,
    sandbox: Sandbox | None,
    rlimits: Mapping[str, int] | None = None,
    env: Mapping[str, str] = PRIVILEGED_ENV,
) -> list[str]:
    """The command line of a whole chain as a program (the agent's own helpers: ``plan``'s
    steps taken by ``enter.py`` run by path, then ``last_step`` with exactly ``env``)."""
    steps = plan(cgroup, user, sandbox, rlimits)
    if steps is None:
        return last_step()
    entry = [sys.executable, "-I", "-S", enter.__file__, json.dumps(steps | {"env": env})]
    return [*entry, *last_step()]
