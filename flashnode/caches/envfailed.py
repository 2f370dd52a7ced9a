"""The environment cache's negative cache: builds that failed because of the job's lines,
remembered for a while (in memory and under ``.failed/``, so a restart of the agent remembers
them too) and raised again at once while they last, unless the owner's ``allow_source_builds``
changed since.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from flashnode.caches.envrecords import write_json
from flashnode.clock import Clock
from flashnode.errors import EnvBuildFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    until: float  # on the monotonic clock
    message: str
    tail: str
    source_builds: bool


class FailedBuilds:
    """The failed builds by key. ``lock`` is the cache's own: ``raise_if_failed`` is called
    with it held, ``remember`` and ``expire`` take it."""

    def __init__(self, directory: Path, clock: Clock, lock: threading.Lock) -> None:
        self._failed_dir = directory
        self._clock = clock
        self._lock = lock
        self._failed: dict[str, Failure] = {}

    def remember(self, key: str, exc: EnvBuildFailed, ttl_s: float, source_builds: bool) -> None:
        if ttl_s <= 0:
            return
        failure = Failure(
            self._clock.monotonic() + ttl_s,
            str(exc),
            exc.tail,
            source_builds,
        )
        with self._lock:
            self._failed[key] = failure
        record = {
            "until": self._clock.wall() + ttl_s,
            "message": failure.message,
            "tail": failure.tail,
            "source_builds": failure.source_builds,
        }
        try:
            write_json(self._failed_dir / f"{key}.json", record)
        except OSError as exc2:
            log.warning("env cache: cannot record a failed build: %s", exc2)

    def raise_if_failed(self, key: str, source_builds: bool) -> None:
        """Called with the cache's lock held."""
        failure = self._failed.get(key)
        if failure is None:
            return
        if self._clock.monotonic() >= failure.until or failure.source_builds != source_builds:
            del self._failed[key]
            with contextlib.suppress(OSError):
                (self._failed_dir / f"{key}.json").unlink()
            return
        raise EnvBuildFailed(failure.message, failure.tail)

    def load(self, ttl_s: float) -> None:
        now_mono, now_wall = self._clock.monotonic(), self._clock.wall()
        for path in self._failed_dir.glob("*.json"):
            try:
                data = json.loads(path.read_text())
                left = min(float(data["until"]) - now_wall, ttl_s)
                failure = Failure(
                    now_mono + left,
                    str(data["message"]),
                    str(data.get("tail", "")),
                    bool(data.get("source_builds", False)),
                )
            except (OSError, ValueError, KeyError, TypeError):
                left, failure = 0.0, None
            if failure is None or left <= 0:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            self._failed[path.stem] = failure

    def expire(self, source_builds: bool) -> None:
        with self._lock:
            for key in list(self._failed):
                with contextlib.suppress(EnvBuildFailed):
                    self.raise_if_failed(key, source_builds)
