"""The owner's configuration as the node runs it, and how a reload (SIGHUP, the console) changes it.

``Reloader.current`` is one immutable ``Config``: the settings and the per-task limits derived
from them, swapped as one under a lock. The loop hands each attempt the ``Config`` current when
it claimed it, so an attempt never sees a reload, let alone half of one; the next claim gets the
new one. A reload that cannot be applied (a bad file, a setting only a restart may change, a
runner that refuses it) keeps the running ``Config`` and is shown (``refused``) until one
succeeds; one that fails after the swap, half applied, holds claims until one succeeds (fail
closed: the new origin policies may not be in force).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashnode.attempt import AttemptContext
from flashnode.clock import Clock
from flashnode.config.settings import Settings
from flashnode.errors import FlashnodeError
from flashnode.sandbox.limits import Limits

log = logging.getLogger(__name__)

# What a running agent cannot change: it names the node, its coordinator and its state, and the
# runner made its slots' users and sandboxes at the start.
FIXED = (
    "coordinator",
    "runner",
    "state_dir",
    "node_id",
    "token",
    "join_code",
    "task_user",
    "slots",
)
# What changes only at the next start (the listeners are bound once).
AT_RESTART = ("metrics_listen", "ui_listen")


@dataclass(frozen=True)
class Config:
    """The settings and the limits each task gets under them (``runners.spec.task_limits``)."""

    settings: Settings
    limits: Limits


class Reloader:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        start_thread: Callable[[Callable[[], None], str], None],
        read: Callable[[], Settings] | None = None,
        limits: Callable[[Settings], Limits] | None = None,
        prepare: Callable[[Settings], None] = lambda new: None,
        applied: Callable[[Config], None] = lambda config: None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        """``read``: the configuration as it is now (it raises ``FlashnodeError`` for a bad
        one; None: reloads do nothing). ``limits``: the per-task limits of new settings (None:
        they stay). ``prepare``: what must accept the new settings before they apply (the
        runner's probes: slow, so all of it runs on a thread of its own); what it raises
        refuses the reload. ``applied``: called with the new ``Config`` once it is current,
        before the reload ends; ``wake``: once it has ended, to wake the loop."""
        self._current = config
        self._clock = clock
        self._start_thread = start_thread
        self._read = read
        self._limits = limits
        self._prepare = prepare
        self._applied = applied
        self._wake = wake
        self._lock = threading.Lock()
        self._requested = False
        self._busy = False
        self._broken = False  # a reload failed half applied: claims wait for one that succeeds
        self._refused: dict[str, Any] | None = None

    @property
    def current(self) -> Config:
        with self._lock:
            return self._current

    def snapshot(self, ctx: AttemptContext, config: Config | None = None) -> AttemptContext:
        """What an attempt is given: ``ctx``'s edges and ``config`` (the one its lease was
        claimed under; default: the one current now), which it keeps whatever reload comes
        while it runs (the context is frozen, and so are the settings and limits in it). Only
        ``lent_now`` reads the running configuration: what the owner stopped lending is
        mounted by no attempt."""
        config = config or self.current
        return dataclasses.replace(
            ctx,
            settings=config.settings,
            limits=config.limits,
            lent_now=lambda: self.current.settings.local_data,
        )

    @property
    def requested(self) -> bool:
        """A reload was asked for and has not started yet."""
        return self._requested

    @property
    def busy(self) -> bool:
        """A reload is being applied, or the last one failed half applied: claim nothing until
        it ends, or until a reload succeeds."""
        return self._busy or self._broken

    @property
    def refused(self) -> dict[str, Any] | None:
        """The last refused reload (``at``, ``reason``), until one succeeds."""
        return self._refused

    def request(self) -> None:
        """Reload at the loop's next turn (safe to call from a signal handler: sets a flag)."""
        self._requested = True

    def tick(self) -> None:
        """From the loop: start the reload asked for, unless one is being applied."""
        if self._requested and not self._busy:
            self._requested = False
            self._reload()

    def _reload(self) -> None:
        if self._read is None:
            return
        try:
            new = self._read()
        except FlashnodeError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
            self._refuse(str(exc))
            return
        old = self.current.settings
        changed = [k for k in FIXED if getattr(new, k) != getattr(old, k)]
        if changed:
            log.error("reload refused: changing %s needs a restart", ", ".join(changed))
            self._refuse(f"changing {', '.join(changed)} needs a restart")
            return
        self._busy = True
        self._start_thread(lambda: self._apply(new), "reload")

    def _apply(self, new: Settings) -> None:
        try:
            self._prepare(new)
            limits = self._limits(new) if self._limits is not None else self.current.limits
        except Exception as exc:  # a reload must never take the agent down
            log.error("reload failed, keeping the running configuration: %s", exc)
            self._refuse(str(exc))
            self._busy = False
            return
        with self._lock:
            old = self._current.settings
            self._current = config = Config(new, limits)
        for key in AT_RESTART:
            if getattr(new, key) != getattr(old, key):
                log.warning("%s changes at the next start of the agent", key)
        try:
            self._applied(config)
        except Exception as exc:  # half applied (an origin policy may be the old one): fail closed
            log.exception(
                "applying the reloaded configuration failed; claiming nothing until a"
                " reload succeeds or the agent restarts"
            )
            self._broken = True
            self._refuse(
                f"applying it failed half way ({exc}); no claims until a reload succeeds:"
                " fix the cause and reload, or restart the agent"
            )
        else:
            self._broken = False
            self._refused = None
        self._busy = False
        self._wake()

    def _refuse(self, reason: str) -> None:
        self._refused = {"at": self._clock.wall(), "reason": reason}
