"""What the owner's courtesy asks of each GPU's tasks now (``Courtesy.evaluate``): pure logic on
readings and an injected clock, so every rule is tested with fakes.

Per GPU:

* **The owner's use** (``gpu_yield``, on by default): a process on the GPU that is none of this
  node's tasks' and no program the owner named to ignore (``gpu_yield_ignore``). The tasks on
  that GPU pause at once, and only those; nothing claims it. Past ``gpu_yield_stop_seconds`` of
  the owner's use (from its start: a break shorter than ``gpu_yield_resume_seconds`` does not
  restart the count) they are stopped while one of the owner's processes computes on it, so
  that the GPU's memory is the owner's again (one that only draws, a window, pauses them but
  never stops them). Once the GPU has had none of the owner's processes for
  ``gpu_yield_resume_seconds``, paused tasks run on and it is claimed for again.
* **Heat** (``gpu_temperature_limit_c``): at or above the limit (``CONFIRM`` readings in a row)
  the GPU's tasks pause and nothing claims it, until it is below the limit less ``HYSTERESIS_C``
  and was last at the limit ``HOT_HOLD_S`` ago: a temperature that hovers at the limit holds the
  pause, and one that falls fast once the load is off (a CPU's) does not flap it.

For the CPU (``cpu_temperature_limit_c``): the same heat rule, for every task and every claim.

A reading that fails never starts a hold (a GPU whose processes cannot be read is not the
owner's, an unreadable temperature is not too hot; a hot one stays so for ``UNREAD_S`` at most):
the watch says so in the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashnode.clock import Clock

if TYPE_CHECKING:
    from flashnode.config.settings import Settings

HYSTERESIS_C = 10.0  # a paused hot device runs again this far below its limit
HOT_HOLD_S = 10.0  # ... and no sooner than this after it was last at its limit
CONFIRM = 2  # readings in a row at the limit that make a device hot
UNREAD_S = 60.0  # a hot device whose temperature cannot be read is taken as cool after this


@dataclass(frozen=True)
class CourtesyRules:
    """The owner's courtesy, as configured (see ``Settings``)."""

    gpu_yield: bool = True
    stop_seconds: float = 300.0
    resume_seconds: float = 30.0
    ignore: frozenset[str] = frozenset()
    gpu_limit_c: float | None = 85.0
    cpu_limit_c: float | None = 100.0

    @classmethod
    def from_settings(cls, s: Settings) -> CourtesyRules:
        return cls(
            gpu_yield=s.gpu_yield,
            stop_seconds=s.gpu_yield_stop_seconds,
            resume_seconds=s.gpu_yield_resume_seconds,
            ignore=frozenset(s.gpu_yield_ignore),
            gpu_limit_c=s.gpu_temperature_limit_c or None,  # 0: off
            cpu_limit_c=s.cpu_temperature_limit_c or None,
        )


@dataclass(frozen=True)
class GpuSeen:
    """One reading of one GPU: the owner's processes on it (pid → name; this node's tasks and
    the ignored programs left out; None: unreadable), whether one of them computes on it, and its
    temperature (None: unreadable)."""

    label: str  # "GPU 0"
    others: Mapping[int, str] | None = None
    temperature: float | None = None
    computing: bool = False  # one of the owner's processes computes on it (holds its memory)


@dataclass(frozen=True)
class Verdict:
    """What the GPUs' tasks do now, by GPU (its ``visible`` name), each with why."""

    owner: Mapping[str, str] = field(default_factory=dict)  # the owner's: its tasks pause
    hot: Mapping[str, str] = field(default_factory=dict)  # too hot: its tasks pause
    stop: Mapping[str, str] = field(default_factory=dict)  # its tasks stop (the lease lapses)
    cpu_hot: str | None = None  # every task pauses, no claim

    @property
    def blocked(self) -> dict[str, str]:
        """The GPUs no claim may take, each with why."""
        out = dict(self.hot)
        for gpu, why in self.owner.items():
            out[gpu] = f"{out[gpu]}; {why}" if gpu in out else why
        return out

    def owner_reason(self, gpus: list[str]) -> str | None:
        """Why a task on ``gpus`` pauses for the owner's use (None: it does not)."""
        return "; ".join(self.owner[g] for g in gpus if g in self.owner) or None

    def heat_reason(self, gpus: list[str]) -> str | None:
        """Why a task on ``gpus`` pauses for heat (a GPU's, or the CPU's)."""
        why = [self.hot[g] for g in gpus if g in self.hot]
        return "; ".join([*why, self.cpu_hot] if self.cpu_hot else why) or None

    def stop_reason(self, gpus: list[str]) -> str | None:
        return next((self.stop[g] for g in gpus if g in self.stop), None)


