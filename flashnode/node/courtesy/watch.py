"""The courtesy read and applied beside the running tasks, on a thread of its own
(``CourtesyWatch.run``): every ``FAST_S`` while a task holds a GPU (a GPU given back within a
second) and at once when an attempt starts, else every ``SLOW_S`` (no claim for a GPU the owner
uses or that runs hot).

Each turn: each GPU's processes and temperature (NVML) and the CPU's temperature, through
injected readers; the rules' verdict (``rules.py``) applied: the tasks on a GPU paused or run
again (``request_suspension`` with the source ``gpu`` for the owner's use, ``heat`` for
temperatures), stopped past ``gpu_yield_stop_seconds`` (``Stopped``: the lease lapses, its newest
checkpoint relayed), the blocked GPUs kept from claims (``GpuPool.block``); the power limits
follow the GPUs held (``power.py``).

Whose process is it: a pid on a GPU is the owner's unless it is one of a running task's (its
handle's ``pids``: the host's pids of its cgroup or container), is gone, or runs a program the
owner named in ``gpu_yield_ignore`` (its name as ``ps -o comm`` shows it). The tasks' pids are
asked again only when NVML lists a pid not known to be theirs (a container's are an engine
call), and at least every ``OURS_S``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashnode.attempt.record import State
from flashnode.clock import Clock
from flashnode.errors import Stopped
from flashnode.evidence.gpupool import Device, GpuPool
from flashnode.node.courtesy.power import PowerCap
from flashnode.node.courtesy.rules import Courtesy, CourtesyRules, GpuSeen, Verdict
from flashnode.node.decision import Hold

if TYPE_CHECKING:
    from flashnode.attempt import Attempt

log = logging.getLogger(__name__)

FAST_S = 0.5
SLOW_S = 5.0
CPU_S = 2.0  # the CPU's sensors at most this often
OURS_S = 5.0
COMM_LEN = 15  # the kernel keeps this much of a program's name
JOIN_S = 10.0  # the longest a stop waits for a turn under way (an NVML call that hangs)
WARN_AGAIN_S = 600.0  # an unreadable reading is said again at most this often


@dataclass
class Readers:
    """Where the courtesy reads from; each returns None for "unreadable"."""

    # pid -> whether it computes (holds memory) rather than only draws, on that GPU now
    processes: Callable[[Device, int], dict[int, bool] | None] = lambda d, since_us: None
    temperature: Callable[[Device], float | None] = lambda d: None
    cpu_temperature: Callable[[], float | None] = lambda: None
    process_name: Callable[[int], str | None] = lambda pid: None


class CourtesyWatch:
    def __init__(
        self,
        rules: CourtesyRules,
        readers: Readers,
        clock: Clock,
        gpus: GpuPool,
        power: PowerCap | None = None,
    ) -> None:
        self.courtesy = Courtesy(rules, clock)
        self._readers, self._clock, self._gpus, self._power = readers, clock, gpus, power
        self._ours: set[int] = set()
        self._ours_at: float | None = None
        self._cpu: tuple[float, float | None] | None = None  # (read at, °C)
        self._stopping = False
        self._wake = threading.Event()
        self._ran = threading.Event()  # run() has returned
        self._started = False
        self._foreign: set[int] = set()  # pids seen at the last asking that were not theirs
        self._known: dict[int, set[int]] = {}  # id(attempt) -> its pids as last said
        self._warned: dict[str, float] = {}  # reading -> when last said unreadable
        self._said: dict[str, str] = {}  # visible (or "cpu") -> the pause logged

    @property
    def rules(self) -> CourtesyRules:
        return self.courtesy.rules

    def reconfigure(self, rules: CourtesyRules) -> None:
        self.courtesy.reconfigure(rules)

    def start(self) -> None:
        """At the agent's start: power limits an earlier run left changed set back."""
        if self._power is not None:
            self._power.restore_left(self._gpus.devices, self._gpus.held())

    def run(self, attempts: Callable[[], list[Attempt]], grace: Callable[[], float]) -> None:
        """Turn until ``stop``; never raises (a turn that fails is logged, the next one runs)."""
        self._started = True
        try:
            while not self._stopping:
                try:
                    wait = self.tick(attempts(), grace())
                except Exception:
                    log.exception("the owner's courtesy failed a turn")
                    wait = SLOW_S
                self._clock.wait(self._wake, wait)
                self._wake.clear()
        finally:
            self._ran.set()

    def wake(self) -> None:
        """A turn now (an attempt started: its GPU is watched from here on)."""
        self._wake.set()

    def stop(self) -> None:
        """No more turns; returns once a turn under way has ended (the shutdown's own work
        on the attempts and power limits must not cross one)."""
        self._stopping = True
        self._wake.set()
        if self._started:
            self._ran.wait(JOIN_S)

    def close(self, run_on: set[str]) -> None:
        """The agent leaves: the owner's power limits again where no task runs on (``run_on``:
        the GPUs of tasks let go of for the next start)."""
        if self._power is not None:
            self._power.close(self._gpus.devices, self._gpus.held() | run_on)

    def tick(self, attempts: Sequence[Attempt], grace: float) -> float:
        """One turn; the seconds until the next."""
        devices = list(self._gpus.devices)
        seen = self._read(devices, attempts)
        verdict = self.courtesy.evaluate(seen, self._cpu_celsius(bool(attempts)))
        self._gpus.block(dict(verdict.blocked))
        self._log(verdict, devices)
        for attempt in attempts:
            gpus = [d.visible for d in attempt.devices]
            stop = verdict.stop_reason(gpus)
            # A task that started (its memory on the GPU) and whose result is not in hand.
            started = attempt.handle is not None and attempt.result is None
            if stop is not None and started and attempt.record.state is not State.FINISHED:
                attempt.cancel(Stopped(stop), grace)
            attempt.request_suspension(verdict.owner_reason(gpus), source="gpu")
            attempt.request_suspension(verdict.heat_reason(gpus), source="heat")
        if self._power is not None:  # the owner's own limit while it is the owner's
            self._power.follow(devices, self._gpus.held() - verdict.owner.keys())
        return FAST_S if any(a.devices for a in attempts) else SLOW_S

    def holds(self) -> list[Hold]:
        """The node's holds on claiming: every GPU blocked, or the CPU too hot (which also
        suspends every task)."""
        v, devices = self.courtesy.last, self._gpus.devices
        holds = []
        if devices and all(d.visible in v.blocked for d in devices):
            why = "; ".join(dict.fromkeys(v.blocked.values()))
            fixes = []
            if v.owner:
                fixes.append(
                    "it claims again once a GPU has been free for gpu_yield_resume_seconds; a"
                    " program named there that is not your use of the GPU: add it to"
                    " gpu_yield_ignore (or set gpu_yield = false)"
                )
            if v.hot:
                fixes.append(
                    "it claims again once a GPU is cool; or raise gpu_temperature_limit_c (0: off)"
                )
            holds.append(Hold("courtesy", why, fix="; ".join(fixes)))
        if v.cpu_hot:
            fix = "cool the machine, or raise cpu_temperature_limit_c (0: off)"
            holds.append(Hold("courtesy", v.cpu_hot, suspends=True, fix=fix))
        return holds

    # --- readings -----------------------------------------------------------------------------

    def _read(self, devices: Sequence[Device], attempts: Sequence[Attempt]) -> dict[str, GpuSeen]:
        """Each GPU now: the owner's processes on it, and its temperature."""
        r, rules = self._readers, self.rules
        listed: dict[str, dict[int, bool] | None] = {}
        if rules.gpu_yield:
            since = self._since_us()
            for d in devices:
                what = f"processes of GPU {d.info.index}"
                listed[d.visible] = self._safe(what, r.processes, d, since)
        every = set().union(*(found for found in listed.values() if found))
        ours, unsure = self._our_pids(every, attempts)
        seen = {}
        for d in devices:
            found = listed.get(d.visible)
            others: dict[int, str] | None = None
            computing = False
            if found is not None and d.visible not in unsure:
                others = {}
                for pid, compute in found.items():
                    name = r.process_name(pid) if pid not in ours else None
                    if name is not None and not _ignored(name, rules.ignore):
                        others[pid] = name
                        computing = computing or compute
            temperature = None
            if rules.gpu_limit_c is not None:
                temperature = self._safe(f"temperature of GPU {d.info.index}", r.temperature, d)
            seen[d.visible] = GpuSeen(f"GPU {d.info.index}", others, temperature, computing)
        return seen

    def _our_pids(self, listed: set[int], attempts: Sequence[Attempt]) -> tuple[set[int], set[str]]:
        """(the tasks' pids, the GPUs whose task's pids are not known now). The handles are
        asked again only for a pid in ``listed`` seen neither as theirs nor as another's at the
        last asking (a container's are an engine call), or ``OURS_S`` after it. A handle that
        cannot say (an engine that does not answer) keeps the pids it said last, and its GPUs
        are not judged until it says again: a task is never the owner's by mistake."""
        now = self._clock.monotonic()
        stale = self._ours_at is None or now - self._ours_at >= OURS_S
        unsure: set[str] = set()
        if stale or not listed <= self._ours | self._foreign:
            known, ours = {}, set()
            for attempt in attempts:
                handle = attempt.handle
                if handle is None:
                    continue
                key = id(attempt)
                try:
                    pids = handle.pids() or self._known.get(key, set())
                except Exception:
                    pids = self._known.get(key, set())
                    unsure.update(d.visible for d in attempt.devices)
                known[key] = pids
                ours |= pids
            self._known, self._ours = known, ours
            self._ours_at = None if unsure else now  # asked again at the next turn
            self._foreign = set()
        if not unsure:
            self._foreign |= listed - self._ours
        return self._ours, unsure

    def _cpu_celsius(self, running: bool) -> float | None:
        if self.rules.cpu_limit_c is None:
            return None
        now = self._clock.monotonic()
        if self._cpu is None or now - self._cpu[0] >= (CPU_S if running else SLOW_S):
            self._cpu = (now, self._safe("the CPU's temperature", self._readers.cpu_temperature))
        return self._cpu[1]

    def _since_us(self) -> int:
        return int((self._clock.wall() - 2 * FAST_S) * 1e6)

    def _safe(self, what: str, read: Callable[..., Any], *args: Any) -> Any:
        try:
            value = read(*args)
        except Exception as exc:
            log.debug("courtesy: reading %s failed: %s", what, exc)
            value = None
        now = self._clock.monotonic()
        said = self._warned.get(what)
        if value is None and (said is None or now - said >= WARN_AGAIN_S):
            self._warned[what] = now
            log.warning("courtesy: %s cannot be read: that rule is off until it can be", what)
        return value

    def _log(self, verdict: Verdict, devices: Sequence[Device]) -> None:
        blocked = verdict.blocked
        now = {d.visible: blocked[d.visible] for d in devices if d.visible in blocked}
        if verdict.cpu_hot:
            now["cpu"] = verdict.cpu_hot
        for key, why in now.items():
            if key not in self._said:
                log.info(
                    "courtesy: pausing the tasks on %s: %s",
                    "every task" if key == "cpu" else f"GPU {key}",
                    why,
                )
        for key in self._said.keys() - now.keys():
            log.info("courtesy: %s free again", "the CPU" if key == "cpu" else f"GPU {key}")
        self._said = now


def _ignored(name: str, ignore: frozenset[str]) -> bool:
    return any(name[:COMM_LEN] == program[:COMM_LEN] for program in ignore)
