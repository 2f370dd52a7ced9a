"""Process-tree ownership for trusted tasks: the only module that starts or signals processes.

A task's processes belong to its attempt until the attempt ends, including children that leave
the process group (``setsid``, double fork) to escape. Each task gets:

* its own session and process group (signals go to the whole group);
* a random ownership token in its environment (``FLASHNODE_OWNER``), so that a scan of
  ``/proc/*/environ`` finds every descendant of the task's user even after it detached;
* when the agent is root: its own user (``TaskUser``, one per slot), its cgroup, and its own
  mount and IPC namespaces with private ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (tmpfs, nosuid,
  nodev), so nothing it leaves there outlives it.

The privilege boundary: every process that runs with the agent's privileges on the way to the
task (``unshare``, the setup shell, ``setpriv``) is started with a fixed, minimal environment.
The task's own environment and arguments are applied by the last step, a shell already running as
the task's user, which reads them as a script from its standard input and then execs the task.
So no payload variable (``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ...) ever reaches a privileged
process.

The launch (``Launch``): the chain is started first and its last step waits on a pipe; the
agent records how to find it (pid, cgroup, token) and only then sends the script (``go``), so
that no code of the task runs before the record exists, and one record suffices. The chain can
be started ahead, before its task is known (the trusted runner starts the next one of a slot
while the last task's result is committed): nothing of a task is in it until ``go``. A chain
whose pipe closes without the whole script (the agent gone, ``discard``) exits with
``SETUP_FAILED`` and runs nothing.

``/work``: in the sandbox, the chain binds its working directory (the attempt's workspace, or
an empty directory the workspace is later moved into, for a chain started ahead) at ``/work`` in
the task's mount namespace, so that every ``/work/...`` path works wherever a task names it.

Whose fault (``TaskProcess.launched``): until the task's own exec, the chain's stderr is its
fault channel, a pipe only the agent reads; every step writes why it failed there, and the last
step writes ``LAUNCHED`` there just before it execs the task, with the task's stderr put in its
place. No descriptor of that channel is left to the task, so nothing the task prints or exits
with can make its failure look like its launch's, and a chain that ended without saying
``LAUNCHED`` never ran any code of the task: the node's fault.

Lent directories (``Sandbox.covers``): after the task's own read-only views are bound, each
lent directory's host path is covered by an empty read-only tmpfs in the task's namespace, so
that a task reaches lent data only at the ``/work/inputs/<label>`` it asked for.

Termination is TERM → grace → KILL over the group, the token holders and the cgroup, repeated
until nothing of the task is left, on an injected clock. Output goes through pipes to one thread
per task that keeps a size-capped head and a short tail on disk and sees the main process exit;
the attempt never waits for a pipe held open by a detached descendant: it ends when the main
process exits.

Suspension (an owner control) freezes the task's cgroup where it has a freezer, else stops its
tree with SIGSTOP (group and token holders, in rounds until none runs; SIGCONT resumes it). A
suspended task is resumed before it is terminated, so that it can act on SIGTERM.

Why one module of this size: the only module that starts or signals processes: the launch chain,
its sandbox script, the ownership scan, keyrings.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import pwd
import resource
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnode import statefile
from flashnode.clock import Clock, SystemClock
from flashnode.coordinator import validators
from flashnode.sandbox.cgroups import AttemptCgroup
from flashnode.sandbox.logcap import CappedFile
from flashnode.sandbox.workspace import WORK

log = logging.getLogger(__name__)

OWNER_ENV = "FLASHNODE_OWNER"
READ_CHUNK = 64 * 1024
KILL_ROUNDS_S = 5.0
STOP_ROUNDS_S = 2.0  # SIGSTOP rounds: until no process of the task is left running
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The only environment of the privileged steps before the task's own exec.
PRIVILEGED_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
SETUP_FAILED = 125  # the exit status of a setup step that failed (with a "flashnode:" line)
LAUNCHED = b"flashnode launched the task\n"  # the last step's word before the exec
FAULT_BYTES = 4096  # what is kept of a fault channel
# World-writable places a task could leave things in for later tasks of its user: each its own
# empty tmpfs in the task's mount namespace (those that exist), plus the POSIX message queues of
# its own IPC namespace.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


@functools.lru_cache(maxsize=1)
def agent_kept() -> tuple[tuple[str, str, str], ...]:
    """(private directory, staging directory, kept directory) for each private directory that
    holds the agent's own install (its venv, its package: a checkout under /tmp), where the
    sandboxes of its own helpers and builds would hide it: the top directory of it under the
    private one is bound back there read-only. The staging directory (made once, the agent's,
    0700) is where the private tmpfs is put together before it is moved into place, in the
    sandbox's own mount namespace; one kept directory per private one (the first found)."""
    found: dict[str, str] = {}
    for path in (sys.prefix, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        real = os.path.realpath(path)
        for d in PRIVATE_DIRS:
            if real.startswith(d + "/") and d not in found:
                top = d + "/" + real[len(d) + 1 :].split("/", 1)[0]
                if "\n" not in top:
                    found[d] = top
    return tuple(
        (d, tempfile.mkdtemp(prefix=".flashnode-stage-", dir=d), k) for d, k in found.items()
    )


def new_token() -> str:
    return secrets.token_hex(16)


@dataclass(frozen=True)
class TaskUser:
    """The unprivileged user a trusted task runs as when the agent is root (one per slot)."""

    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class Sandbox:
    """What a root agent sets up around a task before dropping to its user. Bind paths may not
    hold a newline (``command`` refuses them)."""

    tmp_bytes: int  # size of each private tmpfs
    # (host path, target relative to the working directory: bound before it is bound at /work)
    read_only_binds: tuple[tuple[str, str], ...] = field(default=())
    hidden_devices: tuple[str, ...] = field(default=())  # device files the task sees as /dev/null
    fstab: str = ""  # the private tmpfs mounts as one table (``private_fstab``), if written
    work: bool = False  # bind the chain's working directory at /work and enter it there
    covers: str = ""  # the lent directories' covers as one table (``cover_fstab``), if any
    no_network: bool = False  # a network namespace of its own: no interface but a down loopback
    # The job environments' directory, covered by an empty tmpfs (no task sees another job's
    # environment), and what under it is bound back read-only at its same path (the task's own
    # environment, the managed interpreters): shebangs and pyvenv.cfg keep working.
    envs: str = ""
    envs_kept: tuple[str, ...] = field(default=())
    # The agent's own install (its interpreter, its package, uv), where it lies under a private
    # directory (a checkout under /tmp): bound back read-only in the agent's own helpers' and
    # builds' sandboxes, which run it (``agent_kept``).
    keep_agent: bool = False


def private_fstab(path: Path, tmp_bytes: int) -> str:
    """Write the table of a task's private tmpfs mounts (those of ``PRIVATE_DIRS`` that exist
    here, ``tmp_bytes`` each) to ``path``, readable by this user only, and return its path for
    ``Sandbox.fstab``. Each mount's source name is new (``mount -a`` skips a mount it finds
    already there: never one of the host's)."""
    source = f"flashnode-private-{secrets.token_hex(4)}"
    options = f"nosuid,nodev,mode=1777,size={tmp_bytes}"
    table = "".join(f"{source} {d} tmpfs {options} 0 0\n" for d in PRIVATE_DIRS if os.path.isdir(d))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    statefile.write(path, table.encode(), 0o600)
    return str(path)


def cover_fstab(directory: Path, lent: Iterable[Path]) -> str:
    """Write the table of the covers of the ``lent`` directories (an empty read-only tmpfs over
    each, by its resolved path) into ``directory``, and return its path for ``Sandbox.covers``:
    named for what it covers, so that a chain started under another table can tell; "" when
    there is nothing to cover. Deepest first (a cover over a parent would hide the child's
    mount point); none under the private directories or ``/work``, which the task gets its own
    of anyway. Paths are written the way fstab escapes them."""
    targets = set()
    for path in lent:
        real = os.path.realpath(path)
        if not any(real == d or real.startswith(d + "/") for d in (*PRIVATE_DIRS, WORK)):
            targets.add(real)
    if not targets:
        return ""
    ordered = sorted(targets, key=lambda t: (-t.count("/"), t))
    digest = hashlib.sha256("\0".join(ordered).encode("utf-8", "surrogateescape")).hexdigest()
    path = directory / f"covers-{digest[:16]}.fstab"
    if not path.exists():
        source = f"flashnode-cover-{secrets.token_hex(4)}"
        options = "ro,nosuid,nodev,noexec,mode=0555,size=4k"
        table = "".join(f"{source} {_fstab_escape(t)} tmpfs {options} 0 0\n" for t in ordered)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        statefile.write(path, table.encode("utf-8", "surrogateescape"), 0o600)
    return str(path)


def _fstab_escape(path: str) -> str:
    """A path as a field of fstab: whitespace and backslashes as octal escapes."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


@dataclass(frozen=True)
class Stream:
    """One of the task's output streams as captured: its size-capped file and its tail."""

    file: CappedFile

    @property
    def tail(self) -> bytes:
        return self.file.tail


def mqueue_mounts() -> list[str]:
    """Where the host's POSIX message queues are mounted (this process's mount table, which a
    task's new mount namespace copies), as the table writes them."""
    try:
        with open("/proc/self/mounts") as fh:
            return [f[1] for f in (line.split() for line in fh) if len(f) > 2 and f[2] == "mqueue"]
    except OSError:
        return []


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
# environments' directory ($9) with an empty tmpfs, made in the private /tmp with what is kept of
# it bound in (${10}: lines) and then moved over it, hide device files ($4), run the rest. Paths
# in the working directory are taken from the directory the chain is in, not its path, which a
# private directory may cover by now (--no-canonicalize). Every step a process fewer where the
# shell can do it itself: this runs before every task. Each failure goes to stderr: the launch's
# fault channel (module docstring).
SETUP = r"""
fail() { echo "flashnode: $*" >&2; exit 125; }
for f in $1; do echo $$ > "$f" || fail "cannot join cgroup $f"; done
[ -z "$5" ] || mount -a -T "$5" || fail "cannot mount the private directories"
for d in $PRIVATE; do
  case "
${11}
" in *"
$d
"*) continue ;; esac  # put together below, with the agent's own install kept in it
  [ -n "$5" ] || [ ! -d "$d" ] || mount -t tmpfs -o "$2" flashnode-private "$d" \
    || fail "cannot mount $d"
done
[ -z "${11}" ] || printf '%s\n' "${11}" | while IFS= read -r d && IFS= read -r s \
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
[ -z "$9" ] || {
  s=/tmp/.flashnode-envs
  mkdir -m 0700 "$s" && mount -t tmpfs -o nosuid,nodev,mode=0711,size=64k flashnode-envs "$s" \
    || fail "cannot cover the job environments"
  [ -z "${10}" ] || printf '%s\n' "${10}" | while IFS= read -r kept; do
    to="$s${kept#"$9"}"
    umask 022  # this pipeline's subshell only: task users pass through the directories made
    mkdir -p "$to" && mount --no-canonicalize --bind "$kept" "$to" \
      && mount --no-canonicalize -o remount,bind,ro,nosuid,nodev "$to" \
      || fail "cannot bind the job environment $kept read-only"
  done || exit 125
  mount -o remount,ro "$s" && mount --no-canonicalize --move "$s" "$9" && rmdir "$s" \
    || fail "cannot cover the job environments"
}
for dev in $4; do mount --bind /dev/null "$dev" || fail "cannot hide $dev"; done
shift 11
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
    if sandbox and any(
        "\n" in p or not p.startswith(sandbox.envs + "/") for p in sandbox.envs_kept
    ):
        raise ValueError("a kept environment's path holds a newline or lies elsewhere")
    procs = " ".join(cgroup.procs_files) if cgroup else ""
    tmpfs = f"nosuid,nodev,mode=1777,size={sandbox.tmp_bytes}" if sandbox else ""
    binds = "\n".join(f"{s}\n{d}" for s, d in sandbox.read_only_binds) if sandbox else ""
    setup = SETUP.replace("$PRIVATE", " ".join(PRIVATE_DIRS) if sandbox else "")
    hidden = " ".join(sandbox.hidden_devices) if sandbox else ""
    fstab = sandbox.fstab if sandbox else ""
    queues = " ".join(mqueue_mounts()) if sandbox else ""
    work = "1" if sandbox and sandbox.work else ""
    covers = sandbox.covers if sandbox else ""
    envs = sandbox.envs if sandbox else ""
    kept = "\n".join(sandbox.envs_kept) if sandbox else ""
    agent = ""
    if sandbox and sandbox.keep_agent and not sandbox.fstab:
        agent = "\n".join("\n".join(k) for k in agent_kept())
    args = [procs, tmpfs, binds, hidden, fstab, queues, work, covers, envs, kept, agent]
    cmd = ["/bin/sh", "-c", setup, "flashnode-setup", *args, *cmd]
    if sandbox is not None:
        net = ["--net"] if sandbox.no_network else []
        cmd = ["unshare", "--mount", "--ipc", *net, "--propagation", "private", "--", *cmd]
    return cmd


GO_TIMEOUT_S = 30.0  # the longest the chain may take to read its script


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


class TaskProcess:
    """A started task: its main process, its group, its token, its cgroup and its output.

    ``launch``: a chain started ahead for it (else one is started here, in ``cwd``, ``cgroup``
    and ``sandbox``, as ``user``). ``workdir``: where the task starts, as it sees it (default
    ``cwd``). ``hold``: do not send the task its script yet (``go``): the caller first records
    ``identity()``. ``max_file_bytes``: the largest file the task may make
    (``env_script``)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        stdout: Path,
        stderr: Path,
        log_max_bytes: int,
        on_exit: Callable[[], None],
        cgroup: AttemptCgroup | None = None,
        user: TaskUser | None = None,
        sandbox: Sandbox | None = None,
        clock: Clock | None = None,
        launch: Launch | None = None,
        hold: bool = False,
        workdir: Path | None = None,
        max_file_bytes: int | None = None,
    ) -> None:
        # First: a script that cannot be made (what cannot be encoded) fails before any chain.
        script = env_script(env, argv, workdir or cwd, max_file_bytes)
        if launch is None:
            launch = Launch(cwd, cgroup, user, sandbox)
        self.token = env[OWNER_ENV]
        self.uid = launch.user.uid if launch.user else os.geteuid()
        # Without a cgroup, a child that drops the token and leaves the group is found only by
        # its uid: a slot's own user runs nothing but this slot's task, so all of its processes
        # are the task's (one agent per set of task users: README).
        self.whole_uid = launch.user is not None and launch.cgroup is None
        self._uid_filter = self.uid if self.whole_uid else None
        self.cgroup = launch.cgroup
        self._clock = clock or SystemClock()
        self._script: bytes | None = script
        self._popen = launch.popen
        self.pid = launch.pid
        self.start_time = launch.start_time
        self._ticks: dict[tuple[int, int], int] = {}
        self.exited = threading.Event()
        self.suspended = False
        self._on_exit = on_exit
        self._closing = threading.Event()
        self.stdout = Stream(CappedFile(stdout, log_max_bytes))
        self.stderr = Stream(CappedFile(stderr, log_max_bytes))
        self._fault = bytearray()  # what the chain said on its fault channel (FAULT_BYTES)
        self._fault_end = b""  # and its last bytes
        self._script_w, out_r, err_r, fault_r = launch.take()
        self._watcher = threading.Thread(
            target=self._watch, args=(out_r, err_r, fault_r), name=f"task-{self.pid}"
        )
        self._watcher.daemon = True
        self._watcher.start()
        if not hold:
            self.go()

    def go(self) -> None:
        """Send the task its script: from here on, the task's own code runs. A chain that ended
        before it read the whole script (its setup failed) runs nothing; its exit says why."""
        script, self._script = self._script, None
        if script is None:
            return
        fd = self._script_w
        try:
            os.set_blocking(fd, False)
            view, deadline = memoryview(script), self._clock.monotonic() + GO_TIMEOUT_S
            poller = select.poll()  # not select(): the agent may hold descriptors past 1023
            poller.register(fd, select.POLLOUT)
            while view and not self.exited.is_set() and self._clock.monotonic() < deadline:
                if poller.poll(200):
                    view = view[os.write(fd, view) :]
        except BrokenPipeError:
            pass
        finally:
            os.close(fd)

    def pids(self) -> set[int]:
        """The task's live processes now (its cgroup, else its group and token holders); each
        is also sampled for CPU time, for hosts without cgroup accounting."""
        found = self.cgroup.pids() if self.cgroup is not None else set(self.members())
        for pid in found:
            sample = cpu_ticks(pid)
            if sample is not None:
                key, ticks = (pid, sample[0]), sample[1]
                self._ticks[key] = max(ticks, self._ticks.get(key, 0))
        return found

    def cpu_seconds(self) -> float | None:
        """CPU time the task used so far: exact from its cgroup, else what sampling saw."""
        if self.cgroup is not None:
            exact = self.cgroup.cpu_seconds()
            if exact is not None:
                return exact
        if not self._ticks:
            return None
        return sum(self._ticks.values()) / CLOCK_TICKS

    def identity(self) -> dict[str, object]:
        """What a restarted agent needs to find this task's processes again."""
        return {
            "whole_uid": self.whole_uid,
            "pid": self.pid,
            "start_time": self.start_time,
            "token": self.token,
            "uid": self.uid,
            "cgroup": {k: str(v) for k, v in self.cgroup.paths.items()} if self.cgroup else None,
            "cgroup_version": self.cgroup.version if self.cgroup else None,
        }

    def _wait(self) -> None:
        self._popen.wait()
        self.exited.set()
        self._on_exit()

    @property
    def launched(self) -> bool:
        """Whether the chain reached the task's exec (said so on its fault channel); once the
        main process exited and ``close`` was called. False: no code of the task ever ran."""
        return self._fault_end == LAUNCHED

    def setup_failure(self) -> str:
        """Why the chain ended before the task's exec, from its fault channel: its last
        ``flashnode:`` line, with the first line a tool printed before it (what the tool said
        first is its error); "" when it said nothing. Control characters replaced."""
        lines = [
            "".join(c if c.isprintable() else "?" for c in line).strip()
            for line in bytes(self._fault).decode("utf-8", "replace").splitlines()
        ]
        lines = [line for line in lines if line]
        ours = [i for i, line in enumerate(lines) if line.startswith("flashnode: ")]
        if not ours:
            return lines[-1][:200] if lines else ""
        why = lines[ours[-1]][len("flashnode: ") :][:200]
        tools = [line for line in lines[: ours[-1]] if not line.startswith("flashnode: ")]
        return f"{why}: {tools[0][:200]}" if tools else why

    def _keep_fault(self, chunk: bytes) -> None:
        room = FAULT_BYTES - len(self._fault)
        if room > 0:
            self._fault += chunk[:room]
        self._fault_end = (self._fault_end + chunk)[-len(LAUNCHED) :]

    def _watch(self, out_fd: int, err_fd: int, fault_fd: int) -> None:
        """One thread per task: copy both pipes into their files until their writers close
        them, or, once ``close`` was called, until nothing more is there (a detached descendant
        holding a pipe never keeps the attempt waiting), and keep what the chain says on its
        fault channel; and see the main process exit, through a pidfd (where there is none, a
        thread of its own waits for it)."""
        streams: dict[int, CappedFile | None] = {
            out_fd: self.stdout.file,
            err_fd: self.stderr.file,
            fault_fd: None,
        }
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            threading.Thread(target=self._wait, name=f"wait-{self.pid}", daemon=True).start()
        poller = select.poll()
        for fd in [*streams, *([pidfd] if pidfd is not None else [])]:
            poller.register(fd, select.POLLIN)
        try:
            while streams or pidfd is not None:
                ready = [fd for fd, _ in poller.poll(200)]
                if not ready and self._closing.is_set() and pidfd is None:
                    return
                for fd in ready:
                    if fd != pidfd and fd not in streams:
                        continue
                    if fd == pidfd:
                        poller.unregister(pidfd)
                        os.close(pidfd)
                        pidfd = None
                        self._wait()
                        continue
                    chunk = os.read(fd, READ_CHUNK)
                    sink = streams[fd]
                    if chunk and sink is None:
                        self._keep_fault(chunk)
                    elif chunk and sink is not None:
                        sink.write(chunk)
                    else:
                        del streams[fd]
                        poller.unregister(fd)
                        os.close(fd)
        finally:
            for fd in [*streams, *([pidfd] if pidfd is not None else [])]:
                os.close(fd)
            self.stdout.file.close()
            self.stderr.file.close()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode if self.exited.is_set() else None

    def suspend(self) -> None:
        """Stop the task from running: its cgroup's freezer, else SIGSTOP to its group and every
        token holder, repeated until none of them runs (a process forked between two rounds is
        caught by the next). Raises OSError when the freezer cannot be written."""
        self.suspended = True
        if self.cgroup is not None and self.cgroup.can_freeze:
            self.cgroup.freeze()
            return
        deadline = self._clock.monotonic() + STOP_ROUNDS_S
        while self._clock.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGSTOP)
            running = [p for p in self.members() if _state(p) not in ("T", "t")]
            if not running:
                return
            for pid in running:
                signal_if_owned(pid, self.token, self.pid, signal.SIGSTOP, self._uid_filter)
            self._clock.sleep(0.01)

    def resume(self) -> None:
        """Let a suspended task run again (thaw its cgroup, SIGCONT its tree)."""
        if not self.suspended:
            return
        self.suspended = False
        if self.cgroup is not None:
            self.cgroup.thaw()
        self._signal_all(signal.SIGCONT)

    def terminate(self, grace: float) -> None:
        """SIGTERM to the group and every token holder, up to ``grace`` seconds for them to go,
        then SIGKILL until none is left. Idempotent. A suspended task is resumed first, so that
        it can act on SIGTERM; with no grace it is killed at once, suspended or not."""
        if grace <= 0:
            self.kill()
            return
        self.resume()
        if self._signal_all(signal.SIGTERM):
            deadline = self._clock.monotonic() + grace
            while self._clock.monotonic() < deadline and self._alive():
                self._clock.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL everything the task owns, repeating while something still answers: the
        group and everything in its cgroup; without a cgroup, the group and every token holder.
        A cgroup holds every process of the task (the chain joins it before the task runs, and
        no process of an unprivileged user can leave it), so a scan of /proc for the token
        would find nothing more there, at the cost of a look at every process on the host.
        A suspended task is killed before it is let run again: it runs no more of its code."""
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            self.cgroup.kill()  # thawed once killed
            self.resume()
        else:
            self._signal_all(signal.SIGKILL)  # a stopped process dies of it all the same
            self.resume()
            deadline = self._clock.monotonic() + KILL_ROUNDS_S
            while self._signal_all(signal.SIGKILL) and self._clock.monotonic() < deadline:
                self._clock.sleep(0.02)
        self._clock.wait(self.exited, KILL_ROUNDS_S)

    def close(self) -> None:
        if self._script is not None:  # never sent: the chain, if still there, runs nothing
            self._script = None
            with contextlib.suppress(OSError):
                os.close(self._script_w)
        self._closing.set()
        self._watcher.join(2.0)

    def _alive(self) -> bool:
        return not self.exited.is_set() or any(True for _ in self.members())

    def members(self) -> Iterator[int]:
        """Live (non-zombie) processes of the task: its group, and every token holder (every
        process of its user, when that user is the slot's own)."""
        return find_owned(self.token, self.uid, self.pid, self.whole_uid)

    def _signal_all(self, sig: signal.Signals) -> bool:
        """Signal the group and every token holder; True if anything alive was there."""
        with contextlib.suppress(OSError):
            os.killpg(self.pid, sig)
        hit = False
        for pid in self.members():
            hit = signal_if_owned(pid, self.token, self.pid, sig, self._uid_filter) or hit
        return hit


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()


def _state(pid: int) -> str | None:
    """The one-letter state of a pid (R, S, T, Z, ...), None when it is gone."""
    st = _stat(pid)
    return st[0] if st else None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a pid."""
    fields = _stat_fields(pid)
    return (fields[0].decode(), int(fields[2])) if fields else None


# The agent's own users (a root agent's; the package's sysusers file makes them), each for one
# purpose, so that nothing else on the host runs as them: ``BUILD_USER`` runs the builds of job
# environments (uv, and whatever a job's packages run while they are built), one build at a time;
# ``HELPER_USER`` runs the agent's own helpers (the module import check, the JSON Schema check),
# which no code of a job runs as: no leftover of a build or a task can signal, freeze or trace
# them.
BUILD_USER = "flashnode-build"
HELPER_USER = "flashnode-helper"
USERS_FIX = "run scripts/task-users as root (the package's sysusers file makes them)"


def own_user(name: str) -> TaskUser | None:
    """One of the agent's own users (``BUILD_USER``, ``HELPER_USER``) when the agent is root;
    None when it is not (it then runs as itself what it would run as that user). Raises
    LookupError, saying why, when that user is missing or is root."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise LookupError(f"the user {name} does not exist") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise LookupError(f"the user {name} is root or in root's group")
    return TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid)


