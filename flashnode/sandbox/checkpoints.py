"""The checkpoints a task leaves under ``out/ckpt/`` as the relay finds them: ``step-<N>`` files
and directories, and flashruntime's directories with a ``manifest.json`` (read from a descriptor
and checked, every part it lists checked against what the walk saw); each ``Checkpoint`` says
whether it can be shipped, and why not. Removing one follows no link.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from flashnode.coordinator import manifests
from flashnode.errors import AttemptFailed
from flashnode.sandbox.dirwalk import FILE_FLAGS, open_at, open_dir, walk
from flashnode.sandbox.outputs import OutputFile, kind, surrogates
from flashnode.sandbox.removal import remove_at
from flashnode.sandbox.workspace import CKPT, Workspace

# A complete checkpoint's name under out/ckpt/: step-<N>, or step-<N>.<ext> (a file).
CHECKPOINT_NAME = re.compile(r"^step-([0-9]{1,15})(?:\.[A-Za-z0-9][A-Za-z0-9._-]{0,63})?$")
MAX_CHECKPOINT_FILES = 1000
MAX_CHECKPOINT_DEPTH = 16  # directories a checkpoint's file may lie below its own
MAX_CKPT_ENTRIES = 10 * MAX_CHECKPOINT_FILES  # what one look at out/ckpt/ reads at most


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


def find_checkpoints(ws: Workspace) -> tuple[list[Checkpoint], int, dict[str, str]]:
    """The checkpoints under out/ckpt/ (by step, then name), the bytes of every regular file
    there (temporaries included), and the directories whose manifest cannot be used (name:
    why). Read the way outputs are: from directory descriptors, nothing followed; a
    checkpoint holding anything but regular files of the task's user has a ``problem``.
    A directory whose manifest.json is not whole yet is left out, as are entries that
    vanish meanwhile (the task renaming). AttemptFailed when out/ckpt is not a real
    directory or holds too many entries."""
    found: dict[str, list[tuple[str, os.stat_result]]] = {}
    total = 0
    for n, (rel, st) in enumerate(walk(ws.root, ["out", CKPT], tolerant=True)):
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
                c = _manifest_checkpoint(ws, name, stats, mf)
            except manifests.Invalid as exc:
                unusable[name] = f"its {manifests.MANIFEST_NAME} cannot be used: {exc}"
                continue
            if c is not None:
                checkpoints.append(c)
        elif CHECKPOINT_NAME.match(name):  # the older layout: a file, or a directory
            checkpoints.append(_checkpoint(name, entries, ws.task_uid))
    checkpoints.sort(key=lambda c: (c.step, c.name))
    return checkpoints, total, unusable


def _manifest_checkpoint(
    ws: Workspace, name: str, stats: dict[str, os.stat_result], mf: os.stat_result
) -> Checkpoint | None:
    """out/ckpt/<name>/ in flashruntime's layout: its manifest read from a descriptor and
    checked, then every part it lists checked against what the walk saw. None while the
    manifest is not whole (it is written last, but not atomically); manifests.Invalid when
    it can never be used."""
    where = f"{CKPT}/{name}/{manifests.MANIFEST_NAME}"
    if not stat.S_ISREG(mf.st_mode):
        raise manifests.Invalid(f"it is not a regular file ({kind(mf.st_mode)})")
    if ws.task_uid is not None and mf.st_uid != ws.task_uid:
        raise manifests.Invalid("it was not written by the task")
    if mf.st_size > manifests.MAX_MANIFEST_BYTES:
        raise manifests.Invalid(f"it is larger than {manifests.MAX_MANIFEST_BYTES} bytes")
    data = _read_checkpoint_file(
        ws, ["out", CKPT, name], manifests.MANIFEST_NAME, mf, manifests.MAX_MANIFEST_BYTES
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
        elif ws.task_uid is not None and st.st_uid != ws.task_uid:
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
    ws: Workspace, parts: list[str], name: str, seen: os.stat_result, limit: int
) -> bytes | None:
    """The bytes of a small file the walk saw, read from a descriptor; None when it changed
    meanwhile (not the file the walk saw, or its size differs)."""
    try:
        fd = open_dir(ws.root, parts)
    except AttemptFailed:
        return None
    try:
        file_fd = open_at(name, FILE_FLAGS, name, dir_fd=fd)
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


def remove_checkpoint(ws: Workspace, name: str) -> None:
    """Delete out/ckpt/<name>, a file or a whole tree, through directory descriptors and
    following no link; best effort (what the task changes meanwhile may stay)."""
    fd = open_dir(ws.root, ["out", CKPT])
    try:
        remove_at(fd, name, 0)
    finally:
        os.close(fd)


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
        if not rel.isprintable() or surrogates(rel) or "\\" in rel:
            problem = problem or f"ckpt/{rel!r} has a name that is not printable UTF-8"
        elif stat.S_ISLNK(mode):
            problem = problem or f"ckpt/{rel} is a symlink"
        elif not stat.S_ISREG(mode):
            problem = problem or f"ckpt/{rel} is not a regular file ({kind(mode)})"
        elif rel.count("/") > MAX_CHECKPOINT_DEPTH:
            problem = problem or f"ckpt/{rel} lies deeper than {MAX_CHECKPOINT_DEPTH} directories"
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
