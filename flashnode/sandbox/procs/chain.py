"""The launch chain's command line: ``unshare``, the setup script run as root in the new
namespaces, ``prlimit``, ``setpriv``, and the last step's shell, which takes the task's
environment and arguments from a script on its standard input (``env_script``).

The privilege boundary: every process that runs with the agent's privileges on the way to the
task (``unshare``, the setup shell, ``setpriv``) is started with a fixed, minimal environment.
The task's own environment and arguments are applied by the last step, a shell already running as
the task's user, which reads them as a script from its standard input and then execs the task.
So no payload variable (``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ...) ever reaches a privileged
process.
"""

from __future__ import annotations

import functools
import os
import resource
from collections.abc import Mapping, Sequence
from pathlib import Path

from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.procs import TaskUser
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
SETUP_FAILED = 125  # the exit status of a setup step that failed (with a "flashnode:" line)
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


# As root, in the new namespaces: join the cgroup ($1: its cgroup.procs files), make the private
# directories ($2: tmpfs options; $5: a table of them all, for one `mount -a` instead of a mount
# each), give the task this namespace's message queues where the host's are mounted ($6:
# ``mqueue_mounts``, read by the agent: the shell's `read` takes a byte per system call), bind the
# read-only views ($3: lines, a source then its target in the working directory, so that paths may
# hold spaces), bind the working directory with them at /work and enter it there ($7), cover the
# lent directories ($8: a table; after the views, whose sources they are), cover the job
# environments' directory ($9) with the empty tmpfs that $5's table put together over the private
# /tmp, with what is kept of it bound in (``envs_fstab``): moved over it, it uncovers the private
# /tmp again; hide device files ($4), run the rest. Paths
# in the working directory are taken from the directory the chain is in, not its path, which a
# private directory may cover by now (--no-canonicalize). Every step a process fewer where the
# shell can do it itself: this runs before every task. Each failure goes to stderr: the launch's
# fault channel (module docstring).
SETUP = r"""
fail() { echo "flashnode: $*" >&2; exit 125; }
for f in $1; do echo $$ > "$f" || fail "cannot join cgroup $f"; done
# (The mount points the table makes, task users pass through: a subshell's umask, not the task's.)
[ -z "$5" ] || (umask 022 && mount --no-canonicalize -a -T "$5") \
  || fail "cannot mount the private directories"
for d in $PRIVATE; do
  case "
${10}
" in *"
$d
"*) continue ;; esac  # put together below, with the agent's own install kept in it
  [ -n "$5" ] || [ ! -d "$d" ] || mount -t tmpfs -o "$2" flashnode-private "$d" \
    || fail "cannot mount $d"
done
[ -z "${10}" ] || printf '%s\n' "${10}" | while IFS= read -r d && IFS= read -r s \
    && IFS= read -r kept; do
  to="$s${kept#"$d"}"
  mount -t tmpfs -o "$2" flashnode-private "$s" && mkdir "$to" \
    && mount --no-canonicalize --bind "$kept" "$to" \
    && mount --no-canonicalize -o remount,bind,ro,nosuid,nodev "$to" \
    && mount --no-canonicalize --move "$s" "$d" || fail "cannot mount $d keeping $kept"
done || exit 125
for q in $6; do  # every mount of the host's message queues: this namespace's instead
  mount -t mqueue -o nosuid,nodev,noexec flashnode-mqueue "$q" || fail "cannot mount $q"
done
[ -z "$3" ] || printf '%s\n' "$3" | while IFS= read -r src && IFS= read -r dst; do
  mount --no-canonicalize --bind "$src" "$dst" \
    && mount --no-canonicalize -o remount,bind,ro,nosuid,nodev "$dst" \
    || fail "cannot mount /work/$dst read-only"
done || exit 125
[ -z "$7" ] || { mount --no-canonicalize --rbind . /work && cd /work; } \
  || fail "cannot bind the workspace at /work"
[ -z "$8" ] || mount -a -T "$8" || fail "cannot cover the lent directories"
# The cover is what lies on /tmp (its 0711, where the private /tmp is sticky), and once moved
# the task's own /tmp is back: sticky and writable (shell tests, not a process each).
[ -z "$9" ] || { [ ! -k $ENVS_STAGE ] && mount --no-canonicalize --move $ENVS_STAGE "$9"; } \
  || fail "cannot cover the job environments"
[ -z "$5" ] || { [ -k /tmp ] && [ -w /tmp ]; } || fail "the private /tmp is not in place"
for dev in $4; do mount --bind /dev/null "$dev" || fail "cannot hide $dev"; done
shift 10
exec "$@"
"""
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


