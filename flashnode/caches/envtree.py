"""An environment's files: a build's tree measured (``tree_bytes``) and its scratch directory taken
back, the published tree made the agent's and read-only to others (``secure_tree``) or copied
fresh through file descriptors that never follow a symlink (``copy_tree``), and removed.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from flashnode.errors import EnvBuildFailed
from flashnode.sandbox.removal import remove_tree


@dataclass(frozen=True)
class TreeStats:
    bytes: int
    files: int


INODE_BYTES = 4096  # what each file and directory counts at least: empty files are not free
MAX_DEPTH = 64  # deeper trees are refused (the published copy refuses them too)


def tree_bytes(top: Path) -> int | None:
    """What the tree under ``top`` holds: the blocks of each inode once, and at least
    ``INODE_BYTES`` per entry; never following a symlink, one directory descriptor open per
    level. None when it is deeper than ``MAX_DEPTH``."""
    seen: set[tuple[int, int]] = set()

    def walk(fd: int, depth: int) -> int | None:
        if depth > MAX_DEPTH:
            return None
        total, subdirs = 0, []
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += INODE_BYTES
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
        for name in subdirs:
            try:
                sub = os.open(name, NOFOLLOW_DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                below = walk(sub, depth + 1)
            finally:
                os.close(sub)
            if below is None:
                return None
            total += below
        return total

    try:
        fd = os.open(top, NOFOLLOW_DIR)
    except OSError:
        return 0
    try:
        return walk(fd, 0)
    finally:
        os.close(fd)


def reclaim(work: Path) -> None:
    """Take the scratch directory back from the build user: the agent's, 0700."""
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, os.geteuid(), os.getegid())
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file, link or tree without following a symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_tree(path)
    else:
        path.unlink()


def secure_tree(top: Path) -> TreeStats:
    """Make ``top`` the agent's and read-only to everyone else: dirs 0755, files 0755 if they
    were executable else 0644, no special files; never following a symlink. For a tree only the
    agent wrote (a tree someone else wrote is copied: copy_tree). Returns its bytes (allocated)
    and files."""
    uid, gid = os.geteuid(), os.getegid()
    total = files = 0

    def fail(exc: OSError) -> None:
        raise exc

    for _, dirnames, filenames, dirfd in os.fwalk(top, follow_symlinks=False, onerror=fail):
        st = os.fstat(dirfd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(dirfd, uid, gid)
        os.fchmod(dirfd, 0o755)
        total += st.st_blocks * 512
        for name in (*dirnames, *filenames):
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
                try:
                    if (st.st_uid, st.st_gid) != (uid, gid):
                        os.fchown(fd, uid, gid)
                    os.fchmod(fd, 0o755 if st.st_mode & 0o111 else 0o644)
                finally:
                    os.close(fd)
                files += 1
            else:
                os.unlink(name, dir_fd=dirfd)
                continue
            total += st.st_blocks * 512
    return TreeStats(total, files)


NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def copy_tree(src: Path, dest: Path, allowed_uids: set[int]) -> None:
    """Copy a tree someone else wrote into ``dest`` (new), the agent's, dirs 0755, files 0644 or
    0755 (their times kept), symlinks as symlinks, nothing else. Every open is relative to a
    directory descriptor and never follows a symlink, so swapping a directory for a link
    mid-copy leads nowhere. A file with more than one link, or owned by a uid outside
    ``allowed_uids``, is refused (it could be another file of this host): EnvBuildFailed."""
    top = os.open(src, NOFOLLOW_DIR)
    try:
        os.mkdir(dest, 0o700)
        out = os.open(dest, NOFOLLOW_DIR)
        try:
            _copy_dir(top, out, allowed_uids, depth=0)
            os.fchmod(out, 0o755)
        finally:
            os.close(out)
    finally:
        os.close(top)


def _copy_dir(src: int, dest: int, allowed_uids: set[int], depth: int) -> None:
    if depth > 64:
        raise EnvBuildFailed("the build left a directory tree too deep to copy")
    for entry in os.scandir(src):
        name = entry.name
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dest)
        elif stat.S_ISDIR(st.st_mode):
            sub = os.open(name, NOFOLLOW_DIR, dir_fd=src)
            try:
                os.mkdir(name, 0o700, dir_fd=dest)
                out = os.open(name, NOFOLLOW_DIR, dir_fd=dest)
                try:
                    _copy_dir(sub, out, allowed_uids, depth + 1)
                    os.fchmod(out, 0o755)
                finally:
                    os.close(out)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src, dest, name, allowed_uids)


def _copy_file(src: int, dest: int, name: str, allowed_uids: set[int]) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        if st.st_nlink > 1 or st.st_uid not in allowed_uids:
            raise EnvBuildFailed(f"the build left a file that is not its own ({name})")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(name, flags, 0o600, dir_fd=dest)
        try:
            with open(fd, "rb", closefd=False) as reader, open(out, "wb", closefd=False) as writer:
                shutil.copyfileobj(reader, writer, 1024 * 1024)
            os.fchmod(out, 0o755 if st.st_mode & 0o111 else 0o644)
            # Its times kept: a compiled module's bytecode names its source's modification time.
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(fd)


def others_can_run(path: Path) -> bool:
    """Whether a user other than the owner can execute ``path`` (every directory above it
    searchable, the file itself readable and executable)."""
    try:
        real = Path(os.path.realpath(path))
        if stat.S_IMODE(real.stat().st_mode) & 0o005 != 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in real.parents)
    except OSError:
        return False