@dataclass
class _Yield:
    since: float | None = None  # the owner's use began (monotonic); None: the GPU is ours
    free_since: float | None = None  # none of the owner's processes since
    who: str = ""


class _Heat:
    """Hot after ``CONFIRM`` readings in a row at or above the limit (one spike is not heat);
    cool again only below it less ``HYSTERESIS_C``, ``HOT_HOLD_S`` after it was last at the
    limit. A reading that fails keeps the state, for ``UNREAD_S`` at most."""

    def __init__(self) -> None:
        self.hot = False
        self._over = 0  # readings in a row at or above the limit
        self._at_limit = 0.0  # when it was last at or above the limit (monotonic)
        self._read_at = 0.0  # the last reading that did not fail

    def update(self, celsius: float | None, limit: float | None, now: float) -> bool:
        if limit is None:
            self.hot, self._over = False, 0
        elif celsius is None:
            if now - self._read_at >= UNREAD_S:
                self.hot, self._over = False, 0
        elif celsius >= limit:
            self._read_at, self._at_limit, self._over = now, now, self._over + 1
            self.hot = self.hot or self._over >= CONFIRM
        else:
            self._read_at, self._over = now, 0
            if celsius < limit - HYSTERESIS_C and now - self._at_limit >= HOT_HOLD_S:
                self.hot = False
        return self.hot


class Courtesy:
    """The rules' state across readings; call ``evaluate`` with each new reading."""

    def __init__(self, rules: CourtesyRules, clock: Clock) -> None:
        self.rules = rules
        self._clock = clock
        self._yields: dict[str, _Yield] = {}
        self._heat: dict[str, _Heat] = {}
        self._cpu = _Heat()
        self.last = Verdict()

    def reconfigure(self, rules: CourtesyRules) -> None:
        if not rules.gpu_yield:
            self._yields.clear()
        self.rules = rules

    def evaluate(self, gpus: Mapping[str, GpuSeen], cpu_celsius: float | None) -> Verdict:
        now, r = self._clock.monotonic(), self.rules
        owner: dict[str, str] = {}
        hot: dict[str, str] = {}
        stop: dict[str, str] = {}
        for visible, seen in gpus.items():
            heat = self._heat.setdefault(visible, _Heat())
            if heat.update(seen.temperature, r.gpu_limit_c, now):
                why = (
                    f"{seen.label} at {seen.temperature:.0f} °C (limit {r.gpu_limit_c:g} °C;"
                    f" runs again below {r.gpu_limit_c - HYSTERESIS_C:g} °C)"
                    if seen.temperature is not None and r.gpu_limit_c is not None
                    else f"{seen.label} too hot"
                )
                hot[visible] = why
            if r.gpu_yield:
                use = self._owner(visible, seen, now)
                if use is not None:
                    owner[visible] = use[0]
                    if use[1] is not None:
                        stop[visible] = use[1]
        cpu_hot = None
        if self._cpu.update(cpu_celsius, r.cpu_limit_c, now):
            cpu_hot = (
                f"the CPU at {cpu_celsius:.0f} °C (limit {r.cpu_limit_c:g} °C;"
                f" runs again below {r.cpu_limit_c - HYSTERESIS_C:g} °C)"
                if cpu_celsius is not None and r.cpu_limit_c is not None
                else "the CPU too hot"
            )
        self.last = Verdict(owner, hot, stop, cpu_hot)
        return self.last

    def _owner(self, visible: str, seen: GpuSeen, now: float) -> tuple[str, str | None] | None:
        """(why the GPU's tasks pause, why they stop now or None) while the owner has it."""
        r = self._yields.setdefault(visible, _Yield())
        others = seen.others
        if others:
            if r.since is None:
                r.since = now
            r.free_since = None
            r.who = ", ".join(f"{name} (pid {pid})" for pid, name in sorted(others.items())[:3])
            if len(others) > 3:
                r.who += f" and {len(others) - 3} more"
        elif r.since is not None:
            if r.free_since is None:
                r.free_since = now
            if now - r.free_since >= self.rules.resume_seconds:
                self._yields[visible] = _Yield()
                return None
        if r.since is None:
            return None
        used = now - r.since
        if r.free_since is not None:
            why = (
                f"{seen.label} was the owner's ({r.who}) until {now - r.free_since:.0f} s ago;"
                f" runs again after {self.rules.resume_seconds:g} s free"
            )
        else:
            why = f"the owner uses {seen.label}: {r.who}"
        ending = None
        # Only while the owner computes on it now: a window that draws needs none of its memory.
        if used >= self.rules.stop_seconds and r.free_since is None and seen.computing:
            ending = (
                f"the owner has used {seen.label} for {used:.0f} s"
                f" (gpu_yield_stop_seconds {self.rules.stop_seconds:g}): its task was stopped"
                " to free the GPU's memory; the lease lapses (not the task's fault)"
            )
        return why, ending
