"""How far a running task says it got: the ``step`` of the newest record in its
``out/metrics.jsonl`` (what ``flashruntime.torch.log_metrics`` appends, one JSON object a line).

The file is the task's: it may be a symlink, a FIFO, a device, huge, or half-written. It is
opened beneath the workspace without following anything, read only if it is a regular file the
task's user owns, and only its last ``TAIL_BYTES``; a line that does not parse, or a step that is
not a whole number, says nothing.
"""

from __future__ import annotations

import json
import os
import stat

from flashnode.errors import AttemptFailed, AttemptLapsed
from flashnode.sandbox.dirwalk import open_at, open_dir
from flashnode.sandbox.workspace import Workspace

METRICS_LOG = "metrics.jsonl"
TAIL_BYTES = 8192
FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def newest_metrics_step(ws: Workspace) -> int | None:
    """The newest whole-number ``step`` the task logged, None when it logged none (or the file
    is not one the agent reads)."""
    try:
        dir_fd = open_dir(ws.root, ["out"])
    except (AttemptFailed, AttemptLapsed, OSError):  # out of descriptors: not shown this time
        return None
    try:
        fd = open_at(METRICS_LOG, FLAGS, f"out/{METRICS_LOG}", dir_fd=dir_fd)
    except (AttemptLapsed, OSError):
        return None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (ws.task_uid is not None and st.st_uid != ws.task_uid):
            return None  # not a file, or not the task's (a hard link to someone else's)
        start = max(st.st_size - TAIL_BYTES, 0)
        data = os.pread(fd, TAIL_BYTES, start)
    except OSError:
        return None
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first may be cut
    for line in reversed(lines):
        step = _step(line)
        if step is not None:
            return step
    return None


def _step(line: bytes) -> int | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        return None
    return step
