"""The outbox: one durable record per live attempt in ``<state dir>/outbox/``.

A record is written as soon as a lease is claimed, updated at each state change (the task's
process identity when it starts; the checked outputs when it finished), and removed once the
attempt's outcome is final. After a crash of the agent, what is left here says what to clean up
and what may still be committed.

Durability: a record is always replaced atomically (write, rename), so a reader sees a whole
record. Only the ``finished`` record, a computed result, is flushed to the disk
(``fdatasync``, then the directory) before anything is uploaded: the other states matter only
while their processes live, and a machine crash ends those anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from pydantic import ValidationError

from flashnode.attempt.record import AttemptRecord
from flashnode.wire import SAFE_ID

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def _path(self, lease_id: str) -> Path:
        if not SAFE_ID.match(lease_id):
            raise ValueError(f"unsafe lease id {lease_id!r}")
        return self.dir / f"{lease_id}.json"

    def write(self, record: AttemptRecord, durable: bool = False) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self._path(record.lease_id)
        tmp = path.with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, record.model_dump_json().encode())
            if durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def read(self, lease_id: str) -> AttemptRecord | None:
        try:
            return AttemptRecord.model_validate_json(self._path(lease_id).read_bytes())
        except (OSError, ValueError, ValidationError):
            return None

    def remove(self, lease_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(lease_id).unlink()

    def leases(self) -> list[str]:
        """Lease ids with a record, oldest first."""
        try:
            entries = sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        return [p.stem for p in entries if SAFE_ID.match(p.stem)]
