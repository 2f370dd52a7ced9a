"""Input archives unpacked into the attempt's ``inputs/`` with nothing allowed to escape.

Members with absolute paths or ``..`` segments, links, devices and FIFOs, more than
``MAX_MEMBERS`` members, more files and directories than ``max_entries`` (every directory made
counts, the parents a member's path needs too) or more than the byte budget are refused with a
reason (AttemptFailed), and a refused archive leaves nothing behind. Every file and directory,
and every chunk of bytes, is handed to ``room`` before it is made or written: the attempt's disk
budget (``attempt/diskbudget.py``), which refuses what would take the disk below
``min_free_bytes`` (the agent unpacks as root, and a few KiB of archive may stand for many
inodes). Files are created with ``O_EXCL | O_NOFOLLOW``, so nothing is written through a link or
over an earlier member.
"""

from __future__ import annotations

import errno
import os
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from flashnode.allocator import STREAM_CHUNK
from flashnode.errors import AttemptFailed, AttemptLapsed, disk_full, disk_full_error
from flashnode.sandbox.removal import remove_tree

MAX_MEMBERS = 100_000


def unpack(
    archive: Path,
    dest: Path,
    name: str,
    max_bytes: int,
    max_entries: int = MAX_MEMBERS,
    room: Callable[[int, int], None] | None = None,
) -> None:
    """Extract a tar or zip archive into ``dest`` (made here) without letting anything escape,
    into at most ``max_bytes`` and ``max_entries`` files and directories, each byte and inode
    handed to ``room`` (which raises when it does not fit) before it is written."""
    import tarfile  # here, not at the top: an idle agent need not load it

    dest.mkdir(mode=0o755)
    budget = _Budget(name, max_bytes, min(max_entries, MAX_MEMBERS), dest, room)
    try:
        if zipfile.is_zipfile(archive):
            _unzip(archive, dest, budget)
        elif tarfile.is_tarfile(archive):
            _untar(archive, dest, budget)
        else:
            raise AttemptFailed(f"input {name!r} is not a tar or zip archive")
    except (AttemptFailed, AttemptLapsed):
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
    def __init__(
        self,
        name: str,
        max_bytes: int,
        max_entries: int,
        dest: Path,
        room: Callable[[int, int], None] | None,
    ) -> None:
        self.name, self.left, self.max, self.members = name, max_bytes, max_bytes, 0
        self.entries, self.max_entries = 0, max_entries
        self.room = room
        self.dirs: set[Path] = {dest}  # directories known to exist

    def member(self) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise AttemptFailed(f"input {self.name!r} has more than {MAX_MEMBERS} members")

    def entry(self) -> None:
        """One more file or directory, about to be made."""
        self.entries += 1
        if self.entries > self.max_entries:
            raise AttemptFailed(
                f"input {self.name!r} unpacks to more than {self.max_entries} files and"
                " directories (directories its members' paths need count too)"
            )
        if self.room is not None:
            self.room(0, 1)

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise AttemptFailed(f"input {self.name!r} unpacks to more than {self.max} bytes")
        if self.room is not None:
            self.room(n, 0)

    def make_dirs(self, path: Path, raw: str) -> None:
        """Make ``path`` and its missing parents under ``dest``, each counted."""
        missing: list[Path] = []
        while path not in self.dirs:
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            self.entry()
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(d).st_mode):
                    raise AttemptFailed(
                        f"input {self.name!r}: member {raw[:100]!r} crosses a non-directory"
                    ) from None
            self.dirs.add(d)


def _write_member(src: IO[bytes], path: Path, executable: bool, budget: _Budget, raw: str) -> None:
    budget.make_dirs(path.parent, raw)
    budget.entry()
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
        while chunk := src.read(STREAM_CHUNK):
            budget.spend(len(chunk))
            out.write(chunk)


def _untar(archive: Path, dest: Path, budget: _Budget) -> None:
    import tarfile  # here, not at the top: an idle agent need not load it

    name = budget.name
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            budget.member()
            path = _member_path(dest, member.name, name)
            if member.isdir():
                budget.make_dirs(path, member.name)
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


def _unzip(archive: Path, dest: Path, budget: _Budget) -> None:
    name = budget.name
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
                budget.make_dirs(path, info.filename)
                continue
            with zf.open(info) as src:
                _write_member(src, path, bool(unix_mode & 0o111), budget, info.filename)
