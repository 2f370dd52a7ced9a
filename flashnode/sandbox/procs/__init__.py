"""Process-tree ownership for trusted tasks: the package that starts and signals their processes.

A task's processes belong to its attempt until the attempt ends, including children that leave
the process group (``setsid``, double fork) to escape. Each task gets:

* its own session and process group (signals go to the whole group);
* a random ownership token in its environment (``FLASHNODE_OWNER``), so that a scan of
  ``/proc/*/environ`` finds every descendant of the task's user even after it detached;
* when the agent is root: its own user (``TaskUser``, one per slot), its cgroup, and its own
  mount and IPC namespaces with private ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (tmpfs, nosuid,
  nodev), so nothing it leaves there outlives it.

The package's parts: ``mounts`` (the ``Sandbox`` and its mount tables), ``chain`` (the command
line of the launch chain, its setup script and the task's environment script), ``launch`` (a
chain started and waiting for its script), ``task`` (a started task: its output, suspension and
termination), ``helpers`` (processes the agent runs for itself as its helper user), and
``keyrings`` (the kernel keyrings no namespace holds).

This module is what they all stand on: who a process runs as (``TaskUser``; the agent's own
users, ``BUILD_USER`` and ``HELPER_USER``, and ending every process of one), and which processes
are a task's (the ownership scan: its group, its token, its uid) and signalling them only while
they are, pinned by a pidfd; ``reap`` ends what an earlier run of the agent left of a task.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from flashnode.clock import Clock, SystemClock

OWNER_ENV = "FLASHNODE_OWNER"
KILL_ROUNDS_S = 5.0


def new_token() -> str:
    return secrets.token_hex(16)


@dataclass(frozen=True)
class TaskUser:
    """The unprivileged user a trusted task runs as when the agent is root (one per slot)."""

    name: str
    uid: int
    gid: int


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()


def process_state(pid: int) -> str | None:
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
