"""Input archives unpacked into the attempt's ``inputs/`` with nothing allowed to escape.

Members with absolute paths or ``..`` segments, links, devices and FIFOs, more than
``MAX_MEMBERS`` members or more than the byte budget are refused with a reason (AttemptFailed), and
a refused archive leaves nothing behind. Files are created with ``O_EXCL | O_NOFOLLOW``, so nothing
is written through a link or over an earlier member.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
import zipfile
from pathlib import Path
from typing import IO

from flashnode.errors import AttemptFailed, disk_full, disk_full_error
from flashnode.sandbox.workspace import remove_tree

MAX_MEMBERS = 100_000
COPY_CHUNK = 1024 * 1024


def unpack(archive: Path, dest: Path, name: str, max_bytes: int) -> None:
    """Extract a tar or zip archive into ``dest`` (made here) without letting anything escape."""
    dest.mkdir(mode=0o755)
    try:
        if zipfile.is_zipfile(archive):
            _unzip(archive, dest, name, max_bytes)
        elif tarfile.is_tarfile(archive):
            _untar(archive, dest, name, max_bytes)
        else:
            raise AttemptFailed(f"input {name!r} is not a tar or zip archive")
    except AttemptFailed:
        remove_tree(dest)
        raise
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, RuntimeError) as exc:
        remove_tree(dest)
        full = disk_full(exc)
        if full is not None:  # the node's disk, not the archive
            raise disk_full_error(full) from None
        raise AttemptFailed(f"input {name!r}: broken archive ({type(exc).__name__})") from None


def _member_path(dest: Path, raw: str, name: str) -> Path:
    """The destination of an archive member, refusing absolute paths and '..' segments."""
    clean = raw.replace("\\", "/")
    if clean.startswith("/") or "\0" in clean or (len(clean) > 1 and clean[1] == ":"):
        raise AttemptFailed(f"input {name!r}: member {raw[:100]!r} has an absolute path")
    parts = [p for p in clean.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise AttemptFailed(f"input {name!r}: member {raw[:100]!r} escapes with '..'")
    if not parts:
        return dest
    return dest.joinpath(*parts)


class _Budget:
    def __init__(self, name: str, max_bytes: int) -> None:
        self.name, self.left, self.max, self.members = name, max_bytes, max_bytes, 0

    def member(self) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise AttemptFailed(f"input {self.name!r} has more than {MAX_MEMBERS} members")

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise AttemptFailed(f"input {self.name!r} unpacks to more than {self.max} bytes")


def _write_member(src: IO[bytes], path: Path, executable: bool, budget: _Budget, raw: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o755 if executable else 0o644)
    except FileExistsError:
        raise AttemptFailed(f"input {budget.name!r}: member {raw[:100]!r} appears twice") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise AttemptFailed(
                f"input {budget.name!r}: member {raw[:100]!r} crosses a non-directory"
            ) from None
        raise
    with os.fdopen(fd, "wb") as out:
        while chunk := src.read(COPY_CHUNK):
            budget.spend(len(chunk))
            out.write(chunk)


def _untar(archive: Path, dest: Path, name: str, max_bytes: int) -> None:
    budget = _Budget(name, max_bytes)
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            budget.member()
            path = _member_path(dest, member.name, name)
            if member.isdir():
                path.mkdir(parents=True, exist_ok=True, mode=0o755)
            elif member.isfile():
                src = tar.extractfile(member)
                if src is None:  # pragma: no cover - isfile() members always have data
                    raise AttemptFailed(f"input {name!r}: unreadable member {member.name[:100]!r}")
                with src:
                    _write_member(src, path, bool(member.mode & 0o111), budget, member.name)
            else:
                kind = (
                    "a symlink"
                    if member.issym()
                    else "a hardlink"
                    if member.islnk()
                    else "a device or FIFO"
                )
                raise AttemptFailed(f"input {name!r}: member {member.name[:100]!r} is {kind}")


def _unzip(archive: Path, dest: Path, name: str, max_bytes: int) -> None:
    budget = _Budget(name, max_bytes)
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            budget.member()
            path = _member_path(dest, info.filename, name)
            unix_mode = info.external_attr >> 16
            if stat.S_IFMT(unix_mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise AttemptFailed(
                    f"input {name!r}: member {info.filename[:100]!r} is not a regular file"
                )
            if info.is_dir():
                path.mkdir(parents=True, exist_ok=True, mode=0o755)
                continue
            with zf.open(info) as src:
                _write_member(src, path, bool(unix_mode & 0o111), budget, info.filename)
