"""The container engine as the runner and its handles share it (``Engine``): whether it answers,
its loss noticed once (no claims until it is back), and this node's containers removed, now or,
while it is away, once it is back."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import docker.errors

from flashnode.runners.container import ENGINE_ERRORS

log = logging.getLogger(__name__)

RECHECK_S = 5  # how often a lost engine is asked again


class Engine:
    """``client``: the Docker SDK's client of the engine."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._up = True
        self._checked_at = time.monotonic()
        self._unremoved: set[str] = set()
        self._lock = threading.Lock()

    def answers(self) -> bool:
        try:
            self.client.ping()
            return True
        except ENGINE_ERRORS:
            return False

    def lost(self) -> None:
        """The engine stopped answering (a request failed and a ping too): said once."""
        if self._up:
            log.warning("container engine stopped answering: no claims until it is back")
        self._up = False

    def ready(self) -> bool:
        """False while the engine is away (checked at most every ``RECHECK_S``); leftovers that
        could not be removed meanwhile are removed once it is back."""
        if self._up:
            return True
        now = time.monotonic()
        if now - self._checked_at < RECHECK_S:
            return False
        self._checked_at = now
        if self.answers():
            log.info("container engine answers again: claiming again")
            self._up = True
            for cid in list(self._unremoved):
                self.remove(cid)
        return self._up

    def remove(self, container_id: str) -> None:
        """Remove one of this node's containers, now or once the engine is back."""
        try:
            self.client.containers.get(container_id).remove(force=True)
        except docker.errors.NotFound:
            pass
        except ENGINE_ERRORS:
            with self._lock:
                self._unremoved.add(container_id)
            return
        with self._lock:
            self._unremoved.discard(container_id)
