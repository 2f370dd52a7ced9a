"""One disk budget per attempt, for what the agent writes for a job before its task starts.

Everything the agent writes into an attempt's workspace for the job (its inputs, plain or
unpacked, and the checkpoint it resumes from) reserves its room first (``Budget.take``), and
the attempt's task starts with what is left (``Reserved.start``): together they stay within
``task_disk_bytes`` and ``task_disk_files`` (directories count as inodes), and never take the
state dir's disk below ``min_free_bytes`` (and its share of the inodes), less what the tasks
running beside it may still write. Who pays is decided before the write, never read off an
ENOSPC: past the job's own caps, the job (``OverBudget``, a failure whose reason names the size
and the cap); past what the disk has now, the node (``ShortOfRoom``: the lease lapses, the node
holds its claims for a while, and the black-hole guard does not count it).

A download reserves each chunk before it writes it (``BudgetedFile``), so that a file whose size
nobody declared is stopped at the first chunk that does not fit; what two attempts write at the
same moment may pass the floor by at most a chunk each.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from flashnode.attempt.diskwatch import Reserved
    from flashnode.config.settings import Settings
    from flashnode.sandbox.diskuse import Space


class Budget:
    """The disk budget of attempt ``key`` as the phases before its task spend it."""

    def __init__(
        self,
        reserved: Reserved,
        key: str,
        settings: Settings,
        space: Callable[[], Space | None],
    ) -> None:
        self._reserved = reserved
        self._key = key
        self._settings = settings
        self._space = space

    def take(self, nbytes: int, inodes: int, what: str) -> None:
        """Count ``nbytes`` and ``inodes`` about to be written for the attempt; OverBudget or
        ShortOfRoom (nothing counted) when they do not fit."""
        self._reserved.stage(self._key, self._settings, self._space(), nbytes, inodes, what)

    def fits(self, nbytes: int, inodes: int, what: str) -> None:
        """Raise as ``take`` would for all of ``nbytes`` and ``inodes`` at once, counting
        nothing: a thing of known size is refused before its first byte."""
        self.take(nbytes, inodes, what)
        self.give_back(nbytes, inodes)

    def give_back(self, nbytes: int, inodes: int) -> None:
        """What was taken and is no longer on disk outside the task's files (removed, or moved
        under out/, where the task's own caps count it)."""
        self._reserved.unstage(self._key, nbytes, inodes)

    def mark(self) -> tuple[int, int]:
        """What the attempt holds now, to give back what was taken since (``since``)."""
        return self._reserved.staged(self._key)

    def since(self, mark: tuple[int, int]) -> tuple[int, int]:
        """The bytes and inodes taken since ``mark``."""
        now = self._reserved.staged(self._key)
        return max(0, now[0] - mark[0]), max(0, now[1] - mark[1])

    def room(self, what: str) -> Callable[[int, int], None]:
        """``take`` for ``what``, to hand to a writer (bytes, inodes)."""
        return lambda nbytes, inodes: self.take(nbytes, inodes, what)

    def open(self, fd: int, what: str) -> BudgetedFile:
        """A file to write through (taking ownership of ``fd``), each write taken first."""
        room = self.room(what)
        return BudgetedFile(fd, lambda n: room(n, 0))


class BudgetedFile(io.FileIO):
    """A file opened for writing whose every write takes its room from a budget first."""

    def __init__(self, fd: int, take: Callable[[int], None]) -> None:
        super().__init__(fd, "wb", closefd=True)
        self._take = take
        self.written = 0

    def write(self, b: ReadableBuffer, /) -> int:
        data = memoryview(b).cast("B")
        self._take(len(data))
        done = 0
        while done < len(data):
            done += super().write(data[done:]) or 0
        self.written += done
        return done
