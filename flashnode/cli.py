"""The ``flashnode`` command: flags/env/config → Settings → wiring; exit codes; logging setup."""

from __future__ import annotations

import json
import logging
import os
import pwd
import random
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click

from flashnode import __version__, cgroups, inventory, owner, preflight
from flashnode.agent import Agent
from flashnode.attempt import AttemptContext
from flashnode.clock import SystemClock
from flashnode.coordinator import Coordinator
from flashnode.errors import (
    ConfigError,
    CredentialsError,
    ExitCode,
    FlashnodeError,
    PrerequisiteError,
)
from flashnode.gpu import Nvml
from flashnode.journal import Journal
from flashnode.ledger import Ledger
from flashnode.procs import TaskUser
from flashnode.runners.base import Runner
from flashnode.runners.trusted import TrustedRunner
from flashnode.settings import Settings, load
from flashnode.slots import GpuPool
from flashnode.status import Sinks, TerminalLine
from flashnode.systemd import Notifier
from flashnode.wire import NodeRegistration

log = logging.getLogger("flashnode")


# journald reads a "<N>" prefix as the line's priority (sd-daemon(3)).
PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class JournalFormatter(logging.Formatter):
    """No timestamp (journald stamps each line), and the priority as a prefix."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


class LineClearingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Clears the terminal status line before a log line, and redraws it after."""

    def __init__(self, line: TerminalLine) -> None:
        super().__init__(line.stream)
        self.line = line

    def emit(self, record: logging.LogRecord) -> None:
        self.line.clear()
        super().emit(record)
        if self.line.text:
            self.line.status(self.line.text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(log_json: bool, line: TerminalLine | None = None) -> None:
    handler: logging.Handler = (
        LineClearingHandler(line) if line else logging.StreamHandler(sys.stderr)
    )
    if log_json:
        handler.setFormatter(JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fail(code: ExitCode, message: str) -> None:
    click.echo(f"flashnode: {message}", err=True)
    sys.exit(int(code))


@click.group()
@click.version_option(__version__, prog_name="flashnode")
def main() -> None:
    """flashnode: the volunteer node agent of the flashruntime distributed ML runtime."""


owner.register(main)


# Paths are checked by the loader, not by click: an unreadable file is a refused setting (78).
PATH = click.Path(path_type=Path, exists=False, readable=False)


@main.command()
@click.option(
    "--config",
    "config_file",
    type=PATH,
    help="TOML config file [default: /etc/flashnode/flashnode.toml when present].",
)
@click.option("--coordinator", help="Coordinator base URL [env FLASHNODE_COORDINATOR].")
@click.option(
    "--runner",
    type=click.Choice(["trusted", "docker"]),
    help="How tasks run: docker (sandboxed, default) or trusted (host, pool-only).",
)
@click.option(
    "--pool",
    "pools",
    multiple=True,
    help="A team pool this node serves; repeatable [env FLASHNODE_POOLS, comma-separated].",
)
@click.option(
    "--state-dir",
    type=PATH,
    help="State directory [default: $STATE_DIRECTORY under systemd, /var/lib/flashnode as"
    " root, else ~/.local/state/flashnode].",
)
@click.option("--node-id", help="Node id [default: generated once, kept in the state dir].")
@click.option(
    "--token-file",
    type=PATH,
    help="File holding the bearer token (mode 0600) [or env FLASHNODE_TOKEN, or what"
    " `flashnode login` stored].",
)
@click.option(
    "--join-code-file",
    type=PATH,
    help="File holding the join code (mode 0600) [or env FLASHNODE_JOIN_CODE, or what"
    " `flashnode login` stored].",
)
@click.option(
    "--task-user",
    help="Unprivileged user trusted tasks run as when the agent is root [env"
    " FLASHNODE_TASK_USER].",
)
@click.option("--max-tasks", type=int, help="Finish this many attempts, then exit 0.")
@click.option(
    "--slots", help="Attempts at once: N (at least 1), or auto (one per GPU) [default: 1]."
)
@click.option("--log-json", is_flag=True, default=None, help="Log JSON lines.")
def work(config_file: Path | None, pools: tuple[str, ...], **flags: Any) -> None:
    """Register with the coordinator, then claim, run and commit tasks until stopped.

    Before anything else the same checks as `flashnode doctor` run (without the coordinator):
    a problem that would keep the agent from working stops it with one line and its exit code
    (78 configuration, 69 a missing prerequisite).
    """
    if pools:
        flags["pools"] = pools
    try:
        settings = load(flags, os.environ, config_file)
    except ConfigError as exc:
        _fail(ExitCode.CONFIG, f"configuration error: {exc}")
    found = preflight.problems(settings)
    for problem in found:
        if problem.code is not None:
            prefix = "configuration error: " if problem.code == ExitCode.CONFIG else ""
            _fail(problem.code, prefix + problem.line())
    line = TerminalLine() if sys.stderr.isatty() and not settings.log_json else None
    setup_logging(settings.log_json, line)
    for problem in found:
        log.warning("%s", problem.line())
    try:
        run_agent(settings, reload=lambda: load(flags, os.environ, config_file), line=line)
    except ConfigError as exc:
        _fail(ExitCode.CONFIG, f"configuration error: {exc}")
    except CredentialsError as exc:
        _fail(ExitCode.CREDENTIALS, f"credentials refused: {exc}")
    except PrerequisiteError as exc:
        _fail(ExitCode.UNAVAILABLE, str(exc))
    except FlashnodeError as exc:
        _fail(ExitCode.FAILURE, str(exc))


def task_user(settings: Settings) -> TaskUser | None:
    """The user trusted tasks run as: required (and not root) when the agent runs as root."""
    if os.geteuid() != 0:
        if settings.task_user:
            raise ConfigError("task_user needs the agent to run as root")
        log.info("trusted tasks run as this agent's own user (uid %d)", os.geteuid())
        return None
    if not settings.task_user:
        raise ConfigError(
            "running as root: set task_user to an unprivileged user for trusted tasks"
        )
    try:
        pw = pwd.getpwnam(settings.task_user)
    except KeyError:
        raise ConfigError(f"task_user {settings.task_user!r} does not exist") from None
    if pw.pw_uid == 0:
        raise ConfigError(f"task_user {settings.task_user!r} is root")
    _check_reachable(settings.state_dir, pw.pw_uid, pw.pw_gid, settings.task_user)
    if not shutil.which("setpriv"):
        raise PrerequisiteError("setpriv (util-linux) is needed to run tasks as task_user")
    log.info("trusted tasks run as %s (uid %d)", pw.pw_name, pw.pw_uid)
    return TaskUser(pw.pw_name, pw.pw_uid, pw.pw_gid)


def _check_reachable(state_dir: Path, uid: int, gid: int, user: str) -> None:
    """The task user must be able to enter every directory above its workspace."""
    for d in [state_dir.resolve(), *state_dir.resolve().parents][1:]:
        st = d.stat()
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            raise ConfigError(
                f"task_user {user!r} cannot enter {d}, above the state dir {state_dir}:"
                " choose another state_dir or allow search (chmod o+x)"
            )


def make_runner(settings: Settings, pool: GpuPool, node: str) -> Runner:
    if settings.runner == "trusted":
        user = task_user(settings)
        hierarchy, why = cgroups.detect()
        if hierarchy is None:
            log.warning("no per-task cgroups (%s): limits rely on process groups and tokens", why)
        else:
            log.info("per-task cgroups in %s", hierarchy.describe())
        limits = cgroups.Limits(settings.task_memory_bytes, settings.task_cpus, settings.task_pids)
        runner = TrustedRunner(
            settings.pools, settings.log_max_bytes, hierarchy, limits, user, pool
        )
        runner.reconfigure(settings)  # task_python: are module tasks on?
        return runner
    # Imported here: the Docker SDK costs a trusted-only agent memory it never uses.
    from flashnode.runners.container import ContainerRunner

    return ContainerRunner(settings, node, pool)


def _thread(fn: Callable[[], None], name: str) -> None:
    threading.Thread(target=fn, name=name, daemon=True).start()


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def run_agent(
    settings: Settings,
    reload: Callable[[], Settings] | None = None,
    line: TerminalLine | None = None,
) -> None:
    try:
        inventory.ensure_state_dir(settings.state_dir)
        node = inventory.node_id(settings)
    except OSError as exc:
        raise ConfigError(f"state dir {settings.state_dir}: {exc.strerror or exc}") from None
    pool = GpuPool()
    runner = make_runner(settings, pool, node)
    nvml = Nvml.open(settings.nvml_library)
    coordinator = Coordinator(
        settings.coordinator,
        token=settings.token.get_secret_value() if settings.token else None,
        join_code=settings.join_code.get_secret_value() if settings.join_code else None,
    )
    ctx = AttemptContext(
        coordinator=coordinator,
        runner=runner,
        settings=settings,
        clock=SystemClock(),
        ledger=Ledger(settings.state_dir / "ledger.jsonl"),
        journal=Journal(settings.state_dir / "journal"),
        start_thread=_thread,
        rng=random.Random(),
        gpu=nvml,
        gpus=pool,
    )

    def registration(current: Settings) -> NodeRegistration:
        devices = nvml.refresh() if nvml is not None else []
        pool.set_devices(devices)
        return inventory.registration(
            current, node, [d.info for d in devices], runner.module_capable
        )

    agent = Agent(
        ctx,
        coordinator,
        registration,
        reload=reload,
        free_bytes=lambda: _free_bytes(settings.state_dir),
        sink=Sinks(Notifier(), *([line] if line else [])),
    )
    log.info(
        "flashnode %s: node %s, %s runner, pools %s, coordinator %s",
        __version__,
        node,
        settings.runner,
        ",".join(settings.pools) or "-",
        settings.coordinator,
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        agent.request_stop()

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        agent.request_reload()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hangup)
    try:
        agent.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        coordinator.close()
