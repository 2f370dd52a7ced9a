"""The disk as the agent measures it beside the workspace walk.

* What the state dir's file system has left (``space``): the bytes and the inodes (files and
  directories) programs other than root's may still use. Read by the ``disk`` hold, and by the
  execute phase for each task's caps and its watch.
* What a running task holds on disk outside what a walk of its workspace finds: its private
  temporary directories (a tmpfs each, in its own mount namespace), and files it removed but
  keeps open. Read from ``/proc`` by the agent (root: it may look into another user's
  processes); a process that is gone, or cannot be looked into, counts as holding nothing. Used
  by the runners' handles (``Handle.disk_bytes``) for ``task_disk_bytes``.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512  # st_blocks counts in these, whatever the filesystem's block size
FULL_BELOW_BYTES = 1 << 20  # a file system with less than this free is full
FULL_BELOW_INODES = 256  # ... and one with fewer free inodes than this


@dataclass(frozen=True)
class Space:
    """What a file system has: free for programs that are not root's (``f_bavail``,
    ``f_favail``), and in all. ``total_inodes`` 0: it has no fixed number of inodes (btrfs,
    for one), and they are never short."""

    free_bytes: int
    total_bytes: int
    free_inodes: int
    total_inodes: int

    def inode_floor(self, min_free_bytes: int) -> int:
        """The inodes to keep free: the same share of them as ``min_free_bytes`` is of the
        bytes (0 where inodes are never short)."""
        if not self.total_inodes or not self.total_bytes:
            return 0
        share = min(min_free_bytes, self.total_bytes) / self.total_bytes
        return math.ceil(self.total_inodes * share)

    def fits(self, min_free_bytes: int, nbytes: int, inodes: int) -> tuple[bool, bool, int, int]:
        """Whether ``nbytes`` and ``inodes`` more stay above the floor (``min_free_bytes``, and
        the same share of the inodes): (bytes fit, inodes fit, bytes above it, inodes above
        it). Inodes always fit where there is no fixed number of them."""
        room = self.free_bytes - min_free_bytes
        files = self.free_inodes - self.inode_floor(min_free_bytes)
        return nbytes <= room, not self.total_inodes or inodes <= files, room, files

    def full(self) -> bool:
        """Nothing more fits: under ``FULL_BELOW_BYTES`` free, or ``FULL_BELOW_INODES`` inodes."""
        if self.free_bytes < FULL_BELOW_BYTES:
            return True
        return bool(self.total_inodes) and self.free_inodes < FULL_BELOW_INODES

    def short(self, min_free_bytes: int) -> str | None:
        """What is below the floor the owner keeps free (``min_free_bytes``, and the same share
        of the inodes), in the owner's words; None when nothing is."""
        if self.free_bytes < min_free_bytes:
            return (
                f"{self.free_bytes >> 20} MiB free, below min_free_bytes"
                f" ({min_free_bytes >> 20} MiB)"
            )
        floor = self.inode_floor(min_free_bytes)
        if self.total_inodes and self.free_inodes < floor:
            return (
                f"{self.free_inodes} inodes free (files and directories), below {floor}"
                " (min_free_bytes' share of them)"
            )
        return None


def space(path: Path) -> Space | None:
    """The file system of ``path`` now; None when it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return Space(
        free_bytes=st.f_bavail * st.f_frsize,
        total_bytes=st.f_blocks * st.f_frsize,
        free_inodes=st.f_favail,
        total_inodes=st.f_files,
    )


def private_bytes(pid: int, dirs: Sequence[str]) -> int:
    """The bytes in use on the filesystems mounted at ``dirs`` as process ``pid`` sees them (its
    mount namespace, through ``/proc/<pid>/root``), each filesystem counted once."""
    total = 0
    seen: set[int] = set()
    for d in dirs:
        try:
            fd = os.open(
                f"/proc/{pid}/root{d}", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            continue
        try:
            dev = os.fstat(fd).st_dev
            if dev in seen:
                continue
            seen.add(dev)
            fs = os.fstatvfs(fd)
            total += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        except OSError:
            continue
        finally:
            os.close(fd)
    return total


def unlinked_bytes(pids: Iterable[int], dev: int) -> int:
    """The bytes of regular files on device ``dev`` that the processes ``pids`` hold open and
    that no longer have a name (written, then removed, to hide them from a walk), each file
    counted once."""
    total = 0
    seen: set[int] = set()
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for name in names:
            with contextlib.suppress(OSError):
                st = os.stat(f"{fds}/{name}")  # the open file itself, not a path to it
                if (
                    st.st_nlink == 0
                    and st.st_dev == dev
                    and stat.S_ISREG(st.st_mode)
                    and st.st_ino not in seen
                ):
                    seen.add(st.st_ino)
                    total += st.st_blocks * BLOCK
    return total
