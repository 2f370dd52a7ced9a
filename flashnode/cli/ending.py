"""How the agent exits (``AgentExit``): one line on standard error, the same with its fix in
``<state dir>/last-exit.json`` (``lastexit.py``), and the exit code; where an agent whose
settings do not load would have kept its state; the state dir's lock, or the exit naming the
agent that holds it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import click

from flashnode.config.loading import read_config_file
from flashnode.config.settings import DEFAULT_CONFIG_FILE, default_state_dir
from flashnode.errors import ConfigError, ExitCode
from flashnode.owner import lastexit, statelock
from flashnode.sanitise import sanitise


def fail(code: ExitCode, message: str) -> NoReturn:
    """Say ``message`` as one line on standard error and exit with ``code``."""
    click.echo(f"flashnode: {sanitise(message)}", err=True)
    sys.exit(int(code))


def exit_state_dir(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None
) -> tuple[Path, bool]:
    """Where an agent whose settings do not load would have kept its state: the flag, the
    environment, the file's ``state_dir`` as written, else the default (the service's
    ``$STATE_DIRECTORY``); and whether one of these named it (not the default alone). Where
    ``flashnode status`` looks for why it exited."""
    given = flags.get("state_dir") or env.get("FLASHNODE_STATE_DIR")
    if not given:
        path = config_file or (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
        if path is not None:
            with contextlib.suppress(ConfigError):
                given = read_config_file(path).get("state_dir")
    if isinstance(given, (str, Path)) and Path(given).is_absolute():
        return Path(given), True
    return default_state_dir(env), bool(env.get("STATE_DIRECTORY"))


class AgentExit:
    """How this agent exits: one line on standard error, the same with its fix in
    ``<state dir>/last-exit.json`` (``lastexit.py``), and the exit code."""

    def __init__(self, state_dir: Path, named: bool = True) -> None:
        self.state_dir = state_dir
        self.named = named  # given by the owner, or the service's; else only the default

    def record(self, code: ExitCode, error: str, fix: str = "") -> None:
        """Best effort: a state dir this user cannot reach keeps no record."""
        where = self.state_dir
        service = default_state_dir(os.environ) if os.environ.get("STATE_DIRECTORY") else None
        with contextlib.suppress(OSError):
            if not where.is_dir() and service is not None:
                where = service  # a state dir the service cannot make: its own, where status looks
            # Not into a default directory no agent has used: it is nobody's yet.
            if self.named or where == service or (where / statelock.LOCK_FILE).exists():
                lastexit.write(where, code, error, fix)

    def fail(self, code: ExitCode, message: str, fix: str = "") -> NoReturn:
        if "; fix: " in message:  # the error's own fix is the one to follow
            message, fix = message.split("; fix: ", 1)
        self.record(code, message, fix)
        fail(code, f"{message}; fix: {fix}" if fix else message)

    @staticmethod
    def restart() -> str:
        """How the owner starts this agent again: its unit's restart under systemd."""
        unit = statelock.systemd_unit(os.getpid()) if os.environ.get("INVOCATION_ID") else None
        return f"sudo systemctl restart {unit}" if unit else "start the agent again"

    def config_fix(self) -> str:
        return (
            "correct the setting named (the config file, a flag or a FLASHNODE_* variable;"
            f" `flashnode doctor` checks them), then {self.restart()}"
        )


def lock_state_dir(state_dir: Path, agent_exit: AgentExit | None = None) -> statelock.StateLock:
    """The state dir's lock; exit 75 naming the holder when another agent has it. OSError when
    the lock file cannot be opened."""
    try:
        return statelock.acquire(state_dir)
    except statelock.Held as exc:
        unit = exc.holder.unit
        how = f"sudo systemctl stop {unit}" if unit else "stop it"
        (agent_exit or AgentExit(state_dir)).fail(
            ExitCode.LOCKED,
            f"another agent runs on the state dir {state_dir}: {exc.holder.describe()}",
            f"{how} first, or give this one its own --state-dir",
        )
