"""``<state dir>/pause.json``: the owner's pause, kept across agent restarts.

``flashnode pause`` writes it (atomically, fsynced, mode 0640) and ``flashnode resume`` removes
it. A running agent needs no signal: ``PauseReader`` is called once per loop turn, costs one
``stat`` while the file is unchanged, and re-reads it when it changed; a pause written while no
agent runs applies when one starts.

On a full disk the file cannot be written: ``flashnode pause`` then tells the running agent by
a signal (``SIGNALS``, which the agent lists in its status), and ``flashnode resume`` always
does. A pause that came by signal holds at once, until ``flashnode resume`` (a duration cannot
travel in a signal); the reader writes it to the file as soon as it can, so that it outlives a
restart like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from flashnode.clock import moment
from flashnode.config.schedule import Pause, PauseMode, parse_duration

PAUSE_FILE = "pause.json"
MAX_BYTES = 4096


def pause(state_dir: Path, duration: str | None, drain: bool, now: float) -> Pause:
    """The owner's pause (``flashnode pause`` and the console's buttons): until ``resume``, or
    for ``duration`` (``30m``, ``2h``, ``1d``: ValueError otherwise); ``drain`` lets running
    tasks finish, else they are stopped and their leases left to lapse. Written before it returns
    (OSError when it cannot be)."""
    until = None if duration is None else now + parse_duration(duration)
    mode: PauseMode = "drain" if drain else "now"
    made = Pause(mode, until, now)
    write(state_dir, made)
    return made


def describe(pause: Pause) -> str:
    """``paused until `flashnode resume`; running tasks finish``, ``paused until 16:30 CEST (in
    2h00m); …``: what a pause does, in a line (the end as ``clock.moment`` shows a moment)."""
    when = (
        "until `flashnode resume`"
        if pause.until is None
        else f"until {moment(pause.until, pause.since or None, seconds=False)}"
    )
    how = (
        "running tasks finish"
        if pause.mode == "drain"
        else "running tasks are stopped and their leases left to lapse (not their failure)"
    )
    return f"paused {when}; {how}"


def write(state_dir: Path, pause: Pause) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / PAUSE_FILE
    tmp = state_dir / f".{PAUSE_FILE}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        os.fchmod(fd, 0o640)  # whatever the umask
        os.write(fd, json.dumps(pause.to_json(), sort_keys=True).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(state_dir)
    return path


def clear(state_dir: Path) -> bool:
    """Remove the pause; False when there was none."""
    try:
        (state_dir / PAUSE_FILE).unlink()
    except FileNotFoundError:
        return False
    _fsync_dir(state_dir)
    return True


def read(state_dir: Path) -> Pause | None:
    """The pause on file (expired or not), None without one; ValueError when it is unreadable."""
    path = state_dir / PAUSE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    try:
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path} is larger than {MAX_BYTES} bytes")
    try:
        return Pause.from_json(json.loads(data))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# What `flashnode pause` and `resume` send a running agent when the file cannot do (the agent
# lists them in status.json, so that a command never signals an agent that does not handle them).
SIGNALS = {
    "pause": signal.SIGUSR1,
    "pause_now": signal.SIGUSR2,
    "resume": signal.SIGRTMIN + 1,  # nothing else ever sends it (SIGCONT is job control's)
}


class PauseReader:
    """``read`` for the loop: re-reads only when the file changed (inode, size, mtime).

    ``signalled`` takes a pause, or a resume, sent by signal; it only sets a flag (it runs in a
    signal handler), and the next call acts on it."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._key: tuple[int, int, int] | None = None
        self._value: Pause | None = None
        self._request: tuple[Pause | None] | None = None  # set by a signal: (pause or None,)
        self._held: Pause | None = None  # a signalled pause not yet in the file

    def signalled(self, pause: Pause | None) -> None:
        """A pause (None: a resume) the owner sent by signal."""
        self._request = (pause,)

    def __call__(self) -> Pause | None:
        request, self._request = self._request, None
        if request is not None:
            (self._held,) = request
            if self._held is None:  # a resume: whatever the file says is over too
                with contextlib.suppress(OSError):
                    clear(self.state_dir)
        if self._held is not None:
            try:
                write(self.state_dir, self._held)  # from now on the file says it
            except OSError:
                return self._held  # the disk is still full: it holds from memory
            self._held = None
        try:
            st = os.lstat(self.state_dir / PAUSE_FILE)
        except FileNotFoundError:
            self._key, self._value = None, None
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            self._value = read(self.state_dir)  # raises while unreadable: re-read every turn
            self._key = key
        return self._value


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
