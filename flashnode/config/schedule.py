"""The owner's time vocabulary, as the settings and ``flashnode pause`` write it: run windows
(``run_windows``), durations (``pause --for``) and the pause record (``pause.json``). Pure parsing,
shared by the settings, the pause file and the owner controls (``node/controls.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

PauseMode = Literal["drain", "now"]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
DAY_MINUTES = 24 * 60
WEEK_MINUTES = 7 * DAY_MINUTES

# --- time windows ----------------------------------------------------------------------------

_TIME = re.compile(r"^([01][0-9]|2[0-4]):([0-5][0-9])$")
_DAY_TOKEN = re.compile(r"^[A-Za-z]+(-[A-Za-z]+)?(,[A-Za-z]+(-[A-Za-z]+)?)*$")
WINDOW_SYNTAX = (
    'DAYS, HH:MM-HH:MM or both, e.g. "Mon-Fri 19:00-07:00", "Sat-Sun", "Mon,Wed 09:00-17:00"'
)


@dataclass(frozen=True)
class Window:
    """One ``run_windows`` entry: intervals in minutes of the week, Monday 00:00 = 0.

    An interval may end past the end of the week (Sunday 22:00-02:00); ``contains`` wraps it.
    A time range that ends at or before its start crosses midnight: it starts on the named days
    and ends on the day after.
    """

    text: str
    intervals: tuple[tuple[int, int], ...]

    def contains(self, minute: float) -> bool:
        for start, end in self.intervals:
            if start <= minute < end or start <= minute + WEEK_MINUTES < end:
                return True
        return False


def parse_window(text: str) -> Window:
    """Parse one window strictly; raise ValueError naming what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"a run window must be a string ({WINDOW_SYNTAX})")
    parts = text.split()
    if not parts or len(parts) > 2:
        raise ValueError(f"{text!r} is not a run window ({WINDOW_SYNTAX})")
    days: list[int] | None = None
    span: tuple[int, int] | None = None
    if len(parts) == 2:
        days, span = _parse_days(text, parts[0]), _parse_span(text, parts[1])
    elif ":" in parts[0]:
        span = _parse_span(text, parts[0])
    else:
        days = _parse_days(text, parts[0])
    if days is None:
        days = list(range(7))
    start, end = span if span is not None else (0, DAY_MINUTES)
    if end <= start:
        end += DAY_MINUTES  # crosses midnight: ends on the next day
    intervals = tuple((d * DAY_MINUTES + start, d * DAY_MINUTES + end) for d in days)
    return Window(text, intervals)


def _parse_days(text: str, part: str) -> list[int]:
    if not _DAY_TOKEN.match(part):
        raise ValueError(f"{text!r}: {part!r} is not a list of days ({WINDOW_SYNTAX})")
    days: list[int] = []
    for item in part.split(","):
        first, _, last = item.partition("-")
        a = _day(text, first)
        b = _day(text, last) if last else a
        d = a
        while True:  # a range may wrap the week: Fri-Mon
            if d in days:
                raise ValueError(f"{text!r}: {DAYS[d].title()} is named twice")
            days.append(d)
            if d == b:
                break
            d = (d + 1) % 7
    return days


def _day(text: str, name: str) -> int:
    low = name.lower()
    for i, (short, full) in enumerate(zip(DAYS, FULL_DAYS, strict=True)):
        if low in (short, full):
            return i
    raise ValueError(f"{text!r}: unknown day {name!r} (use Mon Tue Wed Thu Fri Sat Sun)")


def _parse_span(text: str, part: str) -> tuple[int, int]:
    first, sep, last = part.partition("-")
    a, b = _TIME.match(first), _TIME.match(last)
    if not sep or a is None or b is None:
        raise ValueError(f"{text!r}: {part!r} is not a time range HH:MM-HH:MM (24-hour clock)")
    start = int(a[1]) * 60 + int(a[2])
    end = int(b[1]) * 60 + int(b[2])
    if start >= DAY_MINUTES:
        raise ValueError(f"{text!r}: a window cannot start at 24:00")
    if end > DAY_MINUTES:
        raise ValueError(f"{text!r}: {last} is past 24:00")
    if start == end % DAY_MINUTES:
        raise ValueError(
            f"{text!r}: the range {part} is empty or a whole day; for whole days name only the days"
        )
    return start, end


def minute_of_week(local: datetime) -> float:
    return (
        local.weekday() * DAY_MINUTES
        + local.hour * 60
        + local.minute
        + (local.second + local.microsecond / 1e6) / 60
    )


def minutes_to_opening(windows: tuple[Window, ...], minute: float) -> float | None:
    """Minutes from ``minute`` (of the week) until the next window opens; None: none ever does."""
    ahead = [(start - minute) % WEEK_MINUTES for w in windows for start, _ in w.intervals]
    return min(ahead) if ahead else None


# --- durations -------------------------------------------------------------------------------

_DURATION = re.compile(r"^(?:[0-9]{1,6}[smhdw])+$")
_DURATION_PART = re.compile(r"([0-9]+)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_PAUSE_SECONDS = 366 * 86400


def parse_duration(text: str) -> float:
    """``30m``, ``2h``, ``1d``, ``1h30m``, ``90s``, ``1w`` → seconds; raise ValueError otherwise."""
    value = text.strip().lower()
    if not _DURATION.match(value):
        raise ValueError(
            f"{text!r} is not a duration: use a number and a unit (s, m, h, d, w), e.g. 30m, 2h, 1d"
        )
    seconds = sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    if seconds <= 0:
        raise ValueError(f"{text!r} is zero: a pause must last some time")
    if seconds > MAX_PAUSE_SECONDS:
        raise ValueError(f"{text!r} is longer than a year: pause without --for instead")
    return float(seconds)


# --- the explicit pause ----------------------------------------------------------------------


@dataclass(frozen=True)
class Pause:
    """What ``flashnode pause`` wrote; ``until`` (wall time) None: until ``flashnode resume``."""

    mode: PauseMode = "drain"
    until: float | None = None
    since: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "mode": self.mode, "until": self.until, "since": self.since}

    @classmethod
    def from_json(cls, data: Any) -> Pause:
        """Strict: anything but what ``to_json`` writes raises ValueError."""
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a version 1 pause record")
        if set(data) - {"version", "mode", "until", "since"}:
            raise ValueError("unknown keys in the pause record")
        mode, until, since = data.get("mode"), data.get("until"), data.get("since", 0.0)
        if mode not in ("drain", "now"):
            raise ValueError(f"pause mode {mode!r} is neither drain nor now")
        for name, value in (("until", until), ("since", since)):
            if value is None and name == "until":
                continue
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                raise ValueError(f"pause {name} {value!r} is not a time")
        return cls(mode, None if until is None else float(until), float(since))

    def active(self, wall: float) -> bool:
        return self.until is None or wall < self.until