def helper_user() -> TaskUser | None:
    """Who the agent's own helpers run as: ``own_user(HELPER_USER)``."""
    return own_user(HELPER_USER)


def processes_of(uid: int) -> list[int]:
    """Live (non-zombie) processes with ``uid`` among their real, effective, saved or file
    system uids, read from ``/proc/<pid>/status``: a process that made itself non-dumpable has
    a ``/proc/<pid>`` that root owns, but its status still names its uids."""
    found = []
    me = os.getpid()
    with contextlib.suppress(FileNotFoundError), os.scandir("/proc") as it:
        for entry in it:
            if entry.name.isdigit() and int(entry.name) != me and _runs_as(int(entry.name), uid):
                found.append(int(entry.name))
    return found


def _runs_as(pid: int, uid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            status = fh.read(8192)
    except OSError:
        return False
    fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
    state, uids = fields.get(b"State", b"").split(), fields.get(b"Uid", b"").split()
    if not state or state[0] in (b"Z", b"X"):
        return False
    return str(uid).encode() in uids


def end_processes_of(user: TaskUser, clock: Clock | None = None) -> list[int]:
    """SIGKILL every process of ``user`` (one of the agent's own users, which nothing else runs
    as), in rounds until none is left or ``KILL_ROUNDS_S`` have passed. Returns what is still
    there then (a process the kernel holds in uninterruptible sleep): empty when all are gone."""
    clock = clock or SystemClock()
    deadline = clock.monotonic() + KILL_ROUNDS_S
    while True:
        left = processes_of(user.uid)
        if not left or clock.monotonic() >= deadline:
            return left
        for pid in left:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _runs_as(pid, user.uid):  # checked once pinned: never a reused pid
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        clock.sleep(0.01)


def popen_as(
    argv: Sequence[str],
    env: Mapping[str, str],
    user: TaskUser | None,
    sandbox: Sandbox | None = None,
    cgroup: AttemptCgroup | None = None,
    rlimits: Sequence[str] = (),
    **kwargs: Any,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``user`` (None: as the agent's own user) with exactly ``env``, which no
    step that runs with the agent's privileges sees, in ``sandbox`` and ``cgroup`` if given,
    with ``rlimits`` (``command``). ``kwargs`` go to Popen."""
    env_fd = env_file(env, argv)
    try:
        return subprocess.Popen(
            command(cgroup, user, sandbox, rlimits=rlimits),
            env=PRIVILEGED_ENV,
            stdin=env_fd,
            **kwargs,
        )
    finally:
        os.close(env_fd)


def python_imports(python: str, modules: Sequence[str]) -> str | None:
    """None if ``python`` imports every module; else why not. Run as ``helper_user`` in a
    sandbox of its own (a root agent), bounded in time, its process group killed after."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    try:
        user = helper_user()
    except LookupError as exc:
        return str(exc)
    try:
        proc = popen_as(
            [python, "-I", "-c", code, *modules],
            {"PATH": SYSTEM_PATH},
            user,
            Sandbox(64 * 1024 * 1024, keep_agent=True) if user is not None else None,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "TimeoutExpired"
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
    except OSError as exc:
        return type(exc).__name__
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else f"exit code {proc.returncode}"
    return None


SCHEMA_CHECK_S = 30.0  # the longest a declared schema's check may take on the node


def json_schema_problem(schema: dict[str, Any], metrics: Any) -> str | None:
    """The coordinator's reason why ``metrics`` does not conform to the job's JSON Schema, or
    None (validators.SchemaCheck). Checked by the agent's own interpreter in a helper process
    (a root agent's in a sandbox of its own with no network, become ``helper_user`` before it
    reads the job's schema; at most 1 GiB and ``SCHEMA_CHECK_S``, its process group killed
    after): the schema is the job's, and it is resolved against nothing but itself
    (validators.SCHEMA_HELPER). A check that takes longer fails too (it would hold the
    coordinator as long). validators.Unchecked when it cannot tell."""
    try:
        user = helper_user()
    except LookupError as exc:
        raise validators.Unchecked(f"the schema check has no user to run as: {exc}") from None
    body = json.dumps({"schema": schema, "metrics": metrics}).encode()
    data = os.memfd_create("flashnode-schema-check")
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(data, view) :]
        os.lseek(data, 0, os.SEEK_SET)
        proc = popen_as(
            [
                sys.executable,
                "-I",
                "-c",
                validators.SCHEMA_HELPER,
                str(data),
                f"{user.uid}:{user.gid}" if user is not None else "",
            ],
            {"PATH": SYSTEM_PATH},
            None,
            Sandbox(64 * 1024 * 1024, no_network=True, keep_agent=True)
            if user is not None
            else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(data,),
            start_new_session=True,
        )
    except OSError as exc:
        raise validators.Unchecked(f"the schema check did not start ({exc.strerror})") from None
    finally:
        os.close(data)
    try:
        out, _ = proc.communicate(timeout=SCHEMA_CHECK_S)
    except subprocess.TimeoutExpired:
        return (
            "metrics.json could not be checked against the declared json_schema within"
            f" {SCHEMA_CHECK_S:g} s"
        )
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        verdict = json.loads(out)
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        raise validators.Unchecked(f"the schema check failed (exit code {proc.returncode})")
    if "unchecked" in verdict:
        raise validators.Unchecked(str(verdict["unchecked"]))
    reason = verdict.get("problem")
    return reason if isinstance(reason, str) else None


# --- kernel keyrings: no namespace holds them ------------------------------------------------

KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219}  # the keyctl syscall's number
SETRESUID = {"x86_64": 117, "aarch64": 147, "arm64": 147}  # the setresuid syscall's number
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_SETPERM, KEYCTL_CLEAR = 1, 5, 7
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
# Possessors (every task inherits the agent's session keyring) may view and search it, and
# nothing else: no task can leave a key in it for another.
SESSION_PERM = 0x01000000 | 0x08000000 | 0x00010000
# What the kernel gives a user's own keyrings (possessor all but setattr, user all): a task may
# have opened them to every user, and a clear does not touch permissions.
USER_KEYRING_PERM = 0x1F3F0000


def private_session_keyring() -> str | None:
    """Give this process (call it before any thread starts: threads inherit it) a new session
    keyring that the tasks it starts may not write to. None if done; else why not."""
    number = KEYCTL.get(os.uname().machine)
    if number is None:
        return f"no keyctl syscall number for {os.uname().machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, b"flashnode") < 0:
        errno = ctypes.get_errno()
        if errno in (1, 38):  # EPERM, ENOSYS: keyrings denied (the unit's filter), tasks' too
            return None
        return os.strerror(errno)
    if libc.syscall(number, KEYCTL_SETPERM, KEY_SPEC_SESSION_KEYRING, SESSION_PERM) < 0:
        return os.strerror(ctypes.get_errno())
    return None


def clear_user_keyrings(user: TaskUser) -> str | None:
    """Clear ``user``'s own keyrings (user and user-session: a slot's user is reused by every
    task of its slot, whoever sent it). None when done (or when keyrings are denied to every
    process here, the unit's filter); else why not.

    Without a process (a Python helper cost tens of milliseconds of CPU per task): the kernel
    finds a user's keyrings by the caller's real uid, and credentials belong to each thread, so
    a short-lived thread of the agent takes the user's real and effective uid with the raw
    ``setresuid`` (``os.setresuid`` would change every thread), clears, and ends; its
    credentials end with it. It keeps saved uid 0, so no process of the user may trace it (the
    kernel lets a process trace only a target whose real, effective and saved uids are all its
    own); call it once the user's processes are gone.

    The permissions go back to the kernel's first (a task may have opened its keyrings to every
    user: another slot's task could then leave keys there, or link them into its own keyrings
    and read what the slot's next task keeps there), then the keys go."""
    machine = os.uname().machine
    keyctl, setresuid = KEYCTL.get(machine), SETRESUID.get(machine)
    if keyctl is None or setresuid is None:
        return f"no keyctl or setresuid syscall number for {machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    why: list[str] = []

    def clear() -> None:
        if syscall(setresuid, user.uid, user.uid, 0) < 0:
            why.append(f"setresuid: {os.strerror(ctypes.get_errno())}")
            return
        for keyring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
            for op, args in ((KEYCTL_SETPERM, (USER_KEYRING_PERM,)), (KEYCTL_CLEAR, ())):
                if syscall(keyctl, op, keyring, *args) < 0:
                    errno = ctypes.get_errno()
                    if errno not in (1, 38):  # EPERM, ENOSYS: keyrings denied here to everyone
                        why.append(f"keyctl: {os.strerror(errno)}")

    thread = threading.Thread(target=clear, name=f"keyrings-{user.name}", daemon=True)
    thread.start()
    thread.join()
    return why[0] if why else None


def sandbox_works() -> str | None:
    """None if this process can give a task private namespaces and tmpfs mounts; else why not."""
    probe = "mount -t tmpfs -o nosuid,nodev,size=1m flashnode-probe /tmp"
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--ipc", "--propagation", "private", "/bin/sh", "-c", probe],
            capture_output=True,
            timeout=30,
            env=PRIVILEGED_ENV,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return type(exc).__name__
    if done.returncode != 0:
        return done.stderr.decode(errors="replace").strip()[:200] or f"exit {done.returncode}"
    return None


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(start time, user + system clock ticks) of one process, not counting its children."""
    fields = _stat_fields(pid)
    return (int(fields[19]), int(fields[11]) + int(fields[12])) if fields else None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, its identity."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def reap(identity: Mapping[str, object], clock: Clock | None = None) -> int:
    """Kill what an earlier run of the agent left of a task, from its recorded identity: every
    process carrying its token, the recorded main process if its start time still matches (a
    reused pid never does), and everything in its cgroup. Returns how many were signalled."""
    clock = clock or SystemClock()
    token, uid = identity.get("token"), identity.get("uid")
    pid, started = identity.get("pid"), identity.get("start_time")
    count = 0
    deadline = clock.monotonic() + KILL_ROUNDS_S
    while clock.monotonic() < deadline:
        hit = 0
        whole = identity.get("whole_uid") is True
        if isinstance(token, str) and isinstance(uid, int):
            for p in find_owned(token, uid, None, whole):
                hit += signal_if_owned(p, token, None, signal.SIGKILL, uid if whole else None)
        if isinstance(pid, int) and started is not None and start_time(pid) == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                hit += 1
        if not hit:
            break
        count += hit
        clock.sleep(0.02)
    return count


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            data = b"\0" + fh.read()
    except OSError:
        return False
    return needle in data


def _needle(token: str) -> bytes:
    return f"\0{OWNER_ENV}={token}\0".encode()


def _owned(pid: int, needle: bytes, pgid: int | None, uid: int | None = None) -> bool:
    """Live, and in the group, carrying the token, or (``uid`` given) running as that uid."""
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    if uid is not None:
        try:
            return os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            return False
    return (pgid is not None and st[1] == pgid) or _environ_has(pid, needle)


def find_owned(
    token: str, uid: int, pgid: int | None = None, whole_uid: bool = False
) -> Iterator[int]:
    """Pids of live processes of ``uid`` that carry the ownership token in their environment or
    belong to process group ``pgid``; with ``whole_uid`` (a slot's own user, which nothing but
    its task runs as), every live process of ``uid``: a child that dropped the token and left
    the group is found too, with or without a cgroup."""
    needle = _needle(token)
    me = os.getpid()
    with contextlib.suppress(FileNotFoundError), os.scandir("/proc") as it:
        for entry in it:
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if entry.stat().st_uid != uid:
                    continue
            except OSError:
                continue
            if _owned(int(entry.name), needle, pgid, uid if whole_uid else None):
                yield int(entry.name)


def signal_if_owned(
    pid: int,
    token: str,
    pgid: int | None,
    sig: signal.Signals,
    uid: int | None = None,
) -> bool:
    """Signal ``pid`` only if it still belongs to the task (``uid``: every process of that
    dedicated uid does), pinning its identity with a pidfd first so that a reused pid is never
    touched."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not _owned(pid, _needle(token), pgid, uid):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
