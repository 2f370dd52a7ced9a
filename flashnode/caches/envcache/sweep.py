"""What a crash left, removed at start and on each prune (``Sweeper``): builds under ``.tmp/`` no
one holds, trees being removed, unfinished entries, and lock files whose entry is gone; never
what another holder has locked."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from flashnode.caches.envcache.entries import Entries
from flashnode.caches.envcache.layout import Layout, is_key
from flashnode.caches.envcache.locks import KeyLocks
from flashnode.caches.envcache.pins import Pins
from flashnode.caches.envcache.trash import Trash
from flashnode.caches.envtree import remove

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(
        self, layout: Layout, entries: Entries, locks: KeyLocks, pins: Pins, trash: Trash
    ) -> None:
        self._layout = layout
        self._entries = entries
        self._locks = locks
        self._pins = pins
        self._trash = trash

    def sweep(self) -> None:
        """Remove what a crash left: builds nobody holds, doomed trees, unfinished entries."""
        layout = self._layout
        for path in layout.tmp.iterdir():
            key = path.name.split(".", 1)[0]
            if path.name.startswith("del.") or not is_key(key):
                with contextlib.suppress(OSError):
                    remove(path)
                continue
            self._remove_if_free(key, path)
        for path in layout.root.iterdir():
            if is_key(path.name) and not self._entries.complete(path.name):
                self._remove_if_free(path.name, path)
        for path in layout.locks.iterdir():
            if not os.path.lexists(layout.root / path.name):
                self._remove_if_free(path.name, path)

    def _remove_if_free(self, key: str, path: Path) -> None:
        """Remove ``path`` (of ``key``: its build, entry or lock file) unless a build of this
        process or any holder of the key's lock has it."""
        with self._pins.lock:
            if key in self._pins.builds:
                return
            fd = self._locks.try_exclusive(key)
            if fd is None:
                return
        try:
            if path.parent == self._layout.locks:
                # Unlinked while held: a waiter on the old file sees it is not the path's
                # (KeyLocks.same) and opens the new one.
                if self._locks.same(key, fd) and not os.path.lexists(self._layout.root / key):
                    path.unlink()
                return
            if path.parent == self._layout.root and self._entries.complete(key):
                return
            log.info("env cache: removing leftover %s", path.name)
            self._trash.doom(path)
        finally:
            os.close(fd)
