"""The machine owner's commands, and what they share: how each finds what the packaged service
uses without flags (the config ``/etc/flashnode/flashnode.toml``, the credentials ``flashnode
login`` keeps in ``/etc/flashnode/credentials``, handed to the service with ``LoadCredential=``,
and the state dir ``/var/lib/flashnode``, the service's ``StateDirectory=``); ``status`` and
``history`` are here, the others in their own modules beside this one (``login``, ``doctor``,
``pools``, ``controls``, ``envs``; ``main`` holds ``work`` and assembles them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from flashnode.clock import duration
from flashnode.config.loading import read_config_file
from flashnode.config.settings import DEFAULT_CONFIG_FILE, default_state_dir
from flashnode.errors import ConfigError, ExitCode
from flashnode.owner import lastexit, status
from flashnode.owner.ledger import Ledger
from flashnode.owner.ledgerview import CHECKPOINT_FILE, LedgerView
from flashnode.runners.registry import load_settings
from flashnode.sanitise import sanitise

config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    help="TOML config file [default: /etc/flashnode/flashnode.toml when present].",
)
state_dir_option = click.option(
    "--state-dir",
    # Not readable=True: the service's state dir is 0711 (members of group flashnode reach
    # status.json in it without listing it).
    type=click.Path(path_type=Path, readable=False),
    default=None,
    help="The agent's state dir [default: the config's state_dir, else /var/lib/flashnode as"
    " root, else ~/.local/state/flashnode, else the service's /var/lib/flashnode].",
)
credentials_dir_option = click.option(
    "--credentials-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where stored credentials live [default: the config's credentials_dir, else"
    " /etc/flashnode/credentials as root, else ~/.config/flashnode/credentials].",
)


def stop(code: ExitCode, message: str) -> NoReturn:
    click.echo(f"flashnode: {sanitise(message)}", err=True)
    sys.exit(int(code))


SERVICE_STATE_DIR = Path("/var/lib/flashnode")  # systemd/flashnode.service's StateDirectory=


def state_dir_of(config_file: Path | None, state_dir: Path | None) -> Path:
    """The state dir an owner's command reads: given, configured, this user's default, or (a
    member of group flashnode who is not root) the packaged service's."""
    if state_dir is not None:
        return state_dir
    try:
        found = load_settings({}, os.environ, config_file).state_dir
    except ConfigError:  # where that agent kept its state all the same (why it exited)
        written = config_value(config_file, "state_dir")
        found = Path(
            os.environ.get("FLASHNODE_STATE_DIR")
            or (written if isinstance(written, str) and written.startswith("/") else None)
            or default_state_dir()
        )

    def used(directory: Path) -> bool:  # an agent ran there, or tried to
        try:
            return any((directory / f).exists() for f in (status.STATUS_FILE, lastexit.EXIT_FILE))
        except OSError:  # one this user may not look into: it is someone's
            return True

    if not used(found) and used(SERVICE_STATE_DIR):
        return SERVICE_STATE_DIR
    return found


