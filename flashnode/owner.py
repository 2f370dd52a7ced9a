"""The machine owner's commands: login/logout, status, doctor, pools, history.

Run as root, each finds what the packaged service uses without flags: the config
``/etc/flashnode/flashnode.toml``, the credentials ``flashnode login`` keeps in
``/etc/flashnode/credentials`` (handed to the service with ``LoadCredential=``), and the state dir
``/var/lib/flashnode`` (the service's ``StateDirectory=``).

Why one module of this size: the owner's commands share how they find the service's config,
credentials and state.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
import tomlkit
import tomlkit.exceptions
from pydantic import SecretStr

from flashnode import cgroups, datacache, inventory, localdata, preflight, status
from flashnode.coordinator import Coordinator
from flashnode.errors import (
    ConfigError,
    CoordinatorError,
    CoordinatorUnavailable,
    CredentialsError,
    ExitCode,
    Unregistered,
)
from flashnode.gpu import Nvml
from flashnode.ledger import Ledger
from flashnode.settings import (
    DEFAULT_CONFIG_FILE,
    POOL_ID,
    Settings,
    credentials_file,
    default_credentials_dir,
    default_state_dir,
    load,
    normalise_url,
    read_config_file,
)
from flashnode.wire import NodeHeartbeat

MAX_SECRET = 4096

config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    help="TOML config file [default: /etc/flashnode/flashnode.toml when present].",
)
state_dir_option = click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The agent's state dir [default: the config's state_dir, else /var/lib/flashnode as"
    " root, else ~/.local/state/flashnode].",
)
credentials_dir_option = click.option(
    "--credentials-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where stored credentials live [default: the config's credentials_dir, else"
    " /etc/flashnode/credentials as root, else ~/.config/flashnode/credentials].",
)


def _stop(code: ExitCode, message: str) -> NoReturn:
    click.echo(f"flashnode: {message}", err=True)
    sys.exit(int(code))


def _state_dir(config_file: Path | None, state_dir: Path | None) -> Path:
    if state_dir is not None:
        return state_dir
    try:
        return load({}, os.environ, config_file).state_dir
    except ConfigError:
        return Path(os.environ.get("FLASHNODE_STATE_DIR") or default_state_dir())


def register(main: click.Group) -> None:
    for command in (login, logout, status_command, doctor, pools, history):
        main.add_command(command)


# --- credentials ---------------------------------------------------------------------------


def _file_value(config_file: Path | None, key: str) -> Any:
    """One key of the config file as written, or None (flags and environment aside)."""
    path = config_file or (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None)
    if path is None:
        return None
    try:
        return read_config_file(path).get(key)
    except ConfigError:
        return None


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
            _stop(ExitCode.CONFIG, f"the {what} is not one line of printable text; nothing stored")
    if not token and not code:
        _stop(
            ExitCode.CONFIG,
            "no token and no join code given (one per line on standard input, or at the"
            " prompts); nothing stored",
        )
    return token, code


def _probe_node_id(s: Settings, persist: bool) -> str:
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


def register_dry_run(s: Settings, node: str) -> str:
    """Register ``node`` with the coordinator as ``work`` would (its pools, runner opt-ins and
    GPUs), and return the id the coordinator answers with. Registering is idempotent, and a
    running agent registers again when told to (SIGHUP). Raises CoordinatorError."""
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
        return client.register(inventory.registration(s, node, gpus))
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
        _stop(ExitCode.CONFIG, f"cannot make {directory}: {exc.strerror}; nothing stored")
    if not stat.S_ISDIR(st.st_mode):
        _stop(ExitCode.CONFIG, f"{directory} is not a directory; nothing stored")
    if st.st_uid != os.geteuid():
        _stop(ExitCode.CONFIG, f"{directory} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        _stop(
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


def _tell_agent(state_dir: Path, why: str) -> None:
    snapshot = status.read(state_dir)
    if snapshot is None:
        return
    with contextlib.suppress(OSError):
        os.kill(int(snapshot["pid"]), signal.SIGHUP)
        click.echo(f"told the running agent (pid {snapshot['pid']}) to {why}")


def _coordinator_url(coordinator: str | None, config_file: Path | None) -> str:
    """The coordinator named on the command line or in the config, normalised (exit 78 if none
    or not a URL)."""
    given = coordinator or _file_value(config_file, "coordinator")
    if not given:
        _stop(ExitCode.CONFIG, "no coordinator: give --coordinator URL or set it in the config")
    try:
        return normalise_url(str(given))
    except ValueError as exc:
        _stop(ExitCode.CONFIG, f"coordinator: {exc}")


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
    directory.
    """
    url = _coordinator_url(coordinator, config_file)
    token, code = _read_secrets()
    # The node as `work` will see it, with the new secrets in place of whatever is stored.
    env = {
        k: v for k, v in os.environ.items() if k not in ("FLASHNODE_TOKEN", "FLASHNODE_JOIN_CODE")
    }
    try:
        base = load({"coordinator": url}, env, config_file)
    except ConfigError:
        try:  # a config `work` would refuse: the environment and the defaults alone
            base = load({"coordinator": url}, env, Path(os.devnull))
        except ConfigError:
            base = Settings(coordinator=url)
    s = base.model_copy(
        update={
            "coordinator": url,
            "token": SecretStr(token) if token else None,
            "join_code": SecretStr(code) if code else None,
        }
    )
    node = _probe_node_id(s, persist=True)
    try:
        registered = register_dry_run(s, node)
    except CredentialsError as exc:
        _stop(ExitCode.CREDENTIALS, f"{url} refused them: {exc}; nothing stored")
    except CoordinatorUnavailable as exc:
        _stop(ExitCode.UNAVAILABLE, f"{url} did not answer: {exc}; nothing stored")
    except CoordinatorError as exc:
        _stop(
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
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # what was checked is what is stored: no stale half
    click.echo(f"{url} accepted them: registered as node {registered}")
    click.echo(f"stored in {' and '.join(stored)}")
    if os.environ.get("FLASHNODE_TOKEN") or s.token_file or s.join_code_file:
        click.echo("note: token_file, join_code_file or FLASHNODE_TOKEN take precedence over these")
    if os.geteuid() == 0:
        click.echo("the service reads them when it starts: systemctl restart flashnode")
    _tell_agent(s.state_dir, "register again")


@click.command()
@click.option(
    "--coordinator", help="Coordinator URL whose credentials to forget [default: the config's]."
)
@config_option
@credentials_dir_option
def logout(coordinator: str | None, config_file: Path | None, credentials_dir: Path | None) -> None:
    """Forget the stored token and join code for a coordinator. Exit 1 if none were stored."""
    url = _coordinator_url(coordinator, config_file)
    configured = os.environ.get("FLASHNODE_CREDENTIALS_DIR") or _file_value(
        config_file, "credentials_dir"
    )
    directory = credentials_dir or Path(configured or default_credentials_dir())
    removed = []
    for kind in ("token", "join-code"):
        path = credentials_file(url, directory, kind)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(str(path))
    if not removed:
        _stop(ExitCode.FAILURE, f"no credentials stored for {url} in {directory}")
    click.echo(f"removed {' and '.join(removed)}")


# --- status and history --------------------------------------------------------------------


@click.command("status")
@config_option
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_command(config_file: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """What the running agent is doing. Exit 3 when no agent runs on the state dir."""
    snapshot = status.read(_state_dir(config_file, state_dir))
    if snapshot is None:
        if as_json:
            click.echo(json.dumps({"running": False}))
        else:
            click.echo("no agent is running on this state dir")
        sys.exit(3)
    click.echo(json.dumps(snapshot, sort_keys=True) if as_json else status.render(snapshot))


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
    """Recent attempts from the local ledger."""
    records = Ledger(_state_dir(config_file, state_dir) / "ledger.jsonl").records()[-count:]
    for r in records:
        if as_json:
            click.echo(json.dumps(r, sort_keys=True))
            continue
        at = r.get("ended_at")
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if _number(at) else "-" * 19
        ev = _dict(r.get("evidence"))
        # The task's own figures (its process tree or cgroup, its GPU processes): the wire's
        # host-wide ones would charge the task with whatever else the machine did.
        usage = _dict(r.get("task_usage"))
        wall, cpu, gpu = (
            ev.get("wall_seconds"),
            usage.get("cpu_percent_mean"),
            usage.get("gpu_util_percent_mean"),
        )
        took = f"{wall:.1f}s" if _number(wall) else "-"
        job = f"{r.get('job_id') or '-'}/{r.get('task_id') or '-'}"
        line = f"{ended}  {job}  {r.get('outcome') or '-'!s:9}  {took:>8}"
        line += f"  cpu {f'{cpu:.3g}%' if _number(cpu) else '-'}"
        line += f"  gpu {f'{gpu:.3g}%' if _number(gpu) else '-'}"
        facts = status.describe_facts(r)
        if facts:
            line += f"  [{facts}]"
        if r.get("reason"):
            line += f"  {r['reason']}"
        # What a task wrote (its stderr is in reasons) never drives the owner's terminal.
        click.echo("".join(c if c.isprintable() else "?" for c in line))


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- pools -----------------------------------------------------------------------------------


def _config_path(config_file: Path | None) -> Path:
    return config_file or DEFAULT_CONFIG_FILE


def _parse(path: Path) -> tomlkit.TOMLDocument:
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {path}: {exc}") from None
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
    _replace(path, tomlkit.dumps(doc))
    click.echo(f"pools: {', '.join(new) or '-'} (in {path})")
    state = _state_dir(config_file, None)
    if status.read(state) is None:
        click.echo("no running agent to tell; the change applies at its next start")
    else:
        _tell_agent(state, "reload")


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


# --- doctor ----------------------------------------------------------------------------------


class Report:
    def __init__(self) -> None:
        self.failures = 0

    def ok(self, what: str, detail: str = "") -> None:
        click.echo(f"ok    {what}" + (f": {detail}" if detail else ""))

    def warn(self, what: str, detail: str) -> None:
        click.echo(f"warn  {what}: {detail}")

    def fail(self, what: str, problem: str, fix: str) -> None:
        self.failures += 1
        click.echo(f"FAIL  {what}: {problem}\n      fix: {fix}")


@click.command()
@config_option
@click.option("--coordinator", help="Check against this coordinator URL instead of the config's.")
def doctor(config_file: Path | None, coordinator: str | None) -> None:
    """Check this node's setup as `flashnode work` will see it; every failure names its fix.

    The same checks `work` runs before it starts, then the coordinator: it answers, and it
    accepts a registration of this node with the stored credentials (a dry run: registering
    again is harmless). Exit 1 on any FAIL.
    """
    r = Report()
    if os.geteuid() != 0 and config_file is None and DEFAULT_CONFIG_FILE.exists():
        r.warn("user", f"checking as uid {os.geteuid()}; the service runs as root: sudo it")
    try:
        s = load({"coordinator": coordinator}, os.environ, config_file)
    except ConfigError as exc:
        r.fail("configuration", str(exc), "correct the setting named above")
        sys.exit(1)
    r.ok("configuration", f"{s.runner} runner, pools {','.join(s.pools) or '-'}")
    for finding in preflight.check(s):
        if isinstance(finding, preflight.Ok):
            r.ok(finding.what, finding.detail)
        elif finding.fatal:
            r.fail(finding.what, finding.why, finding.fix)
        else:
            r.warn(finding.what, f"{finding.why} (fix: {finding.fix})")
    _check_coordinator(r, s)
    from flashnode import envs_cli  # it builds on this module's options

    envs_cli.doctor(r, s)
    _check_data(r, s)
    hierarchy, why = cgroups.detect()
    if hierarchy is not None:
        r.ok("cgroups", hierarchy.describe())
    elif s.runner == "trusted":
        r.warn("cgroups", f"{why}: trusted tasks get no memory/CPU/pids limits")
    nvml = Nvml.open(s.nvml_library)
    if nvml is None:
        r.ok("GPUs", "none (no NVML)")
    else:
        r.ok("GPUs", ", ".join(f"{d.info.index}: {d.info.name}" for d in nvml.devices) or "none")
        nvml.close()
    sys.exit(1 if r.failures else 0)


def _check_coordinator(r: Report, s: Settings) -> None:
    login = "flashnode login (token and join code)"
    client = Coordinator(
        s.coordinator,
        token=s.token.get_secret_value() if s.token else None,
        timeout=10,
        answer_deadline=15,
    )
    try:
        client.health()
        r.ok("coordinator", f"{s.coordinator} answers")
        snapshot = status.read(s.state_dir)
        if snapshot is not None and snapshot.get("registered"):
            # A dry run would replace the running agent's registration: check the token with a
            # heartbeat as that node instead.
            client.node_heartbeat(NodeHeartbeat(node_id=str(snapshot.get("node_id"))))
            r.ok(
                "registration",
                f"the running agent (pid {snapshot['pid']}) is registered as"
                f" {snapshot.get('node_id')}; the token is accepted",
            )
            return
        node = _probe_node_id(s, persist=s.state_dir.is_dir())
        registered = register_dry_run(s, node)
        r.ok("registration", f"dry run accepted, as node {registered}")
    except CredentialsError as exc:
        r.fail("registration", f"refused: {exc}", f"run: {login}")
    except Unregistered:
        r.ok("registration", "the token is accepted (the node registers when the agent starts)")
    except CoordinatorUnavailable as exc:
        r.fail(
            "coordinator",
            f"{s.coordinator} does not answer ({exc})",
            "check the URL and the network, or start the coordinator",
        )
    except CoordinatorError as exc:
        r.fail(
            "coordinator",
            f"{s.coordinator} does not answer as a flashruntime coordinator ({exc})",
            "check the URL (scheme, host, port, path)",
        )
    finally:
        client.close()


def _check_data(r: Report, s: Settings) -> None:
    """The dataset cache's use of its budget, and whether the task user can read each lent
    local dataset."""
    if s.dataset_cache_bytes:
        root = s.state_dir / "data"
        count, used = datacache.cache_usage(root)
        r.ok(
            "dataset cache",
            f"{root}: {count} shard(s), {used >> 20} of {s.dataset_cache_bytes >> 20} MiB",
        )
        try:
            free = shutil.disk_usage(s.state_dir).free
        except OSError:
            free = None  # the state dir check above says why
        if free is not None and free < s.dataset_cache_bytes - used:
            r.warn(
                "dataset cache",
                f"the disk has {free >> 20} MiB free, less than the rest of the budget",
            )
    else:
        r.ok("dataset cache", "off (dataset_cache_bytes = 0: no dataset work)")
    if not s.local_data:
        return
    identity = _task_identity(s)
    for label, path in sorted(s.local_data.items()):
        if identity is None:
            r.warn(f"local data {label}", f"{path}: no task user to check it for")
            continue
        uid, gid = identity
        why = localdata.unreadable(path, uid, gid)
        if why:
            r.fail(
                f"local data {label}",
                f"{path}: {why}, as the task user (uid {uid}, gid {gid})",
                f"let that user read it, e.g. chmod -R o+rX {path}"
                f" or setfacl -R -m u:{uid}:rX {path}",
            )
        else:
            r.ok(f"local data {label}", f"{path}, readable by uid {uid}")


def _task_identity(s: Settings) -> tuple[int, int] | None:
    """The uid and gid tasks run as under this configuration; None when it cannot be known."""
    if s.runner == "docker":
        if s.container_user:
            uid, _, gid = s.container_user.partition(":")
            return int(uid), int(gid or uid)
        return (65534, 65534) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    if os.geteuid() != 0:
        return os.geteuid(), os.getegid()
    try:
        pw = pwd.getpwnam(f"{s.task_user}-0")  # slot 0's user: every slot's is alike
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid
