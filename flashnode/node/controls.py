"""The owner's rules evaluated each turn (``Controls.evaluate``): "may this node claim?" and "must
running tasks pause?" (the rules: ``rules.py``; the answer: ``decision.py``).

Pure logic: what the rules read comes from injected readers and the time from an injected clock,
so every rule is tested with fakes and a fake clock.

A rule whose reading is unavailable (no battery, no logind seat, an unreadable counter) never
holds, and says so once in the log. An unreadable pause file is the exception: the owner asked
for something, so it fails closed (paused until resumed).

Hysteresis: ``battery`` and ``load`` hold at once but release only after their condition stayed
clear for ``hold_clear_seconds``; ``active`` releases when the owner has been idle for
``active_idle_seconds``, which is its own hysteresis; ``window`` and ``pause`` are exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from flashnode.clock import Clock, moment
from flashnode.config.schedule import Pause, minute_of_week, minutes_to_opening
from flashnode.node.decision import Decision, Hold
from flashnode.node.rules import CpuCounters, Readers, RuleName, Rules

log = logging.getLogger(__name__)

SENSOR_SECONDS = 5.0  # battery and seat are read at most this often
LOAD_WINDOW_SECONDS = 5.0  # the load is the CPU share over windows of at least this length


class _Latch:
    """On at once; off only after the condition stayed false for ``clear`` seconds."""

    def __init__(self) -> None:
        self.on = False
        self._clear_since: float | None = None

    def update(self, condition: bool, now: float, clear: float) -> bool:
        if condition:
            self.on, self._clear_since = True, None
        elif self.on:
            if self._clear_since is None:
                self._clear_since = now
            if now - self._clear_since >= clear:
                self.on, self._clear_since = False, None
        return self.on

    def reset(self) -> None:
        self.on, self._clear_since = False, None


@dataclass
class _Cached:
    value: Any = None
    read_at: float | None = None


@dataclass
class _LoadState:
    at: float | None = None
    host: CpuCounters | None = None
    tasks: dict[str, float] = field(default_factory=dict)
    percent: float | None = None


class Controls:
    """Evaluates the rules; call ``evaluate`` once per loop turn (cheap: sensors are throttled)."""

    def __init__(self, rules: Rules, readers: Readers, clock: Clock) -> None:
        self.rules = rules
        self._readers = readers
        self._clock = clock
        self._battery = _Cached()
        self._idle = _Cached()
        self._load = _LoadState()
        self._latches = {"battery": _Latch(), "load": _Latch()}
        self._unavailable: set[str] = set()
        self._last: Decision = Decision()

    def reconfigure(self, rules: Rules) -> None:
        """New rules (a reload): keep readings, restart the hysteresis of rules turned off."""
        if not rules.on_battery:
            self._latches["battery"].reset()
        if rules.load_percent is None:
            self._latches["load"].reset()
        self.rules = rules

    @property
    def last(self) -> Decision:
        """The decision of the latest ``evaluate`` (for status and metrics between turns)."""
        return self._last

    def evaluate(self) -> Decision:
        now, wall = self._clock.monotonic(), self._clock.wall()
        r = self.rules
        holds: list[Hold] = []
        stop: str | None = None

        pause, pause_reason = self._pause(wall)
        if pause is not None:
            fix = "flashnode resume (the console's Resume)"
            if pause.until is not None:
                fix += ", or wait: it ends by itself"
            holds.append(Hold("pause", pause_reason, fix=fix))
            if pause.mode == "now":
                stop = pause_reason

        if r.windows:
            minute = minute_of_week(datetime.fromtimestamp(wall, r.tz))
            if not any(w.contains(minute) for w in r.windows):
                holds.append(
                    Hold(
                        "window",
                        f"outside run_windows: {self._opening(wall, minute)}",
                        self._s("window"),
                        "it claims again when a window opens; to work now, change run_windows"
                        " (the config file or the console), then reload",
                    )
                )

        if r.on_battery:
            on = self._sensor("battery", self._battery, self._readers.on_battery, now)
            if self._latches["battery"].update(on is True, now, r.clear_seconds):
                why = (
                    "on battery"
                    if on
                    else f"on battery until recently (waits {r.clear_seconds:g} s on mains)"
                )
                fix = "plug the machine in, or set hold_on_battery = false"
                holds.append(Hold("battery", why, self._s("battery"), fix))

        if r.when_active:
            idle = self._sensor("active", self._idle, self._readers.idle_seconds, now)
            if isinstance(idle, (int, float)) and idle < r.active_idle_seconds:
                holds.append(
                    Hold(
                        "active",
                        f"the owner is at the machine (last input {idle:.0f} s ago;"
                        f" claims resume after {r.active_idle_seconds:g} s idle)",
                        self._s("active"),
                        "leave the seat idle, or set hold_when_active = false",
                    )
                )

        if r.load_percent is not None:
            percent = self._measure_load(now)
            above = percent is not None and percent > r.load_percent
            if self._latches["load"].update(above, now, r.clear_seconds):
                shown = "-" if percent is None else f"{percent:.0f}%"
                why = (
                    f"other programs use {shown} of the CPU (above {r.load_percent:g}%)"
                    if above
                    else f"other programs used more than {r.load_percent:g}% of the CPU until"
                    f" recently (now {shown}; waits {r.clear_seconds:g} s below)"
                )
                fix = "it claims again when other programs use less; or raise (or unset)"
                fix += " hold_above_load_percent"
                holds.append(Hold("load", why, self._s("load"), fix))

        decision = Decision(tuple(holds), stop, pause)
        self._log_changes(decision)
        self._last = decision
        return decision

    def _s(self, rule: RuleName) -> bool:
        return rule in self.rules.suspend

    def _opening(self, wall: float, minute: float) -> str:
        """``next opens Tue 13:00 CEST (in 6d22h)``: in the windows' zone, never ambiguous."""
        ahead = minutes_to_opening(self.rules.windows, minute)
        if ahead is None:
            return "no window ever opens"
        opens = wall + ahead * 60
        return f"next opens {moment(opens, wall, self.rules.tz, seconds=False, day=True)}"

    # --- readings ------------------------------------------------------------------------------

    def _pause(self, wall: float) -> tuple[Pause | None, str]:
        try:
            pause = self._readers.pause()
        except Exception as exc:  # the owner asked for something: fail closed
            self._note_unavailable("pause", f"the pause file is unreadable ({exc})", fail=True)
            return Pause("drain", None, 0.0), (
                f"the pause file is unreadable ({exc}); paused until `flashnode resume`"
            )
        self._note_available("pause")
        if pause is None or not pause.active(wall):
            return None, ""
        if pause.until is None:
            when = "until `flashnode resume`"
        else:
            when = f"until {moment(pause.until, wall, self.rules.tz, seconds=False)}"
        how = "running tasks stopped" if pause.mode == "now" else "running tasks finish"
        return pause, f"paused by the owner {when} ({how})"

    def _sensor(self, rule: str, cache: _Cached, read: Callable[[], Any], now: float) -> Any:
        if cache.read_at is None or now - cache.read_at >= SENSOR_SECONDS:
            try:
                cache.value = read()
            except Exception as exc:
                log.debug("owner control %s: reading failed: %s", rule, exc)
                cache.value = None
            cache.read_at = now
            if cache.value is None:
                self._note_unavailable(rule, _UNAVAILABLE[rule])
            else:
                self._note_available(rule)
        return cache.value

    def _measure_load(self, now: float) -> float | None:
        """Other programs' share of the machine's CPU over the last window, in percent."""
        st = self._load
        if st.at is not None and now - st.at < LOAD_WINDOW_SECONDS:
            return st.percent
        try:
            host = self._readers.host_cpu()
            tasks = self._readers.task_cpu()
        except Exception as exc:
            log.debug("owner control load: reading failed: %s", exc)
            host = tasks = None
        if host is None or tasks is None:
            self._note_unavailable("load", _UNAVAILABLE["load"])
            st.at, st.host, st.tasks, st.percent = now, None, {}, None
            return None
        self._note_available("load")
        previous, before = st.host, st.tasks
        st.at, st.host, st.tasks = now, host, dict(tasks)
        if previous is None:
            st.percent = None  # the first reading only starts the window
            return None
        busy, total = host[0] - previous[0], host[1] - previous[1]
        if total <= 0:
            return st.percent
        ours = 0.0
        for key, seconds in tasks.items():
            delta = seconds - before.get(key, 0.0)
            ours += delta if delta >= 0 else seconds  # a counter that restarted
        st.percent = round(min(max((busy - ours) / total * 100.0, 0.0), 100.0), 1)
        return st.percent

    # --- one log line per change ---------------------------------------------------------------

    def _note_unavailable(self, rule: str, why: str, fail: bool = False) -> None:
        if rule not in self._unavailable:
            self._unavailable.add(rule)
            if fail:
                log.error("owner control %s: %s", rule, why)
            else:
                log.warning("owner control %s: %s: the rule is off until it can be", rule, why)

    def _note_available(self, rule: str) -> None:
        if rule in self._unavailable:
            self._unavailable.discard(rule)
            log.info("owner control %s: readings are available again", rule)

    def _log_changes(self, new: Decision) -> None:
        old = {h.rule: h for h in self._last.holds}
        now = {h.rule: h for h in new.holds}
        for rule, hold in now.items():
            before = old.get(rule)
            if before is None or before.suspends != hold.suspends:
                also = " and suspends running tasks" if hold.suspends else ""
                log.info("owner control %s holds claiming%s: %s", rule, also, hold.reason)
        for rule in old.keys() - now.keys():
            log.info("owner control %s released", rule)
        if new.stop_reason and not self._last.stop_reason:
            log.info("owner control pause stops running tasks: %s", new.stop_reason)
        if self._last.holds and not new.holds:
            log.info("claiming resumes: no owner control holds")


_UNAVAILABLE = {
    "battery": "no battery reading on this machine",
    "active": "the seat's idle time is unavailable (no logind seat: a headless machine?)",
    "load": "the CPU counters are unreadable",
}
