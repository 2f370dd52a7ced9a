"""``<state dir>/pause.json``: the owner's pause, kept across agent restarts.

``flashnode pause`` writes it (atomically, fsynced, mode 0640) and ``flashnode resume`` removes
it. A running agent needs no signal: ``PauseReader`` is called once per loop turn, costs one
``stat`` while the file is unchanged, and re-reads it when it changed; a pause written while no
agent runs applies when one starts.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import datetime
from pathlib import Path

from flashnode.controls import Pause, PauseMode, parse_duration

PAUSE_FILE = "pause.json"
MAX_BYTES = 4096


def pause(state_dir: Path, duration: str | None, drain: bool, now: float) -> Pause:
    """The owner's pause (``flashnode pause`` and the console's buttons): until ``resume``, or
    for ``duration`` (``30m``, ``2h``, ``1d``: ValueError otherwise); ``drain`` lets running
    tasks finish, else they are stopped and their leases given back. Written before it returns
    (OSError when it cannot be)."""
    until = None if duration is None else now + parse_duration(duration)
    mode: PauseMode = "drain" if drain else "now"
    made = Pause(mode, until, now)
    write(state_dir, made)
    return made


def describe(pause: Pause) -> str:
    """``paused until `flashnode resume`; running tasks finish``: what a pause does, in a line."""
    when = (
        "until `flashnode resume`"
        if pause.until is None
        else f"until {datetime.fromtimestamp(pause.until):%Y-%m-%d %H:%M}"
    )
    how = (
        "running tasks finish"
        if pause.mode == "drain"
        else "running tasks are stopped and their leases given back"
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


class PauseReader:
    """``read`` for the loop: re-reads only when the file changed (inode, size, mtime)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._key: tuple[int, int, int] | None = None
        self._value: Pause | None = None

    def __call__(self) -> Pause | None:
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
