"""``flashnode ui``: a login link to the running agent's console.

The link is minted from the key the agent wrote for the level this user may read (``console.json``
for root, the owner; ``console-view.json`` for group ``flashnode``, who may only look), good for
ten minutes and one login. It is printed, and opened in a browser where one is available: not as
root (a browser should not run as root) and not with ``--print-url``. The browser is handed a
page of the user's own (0600, in a 0700 directory) that leads on to the link, never the link
itself: a browser's command line is readable by every local user, and the link is a login.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from flashnode.cli.common import config_option, needs_root, state_dir_of, state_dir_option, stop
from flashnode.errors import ExitCode
from flashnode.owner import status

NO_AGENT = 3  # as `flashnode status`


@click.command("ui")
@config_option
@state_dir_option
@click.option("--print-url", is_flag=True, help="Only print the link; open no browser.")
def ui(config_file: Path | None, state_dir: Path | None, print_url: bool) -> None:
    """A login link to the running agent's console (good for 10 minutes, once)."""
    from flashnode.console import auth

    directory = state_dir_of(config_file, state_dir)
    try:
        snapshot = status.read(directory, strict=True)
    except PermissionError:
        needs_root(f"cannot read {directory / status.STATUS_FILE}", group=True)
    if snapshot is None:
        click.echo("flashnode: no agent is running on this state dir", err=True)
        sys.exit(NO_AGENT)
    found = auth.read_key_file(directory)
    if found is None:
        if any((directory / name).exists() for name in auth.KEY_FILES.values()):
            stop(
                ExitCode.FAILURE,
                "the console's login keys are readable by root and group flashnode only:"
                " run `sudo flashnode ui`",
            )
        stop(
            ExitCode.FAILURE,
            "the running agent serves no console (ui_listen is off, or its address was taken:"
            " see the agent's log)",
        )
    level, key, url = found.get("level"), found.get("key"), found.get("url")
    if (
        level not in auth.LEVELS
        or not isinstance(key, str)
        or not isinstance(url, str)
        or found.get("pid") != snapshot.get("pid")
    ):
        stop(ExitCode.FAILURE, "the console's login keys do not belong to the running agent")
    try:
        secret = bytes.fromhex(str(key))
    except ValueError:
        stop(ExitCode.FAILURE, "the console's login key is damaged; restart the agent")
    link = f"{url}/login?token={auth.mint(level, secret, time.time())}"
    click.echo(link)
    if level == "view":
        click.echo(
            "(this login may only look; run `sudo flashnode ui` to change the node)", err=True
        )
    if not print_url and _may_open_browser():
        import webbrowser

        open_privately(link, webbrowser.open)


def open_privately(link: str, opener: Callable[[str], object]) -> Path:
    """Hand ``opener`` (a browser) a ``file://`` page that leads on to ``link``, written where
    only this user can read it (``$XDG_RUNTIME_DIR``, else a new private temporary directory):
    its path, not the link, goes on the browser's command line. The page's path."""
    import html

    base = _private_dir(os.environ.get("XDG_RUNTIME_DIR"))
    page = base / "login.html"
    fd = os.open(page, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    target = html.escape(link, quote=True)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(
            '<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f'<meta http-equiv="refresh" content="0;url={target}">'
            f'<title>flashnode console</title><a href="{target}">Open the console</a>\n'
        )
    opener(page.as_uri())
    return page


def _private_dir(runtime: str | None) -> Path:
    """``$XDG_RUNTIME_DIR/flashnode-ui`` when it is this user's alone, else a new private
    temporary directory (an inherited runtime dir of another user, after ``su``, included)."""
    import tempfile

    if runtime:
        base = Path(runtime) / "flashnode-ui"
        try:
            base.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(base)
        except OSError:
            pass
        else:
            mine = st.st_uid == os.geteuid() and not st.st_mode & 0o077
            if stat.S_ISDIR(st.st_mode) and mine:
                return base
    return Path(tempfile.mkdtemp(prefix="flashnode-ui-"))


def _may_open_browser() -> bool:
    """A graphical session of a user who is not root."""
    if os.geteuid() == 0:
        return False
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
