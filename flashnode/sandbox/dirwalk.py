"""The descriptor walk of the attempt directory: every directory opened relative to the last,
never following a link (``openat`` with ``O_NOFOLLOW``), with at most ``MAX_OPEN_DIRS`` open at
once whatever the tree; an entry that vanishes or is replaced meanwhile, a directory the agent
cannot read and the agent out of descriptors each get their own ending (``walk_error``).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flashnode.errors import AttemptFailed, AttemptLapsed, OutOfDescriptors

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_OPEN_DIRS = 16  # the most directories one walk holds open at once, whatever the tree


def open_dir(root: Path, parts: list[str]) -> int:
    """A descriptor of root/parts..., each step opened relative to the last with O_NOFOLLOW."""
    fd = open_at(str(root), DIR_FLAGS, "the workspace")
    for name in parts:
        try:
            nxt = open_at(name, DIR_FLAGS, "/".join(parts), dir_fd=fd)
        except OSError:
            where = "/".join(parts)
            raise AttemptFailed(f"{where} is not a directory of the workspace") from None
        finally:
            os.close(fd)
        fd = nxt
    return fd


def walk(
    root: Path, parts: list[str], skip: frozenset[str] = frozenset(), tolerant: bool = False
) -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to root/parts, lstat) of everything there, depth first, from directory
    descriptors, never following links; top-level names in ``skip`` are left out.

    Whatever the tree's shape, at most ``MAX_OPEN_DIRS`` directories are open at once: one
    per level of the path walked, and past that many levels the shallower ones are closed
    on the way down and opened again on the way back up (``..``, checked to be the very
    directory it left; else by name from the root, checked the same way). ``tolerant``: an
    entry that vanishes or is replaced while it is read is left out instead of failing the
    walk (AttemptFailed). Nothing else is ever left out: a directory the agent cannot read
    fails the walk, and the agent running out of descriptors ends the attempt
    (OutOfDescriptors), never a gap in what was counted."""
    where = "/".join(parts)
    stack = [_Dir("", open_dir(root, parts))]
    lowest = 0  # stack[lowest:] are open, the shallower ones closed
    try:
        try:
            stack[0].fill()
        except OSError as exc:
            _walk_error(exc, where, tolerant=False)
        while stack:
            d = stack[-1]
            if d.fd < 0:
                if not _reopen(root, d, parts, tolerant):
                    stack.pop()  # moved away while it was read (tolerant): the rest of it
                    lowest = min(lowest, len(stack))
                    continue
                lowest = len(stack) - 1
            if not d.names:
                stack.pop()
                parent = stack[-1] if stack else None
                if parent and parent.fd < 0 and _reopen(root, parent, parts, tolerant, d.fd):
                    lowest = len(stack) - 1
                _close(d)
                lowest = min(lowest, len(stack))
                continue
            name = d.names.pop()
            if not d.rel and name in skip:
                continue
            rel = f"{d.rel}/{name}" if d.rel else name
            try:
                st = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
            except OSError as exc:
                _walk_error(exc, f"{where}/{rel}", tolerant)
                continue
            yield rel, st
            if not stat.S_ISDIR(st.st_mode):
                continue
            try:
                child = _Dir(rel, os.open(name, DIR_FLAGS, dir_fd=d.fd))
                try:
                    child.fill()
                except OSError:
                    _close(child)
                    raise
            except OSError as exc:
                _walk_error(exc, f"{where}/{rel}", tolerant)
                continue
            stack.append(child)
            if len(stack) - lowest > MAX_OPEN_DIRS:
                _close(stack[lowest])  # opened again on the way back up
                lowest += 1
    finally:
        for d in stack:
            _close(d)


def _reopen(root: Path, d: _Dir, parts: list[str], tolerant: bool, child: int = -1) -> bool:
    """Open ``d`` again (its descriptor was closed on the way down): from ``child`` (a
    descriptor of a directory in it) by ``..``, else by name from the root; either way
    checked to be the directory it was. False when it is not there any more (tolerant);
    AttemptFailed (strict)."""
    where = "/".join([*parts, d.rel])
    if child >= 0:
        try:
            fd = os.open("..", DIR_FLAGS, dir_fd=child)
        except OSError as exc:
            _walk_error(exc, where, tolerant=True)  # raises what is not a vanished entry
        else:
            if _adopt(fd, d):
                return True
    try:
        fd = open_dir(root, [*parts, *d.rel.split("/")])
    except AttemptFailed:  # not there any more
        pass
    else:
        if _adopt(fd, d):
            return True
    if tolerant:
        return False
    raise AttemptFailed(f"{where} changed while it was read")


@dataclass
class _Dir:
    """One directory on a walk's path: its descriptor (-1 while closed), which directory it is,
    and the names in it not walked yet."""

    rel: str
    fd: int
    dev: int = 0
    ino: int = 0
    names: list[str] = field(default_factory=list)

    def fill(self) -> None:
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino
        with os.scandir(self.fd) as it:
            names = [e.name for e in it]
        names.reverse()  # popped from the end: in the order the directory lists them
        self.names = names


def _adopt(fd: int, d: _Dir) -> bool:
    """Whether ``fd`` is ``d``'s very directory: then it is ``d``'s descriptor, else closed."""
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) == (d.dev, d.ino):
        d.fd = fd
        return True
    os.close(fd)
    return False


def _close(d: _Dir) -> None:
    if d.fd >= 0:
        os.close(d.fd)
        d.fd = -1


VANISHED = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})  # gone, or replaced
NO_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def _walk_error(exc: OSError, where: str, tolerant: bool) -> None:
    """What an error reading ``where`` means: nothing, for an entry that vanished or was
    replaced in a tolerant walk; else the attempt's ending."""
    if exc.errno in NO_DESCRIPTORS:
        raise OutOfDescriptors(f"the agent ran out of file descriptors reading {where}") from None
    if exc.errno in VANISHED:
        if tolerant:
            return
        raise AttemptFailed(f"{where} changed while it was read") from None
    if exc.errno in (errno.EACCES, errno.EPERM):  # the task made it unreadable to the agent
        raise AttemptFailed(f"{where} cannot be read ({exc.strerror})") from None
    raise AttemptLapsed(f"cannot read {where} ({exc.strerror or exc})") from None


def open_at(name: str, flags: int, what: str, dir_fd: int | None = None) -> int:
    """``os.open``, but the agent out of descriptors is OutOfDescriptors, never a missing or
    changed file (which a caller may take for the task's doing)."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in NO_DESCRIPTORS:
            raise OutOfDescriptors(f"the agent ran out of file descriptors opening {what}") from exc
        raise
