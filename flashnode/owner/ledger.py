"""The local audit ledger: one JSON line per attempt, appended and fsynced.

The agent's ledger is ``0640``, group ``flashnode`` (``Ledger.shared``), as ``status.json`` is:
who may run ``flashnode status`` and look at the console (which shows the ledger's lines) may run
``flashnode history`` too; no one else. So, as status.json, it holds nothing a task printed: a
failure's reason is written without the task's last lines it quotes, which stay the owner's in
the attempt's kept logs (``flashnode logs``). A ledger an older agent made ``0600`` is opened up
when the agent opens it. Where the group cannot own it (no such group, an agent not in it) it
stays ``0600``, the agent's alone.

The ledger is bounded: once it holds ``ROTATE_BYTES`` it becomes ``ledger.jsonl.1`` (the one
before goes) and a new one starts: it keeps the last 60,000 attempts or more (a line is about a
kilobyte) in no more than twice ``ROTATE_BYTES``. Its readers read on from
where they were into the rotated file's rest (``rotated``); all-time totals are summed as the
lines go by (``ledgerview``), not read again.

A line that cannot be written (a full disk) is kept in memory, in order, and written before the
next one, or by ``flush``, which the agent's loop calls while lines wait: the ledger is complete
again once space is back. At most ``MAX_PENDING`` lines wait; an agent that stops meanwhile loses
them (its log has each attempt's outcome too).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from flashnode import statefile
from flashnode.owner.status import without_output

log = logging.getLogger(__name__)

MAX_PENDING = 10_000
ROTATE_BYTES = 64 << 20


def rotated(path: Path) -> Path:
    """Where a ledger goes once it holds ``ROTATE_BYTES`` (one generation is kept)."""
    return path.with_name(path.name + ".1")


class Ledger:
    def __init__(
        self, path: Path, group: str | None = None, rotate_bytes: int = ROTATE_BYTES
    ) -> None:
        """``group``: the group that may read it (the agent's ledger: ``shared``); None: a
        reader's ledger, or one that is the agent's alone. ``rotate_bytes``: its size at
        which it is rotated."""
        self.path = path
        self.group = group
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._failing = False
        self._rotate_failing = False

    @classmethod
    def shared(cls, path: Path) -> Ledger:
        """The agent's ledger, readable by group ``flashnode``; one that is there already gets
        that mode now (an older agent made it ``0600``)."""
        ledger = cls(path, statefile.STATUS_GROUP)
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                ledger._share(fd)
            finally:
                os.close(fd)
        return ledger

    def _share(self, fd: int) -> None:
        """``0640`` with the group when the group can own the file, else ``0600``."""
        if self.group is None:
            return
        st = os.fstat(fd)
        try:
            gid = grp.getgrnam(self.group).gr_gid
            if st.st_gid != gid:
                os.fchown(fd, -1, gid)
            mode = 0o640
        except (KeyError, PermissionError):
            mode = 0o600  # no such group, or the agent is not in it: its own group is no one's
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)

    @property
    def pending(self) -> int:
        """Lines waiting to be written."""
        return len(self._pending)

    def append(self, record: dict[str, Any]) -> None:
        """Write the line (after any still waiting; its reason without what the task printed);
        on an OSError keep it for later, and say so in the log once per stretch of failures."""
        reason = record.get("reason")
        if isinstance(reason, str):
            where = f"flashnode logs {record.get('lease_id') or '<lease>'}, while kept"
            record = {**record, "reason": without_output(reason, where)}
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            if len(self._pending) < MAX_PENDING:
                self._pending.append(line)
            else:
                log.error("ledger: %d lines wait already; this one is dropped", MAX_PENDING)
            self._write_pending()

    def records(self, last: int | None = None) -> list[dict[str, Any]]:
        """The ledger's lines (the rotated one's first), oldest first; only the ``last`` ones
        (read from the end)."""
        fds: list[int] = []
        try:
            # The ledger first: rotated between the two opens, both are the same file (read once).
            for path in (self.path, rotated(self.path)):
                try:
                    fds.append(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
                except FileNotFoundError:
                    fds.append(-1)
            now, before = fds
            if before >= 0 and (
                not stat.S_ISREG(os.fstat(before).st_mode)
                or (now >= 0 and os.fstat(now).st_ino == os.fstat(before).st_ino)
            ):
                before = -1
            lines = _lines(now, last)
            if last is None or len(lines) < last:
                lines = _lines(before, None if last is None else last - len(lines)) + lines
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        return parse(lines)

    def flush(self) -> None:
        """Write the lines that wait, if they can be written now."""
        with self._lock:
            if self._pending:
                self._write_pending()

    def _write_pending(self) -> None:
        waiting = len(self._pending)
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o600)
            try:
                if os.fstat(fd).st_size >= self.rotate_bytes and self._rotate():
                    os.close(fd)
                    fd = -1
                    fd = os.open(self.path, flags, 0o600)
                self._share(fd)
                while self._pending:
                    line = self._pending[0]
                    # Whole or not at all: a partly written line is cut back, so that the line
                    # written again later is not glued to its own first half.
                    size = os.fstat(fd).st_size
                    try:
                        if os.write(fd, line) != len(line):
                            raise OSError(errno.ENOSPC, "short write")
                    except OSError:
                        os.ftruncate(fd, size)
                        raise
                    self._pending.pop(0)
                os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.error(
                    "cannot write the ledger (%s): its lines are kept until they can be",
                    exc.strerror or exc,
                )
            return
        if self._failing:
            self._failing = False
            log.info("the ledger is written again (%d line(s) that waited)", waiting)

    def _rotate(self) -> bool:
        """Move the full ledger aside (the one before goes). False when it cannot be: it is
        then written on past its bound (said once), never held back."""
        try:
            os.replace(self.path, rotated(self.path))
        except OSError as exc:
            if not self._rotate_failing:
                self._rotate_failing = True
                log.error("cannot rotate the ledger (%s): it grows on", exc.strerror or exc)
            return False
        self._rotate_failing = False
        return True


def _lines(fd: int, last: int | None) -> list[bytes]:
    """The whole lines of an open ledger (-1: none), only the ``last`` ones."""
    if fd < 0:
        return []
    if last is not None:
        return tail_lines(fd, os.fstat(fd).st_size, last)
    return _all_lines(fd)[:-1]


def tail(path: Path, count: int, end: int | None = None) -> list[bytes]:
    """The last ``count`` whole lines of the ledger at ``path`` (before offset ``end``); none
    where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        return tail_lines(fd, os.fstat(fd).st_size if end is None else end, count)
    except OSError:
        return []
    finally:
        os.close(fd)


TAIL_CHUNK = 1 << 16


def tail_lines(fd: int, end: int, count: int) -> list[bytes]:
    """The last ``count`` whole lines before offset ``end`` of an open file (a line without its
    newline at ``end`` is not whole yet, and left out), read backwards in chunks."""
    if count <= 0:
        return []
    data, start = b"", end
    while start > 0 and data.count(b"\n") <= count:
        step = min(TAIL_CHUNK, start)
        start -= step
        data = os.pread(fd, step, start) + data
    lines = data.split(b"\n")[:-1]  # what follows the last newline is not a whole line
    if start > 0:
        lines = lines[1:]  # the first may be cut
    return lines[-count:]


def _all_lines(fd: int) -> list[bytes]:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks).split(b"\n")


def parse(lines: list[bytes]) -> list[dict[str, Any]]:
    """Ledger lines as records; a torn line (a crash mid-write) or one that is no object is
    skipped."""
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
