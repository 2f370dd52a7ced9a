"""How the last agent on a state dir ended: ``<state dir>/last-exit.json``.

``flashnode work`` writes it as it exits, whatever the way (refused credentials, a configuration
error, a missing prerequisite, the state dir held by another agent, a bug, or a clean stop), with
the error in the owner's words and its fix. ``flashnode status`` and the console read it: an agent
that is gone cannot say why any more, so the file says it for it. Readable by the ``flashnode``
group, like ``status.json``; writing it never fails the exit it records.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from flashnode import statefile
from flashnode.sanitise import sanitise

EXIT_FILE = "last-exit.json"
MAX_BYTES = 16 * 1024
TEXT_CHARS = 2000


def write(state_dir: Path, code: int, error: str, fix: str = "", now: float | None = None) -> None:
    """Record this process's exit (``code``; ``error`` empty for a clean stop). Best effort: a
    state dir that does not exist or cannot be written keeps no record."""
    record = {
        "version": 1,
        "at": time.time() if now is None else now,
        "pid": os.getpid(),
        "code": int(code),
        "error": sanitise(error, limit=TEXT_CHARS),
        "fix": sanitise(fix, limit=TEXT_CHARS),
    }
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    with contextlib.suppress(OSError):
        if state_dir.is_dir():
            statefile.write(state_dir / EXIT_FILE, data, 0o640, statefile.STATUS_GROUP)


def read(state_dir: Path) -> dict[str, Any] | None:
    """The record, or None (none kept, unreadable, or not one). Raises PermissionError when the
    file is there but this user may not read it (the caller says who may)."""
    try:
        fd = os.open(state_dir / EXIT_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        raise
    except OSError:
        return None
    try:
        data = os.read(fd, MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("version") != 1:
        return None
    at, code = record.get("at"), record.get("code")
    if not isinstance(at, (int, float)) or isinstance(code, bool) or not isinstance(code, int):
        return None
    return {
        "at": float(at),
        "pid": record.get("pid") if isinstance(record.get("pid"), int) else None,
        "code": code,
        "error": sanitise(str(record.get("error") or ""), limit=TEXT_CHARS),
        "fix": sanitise(str(record.get("fix") or ""), limit=TEXT_CHARS),
    }
