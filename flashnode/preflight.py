"""What must hold before ``flashnode work`` starts: one list, for ``work`` and ``doctor``.

``work`` runs :func:`problems` after loading its settings and stops at the first fatal one with its
exit code and one line; ``doctor`` prints every finding of :func:`check`. So the two agree on
every point by construction. The checks are local (no coordinator): the state dir, the stored
credentials, and the runner's prerequisites (the task user and ``setpriv`` and ``task_python`` for
the trusted runner; the engine and the allowed images for the docker runner).

Nothing here changes the host: a state dir that does not exist yet is checked for whether it
can be made, not made. The Docker SDK is imported only to check a docker runner.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flashnode.errors import ExitCode
from flashnode.settings import Settings, format_size


@dataclass(frozen=True)
class Problem:
    """Something wrong, in the owner's words: what was checked, why it fails, how to fix it.

    ``code`` is the exit code ``work`` ends with because of it; None for a warning (``work``
    starts anyway, and says so in its log).
    """

    what: str
    why: str
    fix: str
    code: ExitCode | None = ExitCode.CONFIG

    @property
    def fatal(self) -> bool:
        return self.code is not None

    def line(self) -> str:
        return f"{self.what}: {self.why}; fix: {self.fix}"


@dataclass(frozen=True)
class Ok:
    """A check that passed, with what was found (for ``doctor``)."""

    what: str
    detail: str = ""


Finding = Ok | Problem


def problems(settings: Settings) -> list[Problem]:
    """Every problem :func:`check` finds, fatal ones first."""
    found = [f for f in check(settings) if isinstance(f, Problem)]
    return sorted(found, key=lambda p: not p.fatal)


def check(settings: Settings) -> list[Finding]:
    """Every check, in order: state dir, credentials, the runner's prerequisites."""
    findings = [*_state_dir(settings), *_credentials(settings)]
    if settings.runner == "trusted":
        findings += _trusted(settings)
    else:
        findings += _docker(settings)
    return findings


# --- the state dir ----------------------------------------------------------------------------


def _state_dir(s: Settings) -> Iterator[Finding]:
    path = s.state_dir
    if not path.is_absolute():
        yield Problem("state dir", f"{path} is not an absolute path", "set state_dir to one")
        return
    try:
        st = path.lstat()
    except FileNotFoundError:
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            yield Problem(
                "state dir",
                f"{path} does not exist and this user cannot make it in {parent}",
                f"install -d -m 0700 {path} (as the user the agent runs as), or set state_dir",
            )
        else:
            yield Ok("state dir", f"{path} (made at the first start)")
        return
    except OSError as exc:
        yield Problem("state dir", f"{path}: {exc.strerror}", "set state_dir to a usable directory")
        return
    if not stat.S_ISDIR(st.st_mode):
        yield Problem("state dir", f"{path} is not a directory", "set state_dir to a directory")
        return
    if st.st_uid != os.geteuid():
        yield Problem(
            "state dir",
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})",
            f"chown -R {os.geteuid()} {path}, or set state_dir",
        )
        return
    if not os.access(path, os.W_OK | os.X_OK):
        yield Problem("state dir", f"{path} is not writable", f"chmod u+rwx {path}")
        return
    free = shutil.disk_usage(path).free
    if free < s.min_free_bytes:
        yield Problem(
            "state dir",
            f"{format_size(free)} free in {path}, below min_free_bytes"
            f" ({format_size(s.min_free_bytes)}): the agent will not claim work",
            "free space, or lower min_free_bytes",
            code=None,
        )
    else:
        yield Ok("state dir", f"{path}, {free >> 30} GiB free")


# --- stored credentials -----------------------------------------------------------------------


def _credentials(s: Settings) -> Iterator[Finding]:
    """Where ``flashnode login`` stores secrets must be this user's alone: a directory others can
    write into lets them plant a token, and the agent would work for whoever owns it."""
    directory = s.credentials_dir
    try:
        st = directory.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        yield Problem("credentials", f"{directory}: {exc.strerror}", f"check {directory}")
        return
    if not stat.S_ISDIR(st.st_mode):
        yield Problem("credentials", f"{directory} is not a directory", f"remove {directory}")
    elif st.st_uid != os.geteuid():
        yield Problem(
            "credentials",
            f"{directory} belongs to uid {st.st_uid}, not to this user",
            f"chown {os.geteuid()} {directory}",
        )
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        yield Problem(
            "credentials",
            f"{directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod 700 {directory}",
        )
    else:
        kinds = [k for k, v in (("token", s.token), ("join code", s.join_code)) if v is not None]
        yield Ok("credentials", ", ".join(kinds) if kinds else "none (an open coordinator)")


