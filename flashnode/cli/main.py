"""The ``flashnode`` command: the group of every command (no traceback reaches a user: each error
is one line and its exit code) and ``flashnode work``, which loads the settings, runs the
checks, and hands the agent to flashnode.cli.wiring.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from flashnode import __version__, allocator
from flashnode.cli import common, doctor, login, pools, ui
from flashnode.cli import controls as controls_cli
from flashnode.cli import envs as envs_cli
from flashnode.cli.ending import AgentExit, exit_state_dir, fail, lock_state_dir
from flashnode.cli.logsetup import log_thread_death, setup_logging
from flashnode.cli.wiring import Source, run_agent
from flashnode.config.loading import gather
from flashnode.config.settings import Settings
from flashnode.errors import (
    ConfigError,
    CredentialsError,
    ExitCode,
    FlashnodeError,
    PrerequisiteError,
)
from flashnode.owner import unitview
from flashnode.owner.status import TerminalLine
from flashnode.runners import preflight
from flashnode.runners.registry import RUNNERS, load_settings, names
from flashnode.sanitise import sanitise

log = logging.getLogger("flashnode")


def _lower(message: str) -> str:
    """Click's ``No such option '--x'.`` as one of our lines reads: ``no such option '--x'``."""
    message = message.strip().removesuffix(".")
    return message[:1].lower() + message[1:] if message[1:2].islower() else message


class RunnerName(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.5
    """A runner the registry knows (``runners.registry``), read when the flag is parsed."""

    name = "runner"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if value not in RUNNERS:
            self.fail(f"{value!r} is not a runner (known: {', '.join(names())})", param, ctx)
        return str(value)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[" + "|".join(names()) + "]"


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
            fail(ExitCode.USAGE, f"{_lower(exc.format_message())}; see {command} --help")
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
            fail(ExitCode.FAILURE, f"{where}{exc.strerror or exc}")
        except Exception as exc:
            if os.environ.get("FLASHNODE_DEBUG"):
                raise
            fail(
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
    type=RunnerName(),
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
    allocator.settle()  # first, before any thread: freed memory goes back (issue 44)
    if pools:
        flags["pools"] = pools
    agent_exit = AgentExit(*exit_state_dir(flags, os.environ, config_file))
    unit = unitview.running_under()
    service = unitview.load(unit) if unit else None
    try:
        settings = load_as_service(flags, config_file, service)
    except ConfigError as exc:
        agent_exit.fail(ExitCode.CONFIG, f"configuration error: {exc}", agent_exit.config_fix())
    agent_exit.state_dir = settings.state_dir
    # First, before the checks (they take seconds) and before anything is touched: a second
    # agent on this state dir stops here.
    lock = None
    if settings.state_dir.is_dir():
        with contextlib.suppress(OSError):  # a state dir that is not ours: the checks say why
            lock = lock_state_dir(settings.state_dir, agent_exit)
    found = preflight.problems(settings, service=service)
    for problem in found:
        if problem.code is not None:
            prefix = "configuration error: " if problem.code == ExitCode.CONFIG else ""
            agent_exit.fail(problem.code, prefix + f"{problem.what}: {problem.why}", problem.fix)
    line = TerminalLine() if sys.stderr.isatty() and not settings.log_json else None
    setup_logging(settings.log_json, line)
    threading.excepthook = log_thread_death
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
            agent_exit=agent_exit,
        )
    except ConfigError as exc:
        agent_exit.fail(ExitCode.CONFIG, f"configuration error: {exc}", agent_exit.config_fix())
    except CredentialsError as exc:
        agent_exit.fail(
            ExitCode.CREDENTIALS,
            f"credentials refused: {exc}",
            f"store a token and join code {settings.coordinator} accepts: sudo flashnode login"
            f" --coordinator {settings.coordinator}; then {agent_exit.restart()}",
        )
    except PrerequisiteError as exc:
        agent_exit.fail(
            ExitCode.UNAVAILABLE,
            str(exc),
            f"`flashnode doctor` names what is missing; then {agent_exit.restart()}",
        )
    except FlashnodeError as exc:
        agent_exit.fail(ExitCode.FAILURE, str(exc), f"see the log; then {agent_exit.restart()}")
    except Exception as exc:
        log.exception("unexpected error")
        agent_exit.fail(
            ExitCode.FAILURE,
            f"unexpected error: {type(exc).__name__}: {exc}",
            f"a bug: the log has its traceback (report it); then {agent_exit.restart()}",
        )
    agent_exit.record(ExitCode.OK, "")


def load_as_service(
    flags: Mapping[str, Any], config_file: Path | None, service: unitview.UnitView | None
) -> Settings:
    """The settings; under a systemd unit, a path its sandbox keeps from the agent is refused
    with the unit setting to change (rather than "does not exist" for a file that does)."""
    try:
        return load_settings(flags, os.environ, config_file)
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
