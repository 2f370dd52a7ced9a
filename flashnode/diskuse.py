"""What a running task holds on disk outside what a walk of its workspace finds: its private
temporary directories (a tmpfs each, in its own mount namespace), and files it removed but keeps
open. Read from ``/proc`` by the agent (root: it may look into another user's processes); a
process that is gone, or cannot be looked into, counts as holding nothing.

Used by the runners' handles (``Handle.disk_bytes``) for ``task_disk_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Sequence

BLOCK = 512  # st_blocks counts in these, whatever the filesystem's block size


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
