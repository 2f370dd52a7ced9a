"""The task's files as the agent reads them: the output walk (every regular file under
``out/`` but ``not_outputs``, checked: nothing followed, only files the task's user wrote, within
the caps), what the task's files take while it runs (``usage``), the read of one output (from a
descriptor checked to be the very file the walk saw) and of the agent's own logs.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from flashnode.errors import AttemptFailed
from flashnode.sandbox.dirwalk import FILE_FLAGS, open_at, open_dir, walk
from flashnode.sandbox.workspace import Workspace


@dataclass(frozen=True)
class OutputFile:
    rel: str  # path relative to out/, with '/' separators
    size: int
    dev: int
    ino: int


@dataclass(frozen=True)
class Usage:
    """What a running task's files take in its workspace now (the live watch)."""

    output_bytes: int  # regular files under out/, but ``not_outputs``: what would be uploaded
    output_files: int
    disk_bytes: int  # the blocks of everything under out/ and tmp/, each file once
    disk_files: int  # the files and directories under out/ and tmp/ (inodes), each once


def list_outputs(
    ws: Workspace, max_file_bytes: int, max_total_bytes: int, max_files: int | None = None
) -> list[OutputFile]:
    """Every regular file under out/, checked: no symlink, FIFO, socket or device anywhere,
    only files the task's user owns, nothing over the caps (their size, their total, how
    many), and ``metrics.json`` present at the root. metrics.json comes last: the commit
    anchor goes up once everything else is there."""
    files: list[OutputFile] = []
    total = 0
    for rel, st in walk(ws.root, ["out"], skip=ws.not_outputs):
        mode = st.st_mode
        if not rel.isprintable() or surrogates(rel):
            raise AttemptFailed(f"out/{rel!r} has a name that is not printable UTF-8")
        if stat.S_ISLNK(mode):
            raise AttemptFailed(f"out/{rel} is a symlink; outputs must be regular files")
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise AttemptFailed(f"out/{rel} is not a regular file ({kind(mode)})")
        if ws.task_uid is not None and st.st_uid != ws.task_uid:
            raise AttemptFailed(f"out/{rel} was not written by the task (a hard link?)")
        if st.st_size > max_file_bytes:
            raise AttemptFailed(f"out/{rel} is larger than {max_file_bytes} bytes")
        total += st.st_size
        if total > max_total_bytes:
            raise AttemptFailed(f"outputs are larger than {max_total_bytes} bytes in all")
        if max_files is not None and len(files) >= max_files:
            raise AttemptFailed(f"outputs hold more than {max_files} files (max_output_files)")
        files.append(OutputFile(rel, st.st_size, st.st_dev, st.st_ino))
    if not any(f.rel == "metrics.json" for f in files):
        raise AttemptFailed("the task wrote no out/metrics.json")
    files.sort(key=lambda f: (f.rel == "metrics.json", f.rel))
    return files


def usage(ws: Workspace) -> Usage:
    """What the task's files under out/ and tmp/ take now, walked the way outputs are
    (nothing followed; what vanishes meanwhile is left out): the outputs' bytes and count,
    the disk all of it holds (blocks, so a sparse file counts what it really holds; a file
    with several names once; directories too) and how many files and directories that is
    (inodes, each once). Raises what the walk raises when it cannot read everything."""
    out_bytes = out_files = disk = inodes = 0
    seen: set[tuple[int, int]] = set()
    for top in ("out", "tmp"):
        for rel, st in walk(ws.root, [top], tolerant=True):
            output = top == "out" and rel.split("/", 1)[0] not in ws.not_outputs
            if output and stat.S_ISREG(st.st_mode):
                out_bytes += st.st_size
                out_files += 1
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            disk += st.st_blocks * 512
            inodes += 1
    return Usage(out_bytes, out_files, disk, inodes)


@contextlib.contextmanager
def open_output(ws: Workspace, f: OutputFile) -> Iterator[BinaryIO]:
    """The output file the walk saw, opened without following anything; AttemptFailed when
    the name now leads elsewhere or the file changed size."""
    parts = f.rel.split("/")
    fd = open_dir(ws.root, ["out", *parts[:-1]])
    try:
        try:
            file_fd = open_at(parts[-1], FILE_FLAGS, f"out/{f.rel}", dir_fd=fd)
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
def open_log(ws: Workspace, name: str) -> Iterator[tuple[BinaryIO, int] | None]:
    """One of the agent's own log files (logs/ is not the task's), with its size; None when
    it is missing or empty."""
    fd = open_dir(ws.root, ["logs"])
    try:
        try:
            file_fd = open_at(name, FILE_FLAGS, f"logs/{name}", dir_fd=fd)
        except OSError:
            yield None
            return
    finally:
        os.close(fd)
    with os.fdopen(file_fd, "rb") as fh:
        size = os.fstat(file_fd).st_size
        yield (fh, size) if size > 0 else None


def surrogates(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"
