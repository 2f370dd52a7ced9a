"""The ``flashnode`` command: flags/env/config → Settings → wiring; exit codes; logging setup.

Why one module of this size: mostly click declarations; the wiring of the agent's parts lives here
so that no other module builds edges.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import click
import psutil

from flashnode import __version__
from flashnode.attempt import AttemptContext
from flashnode.attempt.outbox import Outbox
from flashnode.caches.datacache import DataCache, OriginPolicy
from flashnode.caches.envcache import ENVS_DIR, EnvCache
from flashnode.caches.fetcher import Fetcher
from flashnode.cli import common, doctor, login, pools, ui
from flashnode.cli import controls as controls_cli
from flashnode.cli import envs as envs_cli
from flashnode.clock import SystemClock
from flashnode.config.loading import gather, load, read_config_file
from flashnode.config.schedule import Pause, PauseMode
from flashnode.config.settings import DEFAULT_CONFIG_FILE, Settings, default_state_dir
from flashnode.coordinator.client import Coordinator
from flashnode.coordinator.wire import NodeRegistration
from flashnode.errors import (
    ConfigError,
    CredentialsError,
    EnvUnavailable,
    ExitCode,
    FlashnodeError,
    PrerequisiteError,
)
from flashnode.evidence import inventory, sensors
from flashnode.evidence.gpu import Nvml
from flashnode.evidence.gpupool import GpuPool
from flashnode.node.agent import Agent, effective_slots
from flashnode.node.controls import Controls, Readers, Rules
from flashnode.owner import lastexit, ledgerview, metrics, pausefile, statelock, unitview
from flashnode.owner.ledger import Ledger
from flashnode.owner.ledgerview import LedgerView
from flashnode.owner.status import Sinks, TerminalLine
from flashnode.owner.systemd import Notifier
from flashnode.runners import preflight
from flashnode.runners.background import Background
from flashnode.runners.base import Runner, RunnerEnv, runner_class
from flashnode.runners.spec import task_limits
from flashnode.sandbox import cgroups, diskuse
from flashnode.sandbox.limits import Limits
from flashnode.sandbox.procs.helpers import json_schema_problem
from flashnode.sandbox.procs.keyrings import private_session_keyring
from flashnode.sanitise import sanitise

if TYPE_CHECKING:  # the console is imported only when it is served
    from flashnode.console import Console
    from flashnode.console.usage import UsageRing

log = logging.getLogger("flashnode")


# journald reads a "<N>" prefix as the line's priority (sd-daemon(3)).
PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class LogFormatter(logging.Formatter):
    """Every record is one line, sanitised, whatever its source (a task, the coordinator, a data
    origin, a job): a newline in a message cannot start a line (or a journal record) of its own.
    A traceback's lines follow, each sanitised and led like its record (``lead``), indented."""

    def lead(self, record: logging.LogRecord) -> str:
        return ""

    def format(self, record: logging.LogRecord) -> str:
        record.message = sanitise(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lead = self.lead(record)
        more: list[str] = []
        if record.exc_info:
            more += self.formatException(record.exc_info).splitlines()
        if record.stack_info:
            more += self.formatStack(record.stack_info).splitlines()
        lines = [lead + self.formatMessage(record), *(f"{lead}  {sanitise(x)}" for x in more)]
        return "\n".join(lines)


class JournalFormatter(LogFormatter):
    """No timestamp (journald stamps each line), and the priority as a prefix of every line."""

    def lead(self, record: logging.LogRecord) -> str:
        return f"<{PRIORITY.get(record.levelno, 6)}>"


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
            "msg": sanitise(record.getMessage()),
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
        handler.setFormatter(LogFormatter("%(asctime)s %(levelname)-7s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _lower(message: str) -> str:
    """Click's ``No such option '--x'.`` as one of our lines reads: ``no such option '--x'``."""
    message = message.strip().removesuffix(".")
    return message[:1].lower() + message[1:] if message[1:2].islower() else message


def _fail(code: ExitCode, message: str) -> NoReturn:
    click.echo(f"flashnode: {sanitise(message)}", err=True)
    sys.exit(int(code))


class Commands(click.Group):
    """No traceback reaches a user from any command: what this user may not do is one line
    that says to run it with sudo, any other error one line that names it. Click's own errors
    read like ours too: ``flashnode: <what failed>; <the fix>`` (a bad command line: exit 2)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        run = functools.partial(
            super().main, args, prog_name, complete_var, False, windows_expand_args, **extra
        )
        if not standalone_mode:
            return run()
        try:
            code: object = run()  # an Exit's code (--help, --version), else the command's value
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # the help, as asked for by giving nothing
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "flashnode"
            _fail(ExitCode.USAGE, f"{_lower(exc.format_message())}; see {command} --help")
        except click.ClickException as exc:
            click.echo(f"flashnode: {sanitise(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("flashnode: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            # The reader went away (`flashnode history --json | head`): stop quietly, as a
            # shell tool does, and leave nothing for the interpreter to flush at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(128 + signal.SIGPIPE)
        except PermissionError as exc:
            common.needs_root(f"cannot use {exc.filename}" if exc.filename else "not allowed")
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(ExitCode.FAILURE, f"{where}{exc.strerror or exc}")
        except Exception as exc:
            if os.environ.get("FLASHNODE_DEBUG"):
                raise
            _fail(
                ExitCode.FAILURE,
                f"unexpected error: {type(exc).__name__}: {exc} (a bug: please report it;"
                " FLASHNODE_DEBUG=1 shows where)",
            )


@click.group(cls=Commands)
@click.version_option(__version__, prog_name="flashnode")
def main() -> None:
    """flashnode: the volunteer node agent of the flashruntime distributed ML runtime."""


for command in (
    login.login,
    login.logout,
    common.status_command,
    doctor.doctor,
    pools.pools,
    common.history,
    ui.ui,
):
    main.add_command(command)
controls_cli.register(main)
envs_cli.register(main)


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
    help="Unprivileged user trusted tasks run as when the agent is root [env FLASHNODE_TASK_USER].",
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
    (78 configuration, 69 a missing prerequisite). However it exits, it says why in the state
    dir, where `flashnode status` finds it once the agent is gone.
    """
    if pools:
        flags["pools"] = pools
    ending = Ending(*exit_state_dir(flags, os.environ, config_file))
    unit = unitview.running_under()
    service = unitview.load(unit) if unit else None
    try:
        settings = load_as_service(flags, config_file, service)
    except ConfigError as exc:
        ending.fail(ExitCode.CONFIG, f"configuration error: {exc}", ending.config_fix())
    ending.state_dir = settings.state_dir
    # First, before the checks (they take seconds) and before anything is touched: a second
    # agent on this state dir stops here.
    lock = None
    if settings.state_dir.is_dir():
        with contextlib.suppress(OSError):  # a state dir that is not ours: the checks say why
            lock = lock_state_dir(settings.state_dir, ending)
    found = preflight.problems(settings, service=service)
    for problem in found:
        if problem.code is not None:
            prefix = "configuration error: " if problem.code == ExitCode.CONFIG else ""
            ending.fail(problem.code, prefix + f"{problem.what}: {problem.why}", problem.fix)
    line = TerminalLine() if sys.stderr.isatty() and not settings.log_json else None
    setup_logging(settings.log_json, line)
    threading.excepthook = _log_thread_death
    for problem in found:
        log.warning("%s", problem.line())
    try:
        run_agent(
            settings,
            reload=lambda: load_as_service(flags, config_file, service),
            line=line,
            lock=lock,
            accepted=frozenset(p.what for p in found),
            source=Source(flags, config_file),
            ending=ending,
        )
    except ConfigError as exc:
        ending.fail(ExitCode.CONFIG, f"configuration error: {exc}", ending.config_fix())
    except CredentialsError as exc:
        ending.fail(
            ExitCode.CREDENTIALS,
            f"credentials refused: {exc}",
            f"store a token and join code {settings.coordinator} accepts: sudo flashnode login"
            f" --coordinator {settings.coordinator}; then {ending.restart()}",
        )
    except PrerequisiteError as exc:
        ending.fail(
            ExitCode.UNAVAILABLE,
            str(exc),
            f"`flashnode doctor` names what is missing; then {ending.restart()}",
        )
    except FlashnodeError as exc:
        ending.fail(ExitCode.FAILURE, str(exc), f"see the log; then {ending.restart()}")
    except Exception as exc:
        log.exception("unexpected error")
        ending.fail(
            ExitCode.FAILURE,
            f"unexpected error: {type(exc).__name__}: {exc}",
            f"a bug: the log has its traceback (report it); then {ending.restart()}",
        )
    ending.record(ExitCode.OK, "")


def load_as_service(
    flags: Mapping[str, Any], config_file: Path | None, service: unitview.UnitView | None
) -> Settings:
    """The settings; under a systemd unit, a path its sandbox keeps from the agent is refused
    with the unit setting to change (rather than "does not exist" for a file that does)."""
    try:
        return load(flags, os.environ, config_file)
    except ConfigError:
        if service is None:
            raise
        raw, _ = gather(flags, os.environ, config_file)
        found = unitview.check(service, raw)
        if not found:
            raise
        more = (
            f" (and {len(found) - 1} more: sudo flashnode doctor lists them)" if found[1:] else ""
        )
        raise ConfigError(f"{found[0].why}{more}; fix: {found[0].fix}") from None


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


class Ending:
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
        _fail(code, f"{message}; fix: {fix}" if fix else message)

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


def lock_state_dir(state_dir: Path, ending: Ending | None = None) -> statelock.StateLock:
    """The state dir's lock; exit 75 naming the holder when another agent has it. OSError when
    the lock file cannot be opened."""
    try:
        return statelock.acquire(state_dir)
    except statelock.Held as exc:
        unit = exc.holder.unit
        how = f"sudo systemctl stop {unit}" if unit else "stop it"
        (ending or Ending(state_dir)).fail(
            ExitCode.LOCKED,
            f"another agent runs on the state dir {state_dir}: {exc.holder.describe()}",
            f"{how} first, or give this one its own --state-dir",
        )


def make_runner(settings: Settings, env: RunnerEnv) -> Runner:
    """The configured runner (its preflight already passed in ``work``); ConfigError or
    PrerequisiteError when it cannot run here after all (e.g. a task user for a slot that
    ``slots = "auto"`` added)."""
    return runner_class(settings.runner).create(settings, env)


def _thread(fn: Callable[[], None], name: str) -> None:
    def run() -> None:
        try:
            fn()
        except Exception:  # never silently: the log says which thread and why
            log.exception("thread %s ended with an error", name)

    threading.Thread(target=run, name=name, daemon=True).start()


def _log_thread_death(args: threading.ExceptHookArgs) -> None:
    """Any other thread of the agent's that dies says so in the agent's log (journald)."""
    if args.exc_type is SystemExit:
        return
    exc = (args.exc_type, args.exc_value, args.exc_traceback)
    name = args.thread.name if args.thread is not None else "?"
    log.error("thread %s ended with an error", name, exc_info=exc)  # type: ignore[arg-type]


def env_cache(settings: Settings, limits: Limits) -> EnvCache | None:
    """The agent's one cache of job environments: the trusted runner's only. A root agent builds
    as its build user (``procs.BUILD_USER``), in a cgroup of its own with the per-task
    ``limits`` where the host has cgroups (flashnode.caches.envbuild)."""
    if settings.runner != "trusted":
        return None
    hierarchy = cgroups.detect()[0] if os.geteuid() == 0 else None
    try:
        return EnvCache(
            settings.state_dir / ENVS_DIR,
            settings.env_cache_bytes,
            allow_python_downloads=settings.allow_python_downloads,
            allow_source_builds=settings.allow_source_builds,
            negative_ttl_s=settings.env_negative_seconds,
            min_free_bytes=settings.min_free_bytes,
            hierarchy=hierarchy,
            build_limits=limits,
            index_policy=OriginPolicy.of(settings.env_allow_private_indexes),
        )
    except EnvUnavailable as exc:
        raise PrerequisiteError(str(exc)) from None


def data_cache(settings: Settings) -> DataCache:
    """The agent's one dataset cache (``<state dir>/data``) and its fetcher."""
    fetcher = Fetcher(
        ca_file=settings.dataset_ca_file,
        policy=OriginPolicy.of(settings.dataset_allow_private_origins),
        timeout_seconds=settings.dataset_fetch_timeout_seconds,
    )
    try:
        return DataCache(settings.state_dir / "data", settings.dataset_cache_bytes, fetcher)
    except OSError as exc:
        fetcher.close()
        raise PrerequisiteError(f"cannot set up the dataset cache: {exc}") from None


@dataclass(frozen=True)
class Source:
    """Where the running configuration came from: the flags given and the config file."""

    flags: dict[str, Any] = field(default_factory=dict)
    config_file: Path | None = None

    @property
    def file(self) -> Path | None:
        """The file a change is written to (the default one when it exists)."""
        if self.config_file is not None:
            return self.config_file
        return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.exists() else None

    def overridden(self, key: str) -> str | None:
        """Who sets ``key`` over the config file: a flag or the environment; None: the file."""
        if self.flags.get(key) not in (None, ()):
            return f"set by --{'pool' if key == 'pools' else key.replace('_', '-')}"
        if os.environ.get(f"FLASHNODE_{key.upper()}"):
            return f"set by FLASHNODE_{key.upper()}"
        return None


def _gpu_percent(nvml: Nvml | None, gpus: GpuPool) -> float | None:
    """The node's GPUs' mean utilisation now (None: no GPU, or one unreadable)."""
    if nvml is None or not gpus.devices:
        return None
    readings = [nvml.utilization(d) for d in gpus.devices]
    ok = [r for r in readings if r is not None]
    return sum(ok) / len(ok) if ok and len(ok) == len(readings) else None


def _console(
    settings: Settings,
    agent: Agent,
    coordinator: Coordinator,
    ring: UsageRing | None,
    source: Source,
    ledger: LedgerView,
) -> Console | None:
    """The owner's console, when ``ui_listen`` asks for it. An address that cannot be bound
    leaves the agent working without it (the console is on by default: a second agent on the
    machine, or a port taken, must not stop the work), and says so."""
    if settings.ui_listen is None or ring is None:
        return None
    from flashnode.console import start
    from flashnode.console.app import Wiring

    wiring = Wiring(
        state_dir=settings.state_dir,
        settings=lambda: agent.settings,
        config_file=source.file,
        validate=lambda path: load(source.flags, os.environ, path),
        overridden=source.overridden,
        reload=agent.request_reload,
        node_view=coordinator.node_view,
        ring=ring,
        task_uids=_task_uids(settings),
        ledger=ledger,
    )
    try:
        return start(settings.ui_listen, wiring)
    except OSError as exc:
        log.warning(
            "the console is off: cannot listen on %s (%s); set ui_listen to another address",
            settings.ui_listen,
            exc.strerror or exc,
        )
        return None


def _task_uids(settings: Settings) -> frozenset[int]:
    """The uids trusted tasks may run as (every slot the package makes users for)."""
    if settings.task_user is None:
        return frozenset()
    import pwd

    from flashnode.runners.trusted import slot_user_name

    found = set()
    for slot in range(64):
        try:
            found.add(pwd.getpwnam(slot_user_name(settings.task_user, slot)).pw_uid)
        except KeyError:
            continue
    return frozenset(found)


def run_agent(
    settings: Settings,
    reload: Callable[[], Settings] | None = None,
    line: TerminalLine | None = None,
    lock: statelock.StateLock | None = None,
    accepted: frozenset[str] = frozenset(),
    source: Source | None = None,
    ending: Ending | None = None,
) -> None:
    """Run the agent on its state dir, holding the state dir's lock (``lock``: already taken)
    until every attempt has ended and the last status is written. ``accepted``: what the
    preflight warned of at start (the quarantine's checks do not count it again)."""
    try:
        inventory.ensure_state_dir(settings.state_dir)
        if lock is None:
            lock = lock_state_dir(settings.state_dir, ending)
        node = inventory.node_id(settings)
    except OSError as exc:
        raise ConfigError(f"state dir {settings.state_dir}: {exc.strerror or exc}") from None
    try:
        _locked_run(settings, reload, line, node, accepted, source)
    finally:
        lock.release()


def _locked_run(
    settings: Settings,
    reload: Callable[[], Settings] | None,
    line: TerminalLine | None,
    node: str,
    accepted: frozenset[str],
    source: Source | None,
) -> None:
    if settings.runner == "trusted" and os.geteuid() == 0:
        # Before any thread starts (threads, and the tasks they start, inherit it).
        why = private_session_keyring()
        if why:
            log.warning("tasks share this agent's session keyring (%s)", why)
    try:
        served = metrics.create(settings.metrics_listen, settings.metrics_allow_remote)
    except ValueError as exc:
        raise ConfigError(f"metrics_listen: {exc}") from None
    except OSError as exc:
        raise PrerequisiteError(
            f"cannot serve metrics at {settings.metrics_listen}: {exc.strerror or exc}"
        ) from None
    try:
        _run_agent(settings, served, reload, line, node, accepted, source or Source())
    finally:
        served.close()


def _run_agent(
    settings: Settings,
    served: metrics.MetricsSink,
    reload: Callable[[], Settings] | None,
    line: TerminalLine | None,
    node: str,
    accepted: frozenset[str],
    source: Source,
) -> None:
    nvml = Nvml.open(settings.nvml_library)
    gpus = GpuPool(nvml.devices if nvml is not None else [])
    clock = SystemClock()
    slots = effective_slots(settings, len(gpus.devices))
    runner = make_runner(settings, RunnerEnv(node, gpus, clock, slots))
    coordinator = Coordinator(
        settings.coordinator,
        token=settings.token.get_secret_value() if settings.token else None,
        join_code=settings.join_code.get_secret_value() if settings.join_code else None,
    )
    machine = (psutil.virtual_memory().total, os.cpu_count() or 1)
    limits = task_limits(settings, slots, *machine)
    envs = env_cache(settings, limits)
    data = data_cache(settings)
    janitor = Background("janitor")  # retired workspaces, removed off the next claim's way
    ctx = AttemptContext(
        coordinator=coordinator,
        runner=runner,
        settings=settings,
        clock=clock,
        ledger=Ledger(settings.state_dir / "ledger.jsonl"),
        outbox=Outbox(settings.state_dir / "outbox"),
        start_thread=_thread,
        rng=random.Random(),
        gpu=nvml,
        gpus=gpus,
        limits=limits,
        space=lambda: diskuse.space(settings.state_dir),
        metrics=served,
        envs=envs,
        data=data,
        schema_check=json_schema_problem,
        later=janitor.submit,
    )

    def limits_of(new: Settings) -> Limits:
        return task_limits(new, effective_slots(new, len(gpus.devices)), *machine)

    def on_settings(new: Settings, limits: Limits) -> None:
        data.budget_bytes = new.dataset_cache_bytes
        data.fetcher.policy = OriginPolicy.of(new.dataset_allow_private_origins)
        data.prune()
        if envs is not None:
            envs.reconfigure(
                new.env_cache_bytes,
                new.min_free_bytes,
                limits,
                OriginPolicy.of(new.env_allow_private_indexes),
            )

    def registration(current: Settings) -> NodeRegistration:
        devices = nvml.refresh() if nvml is not None else []
        gpus.set_devices(devices)
        return inventory.registration(
            current, node, [d.info for d in devices], runner.module_capable
        )

    pause_reader = pausefile.PauseReader(settings.state_dir)
    readers = Readers(
        pause=pause_reader,
        on_battery=sensors.on_battery,
        idle_seconds=sensors.seat_idle_seconds,
        host_cpu=sensors.host_cpu_times,
    )
    controls = Controls(Rules.from_settings(settings), readers, clock)

    def health(current: Settings) -> list[str]:
        """The quarantine's check: the preflight's problems, but those the owner started with."""
        found = preflight.problems(current)
        return [p.line() for p in found if p.fatal or p.what not in accepted]

    ring = None
    if settings.ui_listen is not None:
        from flashnode.console.usage import UsageRing

        ring = UsageRing(gpu=lambda: _gpu_percent(nvml, gpus))
    given = LedgerView(ctx.ledger.path, checkpoint=settings.state_dir / ledgerview.CHECKPOINT_FILE)
    agent = Agent(
        ctx,
        coordinator,
        registration,
        reload=reload,
        sink=Sinks(Notifier(), *([line] if line else []), *([ring] if ring else [])),
        on_settings=on_settings,
        limits=limits_of,
        controls=controls,
        health=health,
        status_extra={"signals": {k: int(v) for k, v in pausefile.SIGNALS.items()}},
        totals=given.totals,
    )
    readers.task_cpu = agent.task_cpu  # every running task, containers included
    log.info(
        "flashnode %s: node %s, %s runner, %d slot(s), pools %s, coordinator %s",
        __version__,
        node,
        settings.runner,
        slots,
        ",".join(settings.pools) or "-",
        settings.coordinator,
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        agent.request_stop()

    def on_hangup(signum: int, frame: FrameType | None) -> None:
        agent.request_reload()

    def on_pause(mode: PauseMode) -> Callable[[int, FrameType | None], None]:
        return lambda signum, frame: pause_reader.signalled(Pause(mode, None, time.time()))

    def on_resume(signum: int, frame: FrameType | None) -> None:
        pause_reader.signalled(None)

    handlers: list[tuple[int, Callable[[int, FrameType | None], None]]] = [
        (signal.SIGTERM, on_signal),
        (signal.SIGINT, on_signal),
        (signal.SIGHUP, on_hangup),
        # `flashnode pause` and `resume` on a full disk, where the pause file cannot be written.
        (pausefile.SIGNALS["pause"], on_pause("drain")),
        (pausefile.SIGNALS["pause_now"], on_pause("now")),
        (pausefile.SIGNALS["resume"], on_resume),
    ]
    previous = [(sig, signal.signal(sig, handler)) for sig, handler in handlers]
    console = _console(settings, agent, coordinator, ring, source, given)
    try:
        agent.run()
    finally:
        if console is not None:
            console.close()
        given.save()
        janitor.drain(60)
        for sig, old in previous:
            signal.signal(sig, old)
        coordinator.close()
        data.fetcher.close()
