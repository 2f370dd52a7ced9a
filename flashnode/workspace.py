"""The attempt directory: its layout and ownership, and the output walk.

Layout of ``<state_dir>/attempts/<lease_id>/`` (the task sees it as ``/work``)::

    inputs/   staged inputs (plain inputs at inputs/<basename of key>, archives in inputs/<name>/)
    out/      the task's outputs; every regular file is uploaded under the task's output prefix
    tmp/      the task's TMPDIR and HOME
    logs/     stdout.txt and stderr.txt of the task, written by the agent (size-capped)
    data/     dataset slices, read-only: hard links into the agent's dataset cache (made by the
              data phase only when the task has datasets)
    .stage/   downloads in progress (never visible under inputs/)

The privilege boundary (DESIGN.md §5): the directory itself, ``inputs/``, ``logs/`` and
``.stage/`` belong to the agent; only ``out/`` and ``tmp/`` belong to the task's user (see
``hand_over``), so a task can rename nothing the agent later opens by name. Nothing under
``data/`` is ever chowned or chmodded: its files share their inodes with the dataset cache.
The output walk and every read of an output go through directory descriptors the agent opened
itself, never following a link (``openat`` with ``O_NOFOLLOW``), and refuse an ``out`` that is
not a real directory and any file its task's user did not write; an upload reads from a
descriptor that is checked to be the very file the walk saw.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from flashnode.errors import AttemptFailed

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class OutputFile:
    rel: str  # path relative to out/, with '/' separators
    size: int
    dev: int
    ino: int


class Workspace:
    """One attempt's directory tree."""

    def __init__(self, root: Path, task_uid: int | None = None) -> None:
        self.root = root
        self.inputs = root / "inputs"
        self.out = root / "out"
        self.logs = root / "logs"
        self.tmp = root / "tmp"
        self.stage = root / ".stage"
        self.data = root / "data"
        self.task_uid = task_uid  # who writes out/: the walk refuses files of anyone else

    @classmethod
    def create(cls, attempts_dir: Path, lease_id: str) -> Workspace:
        attempts_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ws = cls(attempts_dir / lease_id)
        if ws.root.exists():
            shutil.rmtree(ws.root)
        ws.root.mkdir(mode=0o700)
        for d in (ws.inputs, ws.out, ws.logs, ws.tmp, ws.stage):
            d.mkdir(mode=0o700)
        return ws

    def hand_over(self, uid: int, gid: int, *, inputs_for: str) -> None:
        """Give the task's user ``out/`` and ``tmp/``; let it read its inputs. ``inputs_for``:
        "group" (the trusted runner: the directory and inputs readable by the task's own group
        only, so no other slot's user can enter) or "everyone" (a container's user, which shares
        no group with the host). ``data/`` is left as it is (see the module docstring)."""
        everyone = inputs_for == "everyone"
        me = os.geteuid()
        group = os.getegid() if everyone else gid
        dir_mode, file_mode = (0o755, 0o644) if everyone else (0o750, 0o640)
        if not everyone:
            os.chown(self.root, me, gid)
            self.root.chmod(0o750)
        for d in (self.out, self.tmp):
            os.chown(d, uid, gid)
        os.chown(self.inputs, me, group)
        self.inputs.chmod(dir_mode)
        for dirpath, dirnames, filenames in os.walk(self.inputs):
            for name in dirnames:
                path = os.path.join(dirpath, name)
                os.chown(path, me, group, follow_symlinks=False)
                os.chmod(path, dir_mode)
            for name in filenames:
                path = os.path.join(dirpath, name)
                executable = os.lstat(path).st_mode & 0o100
                os.chown(path, me, group, follow_symlinks=False)
                os.chmod(path, (dir_mode if executable else file_mode), follow_symlinks=False)
        self.task_uid = uid

    def remove(self) -> None:
        # rmtree works from directory descriptors where the platform has them: it never follows
        # a link the task planted.
        shutil.rmtree(self.root, ignore_errors=True)

    # --- outputs ------------------------------------------------------------------------------

    def outputs(self, max_file_bytes: int, max_total_bytes: int) -> list[OutputFile]:
        """Every regular file under out/, checked: no symlink, FIFO, socket or device anywhere,
        only files the task's user owns, nothing over the caps, and ``metrics.json`` present at
        the root. metrics.json comes last: the commit anchor goes up once everything else is
        there."""
        files: list[OutputFile] = []
        total = 0
        for rel, st in self._walk():
            mode = st.st_mode
            if not rel.isprintable() or _surrogates(rel):
                raise AttemptFailed(f"out/{rel!r} has a name that is not printable UTF-8")
            if stat.S_ISLNK(mode):
                raise AttemptFailed(f"out/{rel} is a symlink; outputs must be regular files")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise AttemptFailed(f"out/{rel} is not a regular file ({_kind(mode)})")
            if self.task_uid is not None and st.st_uid != self.task_uid:
                raise AttemptFailed(f"out/{rel} was not written by the task (a hard link?)")
            if st.st_size > max_file_bytes:
                raise AttemptFailed(f"out/{rel} is larger than {max_file_bytes} bytes")
            total += st.st_size
            if total > max_total_bytes:
                raise AttemptFailed(f"outputs are larger than {max_total_bytes} bytes in all")
            files.append(OutputFile(rel, st.st_size, st.st_dev, st.st_ino))
        if not any(f.rel == "metrics.json" for f in files):
            raise AttemptFailed("the task wrote no out/metrics.json")
        files.sort(key=lambda f: (f.rel == "metrics.json", f.rel))
        return files

    def usage(self) -> int:
        """Bytes under out/ now (regular files; nothing is followed): for the output watch."""
        total = 0
        with contextlib.suppress(OSError, AttemptFailed):
            for _, st in self._walk():
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
        return total

    @contextlib.contextmanager
    def open_output(self, f: OutputFile) -> Iterator[BinaryIO]:
        """The output file the walk saw, opened without following anything; AttemptFailed when
        the name now leads elsewhere or the file changed size."""
        parts = f.rel.split("/")
        fd = self._open_dir(["out", *parts[:-1]])
        try:
            try:
                file_fd = os.open(parts[-1], FILE_FLAGS, dir_fd=fd)
            except OSError:
                raise AttemptFailed(f"out/{f.rel} changed after it was checked") from None
        finally:
            os.close(fd)
        fh = os.fdopen(file_fd, "rb")
        with fh:
            st = os.fstat(file_fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or (st.st_dev, st.st_ino) != (f.dev, f.ino)
                or st.st_size != f.size
            ):
                raise AttemptFailed(f"out/{f.rel} changed after it was checked")
            yield fh
            if os.fstat(file_fd).st_size != f.size:
                raise AttemptFailed(f"out/{f.rel} changed while it was read")

    @contextlib.contextmanager
    def open_log(self, name: str) -> Iterator[tuple[BinaryIO, int] | None]:
        """One of the agent's own log files (logs/ is not the task's), with its size; None when
        it is missing or empty."""
        fd = self._open_dir(["logs"])
        try:
            try:
                file_fd = os.open(name, FILE_FLAGS, dir_fd=fd)
            except OSError:
                yield None
                return
        finally:
            os.close(fd)
        with os.fdopen(file_fd, "rb") as fh:
            size = os.fstat(file_fd).st_size
            yield (fh, size) if size > 0 else None

    def _open_dir(self, parts: list[str]) -> int:
        """A descriptor of root/parts..., each step opened relative to the last with O_NOFOLLOW."""
        fd = os.open(self.root, DIR_FLAGS)
        for name in parts:
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError:
                os.close(fd)
                where = "/".join(parts)
                raise AttemptFailed(f"{where} is not a directory of the workspace") from None
            os.close(fd)
            fd = nxt
        return fd

    def _walk(self) -> Iterator[tuple[str, os.stat_result]]:
        """(path relative to out/, lstat) of everything under out/, from directory descriptors,
        never following links."""
        stack = [("", self._open_dir(["out"]))]
        try:
            while stack:
                rel_dir, fd = stack.pop()
                try:
                    with os.scandir(fd) as it:
                        entries = list(it)
                    for entry in entries:
                        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                        st = entry.stat(follow_symlinks=False)
                        yield rel, st
                        if stat.S_ISDIR(st.st_mode):
                            try:
                                sub = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                            except OSError:
                                raise AttemptFailed(
                                    f"out/{rel} changed while it was read"
                                ) from None
                            stack.append((rel, sub))
                finally:
                    os.close(fd)
        finally:
            for _, fd in stack:
                os.close(fd)


def remove_stale_workspaces(attempts_dir: Path, keep: set[str]) -> None:
    """Remove attempt directories whose lease is not in ``keep``."""
    try:
        entries = list(attempts_dir.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name not in keep and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _surrogates(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"
