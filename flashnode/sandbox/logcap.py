"""A task's output stream kept on disk with a size cap: the first ``cap`` bytes, then (when the
stream was longer) a marker saying how much was dropped, and its last bytes. The last line it
printed is kept for the owner's live view (``printable``: never terminal control). Once the
attempt has ended, its output is kept for the owner (``keep``): the latest ``keep_logs``
attempts' under ``<state dir>/logs/``, read by ``flashnode logs`` and the console's history."""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from flashnode.coordinator.ids import SAFE_ID
from flashnode.sandbox.removal import remove_tree
from flashnode.sanitise import sanitise

TAIL_BYTES = 8 * 1024
LINE_CHARS = 160  # the most of a last line the live view shows

_WRITES = itertools.count(1)  # orders writes across streams: which printed last


class CappedFile:
    """``write`` never raises: a file that cannot be written (a full disk) stops being written,
    ``error`` says why, and the stream is still read to its end (the tail kept in memory), so the
    thread that copies it goes on and the task is never left blocked on a full pipe."""

    def __init__(self, path: Path, cap: int) -> None:
        self._out = path.open("wb", buffering=0)  # written as the task prints
        self._cap = cap
        self.total = 0
        self.tail = b""
        self.written_at = 0  # when it was last written, in the order of all writes (0: never)
        self.error: OSError | None = None  # why the file stopped being written

    def write(self, chunk: bytes) -> None:
        room = self._cap - self.total
        if room > 0 and self.error is None:
            try:
                self._out.write(chunk[:room])
            except OSError as exc:
                self.error = exc
        self.total += len(chunk)
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        if chunk:
            self.written_at = next(_WRITES)

    @property
    def last_line(self) -> str:
        """The last non-empty line printed so far (a progress bar's latest state), printable."""
        lines = self.tail.replace(b"\r", b"\n").split(b"\n")
        last = next((x for x in reversed(lines) if x.strip()), b"")
        return printable(last)

    def close(self) -> None:
        over = self.total - self._cap
        try:
            if over > 0 and self.error is None:
                kept = self.tail[-over:]
                self._out.write(
                    f"\n[flashnode: {over} bytes over the {self._cap}-byte cap not kept;"
                    f" the last {len(kept)} follow]\n".encode()
                )
                self._out.write(kept)
        except OSError as exc:
            self.error = exc
        finally:
            with contextlib.suppress(OSError):
                self._out.close()


def printable(data: bytes, limit: int = LINE_CHARS) -> str:
    """One line of a task's output, safe to show on the owner's terminal: decoded, control
    characters escaped (``sanitise``), at most ``limit`` characters."""
    return sanitise(data.decode("utf-8", "replace").strip(), limit=limit)


def latest_line(*files: CappedFile) -> str:
    """The last line of whichever stream printed last."""
    latest = max(files, key=lambda f: f.written_at, default=None)
    return latest.last_line if latest is not None and latest.written_at else ""


class Pump:
    """Copies a stream of chunks into a CappedFile on its own thread (a task's pipe, a
    container's log). ``errors``: what ending the stream early may raise, taken as its end."""

    def __init__(
        self,
        chunks: Iterator[bytes],
        path: Path,
        cap: int,
        name: str,
        errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.file = CappedFile(path, cap)
        self._errors = errors
        self._thread = threading.Thread(target=self._run, args=(chunks,), name=name, daemon=True)
        self._thread.start()

    @property
    def tail(self) -> bytes:
        return self.file.tail

    def _run(self, chunks: Iterator[bytes]) -> None:
        try:
            with contextlib.suppress(*self._errors):
                for chunk in chunks:
                    self.file.write(chunk)
        finally:
            self.file.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


# --- what ended attempts printed, kept for the owner -------------------------------------------

KEPT_DIR = "logs"  # <state dir>/logs/<lease id>/stdout.txt, stderr.txt: the agent's alone


def keep(logs: Path, state_dir: Path, lease_id: str) -> None:
    """Keep an ended attempt's captured output (its workspace's ``logs/``, the agent's own
    directory no task could reach) as ``<state dir>/logs/<lease id>``: a rename, no copy. Best
    effort: what cannot be kept goes with the workspace."""
    kept = state_dir / KEPT_DIR
    with contextlib.suppress(OSError):
        kept.mkdir(mode=0o700, exist_ok=True)
        target = kept / lease_id
        if target.exists():
            return  # an attempt recovered after a restart: the first copy stays
        os.rename(logs, target)
        os.utime(target)  # its place in the rotation: when it ended


def rotate(state_dir: Path, count: int) -> None:
    """Keep the latest ``count`` attempts' output (``keep_logs``), remove the older ones."""
    kept = state_dir / KEPT_DIR
    try:
        entries = [(e.stat(follow_symlinks=False).st_mtime, e.name) for e in os.scandir(kept)]
    except OSError:
        return
    for _, name in sorted(entries, reverse=True)[count:]:
        with contextlib.suppress(OSError):
            remove_tree(kept / name)


def find(state_dir: Path, lease_id: str) -> tuple[Path, bool] | None:
    """Where an attempt's captured output is, and whether the attempt still runs (its
    workspace); None when it is nowhere on this node any more. ``lease_id`` is checked."""
    if not SAFE_ID.match(lease_id):
        return None
    attempts = state_dir / "attempts"
    for path, live in (
        (attempts / lease_id / "logs", True),
        (attempts / f".retired-{lease_id}" / "logs", False),  # ended, being removed
        (state_dir / KEPT_DIR / lease_id, False),
    ):
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                return path, live
    return None
