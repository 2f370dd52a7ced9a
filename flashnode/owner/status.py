"""What ``flashnode status`` and the terminal status line show.

A running agent publishes a snapshot of itself to ``<state dir>/status.json`` (atomically, on
every change and at least every heartbeat); ``flashnode status`` reads it and checks that the
agent that wrote it is still alive. Per running attempt it holds the live view: when it started,
when its lease runs out (from the keeper's last renewal), whether it is suspended, checkpoints
shipped, bytes staged and uploaded; the owner controls' word (paused, which rules hold claiming)
sits beside them.

``status.json`` is the group ``flashnode``'s to read (the console's view-only level), so it never
holds what a task printed: each running task's last output line and the lines a failure's reason
quotes go to ``status-owner.json`` beside it, the agent's user's alone, written with the same
``updated_at`` (``write``). ``read`` puts them back where it may read that file and it belongs
to the same snapshot; elsewhere the snapshot says ``output_hidden`` (the file is not this
user's) or ``output_unavailable`` (it was not written).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeGuard

from flashnode import statefile
from flashnode.clock import duration, moment
from flashnode.errors import ExitCode, disk_full
from flashnode.sanitise import sanitise

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
OWNER_FILE = "status-owner.json"  # what a task printed: the agent's user's alone (``write``)
MERGE_TRIES = 5  # reads of both files while a publish falls between them (``read``) ...
MERGE_WAIT_S = 0.05  # ... this far apart
STALE_PERIODS = 3  # a snapshot older than this many of its promised periods is stale ...
STALE_FLOOR_S = 30.0  # ... and never one younger than this
DEFAULT_FRESH_FOR_S = 5.0  # the promise of a snapshot that states none (heartbeat_seconds)
BLOCK_BYTES = 4096
SLACK_BYTES = 1024  # what a snapshot may grow by and still be written in place


class StatusSink(Protocol):
    def status(self, text: str) -> None: ...
    def send(self, **fields: str | int) -> None: ...
    def tick(self) -> None: ...


# A failed task's reason quotes its last stderr lines after how it ended (``execute._verdict``).
_QUOTED_OUTPUT = re.compile(r"^(exit code -?\d+|killed by signal \d+): ")


def without_output(reason: str, where: str = "owner only") -> str:
    """A reason without the task's own lines it quotes (what the group ``flashnode`` reads:
    status.json, the ledger, the console's view-only level); ``where``: where they are."""
    found = _QUOTED_OUTPUT.search(reason)
    if found is None:
        return reason
    return reason[: found.end(1)] + f" (the task's last lines: {where})"


def write(state_dir: Path, snapshot: dict[str, Any]) -> None:
    """Readable by the agent's user and the ``flashnode`` group only: what a task printed (each
    running attempt's ``last_output``, the lines ``last_ended``'s reason quotes) is taken out
    and written first to ``OWNER_FILE``, the agent's user's alone, with the snapshot's
    ``updated_at`` (status.json then says ``owner_part``); that file is made at the first
    snapshot, so that on a full disk it too can be written in place. Both are padded with
    spaces to a whole number of blocks, with room to spare, so that on a full disk the next
    snapshot can still be written in place (and say that the disk is full)."""
    shared, hidden = _split(snapshot)
    owners = state_dir / OWNER_FILE
    if hidden is not None or not owners.exists():
        part = hidden or {"updated_at": snapshot.get("updated_at"), "last_output": {}}
        try:
            _write_padded(owners, part, 0o600, None)
        except OSError as exc:  # status.json still says the rest; ``read`` says this is missing
            _owner_failed(exc)
        else:
            _owner_failed(None)
    if hidden is not None:
        shared["owner_part"] = True
    _write_padded(state_dir / STATUS_FILE, shared, 0o640, statefile.STATUS_GROUP)


_failing = [False]  # the owner's part could not be written, and that is logged already


def _owner_failed(exc: OSError | None) -> None:
    if exc is None:
        _failing[0] = False
    elif not _failing[0]:
        _failing[0] = True
        log.error(
            "cannot write %s (%s): `flashnode status` shows the owner no task output",
            OWNER_FILE,
            exc.strerror or exc,
        )


