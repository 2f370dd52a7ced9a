"""``flashnode pools``: edit the config's ``pools`` (comments and layout kept, ``configedit``), then
tell a running agent to reload.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import click

from flashnode.cli.common import config_option, state_dir_of, tell_agent
from flashnode.config import configedit
from flashnode.config.settings import DEFAULT_CONFIG_FILE
from flashnode.owner import status
from flashnode.runners.registry import load_settings


def _config_path(config_file: Path | None) -> Path:
    return config_file or DEFAULT_CONFIG_FILE


def _validate(path: Path) -> object:
    return load_settings({}, os.environ, path)


@click.group()
def pools() -> None:
    """List, join or leave team pools (edits the config file, keeping its comments)."""


@pools.command("list")
@config_option
def pools_list(config_file: Path | None) -> None:
    """The pools the config file names."""
    path = _config_path(config_file)
    try:
        found = configedit.file_pools(configedit.parse(path), path)
    except configedit.Refused as exc:
        raise click.ClickException(str(exc)) from None
    for pool in found:
        click.echo(pool)


def _edit(config_file: Path | None, change: Callable[[list[str]], list[str]], pool: str) -> None:
    path = _config_path(config_file)
    try:
        configedit.check_pool(pool)
        changed, now = configedit.change_pools(path, change, _validate)
    except configedit.Refused as exc:
        raise click.ClickException(str(exc)) from None
    if not changed:
        click.echo(f"nothing to change: pools {', '.join(now) or '-'}")
        return
    click.echo(f"pools: {', '.join(now) or '-'} (in {path})")
    state = state_dir_of(config_file, None)
    if status.read(state) is None:
        click.echo("no running agent to tell; the change applies at its next start")
    else:
        tell_agent(state, "reload")


@pools.command("join")
@config_option
@click.argument("pool_id")
def pools_join(config_file: Path | None, pool_id: str) -> None:
    """Serve POOL_ID too, and tell a running agent to reload."""
    _edit(config_file, lambda cur: cur if pool_id in cur else [*cur, pool_id], pool_id)


@pools.command("leave")
@config_option
@click.argument("pool_id")
def pools_leave(config_file: Path | None, pool_id: str) -> None:
    """Stop serving POOL_ID, and tell a running agent to reload."""
    _edit(config_file, lambda cur: [p for p in cur if p != pool_id], pool_id)
