"""The budget kept (``Evictor``): environments no task uses, here or in another process, evicted
least recently used first until the cache holds no more than the budget; whether one is in use
is also what the owner is shown."""

from __future__ import annotations

import logging
import os
import threading

from flashnode.caches.envcache.entries import Entries
from flashnode.caches.envcache.locks import KeyLocks
from flashnode.caches.envcache.pins import Pins
from flashnode.caches.envcache.trash import Trash
from flashnode.caches.envrecords import EnvInfo
from flashnode.sandbox.removal import remove_tree

log = logging.getLogger(__name__)


class Evictor:
    def __init__(self, entries: Entries, locks: KeyLocks, pins: Pins, trash: Trash) -> None:
        self._entries = entries
        self._locks = locks
        self._pins = pins
        self._trash = trash
        self._evicting = threading.Lock()  # one eviction at a time

    def in_use(self, key: str) -> bool:
        """Pinned or being built, by this process or another."""
        with self._pins.lock:
            if self._pins.busy(key):
                return True
        return self._locks.held(key)

    def infos(self) -> list[EnvInfo]:
        """Every finished environment, least recently used first."""
        return self._entries.infos(self.in_use)

    def enforce(self, budget: int, configured: int) -> list[EnvInfo]:
        """Evict what no one uses until the environments hold at most ``budget`` bytes; what was
        evicted. Over the ``configured`` budget after that (the rest is in use), it says so."""
        with self._evicting:
            infos = self.infos()
            total = sum(i.bytes for i in infos)
            evicted: list[EnvInfo] = []
            for info in infos:
                if total <= budget:
                    break
                if not info.in_use and self._evict(info.key):
                    total -= info.bytes
                    evicted.append(info)
                    log.info("env %s: evicted (%d MiB)", info.key[:12], info.bytes >> 20)
            if total > budget and budget == configured:
                log.warning(
                    "env cache holds %d MiB, over its budget of %d MiB: the rest is in use",
                    total >> 20,
                    budget >> 20,
                )
            return evicted

    def _evict(self, key: str) -> bool:
        with self._pins.lock:
            if self._pins.busy(key):
                return False
            fd = self._locks.try_exclusive(key)
            if fd is None:
                return False
        try:
            if not self._locks.same(key, fd):
                return False
            doomed = self._trash.hide(self._entries.path(key))
        finally:
            os.close(fd)
        if doomed is not None:
            remove_tree(doomed)
        return True
