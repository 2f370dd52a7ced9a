"""A task's output stream kept on disk with a size cap: the first ``cap`` bytes, then (when the
stream was longer) a marker saying how much was dropped, and its last bytes."""

from __future__ import annotations

from pathlib import Path

TAIL_BYTES = 8 * 1024


class CappedFile:
    def __init__(self, path: Path, cap: int) -> None:
        self._out = path.open("wb", buffering=0)  # written as the task prints
        self._cap = cap
        self.total = 0
        self.tail = b""

    def write(self, chunk: bytes) -> None:
        room = self._cap - self.total
        if room > 0:
            self._out.write(chunk[:room])
        self.total += len(chunk)
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]

    def close(self) -> None:
        over = self.total - self._cap
        if over > 0:
            kept = self.tail[-over:]
            self._out.write(
                f"\n[flashnode: {over} bytes over the {self._cap}-byte cap not kept;"
                f" the last {len(kept)} follow]\n".encode()
            )
            self._out.write(kept)
        self._out.close()
