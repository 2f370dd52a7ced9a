"""What the trusted runner needs of the host, checked before it starts (``flashnode work`` and
``flashnode doctor``): the slots' task users and the agent's own users, the sandbox, the state
dir's place (not under a private directory, passable by the task users) and ``/work``, the
mount point of every task's workspace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path

from flashnode.config.settings import Settings
from flashnode.errors import ConfigError, ExitCode, PrerequisiteError
from flashnode.owner.unitview import SERVICE_UNIT
from flashnode.runners.findings import Finding, Ok, Problem
from flashnode.runners.userlocks import MAX_USERS, held_elsewhere
from flashnode.sandbox import procs
from flashnode.sandbox.procs.helpers import sandbox_works
from flashnode.sandbox.procs.mounts import PRIVATE_DIRS
from flashnode.sandbox.workspace import WORK

log = logging.getLogger(__name__)


def slot_user_name(task_user: str, slot: int) -> str:
    return f"{task_user}-{slot}"


def under_private_dir(path: Path) -> str | None:
    """The private directory (``/tmp``, ...) a root agent's tasks get in place of the one
    ``path`` lies under, hiding it from them; None when ``path`` is not under one."""
    resolved = path.resolve()
    for private in PRIVATE_DIRS:
        if resolved.is_relative_to(Path(private).resolve()):
            return private
    return None


def users_and_sandbox(s: Settings, slots: int) -> Iterator[Finding]:
    """Who tasks run as, and whether they can be kept apart from the agent and each other."""
    if os.geteuid() != 0:
        if s.task_user:
            yield Problem(
                "task user",
                f"task_user {s.task_user!r} needs the agent to run as root",
                "run the agent as root, or remove task_user",
            )
        elif not s.allow_same_user:
            yield Problem(
                "task user",
                "this agent is not root, so it cannot run tasks as a distinct task user",
                "run it as root with task_user set (tasks then run as <task_user>-<slot>), or"
                " set allow_same_user = true under [trusted] to run them as this agent's own user"
                " (the owner's manual: Security model)",
            )
        else:
            yield Ok("task user", f"tasks run as this agent's own user (uid {os.geteuid()})")
        return
    if not s.task_user:
        yield Problem(
            "task user",
            "the agent runs as root and task_user is not set",
            'set task_user = "flashnode-task" under [trusted] (slot N then runs as'
            " flashnode-task-N)",
        )
        return
    with contextlib.suppress(KeyError):
        if pwd.getpwnam(s.task_user).pw_uid == 0:
            yield Problem(
                "task user", f"task_user {s.task_user!r} is root", "name an unprivileged user"
            )
            return
    try:
        users = slot_users(s.task_user, slots)
    except ConfigError as exc:
        yield Problem(
            "task user",
            str(exc),
            f"create them (the package's sysusers file does): for i in $(seq 0 {slots - 1});"
            " do useradd --system --user-group --no-create-home --shell /usr/sbin/nologin"
            f" {s.task_user}-$i; done",
        )
        return
    blocked = _unreachable(s.state_dir)
    if blocked is not None:
        yield Problem(
            "task user",
            f"they cannot enter {blocked}, above the state dir {s.state_dir}",
            f"choose another state_dir, or allow search: chmod o+x {blocked}",
        )
        return
    yield Ok("task user", ", ".join(f"{u.name} (uid {u.uid})" for u in users))
    yield _users_held(s, slots)
    yield _own_users({u.uid for u in users})
    why = sandbox_works()
    if why:
        yield Problem(
            "task sandbox",
            f"cannot give tasks private mount and IPC namespaces ({why})",
            "run the agent as root with CAP_SYS_ADMIN (the packaged unit does)",
            code=ExitCode.UNAVAILABLE,
        )
        return
    yield Ok("task sandbox", "private /tmp, /var/tmp, /dev/shm and IPC per task")
    yield _work_mount_point()


def _own_users(task_uids: set[int]) -> Finding:
    """The agent's own users (``procs.BUILD_USER``, ``procs.HELPER_USER``): there, and each a
    user of its own (neither the other, nor ``nobody``, nor a task user)."""
    found = []
    for name in (procs.BUILD_USER, procs.HELPER_USER):
        try:
            user = procs.own_user(name)
        except LookupError as exc:
            return Problem(
                "agent users",
                f"{exc}: job environments are built as {procs.BUILD_USER}, and the agent's own"
                f" checks run as {procs.HELPER_USER}",
                procs.USERS_FIX,
            )
        assert user is not None
        found.append(user)
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        nobody = 65534
    uids = {u.uid for u in found}
    if len(uids) < len(found) or uids & (task_uids | {nobody}):
        return Problem(
            "agent users",
            f"{procs.BUILD_USER} and {procs.HELPER_USER} must each have a uid of their own (not"
            " each other's, nobody's or a task user's)",
            f"remove them (userdel) and {procs.USERS_FIX}",
        )
    build, helper = found
    return Ok(
        "agent users",
        f"environments are built as {build.name} (uid {build.uid}), the agent's checks run as"
        f" {helper.name} (uid {helper.uid})",
    )


MOUNT_POINT_FIX = "sudo mkdir -m 0755 /work (the package makes it)"


def _work_mount_point(work: Path = Path(WORK), writable: bool | None = None) -> Finding:
    """Whether each task's workspace can be bound at /work in its namespace: the host's /work
    must be a directory (the mount point only: a task sees its workspace there, never what the
    host keeps in it). A missing one is made at start where / is writable (``make_work_dir``)
    and the packaged unit does not keep it read-only; where it cannot be, the agent refuses to
    start rather than run tasks with their /work rewritten: a /work inside a script would fail
    there (the task charged for it), and the workspace's host path would reach the task's
    environment. ``writable``: whether / is (default: asked)."""
    try:
        st = os.lstat(work)
    except FileNotFoundError:
        if writable is None:
            writable = os.access(work.parent, os.W_OK) and not SERVICE_UNIT.exists()
        if writable:
            return Ok(str(work), "missing: made at start (an empty directory of root's)")
        return Problem(
            str(work),
            "missing, and the agent cannot make it (a read-only /, or the packaged service's"
            " ProtectSystem=strict): each task's workspace is bound there, in its own mount"
            " namespace",
            MOUNT_POINT_FIX,
            code=ExitCode.UNAVAILABLE,
        )
    except OSError as exc:
        return Problem(str(work), f"cannot be read ({exc.strerror})", MOUNT_POINT_FIX)
    if not stat.S_ISDIR(st.st_mode):
        return Problem(
            str(work),
            "is not a directory (a link or a file): each task's workspace is bound there",
            f"make it a directory: sudo mv {work} {work}.old && {MOUNT_POINT_FIX}",
            code=ExitCode.UNAVAILABLE,
        )
    return Ok(str(work), "each task sees its workspace there, bound in its own mount namespace")


def make_work_dir(work: Path = Path(WORK)) -> None:
    """Make the mount point /work (an empty directory of root's) when it is missing;
    PrerequisiteError when it cannot be made. An existing one is left as it is."""
    try:
        os.mkdir(work, 0o755)
    except FileExistsError:
        return
    except OSError as exc:
        raise PrerequisiteError(
            f"{work} is missing and cannot be made ({exc.strerror}): {MOUNT_POINT_FIX}"
        ) from None
    os.chmod(work, 0o755)  # whatever the umask
    log.info("made %s, where each task's workspace is bound in its own mount namespace", work)


def _users_held(s: Settings, slots: int) -> Finding:
    """Whether other agents (of other state dirs) hold the task users this one would take."""
    assert s.task_user
    held = held_elsewhere(s.task_user, s.state_dir)
    exist = sum(1 for n in range(MAX_USERS) if _exists(f"{s.task_user}-{n}"))
    if exist - len(held) < slots:
        return Problem(
            "task users held",
            f"other agents hold {', '.join(held[:4])}{' …' if len(held) > 4 else ''}: too few"
            f" of the {exist} {s.task_user}-N users are left for {slots} slot(s)",
            "stop that agent, or give this one task users of its own (other users, and"
            " task_user naming them): two agents must never run tasks as one user",
        )
    if held:
        return Ok(
            "task users held", f"by other agents: {', '.join(held[:4])}; this one takes others"
        )
    return Ok("task users held", "by no other agent")


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def slot_users(task_user: str, slots: int) -> list[procs.TaskUser]:
    """The users slots 0..slots-1 run as; ConfigError naming the first that is missing or root."""
    users = []
    for slot in range(slots):
        name = slot_user_name(task_user, slot)
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise ConfigError(f"task user {name!r} (for slot {slot}) does not exist") from None
        if pw.pw_uid == 0 or pw.pw_gid == 0:
            raise ConfigError(f"task user {name!r} is root or in group root")
        users.append(procs.TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid))
    if len({u.uid for u in users}) != len(users) or len({u.gid for u in users}) != len(users):
        # A shared uid or group would let one slot's task read another's workspace.
        raise ConfigError(f"the {task_user}-N task users must have distinct uids and groups")
    return users


def passable(state_dir: Path) -> None:
    """Let task users pass through the state dir and ``attempts/`` to their own workspaces
    (search, never list). Again before each task: systemd sets ``StateDirectoryMode`` again on a
    reload, and the task's launch enters its workspace by its path, as the task's user."""
    for d in (state_dir, state_dir / "attempts"):
        mode = stat.S_IMODE(d.stat().st_mode)
        if mode & 0o111 != 0o111:
            d.chmod(mode | 0o111)


def _unreachable(state_dir: Path) -> Path | None:
    """The first directory above the state dir that unrelated users cannot enter, if any."""
    resolved = state_dir.resolve()
    for d in resolved.parents:
        try:
            if not d.stat().st_mode & 0o001:
                return d
        except OSError:
            return d
    return None
