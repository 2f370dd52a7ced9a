"""The machine owner's commands: login/logout, status, doctor, pools, history."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from flashnode import cgroups, datacache, localdata, status
from flashnode.coordinator import Coordinator
from flashnode.errors import ConfigError, CoordinatorError, CredentialsError, Unregistered
from flashnode.gpu import Nvml
from flashnode.inventory import node_id
from flashnode.ledger import Ledger
from flashnode.settings import (
    DEFAULT_CONFIG_FILE,
    POOL_ID,
    Settings,
    credentials_file,
    default_credentials_dir,
    default_state_dir,
    load,
    read_config_file,
)
from flashnode.wire import NodeHeartbeat

config_option = click.option(
    "--config", "config_file", type=click.Path(path_type=Path), help="TOML config file."
)


def _settings(config_file: Path | None) -> Settings:
    try:
        return load({}, os.environ, config_file)
    except ConfigError as exc:
        raise click.ClickException(f"configuration error: {exc}") from None


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


@click.command()
@click.option("--coordinator", required=True, help="Coordinator base URL.")
@click.option("--token", prompt=True, hide_input=True, help="Bearer token (prompted if omitted).")
@click.option("--credentials-dir", type=click.Path(path_type=Path), default=None)
def login(coordinator: str, token: str, credentials_dir: Path | None) -> None:
    """Store this node's token for a coordinator (mode 0600)."""
    path = credentials_file(coordinator, credentials_dir or default_credentials_dir())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token.strip() + "\n")
    os.replace(tmp, path)
    click.echo(f"stored credentials for {coordinator} in {path}")


@click.command()
@click.option("--coordinator", required=True, help="Coordinator base URL.")
@click.option("--credentials-dir", type=click.Path(path_type=Path), default=None)
def logout(coordinator: str, credentials_dir: Path | None) -> None:
    """Forget the stored token for a coordinator."""
    path = credentials_file(coordinator, credentials_dir or default_credentials_dir())
    if path.exists():
        path.unlink()
        click.echo(f"removed {path}")
    else:
        click.echo(f"no credentials stored for {coordinator}")


# --- status and history --------------------------------------------------------------------


