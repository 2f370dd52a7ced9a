"""One environment built and published (``Publisher``): built by the builder in a directory of
its own under ``.tmp/``, within the room the disk and the budget leave (``room``), made the
agent's and read-only to others, recorded, and renamed to ``<key>/`` only when complete: a crash
mid-build leaves nothing that looks usable. The caller holds the key's lock exclusively."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
from pathlib import Path

from flashnode.caches.envbox import BUDGET_BOUND, DiskRoom, size
from flashnode.caches.envbuild import Builder, EnvSpec
from flashnode.caches.envcache.entries import new_meta
from flashnode.caches.envcache.layout import Layout
from flashnode.caches.envcache.trash import Trash
from flashnode.caches.envrecords import fsync_dir, write_json
from flashnode.caches.envtree import remove, secure_tree
from flashnode.clock import Clock
from flashnode.errors import EnvUnavailable

log = logging.getLogger(__name__)


def room(root: Path, budget: int, min_free_bytes: int) -> DiskRoom:
    """What the next build may write: the budget, or the free space above ``min_free_bytes``
    when that is less (none: EnvUnavailable, the node's fault)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError as exc:
        raise EnvUnavailable(f"cannot tell the free space for a build: {exc}") from None
    above = free - min_free_bytes
    if above <= 0:
        raise EnvUnavailable(
            f"no room to build an environment: {size(free)} free, min_free_bytes is"
            f" {size(min_free_bytes)}"
        )
    if budget <= above:
        return DiskRoom(budget, BUDGET_BOUND)
    return DiskRoom(above, "the free disk space above min_free_bytes")


class Publisher:
    def __init__(self, layout: Layout, builder: Builder, trash: Trash, clock: Clock) -> None:
        self._layout = layout
        self._builder = builder
        self._trash = trash
        self._clock = clock

    def publish(
        self,
        spec: EnvSpec,
        *,
        budget: int,
        min_free_bytes: int,
        stop: threading.Event,
        deadline: float,
    ) -> float:
        """Build ``spec`` and publish it as ``<key>/`` (what stood there before, unfinished, is
        removed first); the seconds the build took. Raises what the builder raises
        (EnvBuildFailed: the job's lines; Cancelled), and EnvUnavailable for the node's faults;
        nothing of the build is left behind when it raises."""
        key = spec.key
        entry = self._layout.root / key
        if os.path.lexists(entry):
            self._trash.doom(entry)
        bounds = room(self._layout.root, budget, min_free_bytes)
        work = self._layout.tmp / f"{key}.{secrets.token_hex(6)}"
        work.mkdir(mode=0o700)
        started = self._clock.monotonic()
        log.info("env %s: building Python %s, %d line(s)", key[:12], spec.python, len(spec.lines))
        try:
            env_dir = self._builder.build(spec, work, stop=stop, deadline=deadline, room=bounds)
            if env_dir != work / "env":
                raise EnvUnavailable("the builder put the environment somewhere else")
            for child in work.iterdir():
                if child.name != "env":
                    remove(child)
            stats = secure_tree(env_dir)
            seconds = self._clock.monotonic() - started
            write_json(work / "meta.json", new_meta(spec, stats, seconds, self._clock.wall()))
            os.chmod(work, 0o755)
            os.sync()  # the rename publishes it: what it names must be on disk first
            os.rename(work, entry)
            fsync_dir(self._layout.root)
        except OSError as exc:
            raise EnvUnavailable(f"cannot build the environment: {exc}") from None
        finally:
            if work.exists():
                self._trash.doom(work)
        log.info("env %s: built in %.1f s, %d MiB", key[:12], seconds, stats.bytes >> 20)
        return seconds
