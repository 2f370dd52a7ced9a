"""The attempt directory: its layout and ownership, and the output walk.

Layout of ``<state_dir>/attempts/<lease_id>/`` (the task sees it as ``/work``)::

    inputs/   staged inputs (plain inputs at inputs/<basename of key>, archives in inputs/<name>/)
    out/      the task's outputs, and its working directory; every regular file is uploaded
              under the task's output prefix
    out/ckpt/ the task's checkpoint directory (``FLASHML_CKPT_DIR``), in every workspace; never
              outputs (``not_outputs``): the relay ships a checkpointing task's checkpoints
              from it (``step-<N>.<ext>`` files, ``step-<N>/`` directories, and flashruntime's
              ``step-*``/``checkpoint-*`` directories with a ``manifest.json``), and a resumed
              task finds the one it resumes from there
    tmp/      the task's TMPDIR and HOME
    logs/     stdout.txt and stderr.txt of the task, written by the agent (size-capped)
    data/     dataset slices, read-only: hard links into the agent's dataset cache (made by the
              data phase only when the task has datasets)
    .stage/   downloads in progress (never visible under inputs/)

The privilege boundary (docs/design.md §5): the directory itself, ``inputs/``, ``logs/`` and
``.stage/`` belong to the agent; only ``out/`` and ``tmp/`` belong to the task's user (see
``hand_over``), so a task can rename nothing the agent later opens by name. Nothing under
``data/`` is ever chowned or chmodded: its files share their inodes with the dataset cache.
The output walk and every read of an output go through directory descriptors the agent opened
itself, never following a link (``openat`` with ``O_NOFOLLOW``), and refuse an ``out`` that is
not a real directory and any file its task's user did not write; an upload reads from a
descriptor that is checked to be the very file the walk saw.

Why one module of this size: every descriptor-based walk of the attempt directory (outputs,
checkpoints, removal) beside the layout it relies on.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from flashnode.coordinator import manifests
from flashnode.errors import AttemptFailed, AttemptLapsed, OutOfDescriptors

log = logging.getLogger(__name__)

WORK = "/work"  # where a task sees its workspace (a container's mount, the sandbox's bind)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CKPT = "ckpt"  # out/ckpt/: where a checkpointing task writes its checkpoints
# A complete checkpoint's name under out/ckpt/: step-<N>, or step-<N>.<ext> (a file).
CHECKPOINT_NAME = re.compile(r"^step-([0-9]{1,15})(?:\.[A-Za-z0-9][A-Za-z0-9._-]{0,63})?$")
MAX_CHECKPOINT_FILES = 1000
MAX_CKPT_ENTRIES = 10 * MAX_CHECKPOINT_FILES  # what one look at out/ckpt/ reads at most
REMOVE_DEPTH = 64
MAX_OPEN_DIRS = 16  # the most directories one walk holds open at once, whatever the tree


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


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint as found under out/ckpt/: a file or a directory named by its step."""

    name: str  # its name under out/ckpt/
    step: int
    files: tuple[OutputFile, ...]  # rel is under out/ ("ckpt/step-5/a.bin"), sorted
    stamp: tuple[tuple[str, int, int, int], ...]  # (rel, size, mtime_ns, ino) of every file
    problem: str = ""  # why it cannot be shipped; "" when it can
    directory: bool = False  # a directory (else one file)
    # flashruntime's layout: its checked manifest (the step is the manifest's; ``files`` are the
    # parts it lists, then manifest.json), complete as soon as it is there.
    manifest: manifests.Manifest | None = None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


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
        self.not_outputs = frozenset({CKPT})  # names in out/ that are not outputs

    @classmethod
    def create(cls, attempts_dir: Path, lease_id: str) -> Workspace:
        attempts_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ws = cls(attempts_dir / lease_id)
        if ws.root.exists():
            remove_tree(ws.root)
        ws.root.mkdir(mode=0o700)
        for d in (ws.inputs, ws.out, ws.out / CKPT, ws.logs, ws.tmp, ws.stage):
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
        # Made by the agent, before anything of the task ran: out/ckpt/ and the checkpoint
        # restored into it, which the task uses and may delete (its own from here on).
        _chown_tree(self.out / CKPT, uid, gid)
        if not everyone:
            os.chown(self.root, me, gid)
            self.root.chmod(0o750)
        for d in (self.out, self.tmp):
            os.chown(d, uid, gid)
        os.chown(self.inputs, me, group)
        self.inputs.chmod(dir_mode)
        pending = [str(self.inputs)]  # a stack, not recursion: archives may nest deep
        while pending:
            with os.scandir(pending.pop()) as it:
                for entry in it:
                    st = entry.stat(follow_symlinks=False)
                    os.chown(entry.path, me, group, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        os.chmod(entry.path, dir_mode)
                        pending.append(entry.path)
                    elif stat.S_ISREG(st.st_mode):
                        executable = st.st_mode & 0o100
                        os.chmod(entry.path, dir_mode if executable else file_mode)
        self.task_uid = uid

    def move_into(self, directory: Path) -> None:
        """Put everything of this workspace into ``directory`` (an empty directory of the agent's
        beside it), and ``directory``, with the workspace's owner and mode, in its place: a chain
        started ahead has ``directory`` bound at ``/work`` already. Before any task runs in it.
        OSError, with everything moved back, when it cannot."""
        st = os.lstat(self.root)
        src = os.open(self.root, DIR_FLAGS)
        moved: list[str] = []
        try:
            dst = os.open(directory, DIR_FLAGS)
            try:
                try:
                    for name in os.listdir(src):
                        os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
                        moved.append(name)
                    os.chown(dst, st.st_uid, st.st_gid)
                    os.chmod(dst, stat.S_IMODE(st.st_mode))
                    os.rename(directory, self.root)  # over the workspace's own, now empty
                except OSError:
                    for name in moved:
                        with contextlib.suppress(OSError):
                            os.rename(name, name, src_dir_fd=dst, dst_dir_fd=src)
                    raise
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def remove(self) -> None:
        remove_tree(self.root)

    def seal(self) -> None:
        """Put the directory out of every task's reach where it is (the agent's, mode 0700): a
        finished result kept for the next start of the agent to commit, which the slot's later
        tasks (the same user as the task that wrote it) must neither read nor change."""
        os.chown(self.root, os.geteuid(), os.getegid(), follow_symlinks=False)
        os.chmod(self.root, 0o700, follow_symlinks=False)

    def retire(self) -> Path | None:
        """Put the directory out of every task's reach at once (mode 0700: the slot's next task
        runs as the same user) under a dot name, which the next start of the agent removes
        without a ledger line; where it went, to ``remove_tree`` later. None: it is removed
        here instead (it could not be renamed)."""
        gone = self.root.with_name(f".retired-{self.root.name}")
        try:
            os.chmod(self.root, 0o700)
            os.rename(self.root, gone)
        except FileNotFoundError:
            return None
        except OSError:
            remove_tree(self.root)
            return None
        return gone

    # --- outputs ------------------------------------------------------------------------------

    def outputs(
        self, max_file_bytes: int, max_total_bytes: int, max_files: int | None = None
    ) -> list[OutputFile]:
        """Every regular file under out/, checked: no symlink, FIFO, socket or device anywhere,
        only files the task's user owns, nothing over the caps (their size, their total, how
        many), and ``metrics.json`` present at the root. metrics.json comes last: the commit
        anchor goes up once everything else is there."""
        files: list[OutputFile] = []
        total = 0
        for rel, st in self._walk(["out"], skip=self.not_outputs):
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
            if max_files is not None and len(files) >= max_files:
                raise AttemptFailed(f"outputs hold more than {max_files} files (max_output_files)")
            files.append(OutputFile(rel, st.st_size, st.st_dev, st.st_ino))
        if not any(f.rel == "metrics.json" for f in files):
            raise AttemptFailed("the task wrote no out/metrics.json")
        files.sort(key=lambda f: (f.rel == "metrics.json", f.rel))
        return files

    def usage(self) -> Usage:
        """What the task's files under out/ and tmp/ take now, walked the way outputs are
        (nothing followed; what vanishes meanwhile is left out): the outputs' bytes and count,
        the disk all of it holds (blocks, so a sparse file counts what it really holds; a file
        with several names once; directories too) and how many files and directories that is
        (inodes, each once). Raises what the walk raises when it cannot read everything."""
        out_bytes = out_files = disk = inodes = 0
        seen: set[tuple[int, int]] = set()
        for top in ("out", "tmp"):
            for rel, st in self._walk([top], tolerant=True):
                output = top == "out" and rel.split("/", 1)[0] not in self.not_outputs
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
    def open_output(self, f: OutputFile) -> Iterator[BinaryIO]:
        """The output file the walk saw, opened without following anything; AttemptFailed when
        the name now leads elsewhere or the file changed size."""
        parts = f.rel.split("/")
        fd = self._open_dir(["out", *parts[:-1]])
        try:
            try:
                file_fd = _open(parts[-1], FILE_FLAGS, f"out/{f.rel}", dir_fd=fd)
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
                file_fd = _open(name, FILE_FLAGS, f"logs/{name}", dir_fd=fd)
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
        fd = _open(str(self.root), DIR_FLAGS, "the workspace")
        for name in parts:
            try:
                nxt = _open(name, DIR_FLAGS, "/".join(parts), dir_fd=fd)
            except OSError:
                where = "/".join(parts)
                raise AttemptFailed(f"{where} is not a directory of the workspace") from None
            finally:
                os.close(fd)
            fd = nxt
        return fd

    # --- checkpoints (out/ckpt/) ---------------------------------------------------------------

    def checkpoints(self) -> tuple[list[Checkpoint], int, dict[str, str]]:
        """The checkpoints under out/ckpt/ (by step, then name), the bytes of every regular file
        there (temporaries included), and the directories whose manifest cannot be used (name:
        why). Read the way outputs are: from directory descriptors, nothing followed; a
        checkpoint holding anything but regular files of the task's user has a ``problem``.
        A directory whose manifest.json is not whole yet is left out, as are entries that
        vanish meanwhile (the task renaming). AttemptFailed when out/ckpt is not a real
        directory or holds too many entries."""
        found: dict[str, list[tuple[str, os.stat_result]]] = {}
        total = 0
        for n, (rel, st) in enumerate(self._walk(["out", CKPT], tolerant=True)):
            if n >= MAX_CKPT_ENTRIES:
                raise AttemptFailed(f"out/{CKPT} holds more than {MAX_CKPT_ENTRIES} entries")
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
            top = rel.split("/", 1)[0]
            if CHECKPOINT_NAME.match(top) or manifests.DIRECTORY.match(top):
                found.setdefault(top, []).append((rel, st))
        checkpoints: list[Checkpoint] = []
        unusable: dict[str, str] = {}
        for name, entries in found.items():
            stats = dict(entries)
            head = stats.get(name)
            mf = stats.get(f"{name}/{manifests.MANIFEST_NAME}")
            if head is not None and stat.S_ISDIR(head.st_mode) and mf is not None:
                try:
                    c = self._manifest_checkpoint(name, stats, mf)
                except manifests.Invalid as exc:
                    unusable[name] = f"its {manifests.MANIFEST_NAME} cannot be used: {exc}"
                    continue
                if c is not None:
                    checkpoints.append(c)
            elif CHECKPOINT_NAME.match(name):  # the older layout: a file, or a directory
                checkpoints.append(_checkpoint(name, entries, self.task_uid))
        checkpoints.sort(key=lambda c: (c.step, c.name))
        return checkpoints, total, unusable

    def _manifest_checkpoint(
        self, name: str, stats: dict[str, os.stat_result], mf: os.stat_result
    ) -> Checkpoint | None:
        """out/ckpt/<name>/ in flashruntime's layout: its manifest read from a descriptor and
        checked, then every part it lists checked against what the walk saw. None while the
        manifest is not whole (it is written last, but not atomically); manifests.Invalid when
        it can never be used."""
        where = f"{CKPT}/{name}/{manifests.MANIFEST_NAME}"
        if not stat.S_ISREG(mf.st_mode):
            raise manifests.Invalid(f"it is not a regular file ({_kind(mf.st_mode)})")
        if self.task_uid is not None and mf.st_uid != self.task_uid:
            raise manifests.Invalid("it was not written by the task")
        if mf.st_size > manifests.MAX_MANIFEST_BYTES:
            raise manifests.Invalid(f"it is larger than {manifests.MAX_MANIFEST_BYTES} bytes")
        data = self._read_checkpoint_file(
            ["out", CKPT, name], manifests.MANIFEST_NAME, mf, manifests.MAX_MANIFEST_BYTES
        )
        if data is None:
            return None
        try:
            manifest = manifests.parse(data)
        except manifests.Invalid as exc:
            if str(exc) == manifests.NOT_JSON:
                return None  # still being written
            raise
        files: list[OutputFile] = []
        problem = ""
        for part in sorted(manifest.parts, key=lambda p: p.name):
            st = stats.get(f"{name}/{part.name}")
            if st is None:
                problem = problem or f"its part {part.name!r} is missing"
            elif not stat.S_ISREG(st.st_mode):
                problem = problem or f"its part {part.name!r} is not a regular file"
            elif self.task_uid is not None and st.st_uid != self.task_uid:
                problem = problem or f"its part {part.name!r} was not written by the task"
            elif st.st_size != part.size:
                problem = problem or (
                    f"its part {part.name!r} holds {st.st_size} bytes, not {part.size}"
                )
            else:
                rel = f"{CKPT}/{name}/{part.name}"
                files.append(OutputFile(rel, st.st_size, st.st_dev, st.st_ino))
        files.append(OutputFile(where, len(data), mf.st_dev, mf.st_ino))
        stamp = tuple((f.rel, f.size, 0, f.ino) for f in files)
        return Checkpoint(
            name, manifest.step, tuple(files), stamp, problem, directory=True, manifest=manifest
        )

    def _read_checkpoint_file(
        self, parts: list[str], name: str, seen: os.stat_result, limit: int
    ) -> bytes | None:
        """The bytes of a small file the walk saw, read from a descriptor; None when it changed
        meanwhile (not the file the walk saw, or its size differs)."""
        try:
            fd = self._open_dir(parts)
        except AttemptFailed:
            return None
        try:
            file_fd = _open(name, FILE_FLAGS, name, dir_fd=fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        with os.fdopen(file_fd, "rb") as fh:
            st = os.fstat(file_fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
                return None
            data = fh.read(limit + 1)
        return data if len(data) == seen.st_size <= limit else None

    def remove_checkpoint(self, name: str) -> None:
        """Delete out/ckpt/<name>, a file or a whole tree, through directory descriptors and
        following no link; best effort (what the task changes meanwhile may stay)."""
        fd = self._open_dir(["out", CKPT])
        try:
            _remove_at(fd, name, 0)
        finally:
            os.close(fd)

    def _walk(
        self, parts: list[str], skip: frozenset[str] = frozenset(), tolerant: bool = False
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
        stack = [_Dir("", self._open_dir(parts))]
        lowest = 0  # stack[lowest:] are open, the shallower ones closed
        try:
            try:
                stack[0].fill()
            except OSError as exc:
                _walk_error(exc, where, tolerant=False)
            while stack:
                d = stack[-1]
                if d.fd < 0:
                    if not self._reopen(d, parts, tolerant):
                        stack.pop()  # moved away while it was read (tolerant): the rest of it
                        lowest = min(lowest, len(stack))
                        continue
                    lowest = len(stack) - 1
                if not d.names:
                    stack.pop()
                    parent = stack[-1] if stack else None
                    if parent and parent.fd < 0 and self._reopen(parent, parts, tolerant, d.fd):
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

    def _reopen(self, d: _Dir, parts: list[str], tolerant: bool, child: int = -1) -> bool:
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
            fd = self._open_dir([*parts, *d.rel.split("/")])
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


def _open(name: str, flags: int, what: str, dir_fd: int | None = None) -> int:
    """``os.open``, but the agent out of descriptors is OutOfDescriptors, never a missing or
    changed file (which a caller may take for the task's doing)."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in NO_DESCRIPTORS:
            raise OutOfDescriptors(f"the agent ran out of file descriptors opening {what}") from exc
        raise


def _checkpoint(
    name: str, entries: list[tuple[str, os.stat_result]], task_uid: int | None
) -> Checkpoint:
    """One checkpoint from the walk's entries of out/ckpt/<name> (itself and what is under it)."""
    m = CHECKPOINT_NAME.match(name)
    assert m is not None
    step = int(m[1])
    files: list[OutputFile] = []
    stamp: list[tuple[str, int, int, int]] = []
    problem = ""
    for rel, st in sorted(entries, key=lambda e: e[0]):
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            continue
        if not rel.isprintable() or _surrogates(rel) or "\\" in rel:
            problem = problem or f"ckpt/{rel!r} has a name that is not printable UTF-8"
        elif stat.S_ISLNK(mode):
            problem = problem or f"ckpt/{rel} is a symlink"
        elif not stat.S_ISREG(mode):
            problem = problem or f"ckpt/{rel} is not a regular file ({_kind(mode)})"
        elif task_uid is not None and st.st_uid != task_uid:
            problem = problem or f"ckpt/{rel} was not written by the task"
        files.append(OutputFile(f"{CKPT}/{rel}", st.st_size, st.st_dev, st.st_ino))
        stamp.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    if not files:
        problem = problem or f"ckpt/{name} holds no file"
    elif len(files) > MAX_CHECKPOINT_FILES:
        problem = problem or f"ckpt/{name} holds more than {MAX_CHECKPOINT_FILES} files"
    top = next((st for rel, st in entries if rel == name), None)
    directory = top is not None and stat.S_ISDIR(top.st_mode)
    return Checkpoint(name, step, tuple(files), tuple(stamp), problem, directory=directory)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` and everything under it to ``uid``:``gid``, following no link. For a tree
    the agent made and no task has touched yet."""
    with contextlib.suppress(FileNotFoundError):
        os.chown(path, uid, gid, follow_symlinks=False)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)


def _remove_at(dir_fd: int, name: str, depth: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return
        if depth >= REMOVE_DEPTH:
            return
        sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        try:
            with os.scandir(sub) as it:
                names = [e.name for e in it]
            for child in names:
                _remove_at(sub, child, depth + 1)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        return


def remove_stale_workspaces(attempts_dir: Path, keep: set[str]) -> list[str]:
    """Remove attempt directories whose lease is not in ``keep``; the names (lease ids) of
    those that were not retired (``Workspace.retire``: their attempts ended)."""
    try:
        entries = list(attempts_dir.iterdir())
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        if entry.name not in keep and entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
            if not entry.name.startswith("."):
                removed.append(entry.name)
    return removed


def remove_tree(path: Path) -> None:
    """Remove a directory and everything below it, as deep as a task made it (no recursion: one
    descriptor at a time, a list of names back up) and without following any link (every step
    is relative to a directory descriptor, opened with O_NOFOLLOW; each step up is checked to be
    the very directory it came from). Best effort: what cannot be removed stays and is logged."""
    try:
        fd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror)
        return
    back: list[tuple[str, int, int]] = []  # (name, dev, ino) of each directory we went into
    try:
        while True:
            sub = None
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        sub = sub or entry.name
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
            if sub is not None:
                try:
                    child = os.open(sub, DIR_FLAGS, dir_fd=fd)
                except PermissionError:  # a task's mode 000 (an agent that is not root)
                    _allow_owner(fd, sub)
                    child = os.open(sub, DIR_FLAGS, dir_fd=fd)
                st = os.fstat(fd)
                back.append((sub, st.st_dev, st.st_ino))
                os.close(fd)
                fd = child
                continue
            if not back:
                break
            name, dev, ino = back.pop()
            parent = os.open("..", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise OSError(f"{path} changed while it was removed")
            os.rmdir(name, dir_fd=fd)
    except OSError as exc:
        log.warning("cannot remove all of %s: %s", path, exc)
        os.close(fd)
        return
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _allow_owner(dir_fd: int, name: str) -> None:
    """chmod u+rwx a directory without following a link: through a path-only descriptor."""
    path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
    finally:
        os.close(path_fd)


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
