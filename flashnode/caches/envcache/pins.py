"""What this process holds of the cache (``Pins``): the builds under way, which the other threads
asking for the same environment wait on, and the pins, a count per key. One lock guards both, and
the negative cache too: every method here is called with ``lock`` held."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Build:
    """A build under way in this process: ``done`` is set when it ended, ``error`` is what it
    raised (None: it succeeded)."""

    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Pins:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.builds: dict[str, Build] = {}
        self._counts: dict[str, int] = {}

    def add(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    def drop(self, key: str) -> None:
        left = self._counts.get(key, 1) - 1
        if left > 0:
            self._counts[key] = left
        else:
            self._counts.pop(key, None)

    def busy(self, key: str) -> bool:
        """Pinned, or being built, by this process."""
        return bool(self._counts.get(key)) or key in self.builds
