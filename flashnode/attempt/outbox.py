"""The outbox: one durable record per live attempt in ``<state dir>/outbox/``.

A record is written once the task's processes may exist (with how to find them: a restarted
agent lets every unfinished lease lapse, so nothing before that needs a record), updated when the
run finished (the checked outputs), and removed once the attempt's outcome is final. After a
crash of the agent, what is left here says what to clean up and what may still be committed.

Durability: a record is always replaced atomically (write, rename), so a reader sees a whole
record. Only the ``finished`` record, a computed result, is flushed to the disk
(``fdatasync``, then the directory) before anything is uploaded: the other states matter only
while their processes live, and a machine crash ends those anyway.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from pydantic import ValidationError

from flashnode import statefile
from flashnode.attempt.record import AttemptRecord
from flashnode.coordinator.ids import SAFE_ID

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._made = False

    def _path(self, lease_id: str) -> Path:
        if not SAFE_ID.match(lease_id):
            raise ValueError(f"unsafe lease id {lease_id!r}")
        return self.dir / f"{lease_id}.json"

    def write(self, record: AttemptRecord, durable: bool = False) -> None:
        if not self._made:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._made = True
        data = record.model_dump_json().encode()
        statefile.write(self._path(record.lease_id), data, 0o600, durable=durable)

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
