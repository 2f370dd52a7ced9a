"""The disk hold: claim nothing while the state dir's disk leaves a task no room."""

from __future__ import annotations

import logging
from collections.abc import Callable

from flashnode.attempt.diskwatch import Reserved, no_room
from flashnode.config.settings import Settings
from flashnode.node.controls import Hold
from flashnode.sandbox.diskuse import Space

log = logging.getLogger(__name__)


class DiskHold:
    def __init__(self, space: Callable[[], Space | None], reserved: Reserved) -> None:
        """``space``: the state dir's disk now (None: unknown, never held). ``reserved``: what
        the running tasks may still write on it."""
        self._space = space
        self._reserved = reserved
        self._low = False

    def hold(self, settings: Settings) -> Hold | None:
        """Below ``min_free_bytes`` free in the state dir (or its share of the inodes), or with
        too little above it for a task to start (``diskwatch.no_room``), claim nothing; say so
        once."""
        space = self._space()
        floor = settings.min_free_bytes
        short = no_room(space, floor) if space is not None else None
        left = self._reserved.left(space)
        if space is not None and left is not None and not short:
            taken = no_room(left, floor)
            if taken:
                short = f"{taken} (what the running tasks may still write set aside)"
        if short and not self._low:
            log.warning("not claiming: the state dir has %s", short)
        elif self._low and not short:
            log.info("free space is back above the floor; claiming again")
        self._low = bool(short)
        if space is None or not short:
            return None
        what = "the state dir's disk is full" if space.full() else "low disk"
        return Hold(
            "disk",
            f"{what}: {short}; claims resume above it",
            fix=f"free space on the disk of {settings.state_dir} (`flashnode envs prune`"
            " evicts unused job environments), or lower min_free_bytes",
        )
