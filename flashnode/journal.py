"""The durable per-attempt record in the state dir: one JSON file per live lease.

A record is written (atomically, fsynced) as soon as a lease is claimed, updated when the task's
processes start (their identity: pid, start time, ownership token, cgroup) and when the attempt
has finished and its outputs passed their checks (state ``finished``: the outbox), and removed
once the attempt's outcome is final. After a crash, what is left here says what to clean up and
what may still be committed.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from flashnode.wire import SAFE_ID


class Journal:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def _path(self, lease_id: str) -> Path:
        if not SAFE_ID.match(lease_id):
            raise ValueError(f"unsafe lease id {lease_id!r}")
        return self.dir / f"{lease_id}.json"

    def write(self, lease_id: str, record: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self._path(lease_id)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(record, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def update(self, lease_id: str, **fields: Any) -> None:
        record = self.read(lease_id) or {}
        record.update(fields)
        self.write(lease_id, record)

    def read(self, lease_id: str) -> dict[str, Any] | None:
        try:
            value = json.loads(self._path(lease_id).read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def remove(self, lease_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(lease_id).unlink()

    def leases(self) -> list[str]:
        """Lease ids with a record, oldest first. Unreadable records are skipped."""
        try:
            entries = sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        return [p.stem for p in entries if SAFE_ID.match(p.stem)]
