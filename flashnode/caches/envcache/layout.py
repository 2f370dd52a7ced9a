"""The cache root's layout (the package's docstring draws it): its directories and their modes,
made at start, and the names that can be a key."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from flashnode.errors import EnvUnavailable

ENVS_DIR = "envs"  # the cache's directory in the state dir
PYTHON_DIR = ".python"  # the managed interpreters' directory in the cache

_KEY = re.compile(r"[0-9a-f]{64}")


def is_key(name: str) -> bool:
    """Whether ``name`` can be an environment's key (a sha256 in hex)."""
    return _KEY.fullmatch(name) is not None


@dataclass(frozen=True)
class Layout:
    """The directories under ``root``: ``tmp`` (builds under way, trees being removed), ``locks``
    (one lock file per key), ``failed`` (the negative cache) and ``python`` (uv's interpreters)."""

    root: Path

    @property
    def tmp(self) -> Path:
        return self.root / ".tmp"

    @property
    def locks(self) -> Path:
        return self.root / ".locks"

    @property
    def failed(self) -> Path:
        return self.root / ".failed"

    @property
    def python(self) -> Path:
        return self.root / PYTHON_DIR

    def setup(self) -> None:
        """Make the directories (or set their modes again); EnvUnavailable when it cannot."""
        try:
            for path, mode in (
                (self.root, 0o711),
                (self.tmp, 0o711),
                (self.locks, 0o700),
                (self.failed, 0o700),
                (self.python, 0o755),
            ):
                path.mkdir(exist_ok=True, mode=mode)
                path.chmod(mode)
            if os.geteuid() == 0:
                # Task users must reach <root>/<key>/env: let them search (not list) the dir
                # above, as the workspace does for attempts/.
                parent = self.root.parent
                parent.chmod(stat.S_IMODE(parent.stat().st_mode) | 0o111)
        except OSError as exc:
            raise EnvUnavailable(
                f"cannot set up the environment cache {self.root}: {exc}"
            ) from None
