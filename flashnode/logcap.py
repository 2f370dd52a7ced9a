"""A task's output stream kept on disk with a size cap: the first ``cap`` bytes, then (when the
stream was longer) a marker saying how much was dropped, and its last bytes. The last line it
printed is kept for the owner's live view (``printable``: never terminal control)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

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