def _write_padded(path: Path, snapshot: dict[str, Any], mode: int, group: str | None) -> None:
    data = json.dumps(snapshot, sort_keys=True).encode() + b"\n"
    data = data.ljust(-(-(len(data) + SLACK_BYTES) // BLOCK_BYTES) * BLOCK_BYTES)
    try:
        statefile.write(path, data, mode, group)
    except OSError as exc:
        if disk_full(exc) is None:
            raise
        statefile.overwrite(path, data.rstrip(b" "))


def _split(snapshot: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the snapshot without what a task printed, that part: None when there is none)."""
    outputs: dict[str, str] = {}
    running = []
    for attempt in snapshot.get("running") or []:
        attempt = dict(attempt)
        line = attempt.pop("last_output", None)
        if isinstance(line, str) and line:
            outputs[str(attempt.get("lease_id") or "")] = line
        running.append(attempt)
    shared = {**snapshot, "running": running}
    last = snapshot.get("last_ended")
    reason = last.get("reason") if isinstance(last, dict) else None
    kept = without_output(reason) if isinstance(reason, str) else reason
    if isinstance(last, dict) and kept != reason:
        shared["last_ended"] = {**last, "reason": kept}
    if not outputs and kept == reason:
        return shared, None
    hidden = {"updated_at": snapshot.get("updated_at"), "last_output": outputs, "reason": reason}
    return shared, hidden


def _merge(state_dir: Path, snapshot: dict[str, Any]) -> bool:
    """Put back what a task printed (``OWNER_FILE``) where this user may read it and it was
    written with this snapshot; else say it is hidden, when it is. False: read both again (the
    owner's part is of a later snapshot, published since status.json was read, or torn)."""
    try:
        hidden = json.loads((state_dir / OWNER_FILE).read_text())
    except PermissionError:
        snapshot["output_hidden"] = True
        return True
    except ValueError:  # written in place on a full disk, and read half way
        return False
    except OSError:
        return True
    if not isinstance(hidden, dict):
        return True
    theirs, ours = hidden.get("updated_at"), snapshot.get("updated_at")
    if theirs != ours:
        return not (_number(theirs) and _number(ours) and theirs > ours)
    lines = hidden.get("last_output")
    lines = lines if isinstance(lines, dict) else {}
    for attempt in snapshot.get("running") or []:
        line = lines.get(attempt.get("lease_id")) if isinstance(attempt, dict) else None
        if isinstance(line, str):
            attempt["last_output"] = line
    last, reason = snapshot.get("last_ended"), hidden.get("reason")
    if isinstance(last, dict) and isinstance(reason, str):
        last["reason"] = reason
    snapshot.pop("owner_part", None)
    return True


def read(state_dir: Path, strict: bool = False) -> dict[str, Any] | None:
    """The running agent's snapshot, or None when no agent runs on this state dir. ``strict``:
    PermissionError when this user may not read it (rather than None: "no agent"). What the
    tasks printed is in it where this user may read ``OWNER_FILE`` (the module docstring)."""
    snapshot: dict[str, Any] = {}
    for tries in range(MERGE_TRIES):  # again while a publish falls between the two reads
        if tries:
            time.sleep(MERGE_WAIT_S)
        found = _load(state_dir, strict)
        pid = found.get("pid") if found is not None else None
        if isinstance(pid, bool) or not isinstance(pid, int) or not agent_alive(pid):
            return None
        snapshot = found or {}
        if _merge(state_dir, snapshot):
            break
    if snapshot.pop("owner_part", None) and not snapshot.get("output_hidden"):
        snapshot["output_unavailable"] = True  # its file is missing, or of another snapshot
    now = time.time()
    beat = snapshot.get("last_heartbeat_at")
    snapshot["last_heartbeat_age_s"] = (
        round(now - beat, 1) if isinstance(beat, (int, float)) else None
    )
    for attempt in snapshot.get("running", []):
        attempt.update(ages(attempt, now))
    return snapshot


def _load(state_dir: Path, strict: bool) -> dict[str, Any] | None:
    snapshot = None
    for _ in range(3):  # a snapshot written in place (a full disk) may be read half-written
        try:
            snapshot = json.loads((state_dir / STATUS_FILE).read_text())
            break
        except ValueError:
            time.sleep(0.05)
        except PermissionError:
            if strict:
                raise
            return None
        except OSError:
            return None
    return snapshot if isinstance(snapshot, dict) else None


def staleness(snapshot: dict[str, Any], now: float) -> dict[str, Any]:
    """Whether a snapshot is stale: older than ``STALE_PERIODS`` of the period it promises
    (``fresh_for_s``), and never before ``STALE_FLOOR_S``. ``age_s``: seconds since it was
    written (None: it carries no time, and counts as stale); ``limit_s``: the age it may
    reach; ``since``: when it was written. The one rule ``flashnode status`` and the
    console both follow."""
    promise = snapshot.get("fresh_for_s")
    period = promise if _number(promise) and promise > 0 else DEFAULT_FRESH_FOR_S
    limit = max(STALE_PERIODS * period, STALE_FLOOR_S)
    written = snapshot.get("updated_at")
    if not _number(written):
        return {"stale": True, "age_s": None, "limit_s": limit, "since": None}
    age = round(max(now - written, 0.0), 1)
    return {"stale": age > limit, "age_s": age, "limit_s": limit, "since": written}


def current_exit(
    last_exit: dict[str, Any] | None, snapshot: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The last exit record while it still says something about this node, else None. Not
    an error: a clean stop; while an agent runs (``snapshot``), a second agent refused because
    it runs (exit 75), refused credentials (exit 77) once the running agent registered after
    that exit (the coordinator accepts them now), or any other exit before the running agent
    started (a setting or a prerequisite it got past, a crash it restarted after)."""
    if last_exit is None or not last_exit.get("code"):
        return None
    if snapshot is None:
        return last_exit
    code, at = last_exit.get("code"), last_exit.get("at")
    if code == ExitCode.LOCKED:
        return None
    registered, started = snapshot.get("registered_at"), snapshot.get("started_at")
    if code == ExitCode.CREDENTIALS:
        if _number(registered) and _number(at) and registered > at:
            return None
    elif _number(started) and _number(at) and at < started:
        return None
    return last_exit


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ages(attempt: dict[str, Any], now: float) -> dict[str, float | None]:
    """An attempt's wall-clock times as seconds from ``now``: elapsed, lease left, suspended."""

    def since(key: str, sign: float = 1.0) -> float | None:
        value = attempt.get(key)
        return round((now - value) * sign, 1) if _number(value) else None

    return {
        "elapsed_s": since("started_at"),
        "lease_left_s": since("lease_expires_at", -1.0),
        "suspended_s": since("suspended_since"),
    }


def size(n: Any) -> str:
    if not _number(n):
        return "-"
    for unit, factor in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{int(n)} B"


def percent(value: Any) -> str:
    """``0.15%``, ``97.2%``, ``1520%``: for the task's CPU and GPU figures (no exponents); ``-``
    when not measured."""
    if not _number(value):
        return "-"
    return f"{value:.3g}%" if value < 1000 else f"{value:.0f}%"


def attempt_line(attempt: dict[str, Any], now: float | None) -> str:
    """One attempt in a line (the terminal status line, systemd's STATUS, status.json's
    ``state``); with no ``now``, without its ages (status.json's: its readers work them out from
    its times). Never with what the task printed: systemd's STATUS is any local user's to read
    (``systemctl status``), and the line would rewrite status.json at each line it printed."""
    line = f"{attempt.get('lease_id')} ({attempt.get('job_id')}/{attempt.get('task_id')})"
    if now is None:
        line += f" {attempt.get('phase')}"
        if attempt.get("suspended_since") is not None:
            line += ", suspended"
    else:
        t = ages(attempt, now)
        line += f" {attempt.get('phase')} {duration(t['elapsed_s'])}"
        if t["suspended_s"] is not None:
            line += f", suspended {duration(t['suspended_s'])}"
        if t["lease_left_s"] is not None:
            line += f", lease {duration(t['lease_left_s'])} left"
    return sanitise(line)


def agent_alive(pid: int) -> bool:
    """True when ``pid`` is a live flashnode process.

    An agent that stopped writes ``pid: -1``; ``kill(-1, 0)`` (and ``kill(0, 0)``) would ask
    about every process (or our own group) and succeed as root, so only a positive pid counts.
    A pid reused by another program since the agent died is told apart by its command line.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc to tell by (not Linux): trust kill
    except OSError:
        return True
    return b"flashnode" in cmdline


def render(
    snapshot: dict[str, Any], last_exit: dict[str, Any] | None = None, now: float | None = None
) -> str:
    """``flashnode status``: what the agent does and, whenever it is not working, why and what
    to do about it (each hold with its fix, a coordinator it cannot reach, a refused reload, how
    the agent before it exited); what the node gave (from the ledger: it survives restarts)."""
    now = time.time() if now is None else now
    pools = ",".join(snapshot.get("pools") or []) or "-"
    stale = staleness(snapshot, now)
    lines = stale_lines(snapshot, stale, now) if stale["stale"] else []  # said first
    lines += [
        f"node        {snapshot.get('node_id') or '-'}",
        f"coordinator {snapshot.get('coordinator')}",
        f"runner      {snapshot.get('runner')}   pools {pools}",
        f"state       {snapshot.get('state')}",
    ]
    if _number(snapshot.get("started_at")):
        lines.append(f"started     {moment(snapshot['started_at'], now)}")
    rejoined = snapshot.get("rejoined")
    if isinstance(rejoined, int) and not isinstance(rejoined, bool) and rejoined > 0:
        lines.append(f"restarted   re-attached {rejoined} task(s) after a restart")
    lines.append(f"heartbeat   {_heartbeat(snapshot)}")
    lines += _given(snapshot.get("totals"))
    for problem in snapshot.get("coordinator_problems") or []:
        if isinstance(problem, dict):
            since = problem.get("since")
            when = f" since {moment(since, now)}" if _number(since) else ""
            lines.append(
                f"coordinator {problem.get('conversation')} failing{when}: {problem.get('error')}"
            )
            lines += _fix(problem.get("fix"), "  ")
    refused = snapshot.get("reload_refused")
    if isinstance(refused, dict):
        at = refused.get("at")
        when = f" at {moment(at, now)}" if _number(at) else ""
        lines.append(
            f"reload      refused{when}, running configuration kept: {refused.get('reason')}"
        )
        lines += _fix(RELOAD_FIX, "  ")
    controls = snapshot.get("controls") or {}
    held = controls.get("held_by") or []
    if held:
        lines.append("claiming    held")
        for h in held:
            also = " (suspends running tasks)" if h.get("suspends") else ""
            lines.append(f"  {h.get('rule')}: {h.get('reason')}{also}")
            lines += _fix(h.get("fix"), "    ")
    shown = current_exit(last_exit, snapshot)
    if shown is not None:
        lines += exit_lines(shown, now, before=snapshot.get("started_at"))
    last = snapshot.get("last_ended")
    if isinstance(last, dict):
        why = f": {last['reason']}" if last.get("reason") else ""
        line = (
            f"last ended  {last.get('lease_id')} ({last.get('job_id')}/{last.get('task_id')})"
            f" {last.get('outcome')}{why}"
        )
        if _number(last.get("ended_at")):
            line += f" at {moment(last['ended_at'], now)}"
        lines.append(line)
    running = snapshot.get("running") or []
    since = stale["since"]
    as_of = ""
    if stale["stale"] and running:
        as_of = f" (as of {moment(since, now)}: stale)" if _number(since) else " (stale)"
    lines.append(f"running     {len(running)}{as_of}")
    for a in running:
        pool = f"   pool {a['pool']}" if a.get("pool") else ""
        lines.append(f"  {a.get('lease_id')}  {a.get('job_id')}/{a.get('task_id')}{pool}")
        state = f"{a.get('phase')}, {duration(a.get('elapsed_s'))}"
        if a.get("suspended_s") is not None:
            state += f", suspended for {duration(a.get('suspended_s'))}"
            if a.get("suspend_reason"):
                state += f" ({a['suspend_reason']})"
        lines.append(f"    state        {state}")
        lines.append(f"    lease left   {duration(a.get('lease_left_s'))}")
        checkpoints = a.get("checkpoints")
        shipped = f"{checkpoints}" if _number(checkpoints) else "-"
        if a.get("checkpoint_step") is not None:
            shipped += f" (step {a['checkpoint_step']})"
        if a.get("resumed_from_step") is not None:
            shipped += f", resumed from step {a['resumed_from_step']}"
        lines.append(f"    checkpoints  {shipped}")
        if _number(a.get("metrics_step")):
            lines.append(f"    step logged  {a['metrics_step']} (its metrics.jsonl)")
        lines.append(
            f"    staged       {size(a.get('bytes_staged'))}"
            f"   uploaded {size(a.get('bytes_uploaded'))}"
        )
        facts = describe_facts(a)
        if facts:
            lines.append(f"    prepared     {facts}")
        use = a.get("usage") if isinstance(a.get("usage"), dict) else {}
        lines.append(
            f"    use now      cpu {percent(use.get('cpu_percent'))}"
            f"   memory {size(use.get('memory_bytes'))}   gpu {percent(use.get('gpu_percent'))}"
        )
        none = "-"
        if snapshot.get("output_hidden"):
            none = "owner only (sudo flashnode status)"
        elif snapshot.get("output_unavailable"):
            none = f"not available ({OWNER_FILE} not written: see the agent's log)"
        lines.append(f"    last output  {a.get('last_output') or none}")
    return "\n".join(sanitise(line) for line in lines)


def stale_lines(snapshot: dict[str, Any], stale: dict[str, Any], now: float) -> list[str]:
    """A stale snapshot: how old, what it promised, and what fails (the coordinator problems it
    carries; in any case the agent's loop, which has not written it since)."""
    since = stale["since"]
    when = moment(since, now) if _number(since) else "an unknown time"
    period = snapshot.get("fresh_for_s")
    promise = f"; it promises one every {duration(period)}" if _number(period) else ""
    lines = [
        f"STALE       status written {duration(stale['age_s'])} ago{promise}:"
        " what follows may no longer hold"
    ]
    failing = [
        str(p.get("conversation"))
        for p in snapshot.get("coordinator_problems") or []
        if isinstance(p, dict)
    ]
    if failing:
        lines.append(f"  failing: coordinator {', '.join(failing)} (below: since when, why)")
    lines.append(
        f"  the agent's loop has not written status since {when}; it may be stuck: see the"
        " journal (journalctl -u flashnode)"
    )
    return lines


RELOAD_FIX = (
    "correct the config file (`flashnode doctor` checks it), then reload: sudo systemctl reload"
    " flashnode (or send the agent SIGHUP)"
)


def render_stopped(last_exit: dict[str, Any] | None, totals: dict[str, Any] | None) -> str:
    """``flashnode status`` with no agent running: how the last one exited, and its fix."""
    lines = ["no agent is running on this state dir"]
    if last_exit is not None:
        lines += exit_lines(last_exit, time.time())
    lines += _given(totals)
    return "\n".join(sanitise(line) for line in lines)


def exit_lines(record: dict[str, Any], now: float, before: Any = None) -> list[str]:
    """How an agent exited (``lastexit.read``'s record): when, its code, why, its fix."""
    at = record.get("at")
    when = moment(at, now) if _number(at) else "-"
    code = record.get("code")
    if not code:
        return [f"last exit   stopped at {when} (exit 0)"]
    if _number(before) and _number(at):
        label = "an agent that started beside this one" if at >= before else "before this start"
        lines = [f"last exit   {label}: exit {code} at {when}: {record.get('error')}"]
    else:
        lines = [f"last exit   exit {code} at {when}: {record.get('error')}"]
    return lines + _fix(record.get("fix"), "  ")


def _fix(fix: Any, indent: str) -> list[str]:
    return [f"{indent}fix: {fix}"] if isinstance(fix, str) and fix else []


def _heartbeat(snapshot: dict[str, Any]) -> str:
    controls = snapshot.get("controls")
    held = controls.get("held_by") if isinstance(controls, dict) else None
    held = [h for h in held or [] if isinstance(h, dict)]
    if any(h.get("rule") == "credentials" for h in held):
        return "none: the coordinator refuses this node's credentials (see claiming, below)"
    if not snapshot.get("registered"):
        return "none yet: not registered with the coordinator"
    age = snapshot.get("last_heartbeat_age_s")
    return f"{duration(age)} ago" if _number(age) else "registered, none sent yet"


def _given(totals: Any) -> list[str]:
    """What the node gave (``LedgerView.totals``), today and all time, in two lines."""
    if not isinstance(totals, dict):
        return []
    lines: list[str] = []
    for label, key in (("today", "today"), ("all time", "all_time")):
        t = totals.get(key)
        if not isinstance(t, dict):
            continue
        found = t.get("outcomes")
        outcomes: dict[str, Any] = found if isinstance(found, dict) else {}
        counted = [f"{outcomes.get(k, 0)} {k}" for k in GIVEN]
        counted += [f"{v} {k}" for k, v in sorted(outcomes.items()) if k not in GIVEN and v]
        cpu, gpu = t.get("cpu_hours"), t.get("gpu_hours")
        hours = (
            f"CPU {given_time(cpu)}, GPU {given_time(gpu)}" if _number(cpu) and _number(gpu) else ""
        )
        lead = "given       " if not lines else "            "
        lines.append(f"{lead}{label}: {', '.join(counted)}; {hours}")
    return lines


GIVEN = ("committed", "failed", "lapsed")


def given_time(hours: float) -> str:
    """Hours of use as they read well for short work too: ``0 min``, ``42 s``, ``12 min``,
    ``3.4 h``, ``27 h``."""
    seconds = hours * 3600
    if seconds <= 0:
        return "0 min"
    if seconds < 60:
        return f"{max(round(seconds), 1)} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{hours:.1f} h" if hours < 10 else f"{round(hours)} h"


def describe_facts(attempt: dict[str, Any]) -> str:
    """What an attempt's phases reported (its status snapshot or its ledger line), in a few
    words: its job environment built or reused, its dataset bytes fetched and cache hits, the
    data lent to it, its task's pauses (how many, how long, the last one's why)."""
    words = []
    env = attempt.get("environment")
    if isinstance(env, dict):
        seconds = env.get("build_seconds")
        took = f" in {seconds:.1f} s" if isinstance(seconds, (int, float)) else ""
        words.append(f"env built{took}" if env.get("built") else "env reused")
    data = attempt.get("data")
    if isinstance(data, dict):
        fetched = data.get("bytes_fetched")
        size = f"{fetched / (1 << 20):.1f} MiB" if isinstance(fetched, (int, float)) else "?"
        words.append(f"data {size} fetched, {data.get('cache_hits', 0)} cache hit(s)")
    lent = attempt.get("local_inputs")
    if isinstance(lent, list) and lent:
        words.append("lent " + ",".join(str(x) for x in lent))
    pauses = attempt.get("pauses")
    if isinstance(pauses, dict) and isinstance(pauses.get("count"), int):
        listed = pauses.get("list")
        last = listed[-1] if isinstance(listed, list) and listed else {}
        why = last.get("why") if isinstance(last, dict) else None
        seconds = pauses.get("seconds")
        took = f" {duration(seconds)}" if isinstance(seconds, (int, float)) else ""
        words.append(f"paused {pauses['count']}x{took}" + (f" (last: {why})" if why else ""))
    return "; ".join(words)


class TerminalLine:
    """A one-line live status at the bottom of a terminal; log lines clear it first."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.text = ""

    def status(self, text: str) -> None:
        # Longer than the terminal is wide, the line would wrap and "\r" not clear it.
        text = sanitise(text, limit=shutil.get_terminal_size().columns - 1)
        self.text = text
        self.stream.write(f"\r\x1b[K{text}")
        self.stream.flush()

    def clear(self) -> None:
        self.stream.write("\r\x1b[K")

    def send(self, **fields: str | int) -> None:
        pass

    def tick(self) -> None:
        pass


class Sinks:
    """Several status sinks as one (systemd and the terminal line)."""

    def __init__(self, *sinks: StatusSink) -> None:
        self.sinks = sinks

    def status(self, text: str) -> None:
        for s in self.sinks:
            s.status(text)

    def send(self, **fields: str | int) -> None:
        for s in self.sinks:
            s.send(**fields)

    def tick(self) -> None:
        for s in self.sinks:
            s.tick()
