"""Time, behind one small interface so that the loop can run on a fake clock in tests."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps; all timeouts are measured on it."""

    def wall(self) -> float:
        """Seconds since the epoch, for records only: never for timeouts."""

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait until ``event`` is set or ``timeout`` seconds pass; True if it is set."""

    def sleep(self, seconds: float) -> None:
        """Pause this thread (a poll's interval; never a synchronisation)."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(max(0.0, timeout))

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))
