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
The task's own environment is applied by the last step, a shell already running as the task's
user, which reads it from a sealed memory file and then execs the task. So no payload variable
(``LD_PRELOAD``, ``LD_LIBRARY_PATH``, ...) ever reaches a privileged process.

Termination is TERM → grace → KILL over the group, the token holders and the cgroup, repeated
until nothing of the task is left, on an injected clock. Output goes through pipes to reader
threads that keep a size-capped head and a short tail on disk; the attempt never waits for a pipe
held open by a detached descendant: it ends when the main process exits.

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
import logging
import os
import pwd
import secrets
import select
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnode.cgroups import AttemptCgroup
from flashnode.clock import Clock, SystemClock
from flashnode.logcap import CappedFile, Pump

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
# World-writable places a task could leave things in for later tasks of its user: each its own
# empty tmpfs in the task's mount namespace (those that exist), plus the POSIX message queues of
# its own IPC namespace.
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


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
    read_only_binds: tuple[tuple[str, str], ...] = field(default=())  # (host path, target)
    hidden_devices: tuple[str, ...] = field(default=())  # device files the task sees as /dev/null


class Capture:
    """Copies a pipe into a size-capped file (logcap.Pump) until its writers close it, or, once
    ``close`` is called, until what is already there was read: a detached descendant holding
    the pipe open never keeps the attempt waiting."""

    def __init__(self, fd: int, path: Path, cap: int) -> None:
        self._fd = fd
        self._stop = threading.Event()
        self._pump = Pump(self._chunks(), path, cap, f"capture-{path.name}")

    @property
    def tail(self) -> bytes:
        return self._pump.tail

    @property
    def file(self) -> CappedFile:
        return self._pump.file

    def _chunks(self) -> Iterator[bytes]:
        try:
            while True:
                ready, _, _ = select.select([self._fd], [], [], 0.2)
                if not ready:
                    if self._stop.is_set():
                        return
                    continue
                chunk = os.read(self._fd, READ_CHUNK)
                if not chunk:
                    return
                yield chunk
        finally:
            os.close(self._fd)

    def close(self, timeout: float = 2.0) -> None:
        """Stop reading (after draining what is already there) and wait for the file."""
        self._stop.set()
        self._pump.join(timeout)


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def env_script(env: Mapping[str, str]) -> bytes:
    """A shell script that exports exactly ``env`` (names are checked by the wire parser)."""
    return "".join(f"export {k}={_quote(v)}\n" for k, v in env.items()).encode()


def env_file(env: Mapping[str, str]) -> int:
    """A memory file holding ``env_script(env)``, at offset 0: the task's last step reads it."""
    fd = os.memfd_create("flashnode-task-env")
    try:
        os.write(fd, env_script(env))
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


# As root, in the new namespaces: join the cgroup ($1: its cgroup.procs files), make the private
# directories ($2: tmpfs options; the workspace, the current directory, is bound back in at its
# path if it lived under one of them), bind the read-only views ($3: lines, a source then its
# target, so that paths may hold spaces), run the rest.
SETUP = r"""
fail() { echo "flashnode: $*" >&2; exit 125; }
for f in $1; do echo $$ > "$f" || fail "cannot join cgroup $f"; done
ws=$(pwd -P)
for d in $PRIVATE; do
  [ -d "$d" ] || continue
  mount -t tmpfs -o "$2" flashnode-private "$d" || fail "cannot mount $d"
  case "$ws/" in "$d"/*)
    (umask 022; mkdir -p "$ws") && mount --no-canonicalize --bind . "$ws" && cd "$ws" \
      || fail "cannot keep the workspace under $d";;
  esac
done
if [ -n "$2" ]; then  # every mount of the host's message queues: this namespace's instead
  for q in $(awk '$3 == "mqueue" { print $2 }' /proc/self/mounts); do
    mount -t mqueue -o nosuid,nodev,noexec flashnode-mqueue "$q" || fail "cannot mount $q"
  done
fi
printf '%s\n' "$3" | while IFS= read -r src && IFS= read -r dst; do
  mount --bind "$src" "$dst" && mount -o remount,bind,ro,nosuid,nodev "$dst" \
    || fail "cannot mount $dst read-only"
done || exit 125
for dev in $4; do mount --bind /dev/null "$dev" || fail "cannot hide $dev"; done
shift 4
exec "$@"
"""
# As the task's user: take the task's environment from the memory file on stdin, then run the
# task with stdin from /dev/null.
APPLY_ENV = '. /dev/stdin || exit 125; exec "$@" </dev/null'


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
    argv: Sequence[str],
    cgroup: AttemptCgroup | None,
    user: TaskUser | None,
    sandbox: Sandbox | None,
) -> list[str]:
    """The command line that starts ``argv`` in ``cgroup``, in ``sandbox``, as ``user``, with
    the environment read from stdin (``env_file``)."""
    cmd = ["/bin/sh", "-c", APPLY_ENV, "flashnode-task", *argv]
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
    if cgroup is None and sandbox is None:
        return cmd
    if sandbox and any("\n" in p for bind in sandbox.read_only_binds for p in bind):
        raise ValueError("a read-only view's path holds a newline")
    procs = " ".join(cgroup.procs_files) if cgroup else ""
    tmpfs = f"nosuid,nodev,mode=1777,size={sandbox.tmp_bytes}" if sandbox else ""
    binds = "\n".join(f"{s}\n{d}" for s, d in sandbox.read_only_binds) if sandbox else ""
    setup = SETUP.replace("$PRIVATE", " ".join(PRIVATE_DIRS) if sandbox else "")
    hidden = " ".join(sandbox.hidden_devices) if sandbox else ""
    cmd = ["/bin/sh", "-c", setup, "flashnode-setup", procs, tmpfs, binds, hidden, *cmd]
    if sandbox is not None:
        cmd = ["unshare", "--mount", "--ipc", "--propagation", "private", "--", *cmd]
    return cmd


