"""The owner's commands for a running node: ``pause``, ``resume`` and ``logs``."""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TextIO

import click

from flashnode.cli.common import config_option, needs_root, state_dir_of, state_dir_option
from flashnode.coordinator.ids import SAFE_ID
from flashnode.owner import pausefile, status
from flashnode.sandbox import logcap
from flashnode.sanitise import sanitise

POLL_SECONDS = 0.2
CHUNK = 64 * 1024


def register(main: click.Group) -> None:
    for command in (pause, resume, drain, logs):
        main.add_command(command)


# --- pause and resume ------------------------------------------------------------------------


@click.command()
@config_option
@state_dir_option
@click.option(
    "--for", "duration", metavar="DURATION", help="e.g. 30m, 2h, 1d [default: until resumed]."
)
@click.option(
    "--drain/--now",
    "drain",
    default=True,
    help="Let running tasks finish (default), or stop them now (their leases lapse: not counted"
    " as the tasks' failure).",
)
def pause(
    config_file: Path | None, state_dir: Path | None, duration: str | None, drain: bool
) -> None:
    """Stop taking work; the node stays registered and keeps its heartbeat.

    The pause is kept in the state dir: it outlives agent restarts until `flashnode resume` or
    until its duration ends. A running agent applies it within a second.
    """
    directory = state_dir_of(config_file, state_dir)
    try:
        made = pausefile.pause(directory, duration, drain, time.time())
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--for") from None
    except PermissionError:
        needs_root(f"cannot write the pause in {directory}")
    except OSError as exc:
        # A full disk: the running agent is told by a signal (it keeps the pause in memory, and
        # writes it to the file once it can).
        pid = _signal(directory, "pause" if drain else "pause_now")
        if pid is None:
            raise click.ClickException(
                f"cannot write the pause in {directory}: {exc.strerror}"
            ) from None
        lost = " (--for needs the file: it lasts until then)" if duration is not None else ""
        click.echo(
            f"cannot write the pause in {directory} ({exc.strerror}): told the running agent"
            f" (pid {pid}) by a signal; paused until `flashnode resume`{lost}"
        )
        return
    click.echo(pausefile.describe(made))
    _tell(directory)


@click.command()
@config_option
@state_dir_option
def resume(config_file: Path | None, state_dir: Path | None) -> None:
    """End a pause: the node takes work again (subject to the config's rules)."""
    directory = state_dir_of(config_file, state_dir)
    try:
        removed = pausefile.clear(directory)
    except PermissionError:
        needs_root(f"cannot remove the pause in {directory}")
    except OSError as exc:
        raise click.ClickException(
            f"cannot remove the pause in {directory}: {exc.strerror}"
        ) from None
    snapshot = status.read(directory)
    held = bool(snapshot and (snapshot.get("controls") or {}).get("paused"))
    # Also a pause the agent keeps in memory (it came by signal on a full disk): a signal.
    told = _signal(directory, "resume") if removed or held else None
    click.echo("resumed" if removed or held else "not paused")
    if told is not None:
        click.echo(f"told the running agent (pid {told}): it takes work again within a second")
    elif removed:
        _tell(directory)


# --- drain ---------------------------------------------------------------------------------

DRAIN_TOLD_S = 3.0  # how long `drain` waits for the agent to say how long its drain may take


@click.command()
@config_option
@state_dir_option
@click.option("--wait", is_flag=True, help="Wait until the agent has stopped, saying what runs.")
def drain(config_file: Path | None, state_dir: Path | None, wait: bool) -> None:
    """Stop taking work, let running tasks finish, then stop the agent.

    Running tasks get drain_seconds (300 by default) to finish and commit; those still running
    then are stopped (their leases lapse: not the tasks' failure). Asked twice, they are stopped
    now. Under systemd the service stays stopped until `systemctl start flashnode`. A plain
    `systemctl stop` or `restart` does not wait: running tasks run on for the next start to
    re-attach (reattach_seconds)."""
    directory = state_dir_of(config_file, state_dir)
    snapshot = status.read(directory)
    pid = _signal(directory, "drain")
    if snapshot is None or pid is None:
        click.echo("no agent is running on this state dir")
        return
    running = snapshot.get("running") or []
    click.echo(f"the agent (pid {pid}) drains: it takes no new work; {len(running)} task(s) run")
    for attempt in running:
        if isinstance(attempt, dict):
            click.echo(f"  {status.attempt_line(attempt, time.time())}")
    # How long it may still take: the agent says so once its drain has started.
    shown = ""
    deadline = time.monotonic() + DRAIN_TOLD_S
    while running and time.monotonic() < deadline and status.agent_alive(pid):
        now = status.read(directory)
        if now is not None and now.get("draining"):
            shown = str(now.get("state") or "")
            click.echo(f"  {sanitise(shown)}")
            break
        time.sleep(0.2)
    if not wait:
        return
    while status.agent_alive(pid):
        now = status.read(directory)
        text = str(now.get("state") or "") if now is not None and now.get("pid") else ""
        if text and text != shown:
            click.echo(f"  {sanitise(text)}")
            shown = text
        time.sleep(1.0)
    click.echo("the agent has stopped")


