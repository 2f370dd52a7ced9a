"""The attempt directory: its layout, its making, and who owns what in it.

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
Every walk of it goes through directory descriptors the agent opened itself, never following a
link (``openat`` with ``O_NOFOLLOW``), each in its own module: ``dirwalk`` (the walk),
``outputs`` (the output walk and every read of an output: an ``out`` that is not a real directory
and any file its task's user did not write are refused; an upload reads from a descriptor
checked to be the very file the walk saw), ``checkpoints`` (out/ckpt/) and ``removal``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from flashnode.sandbox.dirwalk import DIR_FLAGS
from flashnode.sandbox.removal import remove_tree

WORK = "/work"  # where a task sees its workspace (a container's mount, the sandbox's bind)
CKPT = "ckpt"  # out/ckpt/: where a checkpointing task writes its checkpoints


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


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` and everything under it to ``uid``:``gid``, following no link. For a tree
    the agent made and no task has touched yet."""
    with contextlib.suppress(FileNotFoundError):
        os.chown(path, uid, gid, follow_symlinks=False)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)
