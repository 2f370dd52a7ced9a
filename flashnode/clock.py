"""Time, behind one small interface so that the loop can run on a fake clock in tests."""

from __future__ import annotations

import threading
import time
from datetime import datetime, tzinfo
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


# --- times as an owner reads them --------------------------------------------------------------


def duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h03m``, ``6d23h``; ``-`` when not known."""
    if seconds is None:
        return "-"
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def local(wall: float, tz: tzinfo | None = None) -> datetime:
    """``wall`` in ``tz`` (None: the system's local time), with its zone."""
    return (
        datetime.fromtimestamp(wall, tz)
        if tz is not None
        else datetime.fromtimestamp(wall).astimezone()
    )


def stamp(wall: float, tz: tzinfo | None = None) -> str:
    """``14:12:03 CEST``: a time of day with its zone, for a line that must not change every
    second (systemd's STATUS=, the terminal line)."""
    at = local(wall, tz)
    return f"{at:%H:%M:%S} {at.tzname() or format(at, '%z')}"


def moment(
    wall: float,
    now: float | None = None,
    tz: tzinfo | None = None,
    seconds: bool = True,
    day: bool = False,
) -> str:
    """A moment with its zone, and how far it is from ``now`` (default: the time now):
    ``14:12:03 CEST (5m ago)`` today, ``Tue 13:00 CEST (in 6d23h)`` within a week (``day``:
    the weekday even today), ``2024-06-11 13:00 CEST`` further off."""
    now = time.time() if now is None else now
    at, today = local(wall, tz), local(now, tz)
    clock = f"{at:%H:%M:%S}" if seconds else f"{at:%H:%M}"
    if at.date() == today.date() and not day:
        shown = clock
    elif abs(wall - now) < 7 * 86400:  # a weekday names one day of these
        shown = f"{at:%a} {clock}"
    else:
        shown = f"{at:%Y-%m-%d} {clock}"
    shown += f" {at.tzname() or format(at, '%z')}"
    ahead = wall - now
    if abs(ahead) < 1:
        return f"{shown} (now)"
    return f"{shown} (in {duration(ahead)})" if ahead > 0 else f"{shown} ({duration(-ahead)} ago)"
