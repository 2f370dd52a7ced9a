"""The owner's rules for this machine, as configured (``Rules``), and where they read from
(``Readers``).

The rules, by name (the names ``suspend_when`` takes):

* ``pause``: ``flashnode pause``. Holds claiming; with ``--now`` it also stops running tasks, an
  ending that is not the task's fault. Expires at its ``until`` (wall time) unless it has none.
* ``window``: ``run_windows``. Claims only inside one of the local-time windows.
* ``battery``: ``hold_on_battery``. Holds while the machine runs on battery.
* ``active``: ``hold_when_active``. Holds while the owner used the seat (keyboard, mouse) less than
  ``active_idle_seconds`` ago.
* ``load``: ``hold_above_load_percent``. Holds while other programs (the host's busy CPU share
  minus this agent's tasks' share) use more of the machine's CPU than this.

Every rule holds claiming; the ones named in ``suspend_when`` also ask that running tasks be
suspended while they hold. The readers are injected, so every rule is tested with fakes; the real
ones are in ``sensors.py`` and ``pausefile.py``. ``controls.py`` evaluates the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import tzinfo
from typing import TYPE_CHECKING, Literal

from flashnode.config.schedule import Pause, Window, parse_window

if TYPE_CHECKING:
    from flashnode.config.settings import Settings

RuleName = Literal["window", "battery", "active", "load"]
RULES: tuple[RuleName, ...] = ("window", "battery", "active", "load")


@dataclass(frozen=True)
class Rules:
    """The owner's rules, as configured (see ``Settings``: the owner-controls block)."""

    windows: tuple[Window, ...] = ()
    tz: tzinfo | None = None  # None: the system's local time
    on_battery: bool = False
    when_active: bool = False
    active_idle_seconds: float = 300.0
    load_percent: float | None = None
    clear_seconds: float = 60.0
    suspend: frozenset[RuleName] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> Rules:
        return cls(
            windows=tuple(parse_window(w) for w in settings.run_windows),
            tz=settings.windows_tzinfo,
            on_battery=settings.hold_on_battery,
            when_active=settings.hold_when_active,
            active_idle_seconds=settings.active_idle_seconds,
            load_percent=settings.hold_above_load_percent,
            clear_seconds=settings.hold_clear_seconds,
            suspend=frozenset(settings.suspend_when),
        )


CpuCounters = tuple[float, float]  # cumulative (busy, total) CPU seconds of the host, all cores


@dataclass
class Readers:
    """Where the rules read from. Each may raise or return None: "not measured".

    ``task_cpu`` maps each running task (any stable key, e.g. the lease id) to its cumulative
    CPU seconds (its cgroup's ``usage_usec``, or its process tree), summed over cores like
    ``host_cpu``. A task new since the last reading counts in full; a task that ended since loses
    its last interval (the error of one window at each task end).
    """

    pause: Callable[[], Pause | None] = lambda: None
    on_battery: Callable[[], bool | None] = lambda: None
    idle_seconds: Callable[[], float | None] = lambda: None
    host_cpu: Callable[[], CpuCounters | None] = lambda: None
    task_cpu: Callable[[], Mapping[str, float] | None] = dict
