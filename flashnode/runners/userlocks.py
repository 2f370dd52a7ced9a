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
drops a lock when its agent's process ends, however it ends, and the supervisors of its tasks
(which keep the lock of their task's user open while the task runs on after a restart: no other
agent takes a user a task still runs as). Each slot gets the user it had in the state dir's last
run (``<state dir>/task-users``) where it can: a task of that run rejoined runs as it, and its
lock, held by the task's supervisor, is this agent's again once the task has ended. The
packaged unit keeps the directory writable (``RuntimeDirectory=``, preserved across restarts).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from flashnode import statefile
from flashnode.errors import ConfigError, PrerequisiteError
from flashnode.owner.status import agent_alive
from flashnode.sandbox import procs

LOCK_DIR = Path("/run/flashnode-task-users")
ASSIGNMENT = "task-users"  # <state dir>/task-users: each slot's user in the last run, a line each
RELOCK_S = 10.0  # the longest a borrowed user's lock is waited for once its task has ended
MAX_USERS = 64  # task_user-0 .. task_user-63 are looked at


class UsersHeld(PrerequisiteError):
    """Too few of the task users are free: other agents hold them."""


class UserLocks:
    """The task users this agent holds, slot by slot, and their locks."""

    def __init__(self, task_user: str, lock_dir: Path = LOCK_DIR) -> None:
        self.task_user = task_user
        self.lock_dir = lock_dir
        self.users: list[procs.TaskUser] = []
        self._fds: dict[int, int] = {}  # uid -> the lock this agent holds
        # Users whose lock a task of this state dir's earlier run still holds (its supervisor):
        # this agent's again once that task has ended (``relock``).
        self._borrowed: set[int] = set()
        self._state_dir = ""  # the state dir the locks name (``take``)
        self._state_id = ""  # ... and which directory it is (its device and inode)

    def take(self, slots: int, state_dir: Path) -> list[procs.TaskUser]:
        """Hold users until there is one for each of ``slots`` slots (those held already kept);
        the users, slot by slot. Each slot gets the user it had in this state dir's last run
        when it can (a task of that run may still be running as it, to be rejoined: its
        supervisor holds the lock then, and it is this agent's), else the first free one.
        UsersHeld when other agents hold too many of them; ConfigError when none of them is
        fit to run tasks (missing, root)."""
        dir_fd = self._open_dir()
        held: list[str] = []
        by_slot: list[procs.TaskUser | None] = [*self.users[:slots]]
        by_slot += [None] * (slots - len(by_slot))
        try:
            wanted = _assignment(state_dir)
            ours = re.compile(rf"{re.escape(self.task_user)}-[0-9]+")
            for slot in range(len(self.users), slots):
                if slot < len(wanted) and ours.fullmatch(wanted[slot]):
                    by_slot[slot] = self._take(dir_fd, wanted[slot], by_slot, state_dir, [], True)
            for slot in range(slots):
                for n in range(MAX_USERS):
                    if by_slot[slot] is not None:
                        break
                    name = f"{self.task_user}-{n}"
                    if any(u is not None and u.name == name for u in by_slot):
                        continue
                    by_slot[slot] = self._take(dir_fd, name, by_slot, state_dir, held, False)
        finally:
            os.close(dir_fd)
        self.users = [u for u in by_slot if u is not None]
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
                f' task_user = "{self.task_user}-x" under [trusted]'
            )
        names = "".join(f"{u.name}\n" for u in self.users).encode()
        with contextlib.suppress(OSError):  # the next run's slots get the same users
            statefile.write(state_dir / ASSIGNMENT, names)
        return self.users

    def _take(
        self,
        dir_fd: int,
        name: str,
        taken: list[procs.TaskUser | None],
        state_dir: Path,
        held: list[str],
        borrow: bool,
    ) -> procs.TaskUser | None:
        """``name`` held for this agent (``borrow``: or already held by this state dir's earlier
        run), or None: missing, or another agent holds it (then added to ``held``)."""
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            return None
        if pw.pw_uid == 0 or pw.pw_gid == 0:
            raise ConfigError(f"task user {name!r} is root or in group root")
        if any(u is not None and (u.uid == pw.pw_uid or u.gid == pw.pw_gid) for u in taken):
            # A shared uid or group would let one slot's task read another's workspace.
            raise ConfigError(
                f"the {self.task_user}-N task users must have distinct uids and groups"
            )
        holder = self._lock(dir_fd, f"uid-{pw.pw_uid}", state_dir)
        if holder is not None:
            # This state dir's (the same directory, not just its name) earlier run, which is
            # gone (this agent holds the state dir's lock): the lock is a supervisor's.
            if (
                borrow
                and self._state_id
                and holder.state == self._state_id
                and not agent_alive(holder.pid)
            ):
                self._borrowed.add(pw.pw_uid)
                return procs.TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid)
            held.append(f"{name} ({holder.who})")
            return None
        return procs.TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid)

    def borrowed(self, user: procs.TaskUser) -> bool:
        """Whether a task of this state dir's earlier run still holds ``user`` (``relock``)."""
        return user.uid in self._borrowed

    def replace(self, slot: int) -> procs.TaskUser | None:
        """Another free user for ``slot`` (its own was taken by another agent); None when none
        is free."""
        dir_fd = self._open_dir()
        try:
            for n in range(MAX_USERS):
                name = f"{self.task_user}-{n}"
                if any(u.name == name for u in self.users):
                    continue
                others = [u for i, u in enumerate(self.users) if i != slot]
                user = self._take(dir_fd, name, [*others], Path(self._state_dir), [], False)
                if user is not None:
                    self.users[slot] = user
                    return user
        finally:
            os.close(dir_fd)
        return None

    def fd_of(self, user: procs.TaskUser) -> int | None:
        """The lock this agent holds on ``user`` (a task's supervisor holds it too, for as long
        as the task runs); None for a user it borrows."""
        return self._fds.get(user.uid)

    def relock(self, user: procs.TaskUser, timeout: float = RELOCK_S) -> bool:
        """Hold ``user`` again once the task of the earlier run that held it has ended (its
        supervisor lets go of the lock as it exits); False when another agent took it first."""
        if user.uid not in self._borrowed:
            return True
        deadline = time.monotonic() + timeout
        while True:
            dir_fd = self._open_dir()
            try:
                holder = self._lock(dir_fd, f"uid-{user.uid}", Path(self._state_dir))
            finally:
                os.close(dir_fd)
            if holder is None:
                self._borrowed.discard(user.uid)
                return True
            if time.monotonic() >= deadline or holder.state != self._state_id:
                return False
            time.sleep(0.05)

    def release(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}
        self._borrowed = set()
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

    def _lock(self, dir_fd: int, name: str, state_dir: Path) -> Holder | None:
        """Lock the file ``name`` (a uid's: two names of one uid are one user): None when this
        agent holds it now, else who does."""
        self._state_dir, self._state_id = str(state_dir), _state_id(state_dir)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(f"{name}.lock", flags, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
            return _holder(text)
        data = f"{os.getpid()}\n{state_dir}\n{self._state_id}\n".encode()
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        self._fds[int(name.removeprefix("uid-"))] = fd
        return None


@dataclass(frozen=True)
class Holder:
    """Who holds a task user's lock, as it wrote: its pid (0: unknown), its state dir, which
    directory that is (device and inode), and its words for the owner."""

    pid: int
    where: str
    state: str
    who: str


def _state_id(state_dir: Path) -> str:
    try:
        st = os.stat(state_dir)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def _holder(text: str) -> Holder:
    """What the holder of a lock wrote in it (its pid, its state dir and that directory's
    identity), and who it is in the owner's words."""
    from flashnode.owner.statelock import systemd_unit

    lines = text.splitlines()
    pid = lines[0] if lines and lines[0].isdigit() else ""
    where = lines[1] if len(lines) > 1 else ""
    state = lines[2] if len(lines) > 2 else ""
    who = f"the agent of pid {pid}" if pid else "another agent"
    unit = systemd_unit(int(pid)) if pid else None
    if unit:
        who += f", systemd unit {unit}"
    if where:
        who += f", state dir {where}"
    return Holder(int(pid) if pid else 0, where, state, who)


def _assignment(state_dir: Path) -> list[str]:
    """Each slot's user in this state dir's last run (``ASSIGNMENT``), slot by slot."""
    try:
        with open(state_dir / ASSIGNMENT, "rb") as fh:
            text = fh.read(64 * 1024).decode("utf-8", "replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines()][:MAX_USERS]


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
                holder = _holder(os.pread(fd, 4096, 0).decode("utf-8", "replace").strip())
                if holder.where != str(state_dir):
                    found.append(f"{name} ({holder.who})")
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return found
