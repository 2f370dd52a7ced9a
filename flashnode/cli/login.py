"""``flashnode login`` and ``logout``: the token and join code, checked with the coordinator
by a real registration before they are stored, private to root.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import sys
from pathlib import Path

import click
from pydantic import SecretStr

from flashnode.cli.common import (
    config_option,
    config_value,
    credentials_dir_option,
    needs_root,
    roots_config,
    stop,
)
from flashnode.config.credentials import (
    credentials_file,
    credentials_names,
    default_credentials_dir,
)
from flashnode.config.settings import Settings
from flashnode.config.urls import normalise_url
from flashnode.coordinator.client import Coordinator
from flashnode.errors import (
    ConfigError,
    CoordinatorError,
    CoordinatorUnavailable,
    CredentialsError,
    ExitCode,
)
from flashnode.evidence import inventory
from flashnode.evidence.gpu import Nvml
from flashnode.owner import statelock, status
from flashnode.runners.registry import capabilities, load_settings

MAX_SECRET = 4096


def _read_secrets() -> tuple[str, str]:
    """Token and join code: prompted for on a terminal, else two lines of standard input."""
    if sys.stdin.isatty():
        token = click.prompt("Token (empty: none)", default="", hide_input=True, show_default=False)
        code = click.prompt(
            "Join code (empty: none)", default="", hide_input=True, show_default=False
        )
    else:
        lines = sys.stdin.read(4 * MAX_SECRET).splitlines()
        token, code = [*lines, "", ""][:2]
    token, code = token.strip(), code.strip()
    for what, value in (("token", token), ("join code", code)):
        if len(value) > MAX_SECRET or not value.isprintable() or " " in value:
            stop(ExitCode.CONFIG, f"the {what} is not one line of printable text; nothing stored")
    if not token and not code:
        stop(
            ExitCode.CONFIG,
            "no token and no join code given (one per line on standard input, or at the"
            " prompts); nothing stored",
        )
    return token, code


def probe_node_id(s: Settings, persist: bool) -> str:
    """The node's id, as the agent will use it: configured, else kept in the state dir. With
    ``persist`` a new one is made and kept (as ``work`` would); without, a fresh throwaway."""
    if s.node_id:
        return s.node_id
    with contextlib.suppress(OSError):
        existing = (s.state_dir / "node-id").read_text().strip()
        if existing:
            return existing
    if persist:
        old = os.umask(0o077)  # the state dir and what is in it are the agent's alone
        try:
            inventory.ensure_state_dir(s.state_dir)
            return inventory.node_id(s)
        except OSError:
            pass
        finally:
            os.umask(old)
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40].strip("-") or "node"
    return f"{host}-{secrets.token_hex(4)}"


class NotACoordinator(CoordinatorError):
    """What answered at the coordinator's URL is not a flashruntime coordinator (the message
    names what it is)."""


def register_dry_run(s: Settings, node: str) -> str:
    """Register ``node`` with the coordinator as ``work`` would (its pools, runner opt-ins and
    GPUs), and return the id the coordinator answers with. Registering is idempotent, and a
    running agent registers again when told to (SIGHUP). Raises CoordinatorError (refused or
    unanswered: NotACoordinator when what answered is no flashruntime coordinator) or
    CredentialsError."""
    nvml = Nvml.open(s.nvml_library)
    gpus = [d.info for d in nvml.refresh()] if nvml is not None else []
    if nvml is not None:
        nvml.close()
    client = Coordinator(
        s.coordinator,
        token=s.token.get_secret_value() if s.token else None,
        join_code=s.join_code.get_secret_value() if s.join_code else None,
        timeout=15,
        answer_deadline=20,
    )
    try:
        # Before the runner is built: no module task is offered until the agent knows it can.
        offer = capabilities(s).offer(s, module_capable=False)
        return client.register(inventory.registration(s, node, offer, gpus))
    except (CredentialsError, CoordinatorError) as exc:
        if isinstance(exc, CoordinatorUnavailable) and exc.status is None:
            raise  # nothing answered: that says nothing about what the URL is
        # Something answered, but refused or made no sense: is it a coordinator at all?
        try:
            stranger = client.stranger()
        except CoordinatorError:
            raise exc from None
        if stranger is not None:
            raise NotACoordinator(stranger) from None
        raise
    finally:
        client.close()


def _private_dir(directory: Path) -> None:
    """Make ``directory`` (0700) or check that it is this user's alone; stop with 78 if not."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        st = directory.lstat()
    except OSError as exc:
        stop(ExitCode.CONFIG, f"cannot make {directory}: {exc.strerror}; nothing stored")
    if not stat.S_ISDIR(st.st_mode):
        stop(ExitCode.CONFIG, f"{directory} is not a directory; nothing stored")
    if st.st_uid != os.geteuid():
        stop(ExitCode.CONFIG, f"{directory} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        stop(
            ExitCode.CONFIG,
            f"{directory} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}):"
            f" run chmod 700 {directory}; nothing stored",
        )


