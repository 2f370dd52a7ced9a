"""A pinned environment as a task gets it (``EnvHandle``): its venv and interpreter, what its
``PATH`` needs, and the pin given back once."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType


class EnvHandle:
    """A pinned environment: it cannot be evicted until ``release()`` (or the end of a ``with``).

    ``path`` is the venv; ``python`` its interpreter (what a module task runs); ``built`` tells
    whether this acquire built it, and ``build_seconds`` how long that took (0 when reused).
    ``unpin`` is the cache's, called once with the key and the lock file's descriptor the pin
    holds (shared).
    """

    def __init__(
        self,
        key: str,
        path: Path,
        lock_fd: int,
        built: bool,
        build_seconds: float,
        unpin: Callable[[str, int], None],
    ) -> None:
        self.key = key
        self.path = path
        self.python = path / "bin" / "python"
        self.built = built
        self.build_seconds = build_seconds
        self._unpin = unpin
        self._fd: int | None = lock_fd
        self._release_lock = threading.Lock()

    def env(self, path: str = os.defpath) -> dict[str, str]:
        """What an argv task's environment needs: ``VIRTUAL_ENV``, and ``PATH`` with the
        environment's ``bin`` first, then ``path`` (the task's own search path)."""
        bin_dir = str(self.path / "bin")
        return {"VIRTUAL_ENV": str(self.path), "PATH": f"{bin_dir}:{path}" if path else bin_dir}

    def release(self) -> None:
        """Unpin (idempotent); the budget is enforced again once nothing uses the env."""
        with self._release_lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            self._unpin(self.key, fd)

    def __enter__(self) -> EnvHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
