"""``flashnode pools``: edit the config's ``pools`` (comments and layout kept), then tell a running
agent to reload.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from flashnode import status
from flashnode.errors import ConfigError
from flashnode.owner import config_option, state_dir_of, tell_agent
from flashnode.settings import DEFAULT_CONFIG_FILE, POOL_ID, load

if TYPE_CHECKING:  # tomlkit only for a `pools` command: a running agent never loads it
    import tomlkit


def _config_path(config_file: Path | None) -> Path:
    return config_file or DEFAULT_CONFIG_FILE


def _parse(path: Path) -> tomlkit.TOMLDocument:
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from None
    import tomlkit
    import tomlkit.exceptions

    try:
        return tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise click.ClickException(f"{path} is not valid TOML ({exc}): fix it first") from None


def _file_pools(doc: tomlkit.TOMLDocument, path: Path) -> list[str]:
    """The pools the config file names (the file alone: flags and environment aside)."""
    value = doc.get("pools")
    if value is None:
        return []
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return [str(p) for p in value]
    raise click.ClickException(f"{path}: pools is not a list of pool ids; fix it by hand")


def _set_pools(doc: tomlkit.TOMLDocument, new: list[str]) -> None:
    """Change ``pools`` in place: an array keeps its layout and comments, a comma-separated
    string stays one, a missing key is added at the top level."""
    value = doc.get("pools")
    if isinstance(value, list):
        for pool in [p for p in value if p not in new]:
            value.remove(pool)
        for pool in new:
            if pool not in value:
                value.append(pool)
    elif isinstance(value, str):
        doc["pools"] = ", ".join(new)
    else:
        doc["pools"] = new


def _replace(path: Path, text: str) -> None:
    """Write ``text`` over ``path`` atomically, keeping its mode and owner, only if ``work``
    would accept the result (checked with the same loader, on the new file, before the
    rename)."""
    target = path.resolve() if path.exists() else path
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if old is not None:
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
            if os.geteuid() == 0:
                os.chown(tmp, old.st_uid, old.st_gid)
        else:
            os.chmod(tmp, 0o644)
        try:
            load({}, os.environ, tmp)
        except ConfigError as exc:
            reason = str(exc).replace(str(tmp), str(path))
            raise click.ClickException(
                f"{path} not changed: flashnode work would refuse the result ({reason})"
            ) from None
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@click.group()
def pools() -> None:
    """List, join or leave team pools (edits the config file, keeping its comments)."""


@pools.command("list")
@config_option
def pools_list(config_file: Path | None) -> None:
    """The pools the config file names."""
    path = _config_path(config_file)
    for pool in _file_pools(_parse(path), path):
        click.echo(pool)


def _edit(config_file: Path | None, change: Callable[[list[str]], list[str]], pool: str) -> None:
    if not POOL_ID.match(pool):
        raise click.ClickException(
            f"{pool!r} is not a valid pool id (letters, digits, . _ : -; up to 128)"
        )
    path = _config_path(config_file)
    doc = _parse(path)
    current = _file_pools(doc, path)
    new = change(current)
    if new == current:
        click.echo(f"nothing to change: pools {', '.join(current) or '-'}")
        return
    _set_pools(doc, new)
    import tomlkit

    _replace(path, tomlkit.dumps(doc))
    click.echo(f"pools: {', '.join(new) or '-'} (in {path})")
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