@click.command("status")
@config_option
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_command(config_file: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """What the running agent is doing."""
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
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
@click.option("-n", "count", type=int, default=20, show_default=True)
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
        if r.get("reason"):
            line += f"  {r['reason']}"
        click.echo(line)


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- pools -----------------------------------------------------------------------------------

POOLS_LINE = re.compile(r"^pools\s*=\s*\[[^\]]*\]\s*$", re.MULTILINE)


def _write_pools(path: Path, new: list[str]) -> None:
    text = path.read_text() if path.exists() else ""
    line = "pools = [" + ", ".join(json.dumps(p) for p in new) + "]"
    text = POOLS_LINE.sub(line, text, count=1) if POOLS_LINE.search(text) else line + "\n" + text
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    if path.exists():
        shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _reload_agent(state_dir: Path) -> None:
    snapshot = status.read(state_dir)
    if snapshot is None:
        click.echo("no running agent to tell; the change applies at its next start")
        return
    os.kill(int(snapshot["pid"]), signal.SIGHUP)
    click.echo(f"told the running agent (pid {snapshot['pid']}) to reload")


@click.group()
def pools() -> None:
    """List, join or leave team pools (edits the config file)."""


def _file_pools(path: Path) -> list[str]:
    """The pools the config file names (the file alone: flags and environment aside)."""
    if not path.exists():
        return []
    try:
        value = read_config_file(path).get("pools", [])
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise click.ClickException(f"{path}: pools is not a list of pool ids")
    return value


@pools.command("list")
@config_option
def pools_list(config_file: Path | None) -> None:
    for pool in _file_pools(config_file or DEFAULT_CONFIG_FILE):
        click.echo(pool)


def _edit(config_file: Path | None, change: Callable[[list[str]], list[str]], pool: str) -> None:
    if not POOL_ID.match(pool):
        raise click.ClickException(f"{pool!r} is not a valid pool id")
    path = config_file or DEFAULT_CONFIG_FILE
    current = _file_pools(path)
    new = change(current)
    if new == current:
        click.echo("nothing to change")
        return
    _write_pools(path, new)
    click.echo(f"pools: {', '.join(new) or '-'}")
    _reload_agent(_state_dir(config_file, None))


@pools.command("join")
@config_option
@click.argument("pool_id")
def pools_join(config_file: Path | None, pool_id: str) -> None:
    _edit(config_file, lambda cur: cur if pool_id in cur else [*cur, pool_id], pool_id)


@pools.command("leave")
@config_option
@click.argument("pool_id")
def pools_leave(config_file: Path | None, pool_id: str) -> None:
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
def doctor(config_file: Path | None) -> None:
    """Check this node's setup; every failure names its fix. Exits 1 on any failure."""
    r = Report()
    try:
        s = load({}, os.environ, config_file)
    except ConfigError as exc:
        r.fail("configuration", str(exc), "correct the setting named above")
        sys.exit(1)
    r.ok("configuration", f"{s.runner} runner, pools {','.join(s.pools) or '-'}")
    _check_state_dir(r, s)
    _check_coordinator(r, s)
    _check_runner(r, s)
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


def _check_state_dir(r: Report, s: Settings) -> None:
    try:
        s.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = s.state_dir / ".doctor"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        r.fail(
            "state dir",
            f"{s.state_dir} is not writable ({exc.strerror})",
            f"create it, owned by the agent's user: install -d -m 0700 {s.state_dir}",
        )
        return
    free = shutil.disk_usage(s.state_dir).free
    if free < s.min_free_bytes:
        r.fail(
            "state dir",
            f"{free >> 20} MiB free, below min_free_bytes",
            "free space or lower min_free_bytes",
        )
    else:
        r.ok("state dir", f"{s.state_dir}, {free >> 30} GiB free")


def _check_coordinator(r: Report, s: Settings) -> None:
    client = Coordinator(
        s.coordinator,
        token=s.token.get_secret_value() if s.token else None,
        timeout=10,
    )
    try:
        client.health()
    except CoordinatorError as exc:
        r.fail(
            "coordinator",
            f"{s.coordinator} does not answer ({exc})",
            "check the URL and the network, or start the coordinator",
        )
        return
    try:
        client.node_heartbeat(
            NodeHeartbeat(
                node_id=node_id(s)
                if s.node_id or (s.state_dir / "node-id").exists()
                else "doctor-probe"
            )
        )
        r.ok("credentials", "accepted")
    except Unregistered:
        r.ok("credentials", "accepted (node not registered yet)")
    except CredentialsError as exc:
        r.fail("credentials", str(exc), "run: flashnode login --coordinator URL, or set token_file")
    except CoordinatorError as exc:
        r.warn("credentials", f"could not check ({exc})")
    finally:
        client.close()
    r.ok("coordinator", s.coordinator)


def _check_runner(r: Report, s: Settings) -> None:
    if s.runner == "trusted":
        if os.geteuid() == 0 and not s.task_user:
            r.fail(
                "trusted runner",
                "running as root without task_user",
                "set task_user to an unprivileged user (e.g. flashnode-task)",
            )
        if os.geteuid() == 0 and not shutil.which("setpriv"):
            r.fail("trusted runner", "setpriv is missing", "install util-linux")
        if s.task_python:
            from flashnode import procs
            from flashnode.wire import MODULES

            why = procs.python_imports(s.task_python, MODULES, None)
            if why:
                r.fail(
                    "module tasks",
                    f"{s.task_python} cannot import them ({why})",
                    f"{s.task_python} -m pip install flashruntime torch",
                )
            else:
                r.ok("module tasks", s.task_python)
        r.ok("trusted runner", f"pools {','.join(s.pools)}")
        return
    try:
        import docker

        client = docker.DockerClient(base_url=s.docker_host, timeout=10)
        client.ping()
    except Exception as exc:
        r.fail(
            "docker engine",
            f"no engine answers at {s.docker_host} ({type(exc).__name__})",
            "start Docker (systemctl start docker) and add the agent's user to the docker group",
        )
        return
    r.ok("docker engine", s.docker_host)
    if not s.allowed_images:
        r.fail(
            "allowed images",
            "allowed_images is empty: every container task is refused",
            "list the images you allow in allowed_images",
        )
    for image in s.allowed_images:
        try:
            client.images.get(image)
            r.ok("image", image)
        except Exception:
            if s.pull_images:
                r.warn("image", f"{image} is not present; it will be pulled when needed")
            else:
                r.fail(
                    "image",
                    f"{image} is not present and pull_images is off",
                    f"docker pull {image}, or set pull_images = true",
                )


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
        pw = pwd.getpwnam(s.task_user or "")
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid
