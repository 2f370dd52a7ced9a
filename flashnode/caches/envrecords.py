"""What the environment cache writes and tells of its environments: a record written whole or
not at all (``write_json``: an environment's meta.json, a failed build's entry; ``fsync_dir``:
a rename made durable), one finished environment as the owner sees it (``EnvInfo``) and the
owner's lines about them (``describe``, ``summary``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashnode.caches.envbox import size


@dataclass(frozen=True)
class EnvInfo:
    """One finished environment, for the owner's view and for eviction."""

    key: str
    python: str
    bytes: int
    last_used: float
    in_use: bool
    path: Path
    created: float = 0.0
    build_seconds: float = 0.0
    lines: tuple[str, ...] = ()


def write_json(path: Path, data: Mapping[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def describe(infos: Sequence[EnvInfo], budget: int) -> Iterator[str]:
    """Lines for the owner: one per environment, most recently used first, then the summary."""
    for info in sorted(infos, key=lambda i: i.last_used, reverse=True):
        names = [line for line in info.lines if not line.startswith("-")]
        shown = ", ".join(names[:4]) + (f", +{len(names) - 4}" if len(names) > 4 else "")
        yield (
            f"{info.key[:12]}  py{info.python:<5} {size(info.bytes):>9}  "
            f"{'in use' if info.in_use else 'idle  '}  {shown or '-'}"
        )
    yield summary(infos, budget)


def summary(infos: Sequence[EnvInfo], budget: int) -> str:
    """One line: how many environments, their bytes against the budget, how many in use."""
    used = sum(i.bytes for i in infos)
    busy = sum(1 for i in infos if i.in_use)
    return f"{len(infos)} environment(s), {size(used)} of {size(budget)} budget, {busy} in use"
