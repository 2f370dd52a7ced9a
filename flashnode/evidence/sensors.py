"""What the owner-control rules read from the host (the edge of ``node/rules.py``'s ``Readers``).

Every reader returns None for "not measured here", never raises for an ordinary absence:

* ``on_battery``: ``psutil.sensors_battery()``. No battery (a desktop, a server, a VM) is None,
  which the battery rule reads as "not on battery"; so is a battery whose plug state is unknown.
* ``seat_idle_seconds``: seconds since the last input at the machine's seat, from logind
  (``loginctl show-seat seat0``: ``IdleHint`` and ``IdleSinceHintMonotonic``), 0 while the seat
  is in use. None where there is no logind or no seat0, as on a headless server or in a
  container: the "active" rule is unavailable there. Graphical sessions report idleness only when
  their desktop sets logind's idle hint (GNOME and KDE do, after their own idle delay); text
  consoles are idle after a few minutes without keystrokes.
* ``host_cpu_times``: cumulative (busy, total) CPU seconds of the host (``sampler``).
* ``cpu_temperature``: the hottest CPU sensor psutil reads (coretemp, k10temp, zenpower,
  cpu_thermal, …), in °C; None where none can be read (a VM, a container, most servers' BMC-only
  sensors): the CPU heat rule is off there.
* ``process_name``: a process's name (its ``comm``), None once it is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable

import psutil

from flashnode.evidence.sampler import host_cpu_times

__all__ = [
    "cpu_temperature",
    "host_cpu_times",
    "on_battery",
    "parse_seat",
    "process_name",
    "seat_idle_seconds",
]

SEAT = "seat0"
# psutil's names of the CPU's own sensors (not a disk's, a GPU's or the board's)
CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal")
LOGINCTL_TIMEOUT = 3.0


def on_battery() -> bool | None:
    """True on battery, False on mains, None without a battery (or an unknown plug state)."""
    read = getattr(psutil, "sensors_battery", None)
    if read is None:
        return None
    try:
        battery = read()
    except Exception:
        return None
    if battery is None or battery.power_plugged is None:
        return None
    return not battery.power_plugged


def parse_seat(text: str, now_usec: int) -> float | None:
    """``loginctl show-seat`` key=value output → seconds since the last input (0: in use)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    hint = values.get("IdleHint")
    if hint == "no":
        return 0.0
    if hint != "yes":
        return None
    since = values.get("IdleSinceHintMonotonic", "")
    if not since.isdigit():
        return None
    # 0 means idle since logind started (no session has had input): idle since boot, at most.
    return max(now_usec - int(since), 0) / 1e6


def seat_idle_seconds(
    loginctl: str | None = None,
    run: Callable[[list[str]], str] | None = None,
) -> float | None:
    """Seconds since the last input at seat0, or None where that cannot be known."""
    binary = loginctl or shutil.which("loginctl")
    if binary is None:
        return None
    argv = [
        binary,
        "--no-pager",
        "show-seat",
        SEAT,
        "--property=IdleHint",
        "--property=IdleSinceHintMonotonic",
    ]
    try:
        out = (run or _run)(argv)
    except (OSError, subprocess.SubprocessError):
        return None
    # CLOCK_MONOTONIC, the clock logind's *Monotonic properties use.
    return parse_seat(out, time.monotonic_ns() // 1000)


def _run(argv: list[str]) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "SYSTEMD_PAGER": ""}
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=LOGINCTL_TIMEOUT,
        env=env,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    return done.stdout


def cpu_temperature() -> float | None:
    """The hottest of the CPU's sensors now, in °C; None where none can be read. k10temp's
    ``Tctl`` (offset on some Ryzens) only where it has no ``Tdie``/``Tccd``."""
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    try:
        sensors = read()
    except Exception:
        return None
    found = []
    for name in CPU_SENSORS:
        entries = [t for t in sensors.get(name, ()) if isinstance(t.current, (int, float))]
        die = [t for t in entries if t.label.startswith(("Tdie", "Tccd"))]
        found += [t.current for t in (die or entries) if 0 < t.current < 150]
    return float(max(found)) if found else None


def process_name(pid: int) -> str | None:
    """``pid``'s name (its comm, unprintable characters as ``?``), None once it is gone or a
    zombie (it holds nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    name, _, rest = stat.partition("(")[2].rpartition(")")
    if rest.split()[:1] in (["Z"], ["X"], []):
        return None
    return "".join(c if c.isprintable() else "?" for c in name) or "?"
