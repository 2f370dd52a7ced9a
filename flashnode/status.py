"""What ``flashnode status`` and the terminal status line show.

A running agent publishes a snapshot of itself to ``<state dir>/status.json`` (atomically, on
every change and at least every heartbeat); ``flashnode status`` reads it and checks that the
agent that wrote it is still alive.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

STATUS_FILE = "status.json"


class StatusSink(Protocol):
    def status(self, text: str) -> None: ...
    def send(self, **fields: str | int) -> None: ...
    def tick(self) -> None: ...


def write(state_dir: Path, snapshot: dict[str, Any]) -> None:
    path = state_dir / STATUS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snapshot, sort_keys=True))
    os.replace(tmp, path)


def read(state_dir: Path) -> dict[str, Any] | None:
    """The running agent's snapshot, or None when no agent runs on this state dir."""
    try:
        snapshot: dict[str, Any] = json.loads((state_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    pid = snapshot.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not agent_alive(pid):
        return None
    now = time.time()
    beat = snapshot.get("last_heartbeat_at")
    snapshot["last_heartbeat_age_s"] = (
        round(now - beat, 1) if isinstance(beat, (int, float)) else None
    )
    for attempt in snapshot.get("running", []):
        attempt["elapsed_s"] = round(now - attempt.get("started_at", now), 1)
    return snapshot


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


def render(snapshot: dict[str, Any]) -> str:
    pools = ",".join(snapshot.get("pools") or []) or "-"
    age = snapshot.get("last_heartbeat_age_s")
    lines = [
        f"node        {snapshot.get('node_id')}",
        f"coordinator {snapshot.get('coordinator')}",
        f"runner      {snapshot.get('runner')}   pools {pools}",
        f"state       {snapshot.get('state')}   last heartbeat {age} s ago",
        f"counters    {json.dumps(snapshot.get('counters') or {})}",
    ]
    running = snapshot.get("running") or []
    lines.append(f"running     {len(running)}")
    for a in running:
        line = f"  {a['lease_id']}  {a['job_id']}/{a['task_id']}  {a['elapsed_s']} s"
        facts = describe_facts(a)
        lines.append(f"{line}  ({facts})" if facts else line)
    return "\n".join(lines)


def describe_facts(attempt: dict[str, Any]) -> str:
    """What an attempt's phases reported (its status snapshot or its ledger line), in a few
    words: its job environment built or reused, its dataset bytes fetched and cache hits, the
    data lent to it."""
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
    return "; ".join(words)


class TerminalLine:
    """A one-line live status at the bottom of a terminal; log lines clear it first."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.text = ""

    def status(self, text: str) -> None:
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
