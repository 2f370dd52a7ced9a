"""The attempt directory: creation, safe input unpacking, and the output walk.

Layout of ``<state_dir>/attempts/<lease_id>/`` (the task sees it as ``/work``)::

    inputs/   staged inputs (plain inputs at inputs/<basename of key>, archives in inputs/<name>/)
    out/      the task's outputs; every regular file is uploaded under the task's output prefix
    logs/     stdout.txt and stderr.txt of the task (size-capped)
    tmp/      the task's TMPDIR
    .stage/   downloads in progress (never visible under inputs/)

Nothing here follows a symlink it did not create, and nothing is written outside the attempt
directory: archive members that would escape, links, devices and oversized contents are refused
with a reason (AttemptFailed).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flashnode.errors import AttemptFailed

MAX_MEMBERS = 100_000
COPY_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class OutputFile:
    rel: str  # path relative to out/, with '/' separators
    path: Path
    size: int


class Workspace:
    """One attempt's directory tree."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inputs = root / "inputs"
        self.out = root / "out"
        self.logs = root / "logs"
        self.tmp = root / "tmp"
        self.stage = root / ".stage"

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

    def write_spec(self, task_id: str, params: dict[str, Any], inputs: dict[str, str]) -> Path:
        """The spec.json of a module task: its id, params, and inputs as local paths."""
        path = self.root / "spec.json"
        spec = {"task_id": task_id, "params": params, "inputs": inputs}
        path.write_text(json.dumps(spec, sort_keys=True))
        path.chmod(0o644)
        return path

    def hand_over(self, uid: int, gid: int) -> None:
        """Give the task's user its directory, out/ and tmp/; inputs/ and logs/ stay the
        agent's (readable inputs, logs the task cannot rewrite)."""
        for parent in (self.root.parent, self.root.parent.parent):  # attempts/ and the state dir
            parent.chmod(stat.S_IMODE(parent.stat().st_mode) | 0o111)
        for d in (self.root, self.out, self.tmp):
            os.chown(d, uid, gid)
        self.inputs.chmod(0o755)
        for dirpath, dirnames, filenames in os.walk(self.inputs):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
            for name in filenames:
                path = os.path.join(dirpath, name)
                executable = os.lstat(path).st_mode & 0o100
                os.chmod(path, 0o755 if executable else 0o644, follow_symlinks=False)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # --- inputs -------------------------------------------------------------------------------

    def unpack(self, archive: Path, name: str, max_bytes: int) -> None:
        """Extract a tar or zip archive into inputs/<name>/ without letting anything escape."""
        dest = self.inputs / name
        dest.mkdir(mode=0o755)
        try:
            if zipfile.is_zipfile(archive):
                _unzip(archive, dest, name, max_bytes)
            elif tarfile.is_tarfile(archive):
                _untar(archive, dest, name, max_bytes)
            else:
                raise AttemptFailed(f"input {name!r} is not a tar or zip archive")
        except AttemptFailed:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, RuntimeError) as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise AttemptFailed(f"input {name!r}: broken archive ({type(exc).__name__})") from None

    # --- outputs ------------------------------------------------------------------------------

    def outputs(self, max_file_bytes: int, max_total_bytes: int) -> list[OutputFile]:
        """Every regular file under out/, checked: no symlink, FIFO, socket or device anywhere,
        nothing over the caps, and ``metrics.json`` present at the root."""
        files: list[OutputFile] = []
        total = 0
        for rel, st in _walk(self.out):
            mode = st.st_mode
            if not rel.isprintable() or _surrogates(rel):
                raise AttemptFailed(f"out/{rel!r} has a name that is not printable UTF-8")
            if stat.S_ISLNK(mode):
                raise AttemptFailed(f"out/{rel} is a symlink; outputs must be regular files")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise AttemptFailed(f"out/{rel} is not a regular file ({_kind(mode)})")
            if st.st_size > max_file_bytes:
                raise AttemptFailed(f"out/{rel} is larger than {max_file_bytes} bytes")
            total += st.st_size
            if total > max_total_bytes:
                raise AttemptFailed(f"outputs are larger than {max_total_bytes} bytes in all")
            files.append(OutputFile(rel, self.out / rel, st.st_size))
        if not any(f.rel == "metrics.json" for f in files):
            raise AttemptFailed("the task wrote no out/metrics.json")
        # metrics.json goes last: it is the commit anchor, uploaded once everything else is there.
        files.sort(key=lambda f: (f.rel == "metrics.json", f.rel))
        return files


def remove_stale_workspaces(attempts_dir: Path, keep: set[str]) -> None:
    """Remove attempt directories whose lease is not in ``keep``."""
    try:
        entries = list(attempts_dir.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name not in keep and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _walk(top: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under top, never following links."""
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(top / rel_dir if rel_dir else top) as it:
            for entry in it:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                st = entry.stat(follow_symlinks=False)
                yield rel, st
                if stat.S_ISDIR(st.st_mode):
                    stack.append(rel)


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