def command(
    cgroup: AttemptCgroup | None,
    user: TaskUser | None,
    sandbox: Sandbox | None,
    stderr_fd: int | None = None,
    rlimits: Sequence[str] = (),
) -> list[str]:
    """The command line of the chain that runs a task in ``cgroup``, in ``sandbox``, as ``user``;
    its last step takes the task's environment and arguments from stdin (``env_script``).
    ``stderr_fd``: a launch's (the chain's stderr is its fault channel; the task's stderr
    comes on this descriptor). ``rlimits``: ``prlimit`` options (``--fsize=N``), set before the
    user is taken."""
    apply = APPLY_ENV
    if stderr_fd is not None:
        apply = APPLY_LAUNCH % (LAUNCHED.decode().replace("\n", "\\n"), stderr_fd)
    cmd = ["/bin/sh", "-c", apply, "flashnode-task"]
    if user is not None:
        # No supplementary groups, no capabilities, and no_new_privs: no setuid binary can raise
        # the task's privileges again.
        cmd = [
            "setpriv",
            f"--reuid={user.uid}",
            f"--regid={user.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            *(["--bounding-set=-all"] if _may_drop_bounding_set() else []),
            "--no-new-privs",
            "--",
            *cmd,
        ]
    if rlimits:
        cmd = ["prlimit", *rlimits, "--", *cmd]
    if cgroup is None and sandbox is None:
        return cmd
    if sandbox and any("\n" in p for bind in sandbox.read_only_binds for p in bind):
        raise ValueError("a read-only view's path holds a newline")
    procs = " ".join(cgroup.procs_files) if cgroup else ""
    tmpfs = f"nosuid,nodev,mode=1777,size={sandbox.tmp_bytes}" if sandbox else ""
    binds = "\n".join(f"{s}\n{d}" for s, d in sandbox.read_only_binds) if sandbox else ""
    setup = SETUP.replace("$PRIVATE", " ".join(PRIVATE_DIRS) if sandbox else "")
    setup = setup.replace("$ENVS_STAGE", ENVS_STAGE)
    hidden = " ".join(sandbox.hidden_devices) if sandbox else ""
    fstab = sandbox.fstab if sandbox else ""
    queues = " ".join(mqueue_mounts()) if sandbox else ""
    work = "1" if sandbox and sandbox.work else ""
    covers = sandbox.covers if sandbox else ""
    envs = sandbox.envs if sandbox else ""
    if sandbox and bool(sandbox.envs) != os.path.basename(sandbox.fstab).startswith(ENVS_TABLE):
        raise ValueError("the job environments' cover is put together by the sandbox's table")
    agent = ""
    if sandbox and sandbox.keep_agent and not sandbox.fstab:
        agent = "\n".join("\n".join(k) for k in agent_kept())
    args = [procs, tmpfs, binds, hidden, fstab, queues, work, covers, envs, agent]
    cmd = ["/bin/sh", "-c", setup, "flashnode-setup", *args, *cmd]
    if sandbox is not None:
        net = ["--net"] if sandbox.no_network else []
        cmd = ["unshare", "--mount", "--ipc", *net, "--propagation", "private", "--", *cmd]
    return cmd
