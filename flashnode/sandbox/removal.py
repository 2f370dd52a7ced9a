"""Removing what a task made, never following a link: a whole tree (``remove_tree``, as deep as
a task made it), the attempt directories left by earlier runs of the agent
(``remove_stale_workspaces``), and one entry under a directory descriptor (``remove_at``, best
effort, ``REMOVE_DEPTH`` levels down).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from flashnode.sandbox.dirwalk import DIR_FLAGS

log = logging.getLogger(__name__)

REMOVE_DEPTH = 64


def remove_at(dir_fd: int, name: str, depth: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return
        if depth >= REMOVE_DEPTH:
            return
        sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        try:
            with os.scandir(sub) as it:
                names = [e.name for e in it]
            for child in names:
                remove_at(sub, child, depth + 1)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        return


def remove_stale_workspaces(attempts_dir: Path, keep: set[str]) -> list[str]:
    """Remove attempt directories whose lease is not in ``keep``; the names (lease ids) of
    those that were not retired (``Workspace.retire``: their attempts ended)."""
    try:
        entries = list(attempts_dir.iterdir())
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        if entry.name not in keep and entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
            if not entry.name.startswith("."):
                removed.append(entry.name)
    return removed


def remove_tree(path: Path) -> None:
    """Remove a directory and everything below it, as deep as a task made it (no recursion: one
    descriptor at a time, a list of names back up) and without following any link (every step
    is relative to a directory descriptor, opened with O_NOFOLLOW; each step up is checked to be
    the very directory it came from). Best effort: what cannot be removed stays and is logged."""
    try:
        fd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror)
        return
    back: list[tuple[str, int, int]] = []  # (name, dev, ino) of each directory we went into
    try:
        while True:
            sub = None
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        sub = sub or entry.name
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
            if sub is not None:
                try:
                    child = os.open(sub, DIR_FLAGS, dir_fd=fd)
                except PermissionError:  # a task's mode 000 (an agent that is not root)
                    _allow_owner(fd, sub)
                    child = os.open(sub, DIR_FLAGS, dir_fd=fd)
                st = os.fstat(fd)
                back.append((sub, st.st_dev, st.st_ino))
                os.close(fd)
                fd = child
                continue
            if not back:
                break
            name, dev, ino = back.pop()
            parent = os.open("..", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise OSError(f"{path} changed while it was removed")
            os.rmdir(name, dir_fd=fd)
    except OSError as exc:
        log.warning("cannot remove all of %s: %s", path, exc)
        os.close(fd)
        return
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _allow_owner(dir_fd: int, name: str) -> None:
    """chmod u+rwx a directory without following a link: through a path-only descriptor."""
    path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
    finally:
        os.close(path_fd)
