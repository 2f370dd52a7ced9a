"""Files in the state dir, written whole or not at all, with a mode other local users cannot
widen: a temporary file made with ``O_EXCL | O_NOFOLLOW`` and the exact mode (whatever the
umask), optionally handed to the ``flashnode`` group (what ``flashnode status`` may read), then
renamed into place. ``overwrite`` is the way on a full disk: in place, within the blocks the file
already has."""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import threading
from pathlib import Path

STATUS_GROUP = "flashnode"  # members may read status.json (systemd/flashnode.sysusers makes it)


def write(
    path: Path, data: bytes, mode: int = 0o600, group: str | None = None, durable: bool = False
) -> None:
    # Per thread: two threads may write one file (an attempt's record: its relay, its wait).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        if group is not None:
            with contextlib.suppress(KeyError, PermissionError):
                os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
        os.write(fd, data)
        if durable:
            os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, path)
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def overwrite(path: Path, data: bytes) -> None:
    """Write ``data`` over the file in place, padded with spaces to its size: no new block is
    needed, so it works on a full disk. OSError (EFBIG) when ``data`` is larger than the file.
    Not atomic: a reader may see a mix of old and new (``status.read`` tries again)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if len(data) > size:
            raise OSError(errno.EFBIG, f"{len(data)} bytes do not fit in {size}", str(path))
        os.pwrite(fd, data.ljust(size, b" "), 0)
    finally:
        os.close(fd)
