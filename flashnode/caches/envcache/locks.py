"""The lock files under ``.locks/``, one per key (``KeyLocks``): flock shared while a task uses the
environment (a pin), exclusive to build or evict it, so that another process (``flashnode envs
prune``) never removes an environment a running task uses.

A lock file may be unlinked and made anew (the sweep removes those whose entry is gone): a holder
checks that the file it locked is still the one the path names (``same``) before it trusts it.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from flashnode.clock import Clock
from flashnode.errors import Cancelled, EnvUnavailable

RETRY_S = 0.1  # how often a waiter for an exclusive lock tries again


class KeyLocks:
    """The lock files in ``directory``. Each descriptor returned is the caller's to close (which
    releases its lock)."""

    def __init__(self, directory: Path, clock: Clock) -> None:
        self.directory = directory
        self._clock = clock

    def open(self, key: str) -> int:
        return os.open(self.directory / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def same(self, key: str, fd: int) -> bool:
        """The locked file is still the one the lock path names (it may have been replaced)."""
        try:
            return os.stat(self.directory / key).st_ino == os.fstat(fd).st_ino
        except OSError:
            return False

    def try_shared(self, key: str) -> int | None:
        """The lock file locked shared, or None when another holder has it exclusively."""
        return self._try(key, fcntl.LOCK_SH)

    def try_exclusive(self, key: str) -> int | None:
        """The lock file locked exclusively, or None when anyone else holds it."""
        return self._try(key, fcntl.LOCK_EX)

    def held(self, key: str) -> bool:
        """Whether anyone holds the key's lock now (a pin or a build, here or in another
        process)."""
        fd = self.open(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def exclusive(self, key: str, stop: threading.Event, deadline: float) -> int:
        """The lock file locked exclusively, waiting for the holders to let go; Cancelled when
        ``stop`` is set, EnvUnavailable past ``deadline`` (on the monotonic clock)."""
        while True:
            fd = self.open(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self.same(key, fd):
                    return fd
            except BlockingIOError:
                pass
            os.close(fd)
            if stop.is_set():
                raise Cancelled("stopped while waiting for the job environment")
            if self._clock.monotonic() >= deadline:
                raise EnvUnavailable("timed out waiting for the environment's lock")
            self._clock.wait(stop, RETRY_S)

    @staticmethod
    def downgrade(fd: int) -> None:
        """Exclusive to shared. Not atomic (flock(2)): the caller checks its entry again."""
        fcntl.flock(fd, fcntl.LOCK_SH)

    def _try(self, key: str, kind: int) -> int | None:
        fd = self.open(key)
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd
