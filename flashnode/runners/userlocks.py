"""Task users belong to one agent: each agent holds an exclusive lock (``flock``) on every task
user it runs tasks as, for its whole life, in ``LOCK_DIR`` (one directory for the machine,
whatever each agent's state dir): two agents never run tasks of different jobs under one uid,
where they could signal and read each other.

Locks are the uids' (``uid-<N>.lock``): two names of one uid are one user. An agent takes the
first ``task_user``-N users (N from 0) that exist and that no other agent
holds, as many as it has slots; so a second agent with the same ``task_user`` runs as users
the first does not hold, and one that finds too few free refuses to start (``UsersHeld``),
naming the holders and the way out (more users, or ``task_user`` naming a set of its own).

``LOCK_DIR`` is root's alone (0700): whoever could open a lock file could hold a user from
every agent. Lock files are opened close-on-exec (no task inherits one) and never removed (a
file removed while locked would let a second agent lock a new one of the same name); the kernel
drops a lock when its agent's process ends, however it ends. The packaged unit keeps the
directory writable (``RuntimeDirectory=``, preserved across restarts).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import stat
from pathlib import Path

from flashnode.errors import ConfigError, PrerequisiteError
from flashnode.sandbox import procs

LOCK_DIR = Path("/run/flashnode-task-users")
MAX_USERS = 64  # task_user-0 .. task_user-63 are looked at


class UsersHeld(PrerequisiteError):
    """Too few of the task users are free: other agents hold them."""


class UserLocks:
    """The task users this agent holds, slot by slot, and their locks."""

    def __init__(self, task_user: str, lock_dir: Path = LOCK_DIR) -> None:
        self.task_user = task_user
        self.lock_dir = lock_dir
        self.users: list[procs.TaskUser] = []
        self._fds: list[int] = []

    def take(self, slots: int, state_dir: Path) -> list[procs.TaskUser]:
        """Hold users until there is one for each of ``slots`` slots (those held already kept);
        the users, slot by slot. UsersHeld when other agents hold too many of them; ConfigError
        when none of them is fit to run tasks (missing, root)."""
        dir_fd = self._open_dir()
        held: list[str] = []
        try:
            for n in range(MAX_USERS):
                if len(self.users) >= slots:
                    break
                name = f"{self.task_user}-{n}"
                if any(u.name == name for u in self.users):
                    continue
                try:
                    pw = pwd.getpwnam(name)
                except KeyError:
                    continue
                if pw.pw_uid == 0 or pw.pw_gid == 0:
                    raise ConfigError(f"task user {name!r} is root or in group root")
                if any(u.uid == pw.pw_uid or u.gid == pw.pw_gid for u in self.users):
                    # A shared uid or group would let one slot's task read another's workspace.
                    raise ConfigError(
                        f"the {self.task_user}-N task users must have distinct uids and groups"
                    )
                holder = self._lock(dir_fd, f"uid-{pw.pw_uid}", state_dir)
                if holder is not None:
                    held.append(f"{name} ({holder})")
                    continue
                self.users.append(procs.TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid))
        finally:
            os.close(dir_fd)
        if len(self.users) < slots:
            if not held:
                raise ConfigError(
                    f"task user {self.task_user}-{len(self.users)} (for slot {len(self.users)})"
                    " does not exist"
                )
            raise UsersHeld(
                f"{slots} task users are needed and only {len(self.users)} of"
                f" {self.task_user}-N are free: other agents hold {', '.join(held[:4])}"
                f"{' …' if len(held) > 4 else ''}. Stop that agent first, or give this one task"
                f" users of its own: make them (for i in $(seq 0 {slots - 1}); do useradd"
                f" --system --user-group --no-create-home {self.task_user}-x-$i; done) and set"
                f' task_user = "{self.task_user}-x"'
            )
        return self.users[:slots]

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        self.users = []

    def _open_dir(self) -> int:
        """``LOCK_DIR``, made root's and 0700 when missing; refused when anyone else could
        write to it or it is not a real directory."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.lock_dir, 0o700)
        try:
            fd = os.open(self.lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise PrerequisiteError(
                f"cannot open {self.lock_dir}, where agents lock their task users: {exc.strerror}"
            ) from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise PrerequisiteError(
                f"{self.lock_dir}, where agents lock their task users, is not root's alone"
                f" (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): anyone who can"
                f" write there can hold the task users; sudo chown root: {self.lock_dir} &&"
                f" sudo chmod 700 {self.lock_dir}"
            )
        return fd

    def _lock(self, dir_fd: int, name: str, state_dir: Path) -> str | None:
        """Lock the file ``name`` (a uid's: two names of one uid are one user): None when this
        agent holds it now, else who does."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(f"{name}.lock", flags, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
            return _holder(text)[1]
        data = f"{os.getpid()}\n{state_dir}\n".encode()
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        self._fds.append(fd)
        return None


def _holder(text: str) -> tuple[str, str]:
    """What the holder of a lock wrote in it (its pid, its state dir): its state dir, and who
    it is in the owner's words."""
    from flashnode.owner.statelock import systemd_unit

    lines = text.splitlines()
    pid = lines[0] if lines and lines[0].isdigit() else ""
    where = lines[1] if len(lines) > 1 else ""
    who = f"the agent of pid {pid}" if pid else "another agent"
    unit = systemd_unit(int(pid)) if pid else None
    if unit:
        who += f", systemd unit {unit}"
    if where:
        who += f", state dir {where}"
    return where, who


def held_elsewhere(task_user: str, state_dir: Path, lock_dir: Path = LOCK_DIR) -> list[str]:
    """The ``task_user``-N users that agents of other state dirs hold now, each with its holder
    (for ``doctor``: nothing is held longer than a look)."""
    found: list[str] = []
    try:
        dir_fd = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return found  # no agent has locked a user since the machine started
    try:
        for n in range(MAX_USERS):
            name = f"{task_user}-{n}"
            try:
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(f"uid-{pwd.getpwnam(name).pw_uid}.lock", flags, dir_fd=dir_fd)
            except (KeyError, OSError):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                where, who = _holder(os.pread(fd, 4096, 0).decode("utf-8", "replace").strip())
                if where != str(state_dir):
                    found.append(f"{name} ({who})")
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return found