def config_value(config_file: Path | None, key: str) -> Any:
    """One key of the config file as written, or None (flags and environment aside)."""
    path = config_file or (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
    if path is None:
        return None
    try:
        return read_config_file(path).get(key)
    except ConfigError:
        return None


def tell_agent(state_dir: Path, why: str) -> None:
    snapshot = status.read(state_dir)
    if snapshot is None:
        return
    with contextlib.suppress(OSError):
        os.kill(int(snapshot["pid"]), signal.SIGHUP)
        click.echo(f"told the running agent (pid {snapshot['pid']}) to {why}")


@click.command("status")
@config_option
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_command(config_file: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """What the running agent is doing and, when it is not working, why and what to do.

    With no agent running: how the last one exited (credentials refused, a configuration
    error, ...) and its fix. Exit 3 when no agent runs on the state dir.
    """
    directory = state_dir_of(config_file, state_dir)
    try:
        snapshot = status.read(directory, strict=True)
        last_exit = lastexit.read(directory)
    except PermissionError as exc:
        needs_root(f"cannot read {exc.filename or directory}", group=True)
    if snapshot is None:
        totals = _stopped_totals(directory)
        if as_json:
            click.echo(json.dumps({"running": False, "last_exit": last_exit, "totals": totals}))
        else:
            click.echo(status.render_stopped(last_exit, totals))
        sys.exit(3)
    if as_json:
        click.echo(json.dumps({**snapshot, "last_exit": last_exit}, sort_keys=True))
    else:
        click.echo(status.render(snapshot, last_exit))


def _stopped_totals(directory: Path) -> dict[str, Any] | None:
    """What the node gave, from the ledger, when no agent publishes it (None: unreadable)."""
    ledger, checkpoint = directory / "ledger.jsonl", directory / CHECKPOINT_FILE
    view = LedgerView(ledger, checkpoint=checkpoint, persist=False)
    try:
        return view.totals() if view.path.exists() else None
    except OSError:
        return None


def roots_config(config_file: Path | None) -> Path | None:
    """The config file, when this user is not root and the file is root's: the agent it
    configures runs as root (the packaged service), with credentials and state only root may
    read or write, so what checks or changes them must run as root too."""
    path = config_file or (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
    if path is None or os.geteuid() == 0:
        return None
    try:
        return path if path.stat().st_uid == 0 else None
    except OSError:
        return None


def needs_root(what: str, group: bool = False, denied: bool = True) -> NoReturn:
    """One line for what this user may not do: run it with sudo (or, for what the group
    ``flashnode`` may read, join it)."""
    hint = "run it with sudo"
    if group and os.geteuid() != 0:
        hint += (
            ", or join the group flashnode (sudo usermod -aG flashnode $USER, then log in again)"
        )
    stop(ExitCode.FAILURE, f"{what}: {'permission denied; ' if denied else ''}{hint}")


@click.command()
@config_option
@state_dir_option
@click.option(
    "-n",
    "count",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="How many of the latest attempts to show.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
def history(config_file: Path | None, state_dir: Path | None, count: int, as_json: bool) -> None:
    """Recent attempts from the local ledger.

    The ledger is readable by root and the group flashnode (who may run `flashnode status`
    and look at the console, which shows it too)."""
    ledger = Ledger(state_dir_of(config_file, state_dir) / "ledger.jsonl")
    try:
        records = ledger.records(last=count)
    except PermissionError:
        needs_root(f"cannot read {ledger.path}", group=True)
    for r in records:  # the lines an older agent wrote quote what the task printed
        if isinstance(r.get("reason"), str):
            r["reason"] = status.without_output(r["reason"], "not kept in the ledger")
    if as_json:
        for r in records:
            click.echo(json.dumps(r, sort_keys=True))
        return
    if records:
        for line in history_table(records, os.cpu_count() or 1, _terminal_width()):
            click.echo(line)


HISTORY_HEADER = ("ended", "lease", "job/task", "outcome", "took", "cpu", "gpu", "[facts] reason")
RIGHT = {"took", "cpu", "gpu"}  # figures: aligned on their right
JOB_TASK_MOST = 48  # a longer job/task id is cut (its whole id: --json)
NOTES_LEAST = 20  # on a narrow terminal the facts and reason still get this much
WIDE = 120  # a terminal narrower than this shows the times without their year and seconds


def history_table(records: list[dict[str, Any]], cores: int, width: int = 0) -> list[str]:
    """The header and a row per attempt, each column as wide as its widest cell, so that every
    row lines up under the header whatever it holds; the last column (facts, reason) is cut
    with "…" where the line would pass ``width`` (a terminal's; 0: no limit). Every cell is
    sanitised first: what a task wrote (its stderr is in reasons) never drives the owner's
    terminal, and the widths are those of what is shown."""
    header = list(HISTORY_HEADER)
    header[0] = f"ended ({time.strftime('%Z')})"
    narrow = 0 < width < WIDE
    rows = [header] + [_history_row(r, cores, narrow) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if name in RIGHT else cell.ljust(w)
            for name, cell, w in zip(HISTORY_HEADER, row, widths, strict=False)  # less notes
        ]
        fixed = "  ".join(cells)
        notes = row[-1]
        if width > 0 and notes and len(fixed) + 2 + NOTES_LEAST > width:
            # No room beside the row: on a line of its own under it, indented.
            lines.append(fixed.rstrip())
            lines.append(f"    {_cut(notes, max(width - 4, NOTES_LEAST))}")
            continue
        if width > 0 and notes:
            notes = _cut(notes, max(width - len(fixed) - 2, NOTES_LEAST))
        lines.append(f"{fixed}  {notes}".rstrip())
    return lines


def _history_row(r: dict[str, Any], cores: int, narrow: bool = False) -> list[str]:
    at = r.get("ended_at")
    shape = "%m-%d %H:%M" if narrow else "%Y-%m-%d %H:%M:%S"  # a narrow terminal: no year
    ended = time.strftime(shape, time.localtime(at)) if _number(at) else "-"
    ev = _dict(r.get("evidence"))
    # The task's own figures (its process tree or cgroup, its GPU processes): the wire's
    # host-wide ones would charge the task with whatever else the machine did.
    usage = _dict(r.get("task_usage"))
    wall = ev.get("wall_seconds")
    took = "-"
    if isinstance(wall, (int, float)) and _number(wall):
        took = f"{wall:.1f}s" if wall < 60 else duration(wall)
    # The lease names the attempt for `flashnode logs LEASE`: never cut.
    job = _cut(sanitise(f"{r.get('job_id') or '-'}/{r.get('task_id') or '-'}"), JOB_TASK_MOST)
    facts = status.describe_facts(r)
    notes = " ".join(x for x in (f"[{facts}]" if facts else "", str(r.get("reason") or "")) if x)
    return [
        ended,
        sanitise(str(r.get("lease_id") or "-")),
        job,
        sanitise(str(r.get("outcome") or "-")),
        took,
        _figure(usage.get("cpu_percent_mean"), 100.0 * cores),
        _figure(usage.get("gpu_util_percent_mean"), 100.0),
        sanitise(notes),
    ]


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def _terminal_width() -> int:
    """The terminal's width (or $COLUMNS) when the table goes to a terminal; 0 (no limit) when
    it goes to a file or a pipe, whatever $COLUMNS says (a script reads every line whole)."""
    if not sys.stdout.isatty():
        return 0
    return shutil.get_terminal_size(fallback=(0, 0)).columns


def _figure(value: object, most: float) -> str:
    """A task's figure in percent; '-' when not measured, or past what it can be (a line an
    agent before 0.5 wrote: CPU over too short a wall time)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= most:
        return "-"
    return status.percent(value)


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