def _store(path: Path, value: str) -> None:
    """Write a secret: a new 0600 file made with O_EXCL (never through one someone planted),
    flushed to disk, then renamed over the old one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(value + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _coordinator_url(coordinator: str | None, config_file: Path | None) -> str:
    """The coordinator named on the command line or in the config, normalised (exit 78 if none
    or not a URL)."""
    given = coordinator or config_value(config_file, "coordinator")
    if not given:
        stop(ExitCode.CONFIG, "no coordinator: give --coordinator URL or set it in the config")
    try:
        return normalise_url(str(given))
    except ValueError as exc:
        stop(ExitCode.CONFIG, f"coordinator: {exc}")


@click.command()
@click.option(
    "--coordinator",
    help="Coordinator URL, e.g. https://coordinator.example.org [default: the config's].",
)
@config_option
@credentials_dir_option
def login(coordinator: str | None, config_file: Path | None, credentials_dir: Path | None) -> None:
    """Check a token and join code with the coordinator, then store them for the agent.

    Both come from prompts, or from standard input (the token on the first line, the join code
    on the second; either may be empty), never from the command line. They are stored only
    after the coordinator accepted a registration of this node with them (registering again is
    harmless); refused credentials never replace stored ones. Files are 0600 in a 0700
    directory. Exit 77: refused; 69: the coordinator did not answer; 78: a bad URL or
    directory, or what answers there is not a flashruntime coordinator (it is named).
    """
    service = roots_config(config_file)
    if service is not None and credentials_dir is None:
        needs_root(
            f"the agent of {service} runs as root and reads the credentials root stores (here"
            " they would go to your own home, which it never reads)",
            denied=False,
        )
    url = _coordinator_url(coordinator, config_file)
    token, code = _read_secrets()
    # The node as `work` will see it, with the new secrets in place of whatever is stored.
    env = {
        k: v for k, v in os.environ.items() if k not in ("FLASHNODE_TOKEN", "FLASHNODE_JOIN_CODE")
    }
    try:
        base = load_settings({"coordinator": url}, env, config_file)
    except ConfigError:
        try:  # a config `work` would refuse: the environment and the defaults alone
            base = load_settings({"coordinator": url}, env, Path(os.devnull))
        except ConfigError:
            base = Settings(coordinator=url)
    s = base.model_copy(
        update={
            "coordinator": url,
            "token": SecretStr(token) if token else None,
            "join_code": SecretStr(code) if code else None,
        }
    )
    node = probe_node_id(s, persist=True)
    try:
        registered = register_dry_run(s, node)
    except NotACoordinator as exc:
        stop(
            ExitCode.CONFIG,
            f"{url} is not a flashruntime coordinator: {exc}; check the URL (scheme, host,"
            " port, path); nothing stored",
        )
    except CredentialsError as exc:
        stop(ExitCode.CREDENTIALS, f"{url} refused them: {exc}; nothing stored")
    except CoordinatorUnavailable as exc:
        stop(ExitCode.UNAVAILABLE, f"{url} did not answer: {exc}; nothing stored")
    except CoordinatorError as exc:
        stop(
            ExitCode.CONFIG,
            f"{url} does not answer as a flashruntime coordinator ({exc}); nothing stored",
        )
    directory = credentials_dir or s.credentials_dir or default_credentials_dir()
    _private_dir(directory)
    stored = []
    for kind, value in (("token", token), ("join-code", code)):
        path = credentials_file(url, directory, kind)
        if value:
            _store(path, value)
            stored.append(str(path))
        # What was checked is what is stored: no stale half, and no older pair under another
        # name of the same coordinator (localhost for 127.0.0.1) that the agent might find.
        for stem in credentials_names(url)[0 if not value else 1 :]:
            with contextlib.suppress(FileNotFoundError):
                (directory / f"{stem}.{kind}").unlink()
    click.echo(f"{url} accepted them: registered as node {registered}")
    click.echo(f"stored in {' and '.join(stored)}")
    if os.environ.get("FLASHNODE_TOKEN") or s.token_file or s.join_code_file:
        click.echo("note: token_file, join_code_file or FLASHNODE_TOKEN take precedence over these")
    click.echo(_when_used(s.state_dir))


def _when_used(state_dir: Path) -> str:
    """When the agent uses what was stored: at its next start. A running one keeps the
    credentials it started with (a reload refuses new ones, and the unit handed it a copy), so
    it is not told anything: it is to be restarted."""
    snapshot = status.read(state_dir)
    if snapshot is None:
        how = "sudo systemctl enable --now flashnode" if os.geteuid() == 0 else "flashnode work"
        return f"the agent reads them when it starts ({how})"
    pid = int(snapshot["pid"])
    unit = statelock.systemd_unit(pid)
    how = f"sudo systemctl restart {unit}" if unit else "stop it and start it again"
    return (
        f"the running agent (pid {pid}) keeps the credentials it started with until it"
        f" restarts: {how} (running tasks run on and are re-attached)"
    )


@click.command()
@click.option(
    "--coordinator", help="Coordinator URL whose credentials to forget [default: the config's]."
)
@config_option
@credentials_dir_option
def logout(coordinator: str | None, config_file: Path | None, credentials_dir: Path | None) -> None:
    """Forget the stored token and join code for a coordinator. Exit 1 if none were stored."""
    if roots_config(config_file) is not None and credentials_dir is None:
        needs_root("the credentials of an agent that runs as root are root's", denied=False)
    url = _coordinator_url(coordinator, config_file)
    configured = os.environ.get("FLASHNODE_CREDENTIALS_DIR") or config_value(
        config_file, "credentials_dir"
    )
    directory = credentials_dir or Path(configured or default_credentials_dir())
    removed = []
    for kind in ("token", "join-code"):
        for stem in credentials_names(url):  # every name of this coordinator
            path = directory / f"{stem}.{kind}"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(str(path))
    if not removed:
        stop(ExitCode.FAILURE, f"no credentials stored for {url} in {directory}")
    click.echo(f"removed {' and '.join(removed)}")