class TaskProcess:
    """A started task: its main process, its group, its token, its cgroup and its output."""

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
    ) -> None:
        self.token = env[OWNER_ENV]
        self.uid = user.uid if user else os.geteuid()
        # Without a cgroup, a child that drops the token and leaves the group is found only by
        # its uid: a slot's own user runs nothing but this slot's task, so all of its processes
        # are the task's (one agent per set of task users: README).
        self.whole_uid = user is not None and cgroup is None
        self._uid_filter = self.uid if self.whole_uid else None
        self.cgroup = cgroup
        self._clock = clock or SystemClock()
        env_fd = env_file(env)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._popen = subprocess.Popen(
                command(argv, cgroup, user, sandbox),
                env=PRIVILEGED_ENV,
                cwd=cwd,
                stdin=env_fd,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
                close_fds=True,
                umask=0o077,
            )
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (env_fd, out_w, err_w):
                os.close(fd)
        self.pid = self._popen.pid
        self.start_time = start_time(self.pid)
        self._ticks: dict[tuple[int, int], int] = {}
        self.exited = threading.Event()
        self.suspended = False
        self._on_exit = on_exit
        self.stdout = Capture(out_r, stdout, log_max_bytes)
        self.stderr = Capture(err_r, stderr, log_max_bytes)
        threading.Thread(target=self._wait, name=f"wait-{self.pid}", daemon=True).start()

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
        it can act on SIGTERM."""
        self.resume()
        if self._signal_all(signal.SIGTERM):
            deadline = self._clock.monotonic() + grace
            while self._clock.monotonic() < deadline and self._alive():
                self._clock.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL everything the task owns, repeating while something still answers: the
        group, every token holder, then everything in its cgroup."""
        self.resume()
        deadline = self._clock.monotonic() + KILL_ROUNDS_S
        while self._signal_all(signal.SIGKILL) and self._clock.monotonic() < deadline:
            self._clock.sleep(0.02)
        if self.cgroup is not None:
            self.cgroup.kill()
        self._clock.wait(self.exited, KILL_ROUNDS_S)

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()

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


def helper_user() -> TaskUser | None:
    """Who the agent's own helpers run as when the agent is root (the module import check, a
    job environment's source build): ``nobody``, whom no task runs as, so that no task can
    reach into them (a slot's task could trace or rewrite a process of its own uid)."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        return TaskUser("nobody", 65534, 65534)
    return TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid)


def popen_as(
    argv: Sequence[str],
    env: Mapping[str, str],
    user: TaskUser | None,
    sandbox: Sandbox | None = None,
    **kwargs: Any,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``user`` (None: as the agent's own user) with exactly ``env``, which no
    step that runs with the agent's privileges sees, in ``sandbox`` if given. ``kwargs`` go to
    Popen."""
    env_fd = env_file(env)
    try:
        return subprocess.Popen(
            command(argv, None, user, sandbox), env=PRIVILEGED_ENV, stdin=env_fd, **kwargs
        )
    finally:
        os.close(env_fd)


def python_imports(python: str, modules: Sequence[str]) -> str | None:
    """None if ``python`` imports every module; else why not. Run as ``helper_user`` in a
    sandbox of its own (a root agent), bounded in time, its process group killed after."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    user = helper_user()
    try:
        proc = popen_as(
            [python, "-I", "-c", code, *modules],
            {"PATH": SYSTEM_PATH},
            user,
            Sandbox(64 * 1024 * 1024) if user is not None else None,
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


# --- kernel keyrings: no namespace holds them ------------------------------------------------

KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219}  # the keyctl syscall's number
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_SETPERM, KEYCTL_CLEAR = 1, 5, 7
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
# Possessors (every task inherits the agent's session keyring) may view and search it, and
# nothing else: no task can leave a key in it for another.
SESSION_PERM = 0x01000000 | 0x08000000 | 0x00010000
CLEAR_USER_KEYRINGS = (
    "import ctypes, sys; c = ctypes.CDLL(None)\n"
    "for k in (-4, -5): c.syscall(int(sys.argv[1]), 7, k)"
)


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


def clear_user_keyrings(user: TaskUser) -> subprocess.Popen[bytes] | None:
    """Start clearing ``user``'s own keyrings (user and user-session: a slot's user is reused by
    every task of its slot, whoever sent it). None where it cannot be done."""
    number = KEYCTL.get(os.uname().machine)
    python = shutil.which("python3", path=SYSTEM_PATH)
    if number is None or python is None:
        return None
    try:
        return popen_as(
            [python, "-I", "-S", "-c", CLEAR_USER_KEYRINGS, str(number)],
            {"PATH": SYSTEM_PATH},
            user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None


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
