"""Process-tree ownership for trusted tasks: the only module that starts or signals processes.

A task's processes belong to its attempt until the attempt ends, including children that leave
the process group (``setsid``, double fork) to escape. Each task gets:

* its own session and process group (signals go to the whole group);
* a random ownership token in its environment (``FLASHNODE_OWNER``), so that a scan of
  ``/proc/*/environ`` finds every descendant of the task's user even after it detached.

Termination is TERM → grace → KILL over both, repeated until nothing carrying the token is left.
Output goes through pipes to reader threads that keep a size-capped head and a short tail on disk;
the attempt never waits for a pipe held open by a detached descendant: it ends when the main
process exits, and its leftovers are then killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashnode.cgroups import AttemptCgroup
from flashnode.logcap import CappedFile

log = logging.getLogger(__name__)

OWNER_ENV = "FLASHNODE_OWNER"
READ_CHUNK = 64 * 1024
KILL_ROUNDS_S = 5.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def new_token() -> str:
    return secrets.token_hex(16)


class Capture:
    """Copies a pipe into a size-capped file (logcap.CappedFile) on its own thread."""

    def __init__(self, fd: int, path: Path, cap: int) -> None:
        self._fd = fd
        self._file = CappedFile(path, cap)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"capture-{path.name}", daemon=True)
        self._thread.start()

    @property
    def tail(self) -> bytes:
        return self._file.tail

    def _run(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self._fd], [], [], 0.2)
                if not ready:
                    if self._stop.is_set():
                        break
                    continue
                chunk = os.read(self._fd, READ_CHUNK)
                if not chunk:
                    break
                self._file.write(chunk)
        finally:
            os.close(self._fd)
            self._file.close()

    def close(self, timeout: float = 2.0) -> None:
        """Stop reading (after draining what is already there) and wait for the file."""
        self._stop.set()
        self._thread.join(timeout)


@dataclass(frozen=True)
class TaskUser:
    """The unprivileged user trusted tasks run as when the agent is root."""

    name: str
    uid: int
    gid: int


# Joins the attempt's cgroup in every hierarchy before the task's first instruction, so that not
# even its first fork escapes: $1 holds the cgroup.procs files, the rest is the command.
CGROUP_TRAMPOLINE = (
    'for f in $1; do echo $$ > "$f" || { echo "flashnode: cannot join cgroup $f" >&2; exit 125; };'
    ' done; shift; exec "$@"'
)


def command(argv: Sequence[str], cgroup: AttemptCgroup | None, user: TaskUser | None) -> list[str]:
    """The command line that starts ``argv`` in ``cgroup`` as ``user``."""
    cmd = list(argv)
    if user is not None:
        # setpriv drops to the task user with no supplementary groups and no_new_privs set, so
        # no setuid binary can raise the task's privileges again.
        cmd = [
            "setpriv",
            f"--reuid={user.uid}",
            f"--regid={user.gid}",
            "--clear-groups",
            "--no-new-privs",
            "--",
            *cmd,
        ]
    if cgroup is not None:
        cmd = [
            "/bin/sh",
            "-c",
            CGROUP_TRAMPOLINE,
            "flashnode-task",
            " ".join(cgroup.procs_files),
            *cmd,
        ]
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
    ) -> None:
        self.token = env[OWNER_ENV]
        self.uid = user.uid if user else os.geteuid()
        self.cgroup = cgroup
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._popen = subprocess.Popen(
                command(argv, cgroup, user),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
                close_fds=True,
                umask=0o077,
            )
        except BaseException:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        os.close(out_w)
        os.close(err_w)
        self.pid = self._popen.pid
        self.start_time = start_time(self.pid)
        self._ticks: dict[tuple[int, int], int] = {}
        self.exited = threading.Event()
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

    def terminate(self, grace: float) -> None:
        """SIGTERM to the group and every token holder, up to ``grace`` seconds for them to go,
        then SIGKILL until none is left. Idempotent."""
        if self._signal_all(signal.SIGTERM):
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self._alive():
                time.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        """SIGKILL everything the task owns, repeating while something still answers: the
        group, every token holder, then everything in its cgroup."""
        deadline = time.monotonic() + KILL_ROUNDS_S
        while self._signal_all(signal.SIGKILL) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.cgroup is not None:
            self.cgroup.kill()
        self.exited.wait(KILL_ROUNDS_S)

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()

    def _alive(self) -> bool:
        return not self.exited.is_set() or any(True for _ in self.members())

    def members(self) -> Iterator[int]:
        """Live (non-zombie) processes of the task: its group, and every token holder."""
        return find_owned(self.token, self.uid, self.pid)

    def _signal_all(self, sig: signal.Signals) -> bool:
        """Signal the group and every token holder; True if anything alive was there."""
        with contextlib.suppress(OSError):
            os.killpg(self.pid, sig)
        hit = False
        for pid in self.members():
            hit = signal_if_owned(pid, self.token, self.pid, sig) or hit
        return hit


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a pid."""
    fields = _stat_fields(pid)
    return (fields[0].decode(), int(fields[2])) if fields else None


def python_imports(python: str, modules: Sequence[str], user: TaskUser | None) -> str | None:
    """None if ``python`` (run as ``user``) imports every module; else why not."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    cmd = command([python, "-c", code, *modules], None, user)
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=120, env={"PATH": os.defpath})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return type(exc).__name__
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else f"exit code {done.returncode}"
    return None


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(start time, user + system clock ticks) of one process, not counting its children."""
    fields = _stat_fields(pid)
    return (int(fields[19]), int(fields[11]) + int(fields[12])) if fields else None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, its identity."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def reap(identity: Mapping[str, object]) -> int:
    """Kill what an earlier run of the agent left of a task, from its recorded identity: every
    process carrying its token, the recorded main process if its start time still matches (a
    reused pid never does), and everything in its cgroup. Returns how many were signalled."""
    token, uid = identity.get("token"), identity.get("uid")
    pid, started = identity.get("pid"), identity.get("start_time")
    count = 0
    deadline = time.monotonic() + KILL_ROUNDS_S
    while time.monotonic() < deadline:
        hit = 0
        if isinstance(token, str) and isinstance(uid, int):
            for p in find_owned(token, uid):
                hit += signal_if_owned(p, token, None, signal.SIGKILL)
        if isinstance(pid, int) and started is not None and start_time(pid) == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                hit += 1
        if not hit:
            break
        count += hit
        time.sleep(0.02)
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


def _owned(pid: int, needle: bytes, pgid: int | None) -> bool:
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return (pgid is not None and st[1] == pgid) or _environ_has(pid, needle)


def find_owned(token: str, uid: int, pgid: int | None = None) -> Iterator[int]:
    """Pids of live processes of ``uid`` that carry the ownership token in their environment or
    belong to process group ``pgid``."""
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
            if _owned(int(entry.name), needle, pgid):
                yield int(entry.name)


def signal_if_owned(pid: int, token: str, pgid: int | None, sig: signal.Signals) -> bool:
    """Signal ``pid`` only if it still belongs to the task, pinning its identity with a pidfd
    first so that a reused pid is never touched."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not _owned(pid, _needle(token), pgid):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