# --- the trusted runner -----------------------------------------------------------------------


def _trusted(s: Settings) -> Iterator[Finding]:
    user = None
    if os.geteuid() != 0:
        if s.task_user:
            yield Problem(
                "task user",
                f"task_user {s.task_user!r} needs the agent to run as root",
                "run the agent as root, or remove task_user",
            )
            return
        yield Ok("task user", f"tasks run as this agent's own user (uid {os.geteuid()})")
    elif not s.task_user:
        yield Problem(
            "task user",
            "the agent runs as root and task_user is not set",
            'set task_user = "flashnode-task" (an unprivileged user; never root)',
        )
        return
    else:
        try:
            user = pwd.getpwnam(s.task_user)
        except KeyError:
            yield Problem(
                "task user",
                f"task_user {s.task_user!r} does not exist",
                f"useradd --system --no-create-home --shell /usr/sbin/nologin {s.task_user}",
            )
            return
        if user.pw_uid == 0:
            yield Problem(
                "task user", f"task_user {s.task_user!r} is root", "name an unprivileged user"
            )
            return
        blocked = _blocked_above(s.state_dir, user.pw_uid, user.pw_gid)
        if blocked is not None:
            yield Problem(
                "task user",
                f"{s.task_user!r} cannot enter {blocked}, above the state dir {s.state_dir}",
                f"choose another state_dir, or allow search: chmod o+x {blocked}",
            )
            return
        if not shutil.which("setpriv"):
            yield Problem(
                "setpriv",
                "setpriv is missing: tasks cannot be run as task_user",
                "install util-linux",
                code=ExitCode.UNAVAILABLE,
            )
            return
        yield Ok("task user", f"{user.pw_name} (uid {user.pw_uid})")
    if s.task_python:
        # Imported here: procs is an edge that the other checks do not need.
        from flashnode import procs
        from flashnode.wire import MODULES

        as_user = procs.TaskUser(user.pw_name, user.pw_uid, user.pw_gid) if user else None
        why = procs.python_imports(s.task_python, MODULES, as_user)
        if why:
            yield Problem(
                "module tasks",
                f"off: {s.task_python} cannot import the allowlisted modules ({why})",
                f"{s.task_python} -m pip install flashruntime torch, or unset task_python",
                code=None,
            )
        else:
            yield Ok("module tasks", f"on, under {s.task_python}")


def _blocked_above(state_dir: Path, uid: int, gid: int) -> Path | None:
    """The first directory above ``state_dir`` that ``uid`` cannot enter, or None."""
    for d in [*state_dir.parents][::-1]:
        try:
            st = d.stat()
        except OSError:
            return None  # the rest is made by the agent, searchable
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return d
    return None


# --- the docker runner ------------------------------------------------------------------------


def _docker(s: Settings) -> Iterator[Finding]:
    if not s.allowed_images:
        yield Problem(
            "allowed images",
            "allowed_images is empty: this node would refuse every container task",
            'list the images you allow, pinned, e.g. allowed_images = ["python:3.11-slim"]',
        )
        return
    # Imported here: the Docker SDK costs a trusted-only agent memory it never uses.
    import docker

    try:
        client = docker.DockerClient(base_url=s.docker_host, timeout=10)
        client.ping()
    except Exception as exc:
        yield Problem(
            "docker engine",
            f"no container engine answers at {s.docker_host} ({type(exc).__name__})",
            "start Docker (systemctl start docker), or use the trusted runner for pool work",
            code=ExitCode.UNAVAILABLE,
        )
        return
    try:
        yield Ok("docker engine", s.docker_host)
        present, absent = [], []
        for image in s.allowed_images:
            try:
                client.images.get(image)
                present.append(image)
            except docker.errors.ImageNotFound:
                absent.append(image)
            except Exception as exc:
                yield Problem(
                    "docker engine",
                    f"cannot look up {image} ({type(exc).__name__})",
                    "check the engine (docker info)",
                    code=ExitCode.UNAVAILABLE,
                )
                return
        if absent and not present and not s.pull_images:
            yield Problem(
                "allowed images",
                f"none is present ({', '.join(absent)}) and pull_images is off:"
                " this node could run nothing",
                f"docker pull {absent[0]}, or set pull_images = true",
            )
            return
        for image in absent:
            if s.pull_images:
                yield Ok("image", f"{image} (pulled when a task needs it)")
            else:
                yield Problem(
                    "image",
                    f"{image} is not present and pull_images is off: tasks naming it fail",
                    f"docker pull {image}, or set pull_images = true",
                    code=None,
                )
        for image in present:
            yield Ok("image", image)
    finally:
        client.close()