def _tell(directory: Path) -> None:
    snapshot = status.read(directory)
    if snapshot is None:
        click.echo("no agent is running on this state dir; it applies at the next start")
    else:
        click.echo(f"the running agent (pid {snapshot['pid']}) applies it within a second")


def _signal(directory: Path, what: str) -> int | None:
    """Send the running agent the signal it lists for ``what`` (status.json); its pid, or None
    when no agent runs or it lists none (an agent before 0.5 would die of an unknown one)."""
    snapshot = status.read(directory)
    signals = snapshot.get("signals") if snapshot else None
    number = signals.get(what) if isinstance(signals, dict) else None
    if snapshot is None or not isinstance(number, int) or isinstance(number, bool) or number <= 0:
        return None
    pid = int(snapshot["pid"])
    try:
        os.kill(pid, number)
    except OSError:
        return None
    return pid


# --- logs ------------------------------------------------------------------------------------


@click.command()
@config_option
@state_dir_option
@click.argument("lease", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the task writes.")
@click.option(
    "--raw",
    is_flag=True,
    help="Pass the bytes through unchanged (terminal control sequences included).",
)
def logs(
    config_file: Path | None, state_dir: Path | None, lease: str | None, follow: bool, raw: bool
) -> None:
    """Print a task's stdout and stderr (to this command's stdout and stderr).

    Without LEASE: follow the task that runs (when several run, name one). With LEASE: a
    running task's, or an ended one's while the node keeps it (the latest `keep_logs`
    attempts'; `flashnode history` lists them). With -f, follow a running task until its
    attempt ends. Where both end up in one place (a terminal, `2>&1`), each stretch of output
    is headed by the stream it came from, `==> stdout <==` or `==> stderr <==`; one stream
    alone: send the other away (`2>/dev/null`, `>/dev/null`). Control characters the task
    printed are shown escaped unless --raw (the bytes unchanged, no headers): a task must not
    drive the owner's terminal.
    """
    directory = state_dir_of(config_file, state_dir)
    if lease is None:
        lease, follow = _only_running(directory), True
    if not SAFE_ID.match(lease):
        raise click.BadParameter(f"{lease!r} is not a lease id", param_hint="LEASE")
    try:
        os.stat(directory / "attempts")
        found = logcap.find(directory, lease)
    except PermissionError:
        needs_root(f"cannot read {directory}")
    except OSError:
        found = logcap.find(directory, lease)
    if found is None and not os.access(directory, os.R_OK):
        needs_root(f"cannot read {directory}")
    if found is None:
        raise click.ClickException(
            f"no output of attempt {lease} is on this node: it never ran here, or it ended"
            " before the latest keep_logs attempts (`flashnode history` lists them)"
        )
    path, live = found
    out: Sink
    err: Sink
    if raw:
        out, err = sys.stdout.buffer, sys.stderr.buffer
    else:
        out, err = Clean(sys.stdout), Clean(sys.stderr)
    marked = not raw and _one_place(sys.stdout, sys.stderr)
    try:
        # An attempt that ended is printed whole; a running one followed until its end.
        tail(path, out, err, follow and live, marked=marked)
    except PermissionError:
        needs_root(f"cannot read {path}")
    except KeyboardInterrupt:
        sys.exit(130)


def _only_running(directory: Path) -> str:
    """The lease of the one task that runs; else one line that says what to name."""
    try:
        snapshot = status.read(directory, strict=True)
    except PermissionError:
        needs_root(f"cannot read {directory / status.STATUS_FILE}", group=True)
    if snapshot is None:
        raise click.ClickException(
            "no agent is running on this state dir: name an ended attempt's lease"
            " (`flashnode history` lists them)"
        )
    running = [str(a.get("lease_id")) for a in snapshot.get("running") or []]
    if not running:
        raise click.ClickException(
            "no task runs now: name an ended attempt's lease (`flashnode history` lists them)"
        )
    if len(running) > 1:
        raise click.UsageError(
            f"{len(running)} tasks run: name one, flashnode logs LEASE, of "
            + ", ".join(sanitise(r) for r in running)
        )
    return running[0]


class Sink(Protocol):
    def write(self, data: bytes, /) -> object: ...
    def flush(self) -> None: ...


class Clean:
    """Decodes UTF-8 across chunk boundaries and escapes what would drive a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._cr = False

    def write(self, data: bytes, /) -> int:
        text = self._decoder.decode(data)
        if self._cr and text.startswith("\n"):
            text = text[1:]
        self._cr = text.endswith("\r")
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # progress bars: one line each
        self.stream.write(sanitise(text, keep="\t\n"))
        return len(data)

    def flush(self) -> None:
        self.stream.flush()


class _Stream:
    """One of ``logs/stdout.txt``, ``logs/stderr.txt``, read by descriptor as it grows."""

    def __init__(self, path: Path, sink: Sink) -> None:
        self.path, self.sink = path, sink
        self.fd: int | None = None
        self.inode: int | None = None

    def pump(self) -> None:
        self._reopen_if_replaced()
        if self.fd is None:
            return
        wrote = False
        while True:
            chunk = os.read(self.fd, CHUNK)
            if not chunk:
                break
            self.sink.write(chunk)
            wrote = True
        if wrote:
            self.sink.flush()

    def _reopen_if_replaced(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return  # not created yet, or the attempt is being removed: keep what is open
        if self.fd is not None and st.st_ino == self.inode:
            return
        if not stat.S_ISREG(st.st_mode):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return
        if self.fd is not None:
            self.pump_rest()
            os.close(self.fd)
        self.fd, self.inode = fd, os.fstat(fd).st_ino

    def pump_rest(self) -> None:
        assert self.fd is not None
        while chunk := os.read(self.fd, CHUNK):
            self.sink.write(chunk)
        self.sink.flush()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _one_place(a: TextIO, b: TextIO) -> bool:
    """Whether two output streams end in the same file, pipe or terminal (where the reader sees
    them merged)."""
    try:
        x, y = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


class _Headed:
    """One stream's sink that, where output switches from the other stream, first writes
    ``==> NAME <==`` on a line of its own (after a newline if the other stopped mid-line). The
    task cannot forge a header: a line of its own that begins ``==> `` is written ``\\==> ``
    (the bytes that may begin one are held back until the rest of the line tells)."""

    def __init__(self, name: str, sink: Sink, shared: dict[str, object]) -> None:
        self.name, self.sink, self.shared = name, sink, shared
        self.held = b""

    def write(self, data: bytes, /) -> object:
        data, self.held = self.held + data, b""
        if data:
            self._switch()
        out = bytearray()
        start = not self.shared.get("mid_line")
        for line in data.splitlines(keepends=True):
            if start and line.startswith(HEADER_MARK):
                out += b"\\"
            elif start and HEADER_MARK.startswith(line):  # "==" at the end: not known yet
                self.held = line
                break
            out += line
            start = line.endswith((b"\n", b"\r"))
        if out:
            self.shared["mid_line"] = not start
        return self.sink.write(bytes(out))

    def finish(self) -> None:
        """What was held back is written as it is: no more of its line will come."""
        held, self.held = self.held, b""
        if held:
            self._switch()
            self.sink.write(held)
            self.shared["mid_line"] = True

    def _switch(self) -> None:
        """The header, where the output switches to this stream."""
        if self.shared.get("current") == self.name:
            return
        if self.shared.get("mid_line"):
            self.sink.write(b"\n")
            self.shared["mid_line"] = False
        self.sink.write(f"==> {self.name} <==\n".encode())
        self.shared["current"] = self.name

    def flush(self) -> None:
        self.sink.flush()


HEADER_MARK = b"==> "


def tail(
    logs: Path,
    out: Sink,
    err: Sink,
    follow: bool,
    poll: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    marked: bool = False,
) -> None:
    """Copy ``logs/stdout.txt`` to ``out`` and ``logs/stderr.txt`` to ``err``; with ``follow``,
    keep copying (every ``poll`` seconds) until the directory disappears (the attempt ended and
    its workspace went), then copy what is left. ``marked``: head each stretch of output with
    the stream it came from (the two end up in one place)."""
    if marked:
        shared: dict[str, object] = {}
        out, err = _Headed("stdout", out, shared), _Headed("stderr", err, shared)
    streams = [_Stream(logs / "stdout.txt", out), _Stream(logs / "stderr.txt", err)]
    try:
        for s in streams:
            s.pump()
        while follow:
            gone = not _is_dir(logs)
            for s in streams:
                s.pump()
            if gone:
                break
            sleep(poll)
    finally:
        for s in streams:
            s.close()
        for sink in (out, err):
            if isinstance(sink, _Headed):
                sink.finish()


def _is_dir(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.lstat(path).st_mode)
    return False
